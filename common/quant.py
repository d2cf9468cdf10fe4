"""Block FP8: the recipe that turns a 2-D weight (or each of stacked experts) into float8_e4m3fn values and one float32 scale per
block (128 x 128 by default), as DeepSeek-V3 and the Qwen3 FP8 checkpoints ship them and as vLLM
quantizes online (`fp8_per_block`): per block, amax = max |x| in float32, at least 1e-4; the
scale is amax / 448 (the largest e4m3fn value); the values are x * (1 / scale), cast to
float8_e4m3fn; partial blocks at the edges count their elements alone. The scale tensor
(`weight_scale_inv` in a checkpoint) is what multiplies the values back.

A block's scale depends on every element of the block. On the trainer ranks (FP8 bytes on the
wire: common/layout/quantized.py), a piece made of whole blocks is quantized on its own; where
pieces of several ranks share a row of blocks (FSDP2 row shards), the ranks first exchange their
partial max |x| per block (`QuantizedBuffers.exchange`) and each quantizes its rows with the whole
block's scale (`fp8_piece_quantize`). On the inference rank (`quantize="receiver"`), its shard of a
block-quantized layer is always whole blocks (vLLM refuses a tensor-parallel split that is not)."""

from __future__ import annotations

import torch

from reshard.common.layout.quantized import BLOCK as FP8_BLOCK
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
AMAX_FLOOR = 1e-4  # an all-zero block gets this amax (its scale is not 0)
AMAX_TAG = 2**31 - 2  # the trainer ranks' exchange of partial block maxima (outside any plan's tags)
# A float dtype's integer twin, and the mask that clears its sign bit
_MAGNITUDE_BITS = {torch.bfloat16: (torch.int16, 0x7FFF), torch.float16: (torch.int16, 0x7FFF),
                   torch.float32: (torch.int32, 0x7FFFFFFF)}


# On an accelerator, as many rows of blocks at a time as fit in this much float32 scratch (a
# CPU core goes one row of blocks at a time, to stay in cache; a GPU wants few, large kernels)
DEVICE_SCRATCH_BYTES = 64 << 20


def fp8_block_quantize(x: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(values float8_e4m3fn in x's shape, scales float32 [ceil(rows / block[0]), ceil(cols / block[1])]);
    stacked experts (E, rows, cols): each expert's, scales [E, ceil(rows / block[0]), ceil(cols / block[1])].

    On a CPU, one row of blocks at a time, through a scratch row that stays in cache (4x faster on
    a core than the whole tensor at once); on an accelerator, as many rows of blocks as fit in
    DEVICE_SCRATCH_BYTES. The arithmetic is the same element by element."""
    if x.dim() not in (2, 3):
        raise ValueError(f"block FP8 quantizes 2-D weights or stacked experts (3-D), not a tensor of shape "
                         f"{list(x.shape)}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"block FP8 quantizes floating-point weights, not {x.dtype}")
    if x.dim() == 3:  # stacked experts: each expert's matrix in blocks of its own
        values = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
        scales = torch.empty((x.shape[0], -(-x.shape[1] // block[0]), -(-x.shape[2] // block[1])),
                             dtype=torch.float32, device=x.device)
        for e in range(x.shape[0]):
            values[e], scales[e] = fp8_block_quantize(x[e], block)
        return values, scales
    gm, wide = -(-x.shape[0] // block[0]), -(-x.shape[1] // block[1]) * block[1]
    step = 1 if x.device.type == "cpu" else DEVICE_SCRATCH_BYTES // (block[0] * wide * 4)
    return _quantize(x, block, max(1, min(gm, step)))


def _max_abs(blocks: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """max |x| over `dims`, exact, in the blocks' own dtype. For the common floats, read on the bits
    with the sign cleared: they order as integers as |x| orders as a float (NaN above infinity, as
    amax propagates it), and integer ops are 3x faster on a CPU core."""
    bits, sign = _MAGNITUDE_BITS.get(blocks.dtype, (None, 0))
    if bits is None:
        return blocks.abs().amax(dim=dims)
    return torch.bitwise_and(blocks.view(bits), sign).amax(dim=dims).view(blocks.dtype)


def _quantize(x: torch.Tensor, block: tuple[int, int], step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_block_quantize, `step` rows of blocks at a time (a partial last row of blocks alone)."""
    m, n = x.shape
    bm, bn = block
    gm, gn = -(-m // bm), -(-n // bn)
    values = torch.empty((m, n), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((gm, gn), dtype=torch.float32, device=x.device)
    wide = gn * bn
    # A partial column block, or rows that are not contiguous (a column shard's view): copied into a
    # zero-padded scratch first (zeros do not change a block's amax)
    copy_in = n % bn or (m > 1 and x.stride(0) != n) or x.stride(-1) != 1
    padded = x.new_zeros((step * bm, wide)) if copy_in else None
    # x * (1 / scale) in float32 (at least), as vLLM's quantizer
    scratch = torch.empty((step * bm, wide), dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
    i = 0
    while i < gm:
        r0 = i * bm
        k = min(step, (m - r0) // bm) or 1  # whole rows of blocks, or the partial last one
        h = min(k * bm, m - r0)
        rows = x[r0:r0 + h]
        if padded is not None:
            padded[:h, :n].copy_(rows)
            rows = padded[:h]
        blocks = rows.reshape(k, h // k, gn, bn)
        # a partial row block counts its rows alone
        scale = _max_abs(blocks, (1, 3)).float().clamp_(min=AMAX_FLOOR) / FP8_MAX
        scales[i:i + k] = scale
        out = scratch[:h].view(k, h // k, gn, bn)
        out.copy_(blocks)
        out.mul_((1.0 / scale).view(k, 1, gn, 1))
        values[r0:r0 + h].copy_(scratch[:h, :n])
        i += k
    return values, scales


def block_amax(rows: torch.Tensor, col0: int, width: int, block: tuple[int, int] = FP8_BLOCK) -> torch.Tensor:
    """max |x| per column block of some rows of one row of blocks, as float32, over the tensor's
    `width` column blocks (0 outside the blocks `rows`, starting at column `col0`, covers): a part
    of each block's amax, which the max of all parts makes whole (0 changes no max)."""
    h, w = rows.shape
    gn = -(-w // block[1])
    out = torch.zeros(width, dtype=torch.float32, device=rows.device)
    if h == 0:
        return out
    pad = rows.new_zeros((h, gn * block[1]))
    pad[:, :w].copy_(rows)
    c0 = col0 // block[1]
    out[c0:c0 + gn] = _max_abs(pad.view(h, gn, block[1]), (0, 2)).float()
    return out


def _with_scale(rows: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """rows * (1 / scale) per column block, in float32 (at least), cast to float8_e4m3fn: the
    recipe's values for rows of one row of blocks whose scales are known."""
    h, w = rows.shape
    gn = scale.numel()
    out = torch.empty((h, gn * block[1]), dtype=torch.promote_types(rows.dtype, torch.float32), device=rows.device)
    out[:, :w].copy_(rows)
    out.view(h, gn, block[1]).mul_((1.0 / scale).view(1, gn, 1))
    return out[:, :w].to(torch.float8_e4m3fn)


def fp8_piece_quantize(x: torch.Tensor, row0: int, rows: int, col0: int, amax: dict[int, torch.Tensor],
                       block: tuple[int, int] = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """The recipe for a piece `x` of a tensor of `rows` rows, whose first element is the tensor's
    (row0, col0) and whose rows may start or end inside a row of blocks: for such a row of
    blocks, `amax[k]` is its whole max |x| per column block of the tensor (every part's
    `block_amax`, maxed). (values in x's shape, the scales of the rows of blocks whose first row
    the piece holds: common/layout/quantized.py `owned_scales`)."""
    h, w = x.shape
    bm = block[0]
    c0, c1 = col0 // block[1], -(-(col0 + w) // block[1])
    values = torch.empty((h, w), dtype=torch.float8_e4m3fn, device=x.device)
    parts: list[torch.Tensor] = []
    at = row0
    while at < row0 + h:
        k = at // bm
        end = min(row0 + h, (k + 1) * bm, rows)
        whole = at == k * bm and end == min((k + 1) * bm, rows)
        if whole:  # whole rows of blocks, up to the next that is split
            while end < row0 + h and end % bm == 0 and min(end + bm, rows) <= row0 + h:
                end = min(end + bm, rows)
            v, sc = fp8_block_quantize(x[at - row0:end - row0], block)
            parts.append(sc)
        else:
            if k not in amax:
                raise ValueError(f"rows {at}:{end} split a row of blocks ({k}) whose whole max |x| is not known")
            scale = amax[k][c0:c1].clamp(min=AMAX_FLOOR) / FP8_MAX
            v = _with_scale(x[at - row0:end - row0], scale, block)
            if at == k * bm:  # the piece holds the row of blocks' first row: it sends its scales
                parts.append(scale.view(1, -1))
        values[at - row0:end - row0] = v
        at = end
    scales = torch.cat(parts) if parts else torch.empty((0, c1 - c0), dtype=torch.float32, device=x.device)
    return values, scales


class QuantizedBuffers(dict):
    """A sender's buffers for one transfer with its derived ones (common/layout/quantized.py): each
    piece its rank's layout moved into FP8 values and scales is quantized from `buffers` (its live or
    snapshot tensors, by name; `descs`, its own LocalBuffers by name) when the transfer first reads
    either of them, so quantizing a later round overlaps the bytes of an earlier one in flight.

    `split`: (the SplitRows this rank holds part of, source rank -> the SplitRows it shares with
    it), from common/layout/quantized.py `amax_exchange`. Then `exchange` runs before the first
    byte moves, and the pieces in those rows of blocks are quantized with the whole blocks' scales."""

    def __init__(self, rank_buffers, descs, buffers: dict[str, torch.Tensor], split=None) -> None:
        from reshard.common.layout.quantized import derived_pieces, source_buffer

        super().__init__(buffers)
        self._todo = {}
        self._pieces = {}  # values buffer -> (source buffer, piece index, the piece as the tensor's box)
        descs_of = {b.name: b for b in rank_buffers}
        for values, scales, i in derived_pieces(rank_buffers):
            piece = (source_buffer(values), i, values, scales)
            self._todo[values] = self._todo[scales] = piece
            self._pieces[values] = (piece[0], i, descs_of[values].pieces[0])
        self._descs = descs
        self._rows, self._peers = split or ((), {})
        self._amax: dict[str, dict[int, torch.Tensor]] = {}  # tensor -> row of blocks -> its whole max |x|
        self._height = {r.tensor: r.rows for r in self._rows}

    def _piece(self, values: str) -> torch.Tensor:
        base, i, _ = self._pieces[values]
        return self._descs[base].pieces[i].view(self[base])

    def __missing__(self, name: str) -> torch.Tensor:
        base, i, values, scales = self._todo.pop(name) if name in self._todo else (None, 0, "", "")
        if base is None:
            raise KeyError(name)
        self._todo.pop(values if name == scales else scales, None)
        x, piece = self._piece(values), self._pieces[values][2]
        if piece.tensor in self._height:
            self[values], self[scales] = fp8_piece_quantize(x, piece.box.offset[0], self._height[piece.tensor],
                                                            piece.box.offset[1], self._amax.get(piece.tensor, {}))
        else:
            self[values], self[scales] = fp8_block_quantize(x)
        return self[name]

    def partial_amax(self, tensor: str, row: int, width: int, block: tuple[int, int] = FP8_BLOCK) -> torch.Tensor:
        """This rank's part of the max |x| per column block of one row of blocks of `tensor`, on the
        device of the weights."""
        out = None
        for values, (_, _, piece) in self._pieces.items():
            a, b = piece.box.offset[0], piece.box.end[0]
            lo, hi = max(a, row * block[0]), min(b, (row + 1) * block[0])
            if piece.tensor == tensor and lo < hi:
                part = block_amax(self._piece(values)[lo - a:hi - a], piece.box.offset[1], width, block)
                out = part if out is None else torch.maximum(out, part)
        return out if out is not None else torch.zeros(width, dtype=torch.float32)

    def exchange(self, transport, deadline: float) -> None:
        """Before the update's first byte: this rank's partial max |x| of every split row of blocks it
        holds part of; one message each way with each peer sharing some (`width` float32 per row,
        in the order both sides list them); each row's whole max kept. Every rank of the exchange
        calls it (the trainer worker, through RankUpdate.prelude)."""
        import time

        mine = {(r.tensor, r.row): self.partial_amax(r.tensor, r.row, r.width) for r in self._rows}
        wire = getattr(transport, "device", None) or torch.device("cpu")  # where the transport moves bytes from
        posted, inbox, sent = [], {}, []
        for peer, rows in sorted(self._peers.items()):
            out = torch.cat([mine[(r.tensor, r.row)].to(wire) for r in rows])
            inbox[peer] = torch.empty_like(out)
            sent.append(out)  # kept until its send is done
        if torch.device(wire).type == "cuda":  # the maxima were made on this stream; the transport sends on its own
            torch.cuda.current_stream(wire).synchronize()
        for (peer, rows), out in zip(sorted(self._peers.items()), sent):
            posted.append(transport.send(out.view(torch.uint8), peer, AMAX_TAG))
            posted.append(transport.recv(inbox[peer].view(torch.uint8), peer, AMAX_TAG))
        transport.flush()
        for w in posted:
            w.wait(max(0.001, deadline - time.monotonic()))
        for peer, rows in self._peers.items():
            at = 0
            for r in rows:
                key = (r.tensor, r.row)
                mine[key] = torch.maximum(mine[key], inbox[peer][at:at + r.width].to(mine[key].device))
                at += r.width
        for (t, k), amax in mine.items():
            self._amax.setdefault(t, {})[k] = amax

    @property
    def pending(self) -> bool:
        """Whether any derived buffer is still to be made (False: there are none)."""
        return bool(self._todo)
