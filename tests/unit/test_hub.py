"""The worker hub's judgement of silent workers (common/hub.py)."""

import asyncio
import time

from reshard.common.hub import WorkerConn, WorkerHub
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
