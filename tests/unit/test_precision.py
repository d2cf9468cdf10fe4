"""Negotiated precision: a trainer holds fp32 masters (FSDP2 under a bf16 MixedPrecisionPolicy),
the engine serves bf16; the pair plans without any declaration, the sender casts as it packs,
bf16 bytes cross the wire, and the receiver holds exactly the bf16 cast of the gathered masters.
A cast that loses range (a float into an integer) is refused by name unless declared.

The expectation is the test's own: masters it wrote, gathered by the test, cast by torch."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from reshard.common.dataplane.checksum import P
from reshard.common.dataplane.engine import Engine, StagingPool, receiver_checksums
from reshard.common.layout.core import Box, Layout, LayoutError, LocalBuffer, Piece, TensorSpec, dtype_casts
from reshard.common.layout.values import cast_refusal
from reshard.common.models.frameworks import build, parse_spec
from reshard.common.plan import verify
from reshard.common.plan.planner import PlanOptions, make_plan
from reshard.integrations.dtensor import module_layout

from .loopback import Loopback


class Counting(Loopback):
    """The loopback wire, counting the bytes each send puts on it."""

    def __init__(self, rank: int, wire: dict, counter: list[int]) -> None:
        super().__init__(rank, wire)
        self.counter = counter

    def send(self, buf, peer, tag):
        self.counter[0] += buf.numel()
        return super().send(buf, peer, tag)


@pytest.mark.parametrize("src,dst,ok", [
    ("float32", "bfloat16", True), ("float32", "float16", True), ("bfloat16", "float32", True),
    ("float64", "bfloat16", True), ("float16", "bfloat16", True), ("int32", "int64", True), ("uint8", "int32", True),
    ("float32", "int8", False), ("bfloat16", "int32", False), ("int64", "int32", False), ("int8", "uint8", False),
    ("uint8", "int8", False), ("int32", "float32", False), ("int64", "int64", True)])
def test_which_casts_need_a_declaration(src, dst, ok):
    assert (cast_refusal(src, dst) is None) == ok


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(6, 10, bias=False)
        self.down = torch.nn.Linear(10, 6, bias=False)
        self.norm = torch.nn.Parameter(torch.zeros(5))


def _masters() -> dict[str, torch.Tensor]:
    """fp32 values that bf16 cannot hold: the cast must round."""
    g = torch.Generator().manual_seed(7)
    return {n: torch.randn(s, generator=g) / 3 for n, s in (("up.weight", (10, 6)), ("down.weight", (6, 10)), ("norm", (5,)))}


def fsdp2_sources(world: int, masters: dict[str, torch.Tensor]):
    """Every rank's layout and local shards of an FSDP2 model (fully_shard with a bf16
    MixedPrecisionPolicy: fp32 sharded parameters), on a fake process group."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    ranks, bufs, tensors = [], [], None
    try:
        for rank in range(world):
            if dist.is_initialized():
                dist.destroy_process_group()
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
            mesh = dist.device_mesh.init_device_mesh("cpu", (world,))
            model = Mlp()
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(masters[n])
            fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
            assert all(p.dtype == torch.float32 for p in model.parameters()), "FSDP2 keeps fp32 sharded masters"
            _, _, tensors, buffers = module_layout(model)
            ranks.append(tuple(d for d, _ in buffers.values()))
            bufs.append({n: t.detach().clone() for n, (_, t) in buffers.items()})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return Layout(dict(tensors), tuple(ranks)), bufs


def bf16_tp2() -> Layout:
    """The engine's side, as vLLM TP 2 holds it in bf16: up by rows, down by columns, norm replicated."""
    specs = {n: TensorSpec(n, s, "bfloat16") for n, s in (("up.weight", (10, 6)), ("down.weight", (6, 10)), ("norm", (5,)))}
    ranks = []
    for r in range(2):
        ranks.append((
            LocalBuffer("up", (5, 6), "bfloat16", (Piece("up.weight", Box((0, 0), (5, 6)), Box((5 * r, 0), (5, 6))),)),
            LocalBuffer("down", (6, 5), "bfloat16", (Piece("down.weight", Box((0, 0), (6, 5)), Box((0, 5 * r), (6, 5))),)),
            LocalBuffer("norm", (5,), "bfloat16", (Piece("norm", Box((0,), (5,)), Box((0,), (5,))),)),
        ))
    return Layout(specs, tuple(ranks))


@pytest.mark.parametrize("relay", [True, False])
def test_fsdp2_fp32_masters_into_bf16_engine(relay):
    masters = _masters()
    src, sbufs = fsdp2_sources(2, masters)
    dst = bf16_tp2()
    assert {t.dtype for t in src.tensors.values()} == {"float32"} and not src.allow_casts  # nothing declared
    assert dtype_casts(src, dst) == {("float32", "bfloat16"): 3}
    plan = make_plan(src, dst, PlanOptions(relay=relay, direct_min_bytes=1))
    assert all((s.src_dtype, s.dst_dtype) == (("bfloat16",) * 2 if m.relay else ("float32", "bfloat16"))
               for m in plan.messages for s in m.segments)
    shapes = {n: s.shape for n, s in dst.tensors.items()}
    wire, sent_bytes, deadline = {}, [0], time.monotonic() + 60
    dbufs = [{b.name: torch.full(b.shape, float("nan"), dtype=torch.bfloat16) for b in dst.ranks[d]} for d in range(2)]
    sent: dict = {}
    reports = []
    for r in range(src.world):
        sums = Engine(Counting(r, wire, sent_bytes), plan, "src", r, sbufs[r], shapes, StagingPool(), deadline).run()
        reports.append(verify.sender_report(plan, sums))
        for k, c in sums.items():
            sent[k] = (sent.get(k, 0) + c) % P
    trainer_bytes = sent_bytes[0]
    for d in range(dst.world):
        Engine(Counting(src.world + d, wire, sent_bytes), plan, "dst", d, dbufs[d], shapes, StagingPool(), deadline,
               receiver_sums=True).run()
    assert not wire
    # Bit-exact: the test's own gather (its masters) cast by torch, sliced as vLLM TP 2 holds it.
    for d in range(2):
        want = {"up": masters["up.weight"][5 * d:5 * d + 5], "down": masters["down.weight"][:, 5 * d:5 * d + 5], "norm": masters["norm"]}
        for n, w in want.items():
            assert torch.equal(dbufs[d][n], w.to(torch.bfloat16)), f"rank {d} {n}"
        assert not torch.equal(dbufs[d]["up"].float(), want["up"]), "the masters were bf16-representable: no cast tested"
    # bf16 on the wire: every destination element once, 2 bytes each (a relay forwards a replica's copy
    # from inference to inference), alignment padding of packed messages aside.
    per_rank = 5 * 6 + 6 * 5 + 5
    assert plan.total_bytes == 2 * 2 * per_rank
    from_trainer = sum(m.nbytes for m in plan.messages if not m.relay)
    assert from_trainer == plan.total_bytes - sum(m.nbytes for m in plan.messages if m.relay)
    assert trainer_bytes == sum(m.wire_bytes for m in plan.messages if not m.relay)
    assert from_trainer <= trainer_bytes < 0.6 * 2 * from_trainer, \
        f"{trainer_bytes} bytes left the trainer for {from_trainer // 2} elements: fp32 would be {2 * from_trainer}"
    # The sender's checksums (of the bf16 it packed) verify what landed.
    values = verify.merge_reports(plan, reports)
    expected = plan.expected_checksums(sent)
    for d in range(2):
        got = receiver_checksums(plan, d, dbufs[d], dst, shapes)
        assert got == {k: v for k, v in expected.items() if k[0] == d}
        verify.check_rank(plan, d, verify.rank_expected(plan, d, values), dbufs[d], dst.rank_pieces(d), shapes)


def test_lossy_cast_refused_by_name_unless_declared():
    masters = _masters()
    src, _ = fsdp2_sources(2, masters)
    dst = bf16_tp2()
    ints = Layout({n: TensorSpec(n, s.shape, "int8") for n, s in dst.tensors.items()},
                  tuple(tuple(LocalBuffer(b.name, b.shape, "int8", b.pieces) for b in r) for r in dst.ranks))
    with pytest.raises(LayoutError, match=r"tensor 'down.weight': dtype mismatch, source float32 vs destination int8: "
                                          r"a float \(float32\) into an integer \(int8\) loses its range.*allow_casts"):
        make_plan(src, ints)
    declared = Layout(src.tensors, src.ranks, allow_casts=True)
    assert make_plan(declared, ints).total_bytes == 2 * (5 * 6 + 6 * 5 + 5)


def test_layout_spec_dtype():
    assert parse_spec("framework=fsdp,dp=2,dtype=float32") == ("fsdp", {"dp": 2, "dtype": "float32"})
    with pytest.raises(ValueError, match="dtype='fp32' must be one of"):
        parse_spec("framework=vllm,dtype=fp32")
    src, dst = build("tiny", "framework=fsdp,dp=2,dtype=float32"), build("tiny", "framework=vllm,tp=2")
    assert {t.dtype for t in src.tensors.values()} == {"float32"} and {t.dtype for t in dst.tensors.values()} == {"bfloat16"}
    plan = make_plan(src, dst)
    assert plan.total_bytes == sum(p.box.numel * 2 for r in dst.ranks for b in r for p in b.pieces)
