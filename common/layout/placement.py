"""Compact placements: a device mesh plus, per mesh dimension, Shard(d) or Replicate(),
as DTensor describes a tensor. They expand to boxes, and a whole layout can be
described in a few lines:

    layout = placement_layout(tensors, mesh=(2, 4), placements={
        "model.embed_tokens.weight": (Replicate(), Shard(0)),
        "*": (Shard(0), Shard(1)),
    })

Several mesh dimensions may shard the same tensor dimension (nested, in mesh order,
as DTensor does). Splits follow `torch.chunk` (ceil-sized shards, the last ones short
or empty) unless explicit shard sizes are given (`Shard(0, sizes=(5, 3))`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import itertools
import math
from collections.abc import Mapping, Sequence

from reshard.common.layout.core import Box, Layout, LayoutError, LocalBuffer, Piece, TensorSpec


@dataclasses.dataclass(frozen=True, slots=True)
class Shard:
    dim: int
    """Tensor dimension split across this mesh dimension."""
    sizes: tuple[int, ...] | None = None
    """Explicit (uneven) shard sizes, one per mesh coordinate; default: torch.chunk's split."""


@dataclasses.dataclass(frozen=True, slots=True)
class Replicate:
    pass


Placement = Shard | Replicate


def chunk_sizes(n: int, parts: int) -> list[int]:
    """Shard sizes `torch.chunk` gives: ceil(n / parts) each, the tail short, then empty."""
    if parts < 1:
        raise LayoutError(f"cannot split into {parts} parts")
    step = -(-n // parts) if n else 0
    out = []
    left = n
    for _ in range(parts):
        take = min(step, left)
        out.append(take)
        left -= take
    return out


def _check(shape: tuple[int, ...], mesh: tuple[int, ...], placements: Sequence[Placement], name: str) -> None:
    if len(placements) != len(mesh):
        raise LayoutError(f"{name}: {len(placements)} placements for a mesh of {len(mesh)} dimensions")
    for p in placements:
        if isinstance(p, Shard) and not 0 <= p.dim < len(shape):
            raise LayoutError(f"{name}: Shard({p.dim}) of a {len(shape)}-d tensor")


def _box_at(shape: tuple[int, ...], mesh: tuple[int, ...], placements: Sequence[Placement], coord: Sequence[int],
            name: str) -> Box:
    offset, size = [0] * len(shape), list(shape)
    for mdim, p in enumerate(placements):
        if isinstance(p, Replicate):
            continue
        if p.sizes is not None:
            if len(p.sizes) != mesh[mdim] or sum(p.sizes) != size[p.dim]:
                raise LayoutError(
                    f"{name}: Shard({p.dim}) sizes {list(p.sizes)} must be {mesh[mdim]} sizes summing to {size[p.dim]}")
            sizes = list(p.sizes)
        else:
            sizes = chunk_sizes(size[p.dim], mesh[mdim])
        k = coord[mdim]
        offset[p.dim] += sum(sizes[:k])
        size[p.dim] = sizes[k]
    return Box(tuple(offset), tuple(size))


def box_at(shape: Sequence[int], mesh: Sequence[int], placements: Sequence[Placement], coord: Sequence[int],
           name: str = "tensor") -> Box:
    """The box one mesh coordinate holds (possibly empty): `expand(...)[coord]` without the others."""
    shape, mesh = tuple(shape), tuple(mesh)
    _check(shape, mesh, placements, name)
    return _box_at(shape, mesh, placements, coord, name)


def expand(shape: Sequence[int], mesh: Sequence[int], placements: Sequence[Placement], name: str = "tensor") -> dict[tuple[int, ...], Box]:
    """The box each mesh coordinate holds (possibly empty) for one tensor."""
    shape, mesh = tuple(shape), tuple(mesh)
    _check(shape, mesh, placements, name)
    return {coord: _box_at(shape, mesh, placements, coord, name) for coord in itertools.product(*(range(m) for m in mesh))}


def _lookup(placements: Mapping[str, Sequence[Placement]], name: str) -> Sequence[Placement]:
    if name in placements:
        return placements[name]
    for pat, p in placements.items():  # first matching pattern, in the order given
        if fnmatch.fnmatchcase(name, pat):
            return p
    raise LayoutError(f"no placement given for tensor {name!r} (add it, or a pattern such as '*')")


def placement_layout(tensors: Mapping[str, TensorSpec], mesh: Sequence[int],
                     placements: Mapping[str, Sequence[Placement]], *, allow_casts: bool = False,
                     buffer_dtype: str | None = None) -> Layout:
    """A layout with one buffer per (rank, tensor) it holds; ranks are mesh coordinates in row-major order.

    Empty shards get no buffer."""
    mesh = tuple(mesh)
    world = math.prod(mesh)
    ranks: list[list[LocalBuffer]] = [[] for _ in range(world)]
    coords = list(itertools.product(*(range(m) for m in mesh)))
    for name, spec in tensors.items():
        boxes = expand(spec.shape, mesh, _lookup(placements, name), name)
        for r, coord in enumerate(coords):
            box = boxes[coord]
            if box.numel == 0:
                continue
            region = Box.full(box.size)
            ranks[r].append(LocalBuffer(name, box.size, buffer_dtype or spec.dtype, (Piece(name, region, box),)))
    return Layout(dict(tensors), tuple(tuple(b) for b in ranks), allow_casts=allow_casts)
