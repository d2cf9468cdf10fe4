"""Layouts: one side's full description of where weights live.

A `Layout` holds the canonical tensors of the model and, for every rank, the
local buffers it owns and which box of which canonical tensor each region of a
buffer holds. It holds them as columns (`columns.ColumnRanks`), whoever built
it: a framework builder, the wire, or per-rank Python buffers written by hand
(read into columns once, and kept as their ranks' view). This module is also
the validator: every message about an invalid layout is made here.

The value types a layout is made of live in `values` (re-exported here).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from reshard.common.layout.columns import ColumnRanks, merged_classes
from reshard.common.layout.values import (
    DTYPE_SIZES,
    DTYPES,
    Box,
    LayoutError,
    LocalBuffer,
    Piece,
    TensorSpec,
    cast_refusal,
    contiguous_strides,
    dtype_of,
    flat_pieces,
    flat_range_to_boxes,
    itemsize,
)

__all__ = ["DTYPE_SIZES", "DTYPES", "Box", "Layout", "LayoutError", "LocalBuffer", "Piece", "TensorSpec", "check_compatible",
           "contiguous_strides", "coverage_gap", "dtype_casts", "dtype_of", "flat_pieces", "flat_range_to_boxes", "itemsize", "merge_ranks",
           "overlapping_sources"]


@dataclasses.dataclass(frozen=True, slots=True)
class Layout:
    """One side's description: canonical tensors and every rank's local buffers.

    `ranks` may be given as per-rank sequences of `LocalBuffer` (ranks that share one object
    are replicas); the layout reads them into columns and keeps them as the view."""

    tensors: dict[str, TensorSpec]
    ranks: ColumnRanks
    allow_casts: bool = False
    receive_window: int = 0
    """A destination's bound on what it holds of an update at once, bytes (0: none): its ranks
    stage bounded, so the plan sends each rank's buffers in order within this window, from the
    trainer to every replica (no relays)."""
    _memo: dict = dataclasses.field(default_factory=dict, init=False, compare=False, repr=False, hash=False)
    """Derived values (the wire form, the fingerprint), computed once: a layout never changes."""

    def __post_init__(self) -> None:
        if not isinstance(self.ranks, ColumnRanks):
            object.__setattr__(self, "ranks", ColumnRanks.of_buffers(sorted(self.tensors), self.ranks))
        elif len(self.ranks.tensor_names) != len(self.tensors):
            raise LayoutError(f"columns name {len(self.ranks.tensor_names)} tensors, the layout declares {len(self.tensors)}")

    @property
    def world(self) -> int:
        return len(self.ranks)

    def buffer(self, rank: int, name: str) -> LocalBuffer:
        for b in self.ranks[rank]:
            if b.name == name:
                return b
        raise KeyError(f"rank {rank} has no buffer {name!r}")

    def rank_pieces(self, rank: int) -> dict[tuple[str, int], Piece]:
        """A rank's pieces by (buffer name, index in the buffer): how plans and checksums name them."""
        return {(b.name, i): p for b in self.ranks[rank] for i, p in enumerate(b.pieces)}

    @property
    def payload_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    # -- validation --------------------------------------------------------------------
    def validate_rank(self, rank: int, side: str = "layout", require_full_buffers: bool = True) -> None:
        """The exact check of one rank's buffers (LayoutError naming tensor, rank and problem)."""
        bufs = self.ranks[rank]
        names = set()
        for buf in bufs:
            where = f"{side} rank {rank} buffer {buf.name!r}"
            if buf.name in names:
                raise LayoutError(f"{where}: duplicate buffer name")
            names.add(buf.name)
            dtype_of(buf.dtype)
            regions: list[tuple[Box, str]] = []
            for p in buf.pieces:
                spec = self.tensors.get(p.tensor)
                if spec is None:
                    raise LayoutError(f"{where}: piece names unknown tensor {p.tensor!r}")
                if p.flat:
                    if p.region.ndim != 1 or p.region.numel != p.box.numel:
                        raise LayoutError(
                            f"{where}: flat piece of {p.tensor!r} range {p.region} must be 1-D and hold "
                            f"the {p.box.numel} elements of box {p.box}")
                    if p.region.end[0] > buf.numel:
                        raise LayoutError(
                            f"{where}: flat piece of {p.tensor!r} range {p.region} lies outside the "
                            f"buffer's {buf.numel} elements")
                elif p.region.size != p.box.size:
                    raise LayoutError(
                        f"{where}: piece of {p.tensor!r} region {p.region} and box {p.box} "
                        "differ in shape"
                    )
                elif not p.region.within(buf.shape):
                    raise LayoutError(
                        f"{where}: piece of {p.tensor!r} region {p.region} lies outside "
                        f"the buffer shape {list(buf.shape)}"
                    )
                if not p.box.within(spec.shape):
                    raise LayoutError(
                        f"tensor {p.tensor!r}: {where} names box {p.box} outside the "
                        f"tensor shape {list(spec.shape)}"
                    )
                if buf.dtype != spec.dtype and not self.allow_casts:
                    raise LayoutError(
                        f"tensor {p.tensor!r}: {where} holds it as {buf.dtype} but the "
                        f"tensor is {spec.dtype} (dtype mismatch; declare a cast to allow it)"
                    )
                regions += [(b, f"piece of {p.tensor!r}") for b in p.buffer_boxes(buf.shape)]
            for pad in buf.padding:
                if not pad.within(buf.shape):
                    raise LayoutError(f"{where}: padding {pad} lies outside the buffer")
                regions.append((pad, "padding"))
            _check_disjoint(regions, where)
            if require_full_buffers:
                covered = sum(r.numel for r, _ in regions)
                if covered != buf.numel:
                    raise LayoutError(
                        f"{where}: {buf.numel - covered} of {buf.numel} elements are neither "
                        "a piece nor declared padding (coverage gap)"
                    )


def check_compatible(src: Layout, dst: Layout, tensors: set[str] | None = None) -> None:
    """Raise LayoutError naming the first mismatch between the canonical tensors of a pair. Dtypes
    may differ where the sender's cast is safe (`cast_refusal`: fp32 masters into a bf16 engine),
    or anywhere the source layout declares casts: the plan casts each segment as it is packed."""
    if src.tensors is dst.tensors:
        return  # layouts built for one model share their tensors
    for name in sorted(dst.tensors):
        if tensors is not None and name not in tensors:
            continue
        d = dst.tensors[name]
        s = src.tensors.get(name)
        if s is None:
            raise LayoutError(f"tensor {name!r}: the destination needs it but the source layout has no such tensor (unknown name)")
        if s.shape != d.shape:
            raise LayoutError(f"tensor {name!r}: shape mismatch, source {list(s.shape)} vs destination {list(d.shape)}")
        if s.dtype != d.dtype and not src.allow_casts:
            why = cast_refusal(s.dtype, d.dtype)
            if why:
                raise LayoutError(f"tensor {name!r}: dtype mismatch, source {s.dtype} vs destination {d.dtype}: {why}; "
                                  "declare casts on the trainer's layout (allow_casts=True) to send it anyway")


def dtype_casts(src: Layout, dst: Layout, tensors: set[str] | None = None) -> dict[tuple[str, str], int]:
    """(source dtype, destination dtype) -> how many canonical tensors the pair casts on the sender."""
    out: dict[tuple[str, str], int] = {}
    for name, d in dst.tensors.items():
        s = src.tensors.get(name)
        if s is not None and s.dtype != d.dtype and (tensors is None or name in tensors):
            out[(s.dtype, d.dtype)] = out.get((s.dtype, d.dtype), 0) + 1
    return out


def coverage_gap(piece: Piece, rank: int, buffer: str, covered: int) -> LayoutError:
    """A destination piece the source layout does not cover in full (the planner finds it)."""
    return LayoutError(f"tensor {piece.tensor!r}: destination rank {rank} buffer {buffer!r} needs box {piece.box}, but "
                       f"the source layout covers only {covered} of its {piece.box.numel} elements (coverage gap)")


def overlapping_sources(tensor: str, a: tuple[Box, int], b: tuple[Box, int]) -> LayoutError:
    """Two source boxes (box, first rank) that overlap without being replicas (the planner finds them)."""
    return LayoutError(f"tensor {tensor!r}: source boxes {a[0]} (rank {a[1]}) and {b[0]} (rank {b[1]}) "
                       "overlap without being identical replicas")


def merge_ranks(parts: Sequence[Layout], rank_part: Sequence[int]) -> Layout:
    """One layout from one-rank layouts (`parts`), rank r being parts[rank_part[r]]: columns end
    to end, one class per part (ranks that declared the same buffers share it). Tensors declared
    by several parts must agree (LayoutError naming the first rank of each)."""
    tensors: dict[str, TensorSpec] = {}
    first_rank: dict[int, int] = {}
    for r, k in enumerate(rank_part):
        first_rank.setdefault(k, r)
    for k, part in enumerate(parts):
        if part.world != 1:
            raise LayoutError(f"a rank layout has {part.world} ranks, not 1")
        for n, t in part.tensors.items():
            have = tensors.setdefault(n, t)
            if have != t:
                other = next(first_rank[j] for j, q in enumerate(parts) if q.tensors.get(n) == have)
                raise LayoutError(f"tensor {n!r}: rank {first_rank[k]} declares {list(t.shape)} {t.dtype}, "
                                  f"rank {other} {list(have.shape)} {have.dtype}")
    tensor_names = sorted(tensors)
    names, classes, undeclared = merged_classes([p.ranks for p in parts], tensor_names)
    ranks = ColumnRanks(tensor_names, names, classes, list(rank_part), undeclared)
    window = min((p.receive_window for p in parts if p.receive_window), default=0)
    return Layout({n: tensors[n] for n in tensor_names}, ranks, any(p.allow_casts for p in parts), window)


def _check_disjoint(regions: list[tuple[Box, str]], where: str) -> None:
    regions = sorted(regions, key=lambda r: r[0].offset)
    # Sweep on the first dimension, then check pairs that overlap there.
    active: list[tuple[Box, str]] = []
    for box, what in regions:
        if box.numel == 0:
            continue
        start = box.offset[0] if box.ndim else 0
        active = [a for a in active if (a[0].end[0] if a[0].ndim else 1) > start]
        for other, other_what in active:
            if box.intersect(other) is not None:
                raise LayoutError(f"{where}: {what} at {box} overlaps {other_what} at {other}")
        active.append((box, what))


