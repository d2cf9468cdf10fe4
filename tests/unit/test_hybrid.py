"""Hybrid sessions (NCCL between GPUs, CUDA IPC within one), on CPU: the hosts' data plane is a real
gloo group (or the fake NCCL) over a real rendezvous store, and CUDA's handle export and mapping are
replaced by an in-process table (`tests/unit/colocation.py`). `tests/gpu` and `make gpu-check` hold
the CUDA versions."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from reshard.common.dataplane import hybrid
from reshard.common.dataplane.backend import plan_options
from reshard.common.dataplane.checksum import P
from reshard.common.dataplane.cuda_ipc import SessionStore
from reshard.common.dataplane.engine import StagingPool
from reshard.common.dataplane.hybrid import HybridTransport, Placement
from reshard.common.dataplane.rank_update import RankUpdate
from reshard.common.dataplane.transport import GlooTransport, TransportError, serve_store
from reshard.common.models.frameworks import build
from reshard.common.plan.planner import make_plan
from tests.unit.colocation import assert_canonical, buffers, in_process_ipc


def test_placement_gives_each_gpu_one_host():
    # trainer ranks 0, 1 on GPUs a, b; inference ranks 0..3 on a, b, c, d (session ranks 2..5)
    p = Placement(["a", "b", "a", "b", "c", "d"], src_world=2)
    assert p.hosts == [0, 1, 0, 1, 4, 5] and p.comm == [0, 1, 0, 1, 2, 3] and p.world == 4
    assert p.guests == {0: [2], 1: [3]}
    # two inference ranks beside trainer rank 1; two alone on GPU c: the lower one hosts the other
    p = Placement(["a", "b", "b", "b", "c", "c"], src_world=2)
    assert p.hosts == [0, 1, 1, 1, 4, 4] and p.comm == [0, 1, 1, 1, 2, 2] and p.guests == {1: [2, 3], 4: [5]}
    with pytest.raises(TransportError, match=r"trainer ranks \[0, 1\] share GPU a"):
        Placement(["a", "a", "b", "b"], src_world=2)
    with pytest.raises(TransportError, match=r"session ranks \[3\] have none"):
        Placement(["a", "b", "a", ""], src_world=2)


def test_hosts_with_several_guests_and_an_inference_host(monkeypatch):
    """Trainer TP=2 on GPUs a, b; vLLM TP=2 DP=3: ranks 0, 1 on a beside trainer rank 0 (its two
    guests), rank 2 on b (trainer rank 1's), ranks 3, 4, 5 on c with no trainer (rank 3 hosts 4 and 5,
    receiving for itself and for them). Bit-exact, sums equal, every byte counted once."""
    src, dst = build("tiny", "framework=megatron,tp=2"), build("tiny", "framework=vllm,tp=2,dp=3")
    plan, shapes, ranks, results, _ = _session(monkeypatch, ["a", "b", "a", "a", "b", "c", "c", "c"], src, dst)
    errors = [v for v in results.values() if isinstance(v, Exception)]
    assert not errors, errors
    assert results["left"] == []
    sent: dict = {}
    for r in range(src.world):
        for k, v in results[("src", r)][0].items():
            sent[k] = (sent.get(k, 0) + v) % P
    assert sent == {k: v for r in range(dst.world) for k, v in results[("dst", r)][0].items()}
    for _, r, bufs in ranks[src.world:]:
        assert_canonical(dst, r, bufs, shapes, 7)
    assert [results[("dst", r)][1] for r in range(dst.world)] == [plan.recv_bytes(r) for r in range(dst.world)]
    assert sum(results[("src", r)][1] for r in range(src.world)) == plan.total_bytes


def test_a_session_must_name_every_ranks_gpu_and_carry_an_nccl_id():
    from reshard.proto import reshard_pb2 as pb

    s = pb.Session(id="s1", store_host="127.0.0.1", store_port=1, src_world=1, dst_world=2, transport="hybrid",
                   device_uuids=["a", "a"], nccl_unique_id=b"x")
    with pytest.raises(TransportError, match="names the GPUs of 2 ranks, not 3"):
        HybridTransport.for_session(s, 0, 3, 1.0)
    s.device_uuids.append("b")
    s.nccl_unique_id = b""
    with pytest.raises(TransportError, match="carries no nccl_unique_id"):
        HybridTransport.for_session(s, 0, 3, 1.0)


def _session(monkeypatch, gpus, src, dst, fail_host=None, deadline_s=20.0, key="session-key-" + "k" * 20,
             failure=TransportError("the host's engine broke on purpose")):
    """Every rank of a hybrid session at once, each on a thread: {(side, rank): result or exception}."""
    in_process_ipc(monkeypatch, hybrid)
    plan = make_plan(src, dst, plan_options(0, "hybrid"))
    shapes = {n: t.shape for n, t in src.tensors.items()}
    S = src.world
    placement = Placement(gpus, S)
    store, sock = serve_store("127.0.0.1", 10.0)
    port = sock.getsockname()[1]
    ranks = [("src", r, buffers(src, r, shapes, 7)) for r in range(S)] + \
            [("dst", r, buffers(dst, r, shapes, None)) for r in range(dst.world)]
    results: dict = {}

    def run(side, rank, bufs):
        me = rank if side == "src" else S + rank
        net = lambda attach: GlooTransport("127.0.0.1", port, "s", placement.comm[me], placement.world, 10.0,  # noqa: E731
                                           on_connecting=attach, key="net")
        hook = None
        if me == fail_host:
            def hook(rnd):
                raise failure
        try:
            t = HybridTransport(placement, me, lambda: SessionStore("127.0.0.1", port, "s", me, 10.0, key), net)
            try:
                results[(side, rank)] = t.run_update(RankUpdate("u1", plan, side, rank, bufs, shapes, dst, StagingPool(),
                                                                time.monotonic() + deadline_s, hook=hook))
            finally:
                t.close()
        except Exception as e:  # noqa: BLE001 - the test reads it
            results[(side, rank)] = e
            results[("at", side, rank)] = time.monotonic()

    threads = [threading.Thread(target=run, args=r) for r in ranks]
    t0 = time.monotonic()
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    # What the session's steps leave in the store (it lives as long as the trainer controller).
    results["left"] = [k for r in range(len(gpus)) for k in (f"u1/handles/{r}", f"u1/written/{r}")
                       if store.check([f"reshard/{key}/ipc/{k}"])]
    sock.close()
    return plan, shapes, ranks, results, t0


def test_hybrid_session_moves_every_piece_bit_exact(monkeypatch):
    """Trainer TP=2 on GPUs a, b; inference TP=2 DP=2 on a, b, c, d: the hosts of a and b write their
    guests' pieces (their own by device copy, the other GPU's over the group), c and d receive as
    in any session. Every destination piece holds its canonical values (computed apart from the
    plan), the sources' sums equal the sums of what landed, and every byte is counted once."""
    src, dst = build("tiny", "framework=megatron,tp=2"), build("tiny", "framework=vllm,tp=2,dp=2")
    plan, shapes, ranks, results, _ = _session(monkeypatch, ["a", "b", "a", "b", "c", "d"], src, dst)
    errors = [v for v in results.values() if isinstance(v, Exception)]
    assert not errors, errors
    assert results["left"] == []  # each handle and mark was taken by its one reader
    S = src.world
    sent: dict = {}
    for r in range(S):
        for k, v in results[("src", r)][0].items():
            sent[k] = (sent.get(k, 0) + v) % P
    landed = {k: v for r in range(dst.world) for k, v in results[("dst", r)][0].items()}
    assert sent == landed and len(landed) == sum(len(plan.expected_pieces(r)) for r in range(dst.world))
    for _, r, bufs in ranks[S:]:
        assert_canonical(dst, r, bufs, shapes, 7)
    assert sum(results[("src", r)][1] for r in range(S)) == plan.total_bytes
    assert sum(results[("dst", r)][1] for r in range(dst.world)) == plan.total_bytes
    assert not any(m.relay for m in plan.messages)
    assert any(m.src == 0 and m.dst == 0 for m in plan.messages)  # trainer 0 -> its guest: the device-copy path ran
    assert any(m.src == 1 and m.dst == 0 for m in plan.messages)  # another GPU -> a guest: received by its host


def test_a_failing_host_fails_its_guest_at_once_with_its_reason(monkeypatch):
    """The host of GPU a breaks in its first round: the inference rank it hosts fails with the host's
    reason long before the update's deadline, instead of waiting it out."""
    src, dst = build("tiny", "framework=megatron,tp=2"), build("tiny", "framework=vllm,tp=2")
    _, _, _, results, t0 = _session(monkeypatch, ["a", "b", "a", "b"], src, dst, fail_host=0, deadline_s=8.0)
    err = results[("dst", 0)]
    assert isinstance(err, TransportError), err
    assert "trainer rank 0, the host of this GPU, failed: the host's engine broke on purpose" in str(err)
    assert results[("at", "dst", 0)] - t0 < 6.0
    assert isinstance(results[("src", 0)], TransportError)


SECRET = "Zq8" + "x" * 29  # a session's secret (pb.Session.key): its store keys live under it


def test_store_errors_of_ipc_and_hybrid_sessions_never_carry_the_session_secret(monkeypatch):
    """torch's store errors name the keys they wait for, which live under the session's secret: an
    IPC or hybrid rank's store error, and a host's failure that its guests read from the store, say
    what failed without the secret (as the gloo transport's errors do), so that it never reaches
    `status` or a log."""
    import datetime

    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    s = SessionStore("127.0.0.1", server.port, "s", 1, 0.5, SECRET)
    with pytest.raises(TransportError) as e:
        s.get("u1/handles/0")  # torch: "wait timeout after 500ms, keys: /reshard/<secret>/ipc/u1/handles/0"
    assert "the rendezvous store failed to get a key" in str(e.value) and "<session key>" in str(e.value), e.value
    assert SECRET not in str(e.value) and e.value.__cause__ is None and e.value.__suppress_context__
    src, dst = build("tiny", "framework=megatron,tp=2"), build("tiny", "framework=vllm,tp=2")
    broke = RuntimeError(f"wait timeout after 500ms, keys: /reshard/{SECRET}/ipc/u1/written/2")
    _, _, _, results, _ = _session(monkeypatch, ["a", "b", "a", "b"], src, dst, fail_host=0, deadline_s=8.0, key=SECRET,
                                   failure=broke)
    err = results[("dst", 0)]  # the guest, told by its host through the store
    assert isinstance(err, TransportError) and "the host of this GPU, failed: wait timeout" in str(err), err
    assert SECRET not in str(err), err


def test_a_guest_that_never_publishes_fails_its_host_at_the_deadline_and_an_abort_stops_a_wait(monkeypatch):
    monkeypatch.setattr(hybrid, "export_buffers", lambda bufs: b"handles")
    placement = Placement(["a", "a"], src_world=1)
    store, sock = serve_store("127.0.0.1", 10.0)
    port = sock.getsockname()[1]
    made = []

    def net(attach):
        made.append(attach)
        return None

    host = HybridTransport(placement, 0, lambda: SessionStore("127.0.0.1", port, "s", 0, 5.0, "k"), net)
    assert made and host.guests == [1] and host.host == 0
    src, dst = build("tiny", "framework=megatron,tp=1"), build("tiny", "framework=vllm,tp=1")
    plan = make_plan(src, dst, plan_options(0, "hybrid"))
    shapes = {n: t.shape for n, t in src.tensors.items()}
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="inference rank 0, on this GPU, did not publish its buffers' handles in time"):
        host.run_update(RankUpdate("u1", plan, "src", 0, buffers(src, 0, shapes, 7), shapes, dst, StagingPool(),
                                   time.monotonic() + 0.4))
    assert time.monotonic() - t0 < 3
    guest = HybridTransport(placement, 1, lambda: SessionStore("127.0.0.1", port, "s", 1, 5.0, "k"), net)
    assert len(made) == 1  # a guest joins no data-plane group
    threading.Timer(0.2, guest.abort, ("update u2 aborted",)).start()
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="update u2 aborted"):
        guest.run_update(RankUpdate("u2", plan, "dst", 0, buffers(dst, 0, shapes, None), shapes, dst, StagingPool(),
                                    time.monotonic() + 30))
    assert time.monotonic() - t0 < 3
    with pytest.raises(TransportError, match="moves no bytes of its own: its GPU's host \\(trainer rank 0\\) does"):
        HybridTransport(placement, 1, lambda: SessionStore("127.0.0.1", port, "s", 1, 5.0, "k"), net).send(
            torch.zeros(1, dtype=torch.uint8), 0, 0)
    for t in (host, guest):
        t.close()
    sock.close()


def test_hybrid_hosts_over_the_fake_nccl_address_comm_ranks_and_land_bit_exact(monkeypatch):
    """The stream-ordered path (NCCL's, against the fake library and fake CUDA, moving real bytes):
    trainer ranks 0, 1 on GPUs a, b; inference rank 0 on a (trainer 0's guest), inference rank 1 on
    c. The fake matches sends and receives in posting order per pair of communicator ranks, so the
    hosts run one after another, senders first; the guest waits on a thread of its own."""
    from reshard.common.dataplane.nccl_transport import NcclTransport
    from tests.unit.test_nccl import FakeCuda, FakeNccl

    in_process_ipc(monkeypatch, hybrid)
    src, dst = build("tiny", "framework=megatron,tp=2"), build("tiny", "framework=vllm,tp=2")
    plan = make_plan(src, dst, plan_options(1 << 16, "hybrid"))
    shapes = {n: t.shape for n, t in src.tensors.items()}
    placement = Placement(["a", "b", "a", "c"], src_world=2)
    assert placement.comm == [0, 1, 0, 2] and placement.world == 3
    store, sock = serve_store("127.0.0.1", 10.0)
    port = sock.getsockname()[1]
    wire: dict = {}
    libs: dict[int, FakeNccl] = {}

    def transport(me: int) -> HybridTransport:
        def net(attach):
            libs[me] = FakeNccl(wire=wire)
            return NcclTransport(b"\0" * 128, placement.comm[me], placement.world, 5.0, device="cpu", session="s",
                                 library=libs[me], cuda=FakeCuda(), on_connecting=attach)
        return HybridTransport(placement, me, lambda: SessionStore("127.0.0.1", port, "s", me, 10.0, "k"), net)

    bufs = {me: buffers(src, me, shapes, 7) if me < 2 else buffers(dst, me - 2, shapes, None) for me in range(4)}
    deadline = time.monotonic() + 20
    out: dict = {}

    def guest():
        t = transport(2)
        try:
            out[2] = t.run_update(RankUpdate("u1", plan, "dst", 0, bufs[2], shapes, dst, StagingPool(), deadline))
        except Exception as e:  # noqa: BLE001 - the test reads it
            out[2] = e

    th = threading.Thread(target=guest)
    th.start()
    for me, side, rank in ((1, "src", 1), (0, "src", 0), (3, "dst", 1)):
        t = transport(me)
        assert t.stream_ordered
        out[me] = t.run_update(RankUpdate("u1", plan, side, rank, bufs[me], shapes, dst, StagingPool(), deadline))
    th.join(30)
    sock.close()
    assert not isinstance(out[2], Exception), out[2]
    assert 2 not in libs  # the guest joined no communicator
    # Trainer 0's host sends to inference rank 1 (communicator rank 2, session rank 3) and receives its
    # guest's pieces from trainer rank 1 (communicator rank 1): communicator ranks, never session ranks.
    assert {(c[0], c[1]) for c in libs[0].calls if c[0] in ("send", "recv")} == {("send", 2), ("recv", 1)}
    assert not any(wire.values()), "messages sent but never received"
    for me, r in ((2, 0), (3, 1)):
        assert_canonical(dst, r, bufs[me], shapes, 7)
    sent: dict = {}
    for me in (0, 1):
        for k, v in out[me][0].items():
            sent[k] = (sent.get(k, 0) + v) % P
    assert sent == {**out[2][0], **out[3][0]}
