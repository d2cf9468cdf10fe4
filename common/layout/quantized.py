"""Block FP8 on the wire: the source layout that quantizes on the sender.

A destination that serves block FP8 (a vLLM layer of a DeepSeek-V3 or Qwen3 FP8 checkpoint)
declares a weight `W` as float8_e4m3fn and its scales as the float32 tensor `W_scale_inv`,
one per 128 x 128 block (ceil at the edges), as the checkpoint names them. The trainer holds `W`
in bf16 or fp32 and has no scales. `quantized_source` rewrites the trainer's layout so that both
travel: every piece of `W` a trainer rank holds becomes two derived buffers of that rank, the
piece's FP8 values (`<buffer>#fp8:<i>`) and its blocks' scales (`<buffer>#scale:<i>`, `i` the
piece's index in the buffer), which the trainer worker fills at each transfer by quantizing the
piece (`common/quant.py`, the engine's recipe). The FP8 bytes and their scales cross the wire:
about half of bf16, a quarter of fp32.

Stacked experts (vLLM's `w13_weight` (E, 2I, H), `w2_weight` (E, H, I); canonically
`mlp.experts.gate_up_proj` and `down_proj`) are quantized expert by expert: blocks over the last
two dims, one scale tensor of shape (E, ceil(rows / 128), ceil(cols / 128)), as an FP8 checkpoint's
per-expert `weight_scale_inv` stack. A trainer piece of them must be whole blocks (whole experts,
as expert parallelism and FSDP2's Shard(0) cut them; or rows and columns on block boundaries).

A block's scale depends on every element of the block. A piece made of whole blocks (Megatron's
row and column shards, whole experts) is quantized on its own. A piece whose rows start or end
inside a row of blocks (an FSDP2 Shard(0) whose row count is not a multiple of 128) holds part of
that row: the trainer ranks holding parts of one row of blocks exchange their partial max |x| per
block (`split_rows`, `amax_peers`: a few floats per block, before the first byte of the update),
and each quantizes its rows with the whole block's scale. Every element then comes out as if its
block had been quantized whole, and a row of blocks' scales travel from the piece holding its
first row. Columns must still start on a block boundary and end on one or at the tensor's edge
(a column shard that splits blocks is refused by name; the destination can take bf16 instead and
quantize where its blocks are whole: the vLLM backend's `quantize="receiver"`).

Torch-free (the controllers plan without it)."""

from __future__ import annotations

import dataclasses
import math

from reshard.common.layout.core import Box, Layout, LayoutError, LocalBuffer, Piece, TensorSpec
from reshard.common.layout.values import FP8

BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"
DERIVED = ("#fp8:", "#scale:")  # a derived buffer's name: <source buffer><marker><piece index>


def scale_name(tensor: str) -> str:
    return tensor + SCALE_SUFFIX


def full_block(ndim: int, block: tuple[int, int] = BLOCK) -> tuple[int, ...]:
    """The block of a tensor of `ndim` dims: 128 x 128 over its last two, one element along the
    leading ones (stacked experts (E, rows, cols): each expert's matrix in blocks of its own)."""
    return (1,) * (ndim - 2) + tuple(block)


def scale_shape(shape: tuple[int, ...], block: tuple[int, int] = BLOCK) -> tuple[int, ...]:
    return tuple(-(-s // b) for s, b in zip(shape, full_block(len(shape), block)))


def scale_box(box: Box, block: tuple[int, int] = BLOCK) -> Box:
    """The scales of the blocks a block-aligned box covers."""
    full = full_block(len(box.offset), block)
    lo = tuple(o // b for o, b in zip(box.offset, full))
    hi = tuple(-(-e // b) for e, b in zip(box.end, full))
    return Box(lo, tuple(h - l_ for h, l_ in zip(hi, lo)))


def _complement(shape: tuple[int, ...], boxes: list[Box]) -> list[Box]:
    """Boxes covering what `boxes` do not of a tensor of `shape` (slabs along the first dim)."""
    if not shape:
        return []
    cuts = sorted({0, shape[0], *(c for b in boxes for c in (b.offset[0], b.end[0]) if 0 < c < shape[0])})
    out = []
    for lo, hi in zip(cuts, cuts[1:]):
        inside = [Box(b.offset[1:], b.size[1:]) for b in boxes if b.offset[0] <= lo and b.end[0] >= hi]
        rest = _complement(shape[1:], inside) if inside else [Box((0,) * (len(shape) - 1), shape[1:])]
        out += [Box((lo, *r.offset), (hi - lo, *r.size)) for r in rest]
    return out


def scale_buffer(buf: LocalBuffer, name: str, shape: tuple[int, ...] | None = None) -> LocalBuffer:
    """The float32 buffer of a block-FP8 buffer's scales (default shape: one per block of `buf`),
    piece by piece the scales of `buf`'s pieces (each made of whole blocks at block boundaries of
    `buf`: what a linear layer's shard, or a rank's stacked experts, holds); scales no piece covers
    are padding."""
    pieces = tuple(Piece(scale_name(p.tensor), scale_box(p.region), scale_box(p.box)) for p in buf.pieces)
    shape = tuple(shape or scale_shape(buf.shape))
    regions = [p.region for p in pieces]
    padding = _complement(shape, regions)
    if any(any(e > s for e, s in zip(r.end, shape)) for r in regions) or \
            sum(r.numel for r in regions) + sum(b.numel for b in padding) != math.prod(shape):
        raise LayoutError(f"{buf.name}: the scales of its pieces overlap or fall outside {list(shape)}, so they "
                          "cannot be laid out (its pieces are not whole blocks at block boundaries)")
    return LocalBuffer(name, shape, "float32", pieces, tuple(padding))


def aligned(box: Box, shape: tuple[int, ...], block: tuple[int, int] = BLOCK) -> bool:
    """Whether a box of a tensor of `shape` is made of whole blocks."""
    full = full_block(len(shape), block)
    return all(o % b == 0 and (e % b == 0 or e == s) for o, e, s, b in zip(box.offset, box.end, shape, full))


def columns_aligned(box: Box, shape: tuple[int, ...], block: tuple[int, int] = BLOCK) -> bool:
    """Whether a box starts on a column block boundary and ends on one or at the edge."""
    o, e = box.offset[-1], box.end[-1]
    return o % block[1] == 0 and (e % block[1] == 0 or e == shape[-1])


def owned_scales(box: Box, block: tuple[int, int] = BLOCK) -> Box:
    """The scales a trainer piece sends: its column blocks, in the rows of blocks whose first row it
    holds (every row of blocks has one such piece, whoever holds the rest of it); along leading
    dims (stacked experts), the piece's own."""
    lo, hi = -(-box.offset[-2] // block[0]), -(-box.end[-2] // block[0])
    c0, c1 = box.offset[-1] // block[1], -(-box.end[-1] // block[1])
    return Box((*box.offset[:-2], lo, c0), (*box.size[:-2], max(0, hi - lo), c1 - c0))


@dataclasses.dataclass(frozen=True)
class SplitRow:
    """A row of blocks of a block-FP8 tensor that trainer pieces of several rank classes hold parts
    of: their ranks exchange partial max |x| per block before quantizing it."""

    tensor: str
    row: int  # the row of blocks
    rows: int  # the tensor's rows
    width: int  # column blocks of the tensor: the length of a partial max vector
    classes: tuple[int, ...]  # the source rank classes holding some of its rows


def split_rows(layout: Layout, block: tuple[int, int] = BLOCK) -> tuple[SplitRow, ...]:
    """Every row of blocks of a quantized source layout (`quantized_source`) that a piece's rows
    start or end inside of (not at the tensor's edge), with every class holding rows in it (one
    class, where it holds the parts in several pieces).
    Computed once per layout, sorted by (tensor, row)."""
    memo = layout._memo
    if "fp8_split_rows" not in memo:
        held: dict[str, list[tuple[int, Box]]] = {}
        for c in range(len(layout.ranks.classes)):
            for b in layout.ranks.cls(c):
                name, marker, i = b.name.rpartition(DERIVED[0])
                if marker and i.isdigit():
                    held.setdefault(b.pieces[0].tensor, []).append((c, b.pieces[0].box))
        out = []
        for t, pieces in sorted(held.items()):
            if len(layout.tensors[t].shape) != 2:  # stacked experts: pieces of whole blocks (_class_buffers)
                continue
            m, n = layout.tensors[t].shape
            split = sorted({o // block[0] for box in (p for _, p in pieces)
                            for o in (box.offset[0], box.end[0]) if o % block[0] and 0 < o < m})
            for k in split:
                lo, hi = k * block[0], min(m, (k + 1) * block[0])
                classes = tuple(sorted({c for c, box in pieces if box.offset[0] < hi and box.end[0] > lo}))
                out.append(SplitRow(t, k, m, -(-n // block[1]), classes))
        memo["fp8_split_rows"] = tuple(out)
    return memo["fp8_split_rows"]


def amax_exchange(layout: Layout, rank: int, tensors: set[str] | None = None
                  ) -> tuple[tuple[SplitRow, ...], dict[int, list[SplitRow]]] | None:
    """What `rank` of a quantized source layout does before quantizing (`tensors`: an update's,
    default all): (the split rows it holds part of, source rank -> the rows it exchanges partial
    max |x| for with it: every rank of another class holding part of one of them; both sides list
    the same rows in the same order). None where it holds no part of a split row."""
    mine = layout.ranks.rank_class[rank]
    rows = tuple(r for r in split_rows(layout) if mine in r.classes and (tensors is None or r.tensor in tensors))
    if not rows:
        return None
    members: dict[int, list[int]] = {}
    for r, c in enumerate(layout.ranks.rank_class):
        members.setdefault(c, []).append(r)
    peers: dict[int, list[SplitRow]] = {}
    for row in rows:
        for c in row.classes:
            if c != mine:
                for r in members[c]:
                    peers.setdefault(r, []).append(row)
    return rows, peers


def fp8_tensors(src: Layout, dst: Layout) -> dict[str, str]:
    """Destination tensors served as block FP8 that the source holds unquantized -> their scales' names."""
    out = {}
    for name, d in dst.tensors.items():
        s = src.tensors.get(name)
        if d.dtype != FP8 or s is None or s.dtype == FP8:
            continue
        sname = scale_name(name)
        sc = dst.tensors.get(sname)
        if len(d.shape) not in (2, 3):
            raise LayoutError(f"tensor {name!r}: the destination serves it as {FP8} in blocks, but it has shape "
                              f"{list(d.shape)}: block FP8 is a 2-D weight's, or stacked experts' (3-D)")
        if sc is None or sc.dtype != "float32" or tuple(sc.shape) != scale_shape(d.shape):
            raise LayoutError(f"tensor {name!r}: the destination serves it as {FP8} but declares no float32 "
                              f"{sname!r} of shape {list(scale_shape(d.shape))} "
                              f"(its block scales, {BLOCK[0]} x {BLOCK[1]})")
        if sname in src.tensors:
            raise LayoutError(f"tensor {sname!r}: the source holds it, but it is derived from {name!r} when quantized")
        out[name] = sname
    return out


def with_scales(subset: set[str] | None, dst: Layout) -> set[str] | None:
    """A partial update's tensors, with the scales of every block-FP8 tensor in it."""
    if subset is None:
        return None
    return subset | {scale_name(n) for n in subset if dst.tensors[n].dtype == FP8 and scale_name(n) in dst.tensors}


def quantized_source(src: Layout, dst: Layout) -> Layout:
    """`src` with every piece of a tensor `dst` serves as block FP8 moved into derived buffers of
    FP8 values and scales (the module doc); `src` itself where there is none."""
    quant = fp8_tensors(src, dst)
    if not quant:
        return src
    tensors = dict(src.tensors)
    for name, sname in quant.items():
        shape = src.tensors[name].shape
        tensors[name] = TensorSpec(name, shape, FP8)
        tensors[sname] = TensorSpec(sname, scale_shape(shape), "float32")
    first_rank = {}
    for r, c in enumerate(src.ranks.rank_class):
        first_rank.setdefault(c, r)
    made = {c: _class_buffers(src.ranks.cls(c), quant, src.tensors, first_rank[c]) for c in first_rank}
    ranks = [made[c] for c in src.ranks.rank_class]  # ranks of one class share one tuple: replicas stay replicas
    return Layout({n: tensors[n] for n in sorted(tensors)}, ranks, src.allow_casts, src.receive_window)


def _class_buffers(bufs: tuple[LocalBuffer, ...], quant: dict[str, str], tensors: dict[str, TensorSpec],
                   rank: int) -> tuple[LocalBuffer, ...]:
    out = []
    for buf in bufs:
        keep, padding, derived = [], list(buf.padding), []
        for i, p in enumerate(buf.pieces):
            if p.tensor not in quant:
                keep.append(p)
                continue
            shape = tensors[p.tensor].shape
            if len(shape) > 2 and not aligned(p.box, shape):
                raise LayoutError(
                    f"tensor {p.tensor!r}: the destination serves these stacked experts as block FP8 ({BLOCK[0]} x "
                    f"{BLOCK[1]} per expert), and trainer rank {rank} holds its box {p.box}"
                    f"{' (a flat range)' if p.flat else ''}, which splits blocks: the trainer quantizes stacked "
                    "experts where its pieces are whole blocks. Shard them by experts, or on block boundaries, or "
                    "let the destination quantize (the vLLM backend's quantize='receiver': bf16 on the wire)")
            if not columns_aligned(p.box, shape):
                raise LayoutError(
                    f"tensor {p.tensor!r}: the destination serves it as block FP8 ({BLOCK[0]} x {BLOCK[1]}), and "
                    f"trainer rank {rank} holds its box {p.box}{' (a flat range)' if p.flat else ''}, whose columns "
                    "split blocks: the trainer quantizes rows of blocks that its ranks hold across their whole "
                    "width. Shard its columns on block boundaries, or let the destination quantize (the vLLM "
                    "backend's quantize='receiver': bf16 on the wire)")
            padding += p.buffer_boxes(buf.shape)
            full = Box.full(p.box.size)
            derived.append(LocalBuffer(f"{buf.name}{DERIVED[0]}{i}", p.box.size, FP8, (Piece(p.tensor, full, p.box),)))
            sbox = owned_scales(p.box)
            if sbox.numel:  # a piece inside one row of blocks, not its first row, sends no scale
                derived.append(LocalBuffer(f"{buf.name}{DERIVED[1]}{i}", sbox.size, "float32",
                                           (Piece(quant[p.tensor], Box.full(sbox.size), sbox),)))
        if len(keep) == len(buf.pieces):
            out.append(buf)
        elif keep:
            out.append(LocalBuffer(buf.name, buf.shape, buf.dtype, tuple(keep), tuple(padding)))
        out += derived
    return tuple(out)


def derived_pieces(bufs: tuple[LocalBuffer, ...]) -> list[tuple[str, str, int]]:
    """A rank's derived buffers as (values buffer, scales buffer, piece index), its source buffer's
    name being the values buffer's up to its marker: what the trainer worker fills."""
    out = []
    for b in bufs:
        name, marker, i = b.name.rpartition(DERIVED[0])
        if marker and i.isdigit():
            out.append((b.name, f"{name}{DERIVED[1]}{i}", int(i)))
    return out


def has_derived(layout: Layout, rank: int) -> bool:
    """Whether `rank` of a source layout fills derived buffers (looked at once per rank class)."""
    memo = layout._memo.setdefault("fp8_derived_classes", {})
    c = layout.ranks.rank_class[rank]
    if c not in memo:
        memo[c] = bool(derived_pieces(layout.ranks.cls(c)))
    return memo[c]


def source_buffer(derived: str) -> str:
    return derived.rpartition(DERIVED[0])[0]


def wire_bytes(shape: tuple[int, ...]) -> int:
    """Bytes a block-FP8 tensor of `shape` (2-D, or stacked experts) takes on the wire: values and scales."""
    return math.prod(shape) + 4 * math.prod(scale_shape(shape))


def is_linear_weight(name: str, shape: tuple[int, ...]) -> bool:
    """What a block-FP8 checkpoint quantizes: the 2-D projection weights of the decoder layers (not
    embeddings, the LM head, norms or routers)."""
    return len(shape) == 2 and ".layers." in name and name.endswith("_proj.weight")


def whole_block_tensors(layout: Layout) -> set[str]:
    """The 2-D tensors every piece of which, on every rank, is made of whole blocks."""
    out = {n for n, t in layout.tensors.items() if len(t.shape) == 2}
    for c in range(len(layout.ranks.classes)):
        for b in layout.ranks.cls(c):
            out -= {p.tensor for p in b.pieces if p.tensor in out and not aligned(p.box, layout.tensors[p.tensor].shape)}
    return out


def fp8_destination(layout: Layout, among: set[str] | None = None) -> Layout:
    """`layout` as an engine serving a block-FP8 checkpoint holds it: every linear weight
    (`is_linear_weight`) whose buffers hold only such weights, each piece made of whole blocks at a
    block boundary of its buffer, becomes float8_e4m3fn, with a `<buffer>_scale_inv` buffer of its
    scales beside each buffer (`scale_buffer`). Others stay as they are (the bench's FP8 twin of a
    destination: `reshard bench --fp8`). `among`: only these tensors may be FP8."""
    quant = {n for n, t in layout.tensors.items() if is_linear_weight(n, t.shape) and (among is None or n in among)}
    classes = [layout.ranks.cls(c) for c in range(len(layout.ranks.classes))]

    def fits(b: LocalBuffer) -> bool:
        return len(b.shape) == 2 and all(
            p.tensor in quant and not p.flat and aligned(p.box, layout.tensors[p.tensor].shape)
            and all(o % k == 0 for o, k in zip(p.region.offset, BLOCK)) for p in b.pieces)

    changed = True
    while changed:  # a tensor any of whose buffers cannot be FP8 stays unquantized everywhere
        changed = False
        for bufs in classes:
            for b in bufs:
                if not fits(b) and any(p.tensor in quant for p in b.pieces):
                    quant -= {p.tensor for p in b.pieces}
                    changed = True
    if not quant:
        return layout
    tensors = dict(layout.tensors)
    for n in quant:
        shape = tensors[n].shape
        tensors[n] = TensorSpec(n, shape, FP8)
        tensors[scale_name(n)] = TensorSpec(scale_name(n), scale_shape(shape), "float32")
    made = []
    for bufs in classes:
        out = []
        for b in bufs:
            if b.pieces and all(p.tensor in quant for p in b.pieces):
                q = LocalBuffer(b.name, b.shape, FP8, b.pieces, b.padding)
                out += [q, scale_buffer(q, b.name + SCALE_SUFFIX)]
            else:
                out.append(b)
        made.append(tuple(out))
    ranks = [made[c] for c in layout.ranks.rank_class]
    return Layout({n: tensors[n] for n in sorted(tensors)}, ranks, layout.allow_casts, layout.receive_window)
