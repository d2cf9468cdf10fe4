"""An abort reaches the data plane: `Transport.abort()`, called from another thread, fails a
blocked wait (or a rendezvous) at once instead of at the update's deadline. Gloo for real, on a
TCPStore on loopback with each rank on a thread; NCCL against the fake library of test_nccl."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
from torch.distributed import TCPStore

from reshard.common.dataplane.engine import Engine, StagingPool
from reshard.common.dataplane.nccl_transport import NcclTransport
from reshard.common.dataplane.transport import GlooTransport, TransportError
from reshard.common.layout.core import Box, Layout, LocalBuffer, Piece, TensorSpec
from reshard.common.plan.planner import PlanOptions, make_plan

from .test_nccl import FakeCuda, FakeNccl, _transport

DEADLINE_S = 60.0  # what an abort must not wait for


@pytest.fixture(scope="module")
def store():
    """One store for every session here (a fresh prefix each), as the trainer controller serves; it
    outlives the tests' abandoned rendezvous, which end quietly at their own timeout."""
    return TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)


class Watched(GlooTransport):
    """Sets `waiting` as a receive is about to be waited on."""

    def __init__(self, *args, **kw) -> None:
        self.waiting = threading.Event()
        super().__init__(*args, **kw)

    def recv(self, buf, peer, tag):
        work, waiting = super().recv(buf, peer, tag), self.waiting

        class Announced:
            def wait(self, timeout_s: float) -> None:
                waiting.set()
                work.wait(timeout_s)

        return Announced()


def _pair(store, session: str, cls=GlooTransport) -> list[GlooTransport]:
    """Ranks 0 and 1 of a gloo session on `store`, each joined on a thread."""
    out: list = [None, None]

    def join(r: int) -> None:
        out[r] = cls("127.0.0.1", store.port, session, r, 2, DEADLINE_S)

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(out), "the gloo pair did not connect"
    return out


def _one_to_one_plan():
    rows, cols = 32, 64
    specs = {"w": TensorSpec("w", (rows, cols), "float32")}
    full = (LocalBuffer("w", (rows, cols), "float32", (Piece("w", Box.full((rows, cols)), Box.full((rows, cols))),)),)
    plan = make_plan(Layout(specs, (full,)), Layout(specs, (full,)), PlanOptions())
    return plan, {"w": (rows, cols)}


def _abort_when(event: threading.Event, transport, reason: str) -> threading.Thread:
    def run() -> None:
        assert event.wait(30)
        transport.abort(reason)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_gloo_abort_fails_a_blocked_receive_at_once(store):
    sender, receiver = _pair(store, "s1", Watched)  # rank 0 never posts its send
    plan, shapes = _one_to_one_plan()
    out = torch.zeros(shapes["w"])
    engine = Engine(receiver, plan, "dst", 0, {"w": out}, shapes, StagingPool(), time.monotonic() + DEADLINE_S)
    aborter = _abort_when(receiver.waiting, receiver, "update u1 aborted: a trainer worker died during the transfer")
    t0 = time.monotonic()
    with pytest.raises(TransportError, match=r"^update u1 aborted: a trainer worker died during the transfer$"):
        engine.run()
    elapsed = time.monotonic() - t0
    aborter.join(5)
    assert elapsed < 1.0, f"the abort took {elapsed:.2f}s"
    assert not out.any()  # nothing landed
    # The session is unusable from now on, and the peer sees it closed: its send fails, not blocks.
    with pytest.raises(TransportError, match="^update u1 aborted"):
        receiver.recv(torch.zeros(4, dtype=torch.uint8), 0, 1)
    with pytest.raises(TransportError, match="gloo send to rank 1 .*failed"):
        sender.send(torch.ones(1 << 20, dtype=torch.uint8), 1, 0).wait(10)
    receiver.close()
    sender.close()
    # The next update opens a fresh session (a fresh prefix) on the same store, and it works.
    sender, receiver = _pair(store, "s2")
    src = torch.randn(shapes["w"])
    sent = Engine(sender, plan, "src", 0, {"w": src}, shapes, StagingPool(), time.monotonic() + 30)
    done = threading.Thread(target=sent.run)
    done.start()
    Engine(receiver, plan, "dst", 0, {"w": out}, shapes, StagingPool(), time.monotonic() + 30).run()
    done.join(30)
    assert torch.equal(out, src)


def test_gloo_abort_releases_a_rendezvous_and_a_late_peer_finds_it_closed(store):
    connecting = threading.Event()
    made: list[GlooTransport] = []

    def on_connecting(t) -> None:
        made.append(t)
        connecting.set()

    aborter = threading.Thread(target=lambda: connecting.wait(30) and made[0].abort("update u2 aborted: peer gone"))
    aborter.start()
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="^update u2 aborted: peer gone$"):
        GlooTransport("127.0.0.1", store.port, "s3", 0, 2, DEADLINE_S, on_connecting=on_connecting)  # rank 1 is late
    assert time.monotonic() - t0 < 1.0
    aborter.join(5)
    # Rank 1 comes late: rank 0's abandoned rendezvous completes with it and breaks what it made.
    late = GlooTransport("127.0.0.1", store.port, "s3", 1, 2, DEADLINE_S)
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="gloo receive from rank 0 .*failed"):
        late.recv(torch.zeros(4, dtype=torch.uint8), 0, 0).wait(DEADLINE_S)
    assert time.monotonic() - t0 < 5.0
    late.close()


def test_gloo_abort_before_joining_fails_at_once(store):
    with pytest.raises(TransportError, match="^update u3 aborted$"):
        GlooTransport("127.0.0.1", store.port, "s4", 0, 2, DEADLINE_S, on_connecting=lambda t: t.abort("update u3 aborted"))


def test_nccl_abort_from_another_thread_fails_a_frozen_wait():
    lib, cuda = FakeNccl(), FakeCuda()
    t = _transport(lib, cuda, timeout=DEADLINE_S)
    cuda.complete_after = None  # the receive never completes
    w = t.recv(torch.zeros(8, dtype=torch.uint8), 1, 0)
    t.flush()
    polled = threading.Event()
    codes = lib.comm_async_error

    def async_error(comm):  # the data-plane thread polls: it is waiting now
        polled.set()
        return codes(comm)

    lib.comm_async_error = async_error
    aborter = _abort_when(polled, t, "update u4 aborted: reason")
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="^update u4 aborted: reason$"):
        w.wait(DEADLINE_S)
    assert time.monotonic() - t0 < 1.0
    aborter.join(5)
    assert lib.aborted == 1 and t.abort_seconds is not None
    with pytest.raises(TransportError, match="^update u4 aborted: reason$"):
        t.send(torch.zeros(1, dtype=torch.uint8), 1, 0)
    t.abort("again")  # once only
    t.close()  # nothing left to finalize
    assert lib.aborted == 1 and ("finalize",) not in lib.calls and lib.destroyed == 0


def test_nccl_abort_while_joining():
    lib = FakeNccl(async_codes=[7])  # a peer that never joins
    made: list = []
    aborter = threading.Thread(target=lambda: made and made[0].abort("update u5 aborted: peer gone"))

    def on_connecting(t) -> None:
        made.append(t)
        aborter.start()

    t0 = time.monotonic()
    with pytest.raises(TransportError, match="^update u5 aborted: peer gone$"):
        NcclTransport(b"\0" * 128, 0, 4, DEADLINE_S, device="cpu", session="s", library=lib, cuda=FakeCuda(),
                      on_connecting=on_connecting)
    assert time.monotonic() - t0 < 1.0
    aborter.join(5)
    assert lib.aborted == 1


def test_a_session_is_joined_only_under_its_secret(store):
    """Keys live under the session's secret: a process that knows the session id but not the key
    meets nobody (and its error does not leak the key); one with the key joins."""
    key = "f" * 32
    joined: list[object] = []
    first = threading.Thread(target=lambda: joined.append(GlooTransport("127.0.0.1", store.port, "s5", 0, 2, 6.0, key=key)))
    first.start()
    with pytest.raises(TransportError) as e:
        GlooTransport("127.0.0.1", store.port, "s5", 1, 2, 1.5)  # the session id alone
    assert key not in str(e.value)
    second = GlooTransport("127.0.0.1", store.port, "s5", 1, 2, 6.0, key=key)
    first.join(10)
    assert len(joined) == 1
    for t in (joined[0], second):
        t.close()


def _three(store, session: str, timeout_s: float) -> list[GlooTransport]:
    out: list = [None] * 3

    def join(r: int) -> None:
        out[r] = GlooTransport("127.0.0.1", store.port, session, r, 3, timeout_s)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(out), "the gloo session did not connect"
    return out


def test_gloo_abort_releases_a_broadcast_groups_rendezvous(store):
    """A broadcast group is made on a side thread, as the session's rendezvous is: an abort releases
    a rank waiting there for a member that never comes at once, not at the session's timeout (issue
    28, item 24: aborted 0.5 s in, it was released after the 8 s update deadline)."""
    ranks = _three(store, "s6", 20.0)
    aborter = threading.Timer(0.3, ranks[0].abort, args=("update u6 aborted: inference worker 1 died",))
    aborter.start()
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="^update u6 aborted: inference worker 1 died$"):
        ranks[0].prepare_broadcast([(0, 1, 2)], 20.0)  # ranks 1 and 2 never make it
        ranks[0].broadcast(torch.zeros(4, dtype=torch.uint8), (0, 1, 2))
    assert time.monotonic() - t0 < 1.5
    for t in ranks:
        t.close()


def test_gloo_broadcast_groups_are_made_by_the_current_updates_deadline(store):
    """A session joined by an update with a 20 s deadline; a later update with 0.5 s left makes a
    broadcast group whose member never comes: it fails at 0.5 s (issue 28, item 11)."""
    ranks = _three(store, "s7", 20.0)
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="rendezvous of the group 0-1-2 .*within 0.5s"):
        ranks[0].prepare_broadcast([(0, 1, 2)], 0.5)
        ranks[0].broadcast(torch.zeros(4, dtype=torch.uint8), (0, 1, 2))
    assert time.monotonic() - t0 < 2.0
    for t in ranks:
        t.close()

