"""The worker hub's judgement of silent workers (common/control/hub.py)."""

import asyncio
import time

from reshard.common.control.hub import WorkerConn, WorkerHub
from reshard.proto import worker_pb2 as wpb


def _hub() -> tuple[WorkerHub, WorkerConn]:
    hub = WorkerHub(1, "inference")
    conn = WorkerConn(0, wpb.Hello(rank=0, world=1, pid=1234, role="inference"), asyncio.Queue())
    hub.workers[0] = conn
    return hub, conn


def test_a_silent_worker_is_marked_stale():
    async def go():
        hub, conn = _hub()
        watch = asyncio.get_running_loop().create_task(hub.watch_stale(0.4))
        await asyncio.sleep(0.8)
        watch.cancel()
        return conn.stale

    assert asyncio.run(go())


def test_a_controller_that_was_frozen_does_not_blame_its_workers():
    """SIGSTOP then SIGCONT of a controller: its workers' heartbeats wait in the socket while it is
    frozen. On resume it must not call them silent (and fail the update) before reading them."""
    async def go():
        hub, conn = _hub()
        stale = []
        hub.on_stale = stale.append
        watch = asyncio.get_running_loop().create_task(hub.watch_stale(0.4))
        await asyncio.sleep(0.05)
        time.sleep(1.5)  # the controller's loop does not run: frozen
        await asyncio.sleep(0.1)  # resumed: the watcher runs first
        conn.last_seen = time.monotonic()  # the queued heartbeats are read
        await asyncio.sleep(0.2)
        watch.cancel()
        return conn.stale, stale

    assert asyncio.run(go()) == (False, [])


def test_a_hello_for_a_rank_whose_worker_lives_is_refused_not_swapped_in():
    """External workers (no supervisor): a second process's hello for a live rank is refused with
    ALREADY_EXISTS and the live worker stays; the same process attaching again replaces its stream."""
    import grpc
    import pytest

    class Aborted(Exception):
        pass

    class Context:
        def __init__(self):
            self.code = None

        async def abort(self, code, details):
            self.code = code
            raise Aborted(details)

        async def send_initial_metadata(self, md):
            pass

    async def stream(pid):
        yield wpb.WorkerMessage(hello=wpb.Hello(rank=0, world=1, pid=pid, role="inference"))
        await asyncio.sleep(3600)

    async def go():
        hub, conn = _hub()
        ctx = Context()
        with pytest.raises(Aborted, match="held by live worker pid 1234, not pid 999"):
            await hub.Attach(stream(999), ctx).__anext__()
        assert ctx.code == grpc.StatusCode.ALREADY_EXISTS and hub.workers[0] is conn and conn.alive
        again = hub.Attach(stream(1234), Context())
        task = asyncio.get_running_loop().create_task(again.__anext__())
        await asyncio.sleep(0.1)
        replaced = hub.workers[0] is not conn and not conn.alive
        task.cancel()
        return replaced

    assert asyncio.run(go())
