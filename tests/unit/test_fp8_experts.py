"""Block FP8 of stacked MoE experts on the wire (issue 29, item 3): trainer ranks holding whole
experts (expert parallelism, or FSDP2's Shard(0) of the stacked tensor) quantize each expert's
matrix in 128 x 128 blocks of its own, and each inference rank, holding every expert's rows of its
tensor-parallel shard (vLLM's w13_weight: gate rows then up rows; w2_weight: its columns), receives
FP8 values and per-expert scales exactly as a quantizer of each whole expert makes them. The
expectation is the test's own: test_fp8_recipe's block-by-block loop over each expert of the masters."""

from __future__ import annotations

import time

import pytest
import torch

from reshard.common.dataplane.engine import Engine, StagingPool
from reshard.common.layout.core import Box, Layout, LayoutError, LocalBuffer, Piece, TensorSpec, check_compatible
from reshard.common.layout.quantized import fp8_tensors, quantized_source
from reshard.common.plan.planner import PlanOptions, make_plan
from reshard.common.quant import QuantizedBuffers, fp8_block_quantize

from .loopback import Loopback
from .test_fp8_recipe import loop_quantize

E, H, INTER = 4, 200, 256  # hidden 200: a partial column block in gate_up, a partial row block in down
GU, DN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
SHAPES = {GU: (E, 2 * INTER, H), DN: (E, H, INTER)}


def masters() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    out = {n: torch.randn(s, generator=g) * 0.02 for n, s in SHAPES.items()}
    out[GU][2, 300, 150] = 7.0  # an outlier: one block of expert 2's up rows
    return out


def per_expert(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    qs = [loop_quantize(x[e]) for e in range(x.shape[0])]
    return torch.stack([q for q, _ in qs]), torch.stack([s for _, s in qs])


def trainer(cut: int = 2) -> tuple[Layout, list[dict[str, torch.Tensor]]]:
    """fp32 masters over 2 ranks by experts (expert parallelism): rank 0 experts [0, cut), rank 1 the rest."""
    m = masters()
    specs = {n: TensorSpec(n, s, "float32") for n, s in SHAPES.items()}
    ranks, bufs = [], []
    for lo, hi in ((0, cut), (cut, E)):
        rank, held = [], {}
        for n, s in SHAPES.items():
            size = (hi - lo, *s[1:])
            rank.append(LocalBuffer(n, size, "float32", (Piece(n, Box.full(size), Box((lo, 0, 0), size)),)))
            held[n] = m[n][lo:hi].clone()
        ranks.append(tuple(rank))
        bufs.append(held)
    return Layout(specs, tuple(ranks)), bufs


def engine_fp8() -> Layout:
    """vLLM-like TP 2 of a block-FP8 MoE checkpoint: w13 (every expert's gate rows of this rank, then
    its up rows), w2 (every expert's columns of this rank), with their per-expert scale stacks."""
    ip = INTER // 2
    specs = {GU: TensorSpec(GU, SHAPES[GU], "float8_e4m3fn"), DN: TensorSpec(DN, SHAPES[DN], "float8_e4m3fn"),
             GU + "_scale_inv": TensorSpec(GU + "_scale_inv", (E, 4, 2), "float32"),
             DN + "_scale_inv": TensorSpec(DN + "_scale_inv", (E, 2, 2), "float32")}
    ranks = []
    for d in range(2):
        ranks.append((
            LocalBuffer("w13", (E, 2 * ip, H), "float8_e4m3fn", (
                Piece(GU, Box((0, 0, 0), (E, ip, H)), Box((0, d * ip, 0), (E, ip, H))),
                Piece(GU, Box((0, ip, 0), (E, ip, H)), Box((0, INTER + d * ip, 0), (E, ip, H))))),
            LocalBuffer("w13_s", (E, 2, 2), "float32", (
                Piece(GU + "_scale_inv", Box((0, 0, 0), (E, 1, 2)), Box((0, d, 0), (E, 1, 2))),
                Piece(GU + "_scale_inv", Box((0, 1, 0), (E, 1, 2)), Box((0, 2 + d, 0), (E, 1, 2))))),
            LocalBuffer("w2", (E, H, ip), "float8_e4m3fn", (Piece(DN, Box.full((E, H, ip)), Box((0, 0, d * ip), (E, H, ip))),)),
            LocalBuffer("w2_s", (E, 2, 1), "float32", (
                Piece(DN + "_scale_inv", Box.full((E, 2, 1)), Box((0, 0, d), (E, 2, 1))),)),
        ))
    return Layout(specs, tuple(ranks))


def transfer(src: Layout, sbufs, dst: Layout) -> tuple[list[dict[str, torch.Tensor]], object]:
    q = quantized_source(src, dst)
    check_compatible(q, dst)
    plan = make_plan(q, dst, PlanOptions(direct_min_bytes=1))
    shapes = {n: s.shape for n, s in q.tensors.items()}
    wire, deadline = {}, time.monotonic() + 60
    for r in range(len(src.ranks)):
        bufs = QuantizedBuffers(q.ranks[r], {b.name: b for b in src.ranks[r]}, sbufs[r])
        Engine(Loopback(r, wire), plan, "src", r, bufs, shapes, StagingPool(), deadline).run()
    dbufs = [{b.name: torch.zeros(b.shape, dtype=getattr(torch, b.dtype)) for b in dst.ranks[d]} for d in range(2)]
    for d in range(2):
        Engine(Loopback(len(src.ranks) + d, wire), plan, "dst", d, dbufs[d], shapes, StagingPool(), deadline).run()
    assert not wire
    return dbufs, plan


@pytest.mark.parametrize("cut", [2, 1])
def test_fp8_experts_are_quantized_expert_by_expert_on_the_trainer(cut):
    src, sbufs = trainer(cut)
    dst = engine_fp8()
    assert fp8_tensors(src, dst) == {GU: GU + "_scale_inv", DN: DN + "_scale_inv"}
    dbufs, plan = transfer(src, sbufs, dst)
    m = masters()
    (gq, gs), (dq, ds) = per_expert(m[GU]), per_expert(m[DN])
    assert gs[2, 2, 1] == 7.0 / 448.0  # the outlier's block: expert 2, up rows 256-383 (row block 2), columns 128-199
    u8, ip = torch.uint8, INTER // 2
    for d in range(2):
        got = dbufs[d]
        want13 = torch.cat([gq[:, d * ip:(d + 1) * ip], gq[:, INTER + d * ip:INTER + (d + 1) * ip]], dim=1)
        assert torch.equal(got["w13"].view(u8), want13.view(u8)), f"rank {d} w13"
        assert torch.equal(got["w13_s"], torch.stack([gs[:, d], gs[:, 2 + d]], dim=1)), f"rank {d} w13 scales"
        assert torch.equal(got["w2"].view(u8), dq[:, :, d * ip:(d + 1) * ip].view(u8)), f"rank {d} w2"
        assert torch.equal(got["w2_s"], ds[:, :, d:d + 1]), f"rank {d} w2 scales"
    # FP8 on the wire: a byte per element and four per block scale, each once
    assert plan.total_bytes == E * 2 * INTER * H + E * H * INTER + 4 * E * (4 * 2 + 2 * 2)


def test_fp8_experts_quantized_as_one_tensor_come_out_wrong():
    """Negative control: blocks that run across experts (the stack quantized as one 2-D matrix of
    E * rows rows) are not the checkpoint's: here they differ where an expert's rows end inside a
    block (the experts' rows are 512 and 200, so the 200-row down blocks straddle experts)."""
    m = masters()
    flat_q, _ = loop_quantize(m[DN].reshape(E * H, INTER))
    q, _ = per_expert(m[DN])
    assert not torch.equal(flat_q.view(torch.uint8), q.reshape(E * H, INTER).view(torch.uint8))


def test_fp8_block_quantize_takes_stacked_experts():
    m = masters()
    for name in SHAPES:
        values, scales = fp8_block_quantize(m[name].to(torch.bfloat16))
        want_q, want_s = per_expert(m[name].to(torch.bfloat16))
        assert torch.equal(values.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scales, want_s), name
    with pytest.raises(ValueError, match=r"2-D weights or stacked experts \(3-D\), not a tensor of shape \[2, 2, 2, 2\]"):
        fp8_block_quantize(torch.zeros(2, 2, 2, 2))


def test_a_trainer_piece_of_experts_that_splits_blocks_is_refused_by_name():
    src, _ = trainer()
    r0 = list(src.ranks[0])
    size = (2, 100, H)  # rows 0-99 of experts 0-1's gate_up: inside a row of blocks
    r0[0] = LocalBuffer(GU, size, "float32", (Piece(GU, Box.full(size), Box((0, 0, 0), size)),))
    bad = Layout(src.tensors, (tuple(r0), src.ranks[1]))
    with pytest.raises(LayoutError, match=r"tensor 'mlp.experts.gate_up_proj': the destination serves these stacked "
                                          r"experts as block FP8 \(128 x 128 per expert\), and trainer rank 0 holds "
                                          r"its box \[0:2, 0:100, 0:200\], which splits blocks.*quantize='receiver'"):
        quantized_source(bad, engine_fp8())


def test_fp8_experts_without_their_scales_are_refused():
    src, _ = trainer()
    dst = engine_fp8()
    wrong = dict(dst.tensors)
    wrong[DN + "_scale_inv"] = TensorSpec(DN + "_scale_inv", (2, 2), "float32")  # a 2-D weight's scales
    with pytest.raises(LayoutError, match=r"tensor 'mlp.experts.down_proj': the destination serves it as "
                                          r"float8_e4m3fn but declares no float32 "
                                          r"'mlp.experts.down_proj_scale_inv' of shape \[4, 2, 2\]"):
        quantized_source(src, Layout(wrong, dst.ranks))
