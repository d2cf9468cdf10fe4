"""Block FP8's recipe (common/quant.py) against two quantizers written apart from it: a block-by-block
loop in this file (each block sliced out, its own amax and scale, in float32) and vLLM's own
`per_block_cast_to_fp8` (the quantizer of its online `fp8_per_block`), byte for byte, on bf16 and
fp32 weights with partial edge blocks, an all-zero block and a block of outliers."""

import pytest
import torch

from reshard.common.quant import fp8_block_quantize


def weights(dtype: torch.dtype, rows: int = 300, cols: int = 200) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(rows, cols, generator=g) * 0.05
    x[:128, 128:] = 0.0  # a whole block of zeros
    x[130, 5] = 37.0  # an outlier sets its block's scale
    x[-1, -1] = -1e-6  # a partial corner block of one tiny value
    return x.to(dtype)


def loop_quantize(x: torch.Tensor, b: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    m, n = x.shape
    q = torch.empty(m, n, dtype=torch.float8_e4m3fn)
    s = torch.empty(-(-m // b), -(-n // b), dtype=torch.float32)
    for i in range(0, m, b):
        for j in range(0, n, b):
            blk = x[i:i + b, j:j + b]
            amax = max(blk.float().abs().max().item(), 1e-4)
            scale = torch.tensor(amax, dtype=torch.float32) / 448.0
            s[i // b, j // b] = scale
            q[i:i + b, j:j + b] = (blk.float() * (1.0 / scale)).to(torch.float8_e4m3fn)
    return q, s


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_block_recipe_matches_a_block_by_block_quantizer(dtype):
    x = weights(dtype)
    q, s = fp8_block_quantize(x)
    rq, rs = loop_quantize(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and s.shape == (3, 2) and s.dtype == torch.float32
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s, rs)
    # Negative control: a scale 1% off in one block changes that block's values
    bad = (x[:128, :128].float() * (1.0 / (rs[0, 0] * 1.01))).to(torch.float8_e4m3fn)
    assert not torch.equal(bad.view(torch.uint8), q[:128, :128].view(torch.uint8))


@pytest.mark.slow  # importing vLLM takes 3-4 s of the quick suite; the recipe is checked there against a block-by-block quantizer
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_block_recipe_matches_vllms_own_quantizer(dtype):
    pytest.importorskip("vllm", reason="the vllm extra is not installed")
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    x = weights(dtype)
    q, s = fp8_block_quantize(x)
    vq, vs = per_block_cast_to_fp8(x, [128, 128], use_ue8m0=False)
    assert torch.equal(q.view(torch.uint8), vq.view(torch.uint8))
    assert torch.equal(s, vs)


def test_fp8_block_refuses_what_it_cannot_quantize():
    with pytest.raises(ValueError, match="2-D"):
        fp8_block_quantize(torch.zeros(4))
    with pytest.raises(ValueError, match="floating-point"):
        fp8_block_quantize(torch.zeros(4, 4, dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("step", [2, 3, 100])
def test_fp8_block_recipe_many_rows_of_blocks_at_a_time_as_on_a_gpu(dtype, step):
    """An accelerator quantizes several rows of blocks per kernel (common/quant.py); run on a CPU
    here, that path must give the block-by-block loop's bytes too, column-shard views included."""
    from reshard.common.quant import _quantize

    x = weights(dtype if dtype != torch.float16 else torch.float32, rows=700).to(dtype)
    for view in (x, x[:, 3:]):
        q, s = _quantize(view, (128, 128), step)
        rq, rs = loop_quantize(view)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
        assert torch.equal(s, rs)
