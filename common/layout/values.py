"""The layout's value types: dtypes, boxes, canonical tensors, pieces and local buffers.

A piece says that a region of a rank's local buffer holds a box of a canonical
tensor; a local buffer is made of pieces and declared padding. `core.Layout`
holds a whole side in columns and shows each rank as these values.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: importing this module does not import torch
    import torch

# The dtypes a layout may name, with their item sizes, in the order of their wire ids. The layout
# algebra does not import torch: a client (`reshard status`) starts without it.
DTYPE_SIZES: dict[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "int32": 4,
    "int64": 8,
    "float8_e4m3fn": 1,  # block FP8 values: they travel with their scales (common/layout/quantized.py)
}
DTYPES = tuple(DTYPE_SIZES)
FP8 = "float8_e4m3fn"


class LayoutError(ValueError):
    """A layout, or a pair of layouts, that cannot be used for an update."""


def _known(name: str) -> str:
    if name not in DTYPE_SIZES:
        raise LayoutError(f"unknown dtype {name!r}; valid dtypes: {', '.join(DTYPES)}")
    return name


def dtype_of(name: str) -> torch.dtype:
    import torch

    return getattr(torch, _known(name))


def itemsize(dtype: str) -> int:
    return DTYPE_SIZES[_known(dtype)]


FLOAT_DTYPES = frozenset({"bfloat16", "float16", "float32", "float64"})
INT_DTYPES = frozenset({"int8", "uint8", "int32", "int64"})


def cast_refusal(src: str, dst: str) -> str | None:
    """Why a source tensor of dtype `src` may not arrive as `dst` without a declared cast, or None.

    The sender casts as it packs (the wire carries `dst`). Between floating dtypes the cast is
    what an engine does when it loads a checkpoint of another precision (an FSDP2 trainer's fp32
    masters into a bf16 or fp16 engine): allowed. Widening an integer is exact: allowed. Anything
    else loses range or meaning (float to integer, a narrower integer, integer to float):
    refused unless the trainer's layout declares casts (`allow_casts`)."""
    _known(src), _known(dst)
    if src == dst or (src in FLOAT_DTYPES and dst in FLOAT_DTYPES):
        return None
    if dst == FP8:
        return (f"{FP8} values need their block scales: a destination serving block FP8 declares the scales "
                f"(the tensor's name + '_scale_inv') and the sender quantizes its {src} weights")
    if src == FP8:
        return f"{FP8} values mean nothing without their block scales"
    if src in INT_DTYPES and dst in INT_DTYPES:
        if DTYPE_SIZES[dst] > DTYPE_SIZES[src] and dst != "uint8":  # every int here but uint8 is signed
            return None
        return f"{src} does not fit in {dst}"
    if src in FLOAT_DTYPES:
        return f"a float ({src}) into an integer ({dst}) loses its range and fraction"
    return f"an integer ({src}) into a float ({dst}) may round"


@dataclasses.dataclass(frozen=True, slots=True)
class Box:
    """A hyper-rectangle: per-dimension offset and size."""

    offset: tuple[int, ...]
    size: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offset) != len(self.size):
            raise LayoutError(f"box offset {self.offset} and size {self.size} differ in rank")
        if any(o < 0 for o in self.offset) or any(s < 0 for s in self.size):
            raise LayoutError(f"box {self} has a negative offset or size")

    @staticmethod
    def full(shape: Sequence[int]) -> Box:
        return Box(tuple(0 for _ in shape), tuple(shape))

    @property
    def ndim(self) -> int:
        return len(self.size)

    @property
    def numel(self) -> int:
        return math.prod(self.size)

    @property
    def end(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offset, self.size))

    def within(self, shape: Sequence[int]) -> bool:
        return len(shape) == self.ndim and all(e <= s for e, s in zip(self.end, shape))

    def intersect(self, other: Box) -> Box | None:
        lo = tuple(max(a, b) for a, b in zip(self.offset, other.offset))
        hi = tuple(min(a, b) for a, b in zip(self.end, other.end))
        if any(h <= lo_ for lo_, h in zip(lo, hi)):
            return None
        return Box(lo, tuple(h - lo_ for lo_, h in zip(lo, hi)))

    def shift(self, delta: Sequence[int]) -> Box:
        return Box(tuple(o + d for o, d in zip(self.offset, delta)), self.size)

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offset, self.size))

    def slices_in(self, outer: Box) -> tuple[slice, ...]:
        """This box's slices relative to `outer` (which contains it)."""
        return tuple(slice(o - oo, o - oo + s) for o, oo, s in zip(self.offset, outer.offset, self.size))

    def contiguous_range(self, shape: Sequence[int]) -> tuple[int, int] | None:
        """(start, numel) in the row-major flat index space of `shape`, if contiguous."""
        dims = len(shape)
        first = 0
        while first < dims and self.size[first] == 1:
            first += 1
        for d in range(first + 1, dims):
            if self.offset[d] != 0 or self.size[d] != shape[d]:
                return None
        start = 0
        for d in range(dims):
            start = start * shape[d] + self.offset[d]
        return start, self.numel

    def to_json(self) -> list:
        return [list(self.offset), list(self.size)]

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offset, self.size)) + "]"


class _Sized:
    """numel and nbytes of a value with a `shape` and a `dtype` (a canonical tensor, a local buffer)."""

    __slots__ = ()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


@dataclasses.dataclass(frozen=True, slots=True)
class TensorSpec(_Sized):
    """A canonical tensor: name, global shape, dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        dtype_of(self.dtype)
        if not self.name:
            raise LayoutError("a canonical tensor needs a name")
        if any(s <= 0 for s in self.shape):
            raise LayoutError(f"tensor {self.name!r}: shape {self.shape} has a non-positive size")


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, s = [], 1
    for d in reversed(shape):
        out.append(s)
        s *= d
    return tuple(reversed(out))


def flat_range_to_boxes(start: int, end: int, shape: Sequence[int]) -> list[Box]:
    """The flat row-major range [start, end) of a tensor of `shape` as a few boxes (in order),
    each contiguous: at most 2 * ndim - 1 of them."""
    shape = tuple(shape)
    if start >= end:
        return []
    if len(shape) <= 1:
        return [Box((start,), (end - start,))] if shape else [Box((), ())]
    inner = math.prod(shape[1:])
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(end, inner)
    if r0 == r1:  # inside one row of the leading dim
        return [Box((r0, *b.offset), (1, *b.size)) for b in flat_range_to_boxes(c0, c1, shape[1:])]
    out = []
    if c0:
        out += [Box((r0, *b.offset), (1, *b.size)) for b in flat_range_to_boxes(c0, inner, shape[1:])]
        r0 += 1
    if r1 > r0:
        out.append(Box((r0, *(0 for _ in shape[1:])), (r1 - r0, *shape[1:])))
    if c1:
        out += [Box((r1, *b.offset), (1, *b.size)) for b in flat_range_to_boxes(0, c1, shape[1:])]
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class Piece:
    """Region `region` of a local buffer holds box `box` of canonical tensor `tensor`.

    Normally `region` is a box of the buffer of the same shape as `box`. A *flat*
    piece instead names the 1-D range `region` of the flattened buffer, which holds
    `box` in row-major order (FSDP1 flat parameters, a distributed optimizer's
    ranges): see `flat_pieces`."""

    tensor: str
    region: Box
    box: Box
    flat: bool = False

    def base(self, buffer_shape: Sequence[int]) -> tuple[int, tuple[int, ...]]:
        """(flat start, strides) of this piece's box inside the flattened buffer."""
        if self.flat:
            return self.region.offset[0], contiguous_strides(self.box.size)
        strides = contiguous_strides(buffer_shape)
        return sum(o * s for o, s in zip(self.region.offset, strides)), strides

    def view(self, buf: torch.Tensor) -> torch.Tensor:
        """The piece as a view of `buf` (a contiguous tensor), shaped like its box."""
        start, strides = self.base(buf.shape)
        flat = buf.reshape(-1)
        return flat.as_strided(self.box.size, strides, flat.storage_offset() + start)

    def buffer_boxes(self, buffer_shape: Sequence[int]) -> list[Box]:
        """The buffer elements this piece occupies, as boxes of the buffer."""
        if not self.flat:
            return [self.region]
        return flat_range_to_boxes(self.region.offset[0], self.region.end[0], buffer_shape)


def flat_pieces(tensor: str, shape: Sequence[int], start: int, end: int, buffer_start: int) -> list[Piece]:
    """Pieces for the flat range [start, end) of a tensor held from `buffer_start` of a flat buffer."""
    out, pos = [], buffer_start
    for b in flat_range_to_boxes(start, end, shape):
        out.append(Piece(tensor, Box((pos,), (b.numel,)), b, flat=True))
        pos += b.numel
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class LocalBuffer(_Sized):
    """One tensor a worker owns: made of pieces, plus declared padding."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    pieces: tuple[Piece, ...]
    padding: tuple[Box, ...] = ()
