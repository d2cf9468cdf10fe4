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


def fp8_block_quantize(x: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(values float8_e4m3fn in x's shape, scales float32 [ceil(rows / block[0]), ceil(cols / block[1])]).

    One row of blocks at a time, through a scratch row that stays in cache (4x faster on a CPU
    core than the whole tensor at once), with the same arithmetic element by element."""
    if x.dim() != 2:
        raise ValueError(f"block FP8 quantizes 2-D weights, not a tensor of shape {list(x.shape)}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"block FP8 quantizes floating-point weights, not {x.dtype}")
    m, n = x.shape
    bm, bn = block
    gm, gn = -(-m // bm), -(-n // bn)
    values = torch.empty((m, n), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((gm, gn), dtype=torch.float32, device=x.device)
    wide = gn * bn
    # A partial column block, or rows that are not contiguous (a column shard's view): copied into a
    # zero-padded row first (zeros do not change a block's amax)
    padded = x.new_zeros((bm, wide)) if n % bn or (m > 1 and x.stride(0) != n) or x.stride(-1) != 1 else None
    # x * (1 / scale) in float32 (at least), as vLLM's quantizer
    scratch = torch.empty((bm, wide), dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
    for i in range(gm):
        r0 = i * bm
        h = min(bm, m - r0)
        rows = x[r0:r0 + h]
        if padded is not None:
            padded[:h, :n].copy_(rows)
            rows = padded[:h]
        blocks = rows.view(h, gn, bn)
        # |x| and its max are exact in x's own dtype; a partial row block counts its rows alone
        scale = blocks.abs().amax(dim=(0, 2)).float().clamp_(min=AMAX_FLOOR) / FP8_MAX
        scales[i] = scale
        torch.mul(blocks, (1.0 / scale).view(1, gn, 1), out=scratch[:h].view(h, gn, bn))
        values[r0:r0 + h].copy_(scratch[:h, :n])
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
