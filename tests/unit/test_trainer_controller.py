"""The trainer controller's update loop (trainer_svc/service.py), in-process: its WorkerHub is a
subclass that fails where the test says, to reach the paths a real fault rarely does."""

from __future__ import annotations

import asyncio

from reshard.common.control.hub import WorkerHub
from reshard.common.control.rpc import Deadlines
from reshard.proto import reshard_pb2 as pb
from reshard.trainer_svc.service import TrainerController


class Hub(WorkerHub):
    def __init__(self) -> None:
        super().__init__(1, "trainer")
        self.sent: list[dict] = []

    def complete(self) -> bool:
        return True

    async def wait_complete(self, timeout: float) -> None:
        return None

    async def layout(self):
        raise RuntimeError("a bug nobody foresaw")

    def send_all(self, **command) -> None:
        self.sent.append(command)


def test_an_unexpected_error_in_an_update_aborts_it_everywhere():
    """Item 7: an exception of no expected kind in the update is an update failure like any other:
    every worker is told to abort, the data-plane session is dropped, and the outcome says why."""
    async def go():
        hub = Hub()
        ctl = TrainerController(hub, "m", ["127.0.0.1:1"], "r", "127.0.0.1", Deadlines(rpc_s=0.5))
        d = ctl.deployments["127.0.0.1:1"]
        d.session = ("old", (), b"", "k")
        out = await ctl._update_one(d, pb.Version(run="r", step=1), ())
        return out, hub.sent, d.session, ctl.phase

    out, sent, session, phase = asyncio.run(go())
    assert not out.ok and "internal error" in out.error and "a bug nobody foresaw" in out.error, out.error
    assert any("abort" in c for c in sent), sent
    assert session is None and phase == "ABORT"


def test_a_standalone_worker_refuses_a_step_far_ahead_instead_of_spinning():
    """Item 20: a step of 10**12 (a run resumed against a deployment far ahead) made the standalone
    workers simulate every step in between, for ever; it is refused at once, saying why."""
    import time

    import pytest
    import torch

    from reshard.common.models.frameworks import build
    from reshard.proto import worker_pb2 as wpb
    from reshard.trainer_svc.standalone import SyntheticTrainer

    layout = build("tiny", "framework=megatron,tp=1")
    bufs = {d.name: (d, torch.zeros(d.shape, dtype=torch.bfloat16)) for d in layout.ranks[0]}
    w = SyntheticTrainer("127.0.0.1:1", 0, 1, layout.tensors, bufs, run="r")
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="steps ahead"):
        asyncio.run(w._on_step(wpb.Step(version=pb.Version(run="r", step=10 ** 12)), 1))
    assert time.monotonic() - t0 < 5
    w.stop()
