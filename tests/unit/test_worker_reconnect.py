"""A worker whose controller went away attaches again soon after it is back, and says so once per
outage (issue 28, item 24: its reconnect backoff, capped at 2 s, cost about a second of every
recovery after a controller restart). A real hub on a real gRPC server (a Unix socket), stopped
and started again; a real worker."""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time

import pytest
import torch

from reshard.common.control.hub import WorkerHub
from reshard.common.control.rpc import start_server, stop_server
from reshard.common.layout.core import Box, LocalBuffer, Piece, TensorSpec
from reshard.proto import worker_pb2 as wpb
from reshard.proto import worker_pb2_grpc as wgrpc
from reshard.trainer_svc.worker import TrainerWorker


async def _serve(hub: WorkerHub, address: str):
    def register(server):
        wgrpc.add_WorkerControlServicer_to_server(hub, server)
        return [wpb.DESCRIPTOR.services_by_name["WorkerControl"].full_name]

    return await start_server(address, register, worker_tokens=[])


@pytest.mark.slow  # the quick suite's time: 4-6 s
def test_a_worker_attaches_again_soon_after_its_controller_and_warns_once(caplog):
    address = f"unix:{tempfile.mkdtemp(prefix='reshard-reconnect-')}/w.sock"
    spec = TensorSpec("w", (4, 4), "float32")
    desc = LocalBuffer("w", (4, 4), "float32", (Piece("w", Box((0, 0), (4, 4)), Box((0, 0), (4, 4))),))

    async def go():
        server, hs, _ = await _serve(WorkerHub(1, "trainer"), address)
        w = TrainerWorker(address, 0, 1, {"w": spec}, {"w": (desc, torch.zeros(4, 4))}, run="r").start()
        try:
            assert await asyncio.to_thread(w.wait_connected, 10)
            await stop_server(server, hs, 0)  # the controller is gone for 4 s: the worker's retries back off
            await asyncio.sleep(4.0)
            hub = WorkerHub(1, "trainer")
            server, hs, _ = await _serve(hub, address)
            t0 = time.monotonic()
            while not (hub.workers.get(0) and hub.workers[0].alive) and time.monotonic() - t0 < 10:
                await asyncio.sleep(0.01)
            return time.monotonic() - t0
        finally:
            w.stop()
            await stop_server(server, hs, 0)

    with caplog.at_level(logging.DEBUG, logger="reshard.worker"):
        back = asyncio.run(go())
    unreachable = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(unreachable) > 4  # it kept trying
    gaps = [b.created - a.created for a, b in zip(unreachable, unreachable[1:])]
    assert max(gaps) < 1.0, f"attempts {gaps} apart"  # 0.5 s at most, and the failed attempt itself
    # soon: within its retry cadence and one connection attempt (not a long backoff), with room for a loaded machine
    assert back < 4.0, f"attached again {back:.2f}s after its controller was back"
    assert [r.levelno for r in unreachable].count(logging.WARNING) == 1, [r.getMessage() for r in unreachable]
