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
    """(values float8_e4m3fn in x's shape, scales float32 [ceil(rows / block[0]), ceil(cols / block[1])])."""
    if x.dim() != 2:
        raise ValueError(f"block FP8 quantizes 2-D weights, not a tensor of shape {list(x.shape)}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"block FP8 quantizes floating-point weights, not {x.dtype}")
    m, n = x.shape
    bm, bn = block
    gm, gn = -(-m // bm), -(-n // bn)
    if m % bm or n % bn:
        padded = x.new_zeros((gm * bm, gn * bn))  # zeros do not change a block's amax
        padded[:m, :n] = x
    else:
        padded = x.contiguous()  # a piece of a buffer may be a strided view
    blocks = padded.view(gm, bm, gn, bn)
    # |x| and its max are exact in x's own dtype: the float32 copy is made once, by the product
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True).float().clamp(min=AMAX_FLOOR)
    scale = amax / FP8_MAX
    scaled = torch.empty(blocks.shape, dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
    torch.mul(blocks, 1.0 / scale, out=scaled)  # x * (1 / scale) in float32 (at least), as vLLM's quantizer
    values = scaled.to(torch.float8_e4m3fn)
    return values.view(gm * bm, gn * bn)[:m, :n].contiguous(), scale.view(gm, gn)


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

    def quantize_all(self) -> "QuantizedBuffers":
        """Every derived buffer made now (for a caller that reads them other than by name)."""
        for name in list(self._todo):
            if name in self._todo:
                self[name]  # noqa: B018 - __missing__ makes it
        return self


def quantize_derived(rank_buffers, descs, buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The derived buffers alone, all made now."""
    q = QuantizedBuffers(rank_buffers, descs, buffers).quantize_all()
    return {n: t for n, t in q.items() if n not in buffers}
