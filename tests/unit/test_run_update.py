"""One interface for every transport (issue 28, the house): a worker moves its share of an update
through `Transport.run_update(RankUpdate)`, never by asking which transport it holds. A transport
made up here, registered under a name the worker has never heard of, is what the worker calls; the
base class's run_update (gloo's and NCCL's) runs the plan through the engine; the transports that
cannot message every pair of ranks (ipc, hybrid) say so by an attribute, which refuses a tool's
transfer method."""

from __future__ import annotations

import time

import pytest

from reshard.common.dataplane import transport as transport_mod
from reshard.common.dataplane.backend import plan_options
from reshard.common.dataplane.checksum import P
from reshard.common.dataplane.engine import StagingPool
from reshard.common.dataplane.rank_update import RankUpdate
from reshard.common.dataplane.transport import Transport, TransportError
from reshard.common.layout.wire import layout_fingerprint
from reshard.common.models.frameworks import build
from reshard.common.plan.planner import make_plan
from reshard.inference_svc.worker import InferenceWorker
from reshard.proto import reshard_pb2 as pb
from reshard.proto import worker_pb2 as wpb
from reshard.trainer_svc.worker import TrainerWorker
from tests.unit.colocation import assert_canonical, buffers
from tests.unit.loopback import Loopback

SRC, DST = build("tiny", "framework=megatron,tp=1"), build("tiny", "framework=vllm,tp=1")
SHAPES = {n: t.shape for n, t in SRC.tensors.items()}
PLAN = make_plan(SRC, DST, plan_options(0, "gloo"))


class Probe(Transport):
    """Moves nothing: it records what the worker hands it. Messages through it are a failure."""

    name = "probe"
    made: list["Probe"] = []

    def __init__(self) -> None:
        self.updates: list[RankUpdate] = []
        Probe.made.append(self)

    @classmethod
    def for_session(cls, session, rank, world, timeout_s, device="cpu", on_connecting=None):
        t = cls()
        if on_connecting is not None:
            on_connecting(t)
        return t

    def run_update(self, u: RankUpdate):
        self.updates.append(u)
        u.connected()
        return {(0, "probe", 0): 7}, 123, 0.25

    def send(self, buf, peer, tag):
        raise AssertionError("the worker messaged through the transport instead of calling its run_update")

    recv = send

    def close(self) -> None:
        pass


class SharedGpuProbe(Probe):
    name = "shared-gpu-probe"
    moves_messages_between_all_pairs = False


def _workers():
    sbufs, dbufs = buffers(SRC, 0, SHAPES, 7), buffers(DST, 0, SHAPES, None)
    trainer = TrainerWorker("127.0.0.1:1", 0, 1, SRC.tensors, {d.name: (d, sbufs[d.name]) for d in SRC.ranks[0]}, run="r")
    inference = InferenceWorker("127.0.0.1:1", 0, 1, DST.tensors, {d.name: (d, dbufs[d.name]) for d in DST.ranks[0]})
    return trainer, inference


def _prepare(transport: str, method: str = "") -> wpb.Prepare:
    session = pb.Session(id=f"s-{transport}", store_host="127.0.0.1", store_port=1, src_world=1, dst_world=1,
                         transport=transport)
    return wpb.Prepare(update_id="u1", plan_digest=PLAN.digest, session=session, timeout_s=30.0, method=method,
                       src_fingerprint=layout_fingerprint(SRC), dst_fingerprint=layout_fingerprint(DST))


def test_the_worker_calls_the_run_update_of_a_transport_it_does_not_know_by_name(monkeypatch):
    monkeypatch.setitem(transport_mod.TRANSPORTS, "probe", Probe)
    Probe.made.clear()
    for w in _workers():
        try:
            t0 = time.monotonic()
            assert w._run_transfer(_prepare("probe"), PLAN, SRC, DST) == ({(0, "probe", 0): 7}, 123, 0.25)
            t = Probe.made[-1]
            assert w._sessions["s-probe"] is t  # the session the worker keeps, reused and aborted as any other
            [u] = t.updates
            assert (u.update_id, u.plan, u.side, u.rank, u.dst) == ("u1", PLAN, w.side, 0, DST)
            assert u.buffers is w.transfer_buffers() and u.shapes == w.shapes and u.pool is w._pool
            assert t0 + 29 < u.deadline <= time.monotonic() + 30
            assert u.progress is not None and u.hook is not None
            # What the transport's u.connected() said: the CONNECT phase ends on the controller.
            said = [m.progress for m in w._early if m.WhichOneof("kind") == "progress"]
            assert [p.connected for p in said] == [True] and said[0].update_id == "u1"
        finally:
            w.stop()


def test_a_transport_without_messages_between_every_pair_refuses_a_tools_method(monkeypatch):
    monkeypatch.setitem(transport_mod.TRANSPORTS, "shared-gpu-probe", SharedGpuProbe)
    Probe.made.clear()
    trainer, inference = _workers()
    try:
        with pytest.raises(TransportError, match="transfer method 'serialized' sends messages between every pair of "
                                                 "ranks, and a shared-gpu-probe session"):
            trainer._run_transfer(_prepare("shared-gpu-probe", method="serialized"), PLAN, SRC, DST)
        assert Probe.made and not Probe.made[-1].updates
        # The parallel reshard goes through its run_update as usual.
        assert inference._run_transfer(_prepare("shared-gpu-probe", method="reshard"), PLAN, SRC, DST)[1] == 123
    finally:
        trainer.stop()
        inference.stop()


def test_the_base_run_update_runs_the_plan_through_the_engine():
    """What gloo and NCCL take: an in-process message-passing transport (senders first) moves every
    piece bit-exact, through the base class's run_update, with the sums of both ends equal."""
    wire: dict = {}
    src, dst = buffers(SRC, 0, SHAPES, 7), buffers(DST, 0, SHAPES, None)
    connected = []
    deadline = time.monotonic() + 30
    sent = Loopback(0, wire).run_update(RankUpdate("u1", PLAN, "src", 0, src, SHAPES, DST, StagingPool(), deadline,
                                                   connected=lambda: connected.append("src")))
    landed = Loopback(1, wire).run_update(RankUpdate("u1", PLAN, "dst", 0, dst, SHAPES, DST, StagingPool(), deadline,
                                                     connected=lambda: connected.append("dst")))
    assert connected == ["src", "dst"] and not wire
    assert {k: v % P for k, v in sent[0].items()} == landed[0] and landed[0]
    assert sent[1] == landed[1] == PLAN.total_bytes
    assert_canonical(DST, 0, dst, SHAPES, 7)


def test_each_transport_implements_the_one_interface():
    from reshard.common.dataplane.cuda_ipc import IpcTransport
    from reshard.common.dataplane.hybrid import HybridTransport
    from reshard.common.dataplane.nccl_transport import NcclTransport

    classes = {name: transport_mod.transport_class(name) for name in ("gloo", "nccl", "ipc", "hybrid")}
    assert classes["nccl"] is NcclTransport and classes["ipc"] is IpcTransport and classes["hybrid"] is HybridTransport
    for name in ("gloo", "nccl"):  # by messages, through the engine: the base class's
        assert classes[name].run_update is Transport.run_update and classes[name].moves_messages_between_all_pairs
    for name in ("ipc", "hybrid"):  # their own way, and no messages between ranks sharing a GPU
        assert classes[name].run_update is not Transport.run_update
        assert not classes[name].moves_messages_between_all_pairs
