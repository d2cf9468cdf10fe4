"""Block FP8: the recipe that turns a 2-D weight into float8_e4m3fn values and one float32 scale per
block (128 x 128 by default), as DeepSeek-V3 and the Qwen3 FP8 checkpoints ship them and as vLLM
quantizes online (`fp8_per_block`): per block, amax = max |x| in float32, at least 1e-4; the
scale is amax / 448 (the largest e4m3fn value); the values are x * (1 / scale), cast to
float8_e4m3fn; partial blocks at the edges count their elements alone. The scale tensor
(`weight_scale_inv` in a checkpoint) is what multiplies the values back.

A block's scale depends on every element of the block, so a block is quantized where it is
whole: on a trainer rank whose shard is made of whole blocks (common/layout/quantized.py: FP8
bytes on the wire), or on the inference rank, whose shard of a block-quantized layer always is
(vLLM refuses a tensor-parallel split that is not)."""

from __future__ import annotations

import torch

from reshard.common.layout.quantized import BLOCK as FP8_BLOCK
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
AMAX_FLOOR = 1e-4  # an all-zero block gets this amax (its scale is not 0)
# A float dtype's integer twin, and the mask that clears its sign bit
_MAGNITUDE_BITS = {torch.bfloat16: (torch.int16, 0x7FFF), torch.float16: (torch.int16, 0x7FFF),
                   torch.float32: (torch.int32, 0x7FFFFFFF)}


# On an accelerator, as many rows of blocks at a time as fit in this much float32 scratch (a
# CPU core goes one row of blocks at a time, to stay in cache; a GPU wants few, large kernels)
DEVICE_SCRATCH_BYTES = 64 << 20


def fp8_block_quantize(x: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(values float8_e4m3fn in x's shape, scales float32 [ceil(rows / block[0]), ceil(cols / block[1])]).

    On a CPU, one row of blocks at a time, through a scratch row that stays in cache (4x faster on
    a core than the whole tensor at once); on an accelerator, as many rows of blocks as fit in
    DEVICE_SCRATCH_BYTES. The arithmetic is the same element by element."""
    if x.dim() != 2:
        raise ValueError(f"block FP8 quantizes 2-D weights, not a tensor of shape {list(x.shape)}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"block FP8 quantizes floating-point weights, not {x.dtype}")
    gm, wide = -(-x.shape[0] // block[0]), -(-x.shape[1] // block[1]) * block[1]
    step = 1 if x.device.type == "cpu" else DEVICE_SCRATCH_BYTES // (block[0] * wide * 4)
    return _quantize(x, block, max(1, min(gm, step)))


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
    bits, sign = _MAGNITUDE_BITS.get(x.dtype, (None, 0))
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
        # max |x| per block, exact in x's own dtype; a partial row block counts its rows alone
        if bits is None:
            amax = blocks.abs().amax(dim=(1, 3))
        else:
            # The bits of |x| (sign bit cleared) order as integers as |x| orders as a float (NaN
            # above infinity, as amax propagates it), and integer ops are 3x faster on a CPU core
            amax = torch.bitwise_and(blocks.view(bits), sign).amax(dim=(1, 3)).view(x.dtype)
        scale = amax.float().clamp_(min=AMAX_FLOOR) / FP8_MAX
        scales[i:i + k] = scale
        out = scratch[:h].view(k, h // k, gn, bn)
        out.copy_(blocks)
        out.mul_((1.0 / scale).view(k, 1, gn, 1))
        values[r0:r0 + h].copy_(scratch[:h, :n])
        i += k
    return values, scales


class QuantizedBuffers(dict):
    """A sender's buffers for one transfer with its derived ones (common/layout/quantized.py): each
    piece its rank's layout moved into FP8 values and scales is quantized from `buffers` (its live or
    snapshot tensors, by name; `descs`, its own LocalBuffers by name) when the transfer first reads
    either of them, so quantizing a later round overlaps the bytes of an earlier one in flight."""

    def __init__(self, rank_buffers, descs, buffers: dict[str, torch.Tensor]) -> None:
        from reshard.common.layout.quantized import derived_pieces, source_buffer

        super().__init__(buffers)
        self._todo = {}
        for values, scales, i in derived_pieces(rank_buffers):
            piece = (source_buffer(values), i, values, scales)
            self._todo[values] = self._todo[scales] = piece
        self._descs = descs

    def __missing__(self, name: str) -> torch.Tensor:
        base, i, values, scales = self._todo.pop(name) if name in self._todo else (None, 0, "", "")
        if base is None:
            raise KeyError(name)
        self._todo.pop(values if name == scales else scales, None)
        self[values], self[scales] = fp8_block_quantize(self._descs[base].pieces[i].view(self[base]))
        return self[name]

    @property
    def pending(self) -> bool:
        """Whether any derived buffer is still to be made (False: there are none)."""
        return bool(self._todo)
