"""What a long-lived controller or worker keeps does not grow with the updates and sessions it has
seen, nor with the time a peer spends not reading (issue 28, item 10): aborted update ids, the
rendezvous keys of past gloo sessions in the trainer controller's store, the hub's queue of
commands to a worker, and a worker's queue of messages to its controller.

Real gloo groups on a real store, a real hub on a real gRPC server with a real worker; a peer that
stops reading is one whose event loop is held (as a frozen process's would be)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from reshard.common.control import hub as hub_mod
from reshard.common.control import worker as worker_mod
from reshard.common.control.hub import WorkerHub
from reshard.common.control.rpc import start_server, stop_server
from reshard.common.dataplane.transport import GlooTransport, TransportError, serve_store
from reshard.common.layout.core import Box, LocalBuffer, Piece, TensorSpec
from reshard.proto import worker_pb2 as wpb
from reshard.proto import worker_pb2_grpc as wgrpc
from reshard.trainer_svc.worker import TrainerWorker


def _worker(address: str) -> TrainerWorker:
    spec = TensorSpec("w", (4, 4), "float32")
    desc = LocalBuffer("w", (4, 4), "float32", (Piece("w", Box((0, 0), (4, 4)), Box((0, 0), (4, 4))),))
    return TrainerWorker(address, 0, 1, {"w": spec}, {"w": (desc, torch.zeros(4, 4))}, run="r")


def test_aborted_update_ids_are_bounded():
    w = _worker("127.0.0.1:1")
    n = 20 * worker_mod.ABORTED_KEPT

    async def abort_all():
        for i in range(n):
            await w._on_abort(wpb.Abort(update_id=f"u{i}", reason="test"), i)

    asyncio.run(abort_all())
    assert len(w._aborted) == worker_mod.ABORTED_KEPT
    assert f"u{n - 1}" in w._aborted and "u0" not in w._aborted  # the newest are the ones kept


def _session(store, port: int, session: str, world: int, timeout_s: float, key: str) -> list[GlooTransport]:
    out: list = [None] * world

    def join(r: int) -> None:
        out[r] = GlooTransport("127.0.0.1", port, session, r, world, timeout_s, key=key)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(out), "the gloo session did not connect"
    return out


def test_past_gloo_sessions_leave_no_keys_in_the_store():
    """Sessions that connect and broadcast, a session one of whose ranks never comes, and one that
    was aborted while joining: the store holds no key of any of them afterwards."""
    store, sock = serve_store("127.0.0.1", 30.0)
    port = store.port
    assert store.num_keys() == 0
    for s in range(12):
        ranks = _session(store, port, f"s{s}", 3, 30.0, key=f"{s:032x}")
        got = [None] * 3

        def bcast(r: int) -> None:
            ranks[r].prepare_broadcast([(0, 2), (0, 1, 2)], 10.0)
            if r in (0, 2):
                buf = torch.full((8,), 7 if r == 0 else 0, dtype=torch.uint8)
                ranks[r].broadcast(buf, (0, 2)).wait(10.0)
                got[r] = buf

        threads = [threading.Thread(target=bcast, args=(r,)) for r in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert torch.equal(got[2], torch.full((8,), 7, dtype=torch.uint8))
        for t in ranks:
            t.close()
        assert store.num_keys() == 0, f"session {s} left {store.list_keys()}"
    # A rank whose peer never comes: its rendezvous fails, and takes its key out.
    with pytest.raises(TransportError, match="rendezvous .* failed"):
        GlooTransport("127.0.0.1", port, "alone", 0, 2, 0.5, key="a" * 32)
    assert store.num_keys() == 0, store.list_keys()
    # Aborted while joining; its peer comes later and the rendezvous completes on both sides.
    made: list[GlooTransport] = []

    def on_connecting(t) -> None:
        made.append(t)
        threading.Timer(0.2, t.abort, args=("update u1 aborted",)).start()

    with pytest.raises(TransportError, match="^update u1 aborted$"):
        GlooTransport("127.0.0.1", port, "late", 0, 2, 30.0, on_connecting=on_connecting, key="b" * 32)
    GlooTransport("127.0.0.1", port, "late", 1, 2, 30.0, key="b" * 32).close()
    deadline = time.monotonic() + 10
    while store.num_keys() and time.monotonic() < deadline:  # rank 0's rendezvous ends on its own thread
        time.sleep(0.05)
    assert store.num_keys() == 0, store.list_keys()


async def _serve_hub(hub: WorkerHub):
    def register(server):
        wgrpc.add_WorkerControlServicer_to_server(hub, server)
        return [wpb.DESCRIPTOR.services_by_name["WorkerControl"].full_name]

    return await start_server("127.0.0.1:0", register, worker_tokens=[])


def test_a_worker_that_stops_reading_is_dropped_and_its_update_aborted():
    """The controller keeps sending while its worker does not read (its loop is held): the commands
    queued for it stop at the hub's limit, where the worker is dropped; when it runs again it finds
    its stream gone, aborts the update it had in flight, and attaches again."""
    async def go():
        hub = WorkerHub(1, "trainer")
        server, hs, port = await _serve_hub(hub)
        w = _worker(f"127.0.0.1:{port}").start()
        try:
            assert await asyncio.to_thread(w.wait_connected, 10)
            conn = hub.workers[0]
            w._current = "u1"  # an update in flight on the worker
            w._loop.call_soon_threadsafe(time.sleep, 2.0)  # its loop is held: it reads nothing
            await asyncio.sleep(0.1)
            peak, sent = 0, 0
            while sent < 4000:  # 64 KiB each: 250 MiB if nothing bounded them
                hub.send(conn, abort=wpb.Abort(update_id=f"x{sent}", reason="r" * 65536))
                sent += 1
                peak = max(peak, conn.queue.qsize())
                await asyncio.sleep(0)
            dropped = not conn.alive
            deadline = time.monotonic() + 15
            while (hub.workers[0] is conn or "u1" not in w._aborted) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return peak, dropped, hub.workers[0] is not conn and hub.workers[0].alive, "u1" in w._aborted
        finally:
            w.stop()
            await stop_server(server, hs, 0)

    peak, dropped, reattached, aborted = asyncio.run(go())
    assert peak <= hub_mod.QUEUE_LIMIT and dropped
    assert reattached and aborted


@pytest.mark.slow  # 2-3 s: the quick suite keeps under 5 minutes on 2 cores
def test_a_controller_that_stops_reading_leaves_its_worker_a_bounded_queue():
    """The controller's loop is held (frozen) while its worker keeps emitting: heartbeats and byte
    counts are merged while they wait; replies and other answers past the worker's limit make it
    give the stream up. Its queue stays bounded throughout; once the controller runs again the
    worker attaches again, and its newest publish reaches the controller (as a message, or in the
    hello of its new stream: one in flight on a stream given up is lost with it)."""
    async def go():
        hub = WorkerHub(1, "trainer")
        published = []
        hub.on_event = lambda conn, m: published.append(m.published.version.step) if m.WhichOneof("kind") == "published" else None
        server, hs, port = await _serve_hub(hub)
        w = _worker(f"127.0.0.1:{port}").start()
        try:
            assert await asyncio.to_thread(w.wait_connected, 10)
            conn = hub.workers[0]
            sizes = {"merged": 0, "answers": 0}

            def flood() -> None:
                for i in range(40000):  # 1 MB of heartbeats and byte counts
                    w.emit(w._heartbeat())
                    w.emit(wpb.WorkerMessage(progress=wpb.Progress(update_id="u1", bytes_done=i, bytes_total=40000)))
                    if i % 1000 == 0:
                        time.sleep(0.001)
                        sizes["merged"] = max(sizes["merged"], w._out.qsize())
                for i in range(3000):  # 48 MB of answers
                    w.emit(wpb.WorkerMessage(reply=wpb.Reply(id=10**9 + i, ok=False, error="e" * 16000)))
                    if i % 500 == 0:
                        w.publish(i)
                    if i % 100 == 0:
                        time.sleep(0.001)
                        sizes["answers"] = max(sizes["answers"], w._out.qsize())
                time.sleep(0.2)

            th = threading.Thread(target=flood)
            th.start()
            time.sleep(2.5)  # the controller's loop does not run
            await asyncio.to_thread(th.join, 30)
            deadline = time.monotonic() + 15
            newest = lambda: max([*published, hub.workers[0].hello.version.step])  # noqa: E731 - by message or hello
            while (hub.workers[0] is conn or newest() != 2500) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return sizes, hub.workers[0] is not conn, newest()
        finally:
            w.stop()
            await stop_server(server, hs, 0)

    sizes, reattached, newest = asyncio.run(go())
    assert sizes["merged"] <= 4, sizes
    assert sizes["answers"] <= worker_mod.OUT_LIMIT + 8, sizes
    assert reattached and newest == 2500
