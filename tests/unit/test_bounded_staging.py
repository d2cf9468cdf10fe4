"""Bounded staging (issue 29, item 1): a rank receives an update through a pool of fixed size,
each group of buffers loaded as soon as it is complete, its space reused. Every rank's Engine
runs over the in-process loopback; what is loaded is checked against the test's own
regeneration of the weights (tools.synth), sliced by the destination layout's boxes."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from reshard.common.dataplane.checksum import box_checksum
from reshard.common.dataplane.engine import Engine, StagingPool
from reshard.common.layout.core import dtype_of
from reshard.common.models.frameworks import ModelSpec, build
from reshard.common.plan.planner import PlanOptions, make_plan
from reshard.inference_svc.pool import BoundedStaging, _Space
from reshard.tools.synth import init_box, tensor_value

from .loopback import Loopback

SEED = 3
# Twelve thin layers: a rank holds 75 buffers of at most 16 KiB (478 KiB in all in bf16 at TP 2).
MODEL = ModelSpec(hidden=64, heads=4, kv_heads=2, intermediate=128, layers=12, vocab=256)


def _sources(layout) -> list[dict[str, torch.Tensor]]:
    out = []
    for r in range(layout.world):
        bufs = {}
        for d in layout.ranks[r]:
            t = torch.zeros(d.shape, dtype=dtype_of(d.dtype))
            for p in d.pieces:
                init_box(p.view(t), SEED, p.tensor, p.box.offset, layout.tensors[p.tensor].shape)
            bufs[d.name] = t
        out.append(bufs)
    return out


def _run(model, src_spec: str, dst_spec: str, pool_bytes: int, bucket: int, groups=None, relay: bool = True,
         window: int = 0):
    src, dst = build(model, src_spec), build(model, dst_spec)
    if window:  # what a bounded rank declares in its layout
        dst = dataclasses.replace(dst, receive_window=window)
    plan = make_plan(src, dst, PlanOptions(bucket_bytes=bucket, relay=relay))
    shapes = {n: s.shape for n, s in dst.tensors.items()}
    wire, deadline = {}, time.monotonic() + 60
    for r, bufs in enumerate(_sources(src)):
        Engine(Loopback(r, wire), plan, "src", r, bufs, shapes, StagingPool(), deadline).run()
    results = []
    for d in range(dst.world):
        descs = {b.name: b for b in dst.ranks[d]}
        staging = BoundedStaging(descs, shapes, "cpu", pool_bytes, groups=groups(descs) if groups else None)
        model_bufs: dict[str, torch.Tensor] = {}  # what the "engine" loaded: copies (pool space is reused)
        order: list[list[str]] = []

        def load(tensors, model_bufs=model_bufs, order=order):
            order.append(sorted(tensors))
            for n, t in tensors.items():
                assert n not in model_bufs, f"{n} loaded twice"
                model_bufs[n] = t.clone()

        staging.begin(plan, d, load)
        Engine(Loopback(src.world + d, wire), plan, "dst", d, staging, shapes, StagingPool(), deadline,
               hook=staging.round_done).run()
        sums = staging.finish()
        results.append((dst, d, staging, model_bufs, order, sums))
    assert not wire
    return plan, results


@pytest.mark.parametrize("src_spec,dst_spec", [("framework=megatron,tp=2", "framework=vllm,tp=2"),
                                               ("framework=fsdp,dp=3", "framework=vllm,tp=2,dp=2")])
def test_bounded_update_loads_every_buffer_exactly_within_the_pool(src_spec, dst_spec):
    pool = 96 << 10  # a fifth of a rank
    # Replicas take their bytes from the trainer (no relays): a primary would hold what it still has to relay.
    plan, results = _run(MODEL, src_spec, dst_spec, pool, bucket=16 << 10, relay=False)
    for dst, d, staging, loaded, order, sums in results:
        weights = sum(b.nbytes for b in dst.ranks[d])
        assert weights > 4 * pool, "the pool would hold the whole rank: nothing bounded is tested"
        assert set(loaded) == {b.name for b in dst.ranks[d]}, "every buffer loaded once"
        for b in dst.ranks[d]:
            want = torch.zeros(b.shape, dtype=dtype_of(b.dtype))  # padding reads as zeros
            for p in b.pieces:
                p.view(want).copy_(tensor_value(SEED, p.tensor, 0, dst.tensors[p.tensor].shape, want.dtype)[p.box.slices()])
            assert torch.equal(loaded[b.name], want), f"rank {d} buffer {b.name}"
        assert staging.overflow_bytes == 0 and staging.high_water <= pool, (staging.high_water, staging.overflow_bytes)
        assert len(order) == len(loaded) and staging.held_bytes == 0, "loaded one by one as they completed, all freed"
        # The sums VERIFY compares: every piece the plan verifies, of what landed.
        keys, _ = plan.verify_pieces(d)
        assert set(sums) == {(d, b, i) for b, i in keys}
        pieces = dst.rank_pieces(d)
        for (_, b, i), c in sums.items():
            p = pieces[(b, i)]
            assert c == box_checksum(p.view(loaded[b]), p.box.offset, dst.tensors[p.tensor].shape)


def test_groups_load_together_once_all_their_buffers_complete():
    def by_layer(descs):  # a module's buffers load together: here, every buffer of a layer
        return {n: n.split(".mlp")[0].split(".self_attn")[0] for n in descs}

    _, results = _run(MODEL, "framework=megatron,tp=2", "framework=vllm,tp=2", 1 << 20, bucket=16 << 10, groups=by_layer)
    for dst, d, staging, loaded, order, _ in results:
        groups = [set(g) for g in order]
        layers = {}
        for g in groups:
            keys = {by_layer({n: None})[n] for n in g}
            assert len(keys) == 1, f"a load mixed groups: {sorted(g)}"
            layers[keys.pop()] = g
        assert all(g == {n for n in loaded if by_layer({n: None})[n] == k} for k, g in layers.items())


def test_a_buffer_larger_than_the_pool_overflows_and_is_counted(caplog):
    _, results = _run(MODEL, "framework=megatron,tp=2", "framework=vllm,tp=2", 8192, bucket=16 << 10)
    dst, d, staging, loaded, _, _ = results[0]
    biggest = max(b.nbytes for b in dst.ranks[d])
    assert staging.overflow_bytes >= biggest and set(loaded) == {b.name for b in dst.ranks[d]}
    assert caplog.text.count("does not fit the 0.01 MiB pool") == 2, "one warning per rank and update"


def test_space_first_fit_and_coalescing():
    s = _Space(4096)
    a, b, c = s.take(1000), s.take(1000), s.take(1000)
    assert (a, b, c) == (0, 1024, 2048) and s.take(2000) is None
    s.give(b, 1000)
    s.give(a, 1000)
    assert s.free[0] == (0, 2048) and s.take(2000) == 0


def _exact(results) -> None:
    for dst, d, staging, loaded, order, _ in results:
        assert set(loaded) == {b.name for b in dst.ranks[d]}
        for b in dst.ranks[d]:
            want = torch.zeros(b.shape, dtype=dtype_of(b.dtype))
            for p in b.pieces:
                p.view(want).copy_(tensor_value(SEED, p.tensor, 0, dst.tensors[p.tensor].shape, want.dtype)[p.box.slices()])
            assert torch.equal(loaded[b.name], want), f"rank {d} buffer {b.name}"


def test_relays_hold_what_is_still_to_be_relayed():
    """Without a receive window, a primary keeps each buffer until it has forwarded it, and
    forwarding runs one bucket a round behind three senders: most of the rank is held. Still exact,
    and what overflowed is counted, not lost."""
    _, results = _run(MODEL, "framework=fsdp,dp=3", "framework=vllm,tp=2,dp=2", 96 << 10, bucket=16 << 10)
    primary = results[0][2]
    assert primary.overflow_bytes > 0 and primary.high_water > 96 << 10
    _exact(results)


@pytest.mark.parametrize("src_spec,dst_spec,bucket", [("framework=fsdp,dp=3", "framework=vllm,tp=2,dp=2", 16 << 10),
                                                      ("framework=megatron,tp=2", "framework=vllm,tp=1,dp=3", 16 << 10)])
def test_bounded_replicas_take_their_bytes_by_relay_within_the_pool(src_spec, dst_spec, bucket):
    """Bounded ranks in data-parallel replicas (a receive window): each byte leaves the trainer once
    (the other replicas get it by relay, along a chain), and every rank, primaries included, holds
    at most its pool: the primary receives a bucket a round, the pace at which it forwards. The
    same plan without the window's pacing (relays, no window) overflowed above."""
    pool = 96 << 10
    plan, results = _run(MODEL, src_spec, dst_spec, pool, bucket=bucket, window=pool // 2)
    dst = results[0][0]
    # One replica's bytes: the pieces of each distinct rank (replicas hold the same buffers), counted
    # from the layout, apart from the plan
    replicas = {tuple((b.name, b.pieces) for b in rank): rank for rank in reversed(dst.ranks)}
    one_replica = sum(p.box.numel * dtype_of(b.dtype).itemsize for rank in replicas.values() for b in rank for p in b.pieces)
    assert len(replicas) < dst.world
    from_trainer = sum(m.nbytes for m in plan.messages if not m.relay)
    assert any(m.relay for m in plan.messages), "no relays: each replica took its bytes from the trainer"
    assert from_trainer == one_replica, (from_trainer, one_replica)
    _exact(results)
    for dst, d, staging, *_ in results:
        assert staging.overflow_bytes == 0 and staging.high_water <= pool, (d, staging.high_water, staging.overflow_bytes)


@pytest.mark.parametrize("model,src_spec,dst_spec,pool,bucket", [
    (MODEL, "framework=fsdp,dp=3", "framework=vllm,tp=2,dp=2", 96 << 10, 8 << 10),
    (MODEL, "framework=fsdp,dp=2,flat=0", "framework=vllm,tp=2", 96 << 10, 8 << 10),
    # the embedding and lm_head rows (640 KB each) from one trainer rank, the layers from both
    ("small", "framework=megatron,tp=2", "framework=vllm,tp=4", 1536 << 10, 32 << 10)])
def test_a_receive_window_keeps_every_sender_to_the_buffers_in_order(model, src_spec, dst_spec, pool, bucket):
    """The destination's layout declares a receive window (half its pool): the plan sends its
    buffers in order from every sender, so what is held stays within the pool
    (the same pairs without the window held far more: one sender ran ahead through the layers
    while another still sent the embedding, or a primary kept what it had yet to relay)."""
    plan, results = _run(model, src_spec, dst_spec, pool, bucket=bucket, window=pool // 2)
    _exact(results)
    for dst, d, staging, *_ in results:
        assert staging.overflow_bytes == 0 and staging.high_water <= pool, (d, staging.high_water, staging.overflow_bytes)
    _, unwindowed = _run(model, src_spec, dst_spec, pool, bucket=bucket)
    assert max(r[2].high_water for r in unwindowed) > max(r[2].high_water for r in results), "the window changed nothing"


class _Recorded(Loopback):
    """The loopback, recording each receive as it is posted."""

    def __init__(self, rank: int, wire: dict, events: list) -> None:
        super().__init__(rank, wire)
        self.events = events

    def recv(self, buf, peer, tag):
        self.events.append(("recv", peer, tag))
        return super().recv(buf, peer, tag)


def test_a_rounds_groups_load_while_the_next_round_is_posted():
    """On a host-waited transport (gloo), the hook in which bounded staging loads what round i
    completed runs once round i + 1 is posted: the loads overlap the next round's bytes."""
    src, dst = build(MODEL, "framework=megatron,tp=2"), build(MODEL, "framework=vllm,tp=2")
    dst = dataclasses.replace(dst, receive_window=96 << 10)
    plan = make_plan(src, dst, PlanOptions(bucket_bytes=16 << 10))
    shapes = {n: s.shape for n, s in dst.tensors.items()}
    wire, deadline = {}, time.monotonic() + 60
    for r, bufs in enumerate(_sources(src)):
        Engine(Loopback(r, wire), plan, "src", r, bufs, shapes, StagingPool(), deadline).run()
    d = 0
    descs = {b.name: b for b in dst.ranks[d]}
    staging = BoundedStaging(descs, shapes, "cpu", 96 << 10)
    events: list = []

    def load(tensors):
        events.append(("load", sorted(tensors)))

    staging.begin(plan, d, load)

    def hook(i: int) -> None:
        events.append(("hook", i))
        staging.round_done(i)

    Engine(_Recorded(src.world + d, wire, events), plan, "dst", d, staging, shapes, StagingPool(), deadline, hook=hook).run()
    staging.finish()
    rounds = sorted({m.round for m in plan.recvs[d]})
    assert len(rounds) > 3, "too few rounds to tell"
    by_round = {i: {(m.src, m.tag) for m in plan.recvs[d] if m.round == r} for i, r in enumerate(rounds)}
    at = {("recv", s, t): k for k, (kind, *rest) in enumerate(events) if kind == "recv" for s, t in [rest]}
    hooks = {rest[0]: k for k, (kind, *rest) in enumerate(events) if kind == "hook"}
    assert sorted(hooks) == list(range(len(rounds)))
    for i in range(len(rounds) - 1):
        posted = max(at[("recv", s, t)] for s, t in by_round[i + 1])
        assert posted < hooks[i], f"round {i}'s hook ran before round {i + 1} was posted"
    assert any(kind == "load" for kind, *_ in events[: hooks[len(rounds) - 2]]), "nothing loaded before the last round"
