"""The inference controller's update state machine (inference_svc/service.py), driven in-process:
its WorkerHub is a subclass whose workers are simulated at the hub's edge (wait, layout, prepare),
so that an abort can be made to land while BeginUpdate is still preparing."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from reshard.common.control.hub import WorkerHub
from reshard.common.control.rpc import Deadlines
from reshard.common.dataplane.backend import plan_options
from reshard.common.layout.wire import layout_bytes, layout_fingerprint
from reshard.common.models.presets import megatron_layout, model_config, vllm_layout
from reshard.common.plan.planner import make_plan
from reshard.inference_svc.service import InferenceController
from reshard.proto import reshard_pb2 as pb


class Aborted(Exception):
    pass


class Context:
    def __init__(self) -> None:
        self.code = None

    async def abort(self, code, details):
        self.code = code
        raise Aborted(details)

    def auth_context(self):
        return {}


class Hub(WorkerHub):
    """Every rank attached; prepare_all runs `during_prepare` (what a stale worker's abort does) first."""

    def __init__(self, dst) -> None:
        super().__init__(dst.world, "inference")
        self.dst = dst
        self.during_prepare = None
        self.sent: list = []

    def complete(self) -> bool:
        return True

    def alive(self):
        return []

    async def wait_complete(self, timeout: float) -> None:
        return None

    async def layout(self):
        return self.dst, layout_fingerprint(self.dst), layout_bytes(self.dst)

    async def prepare_all(self, timeout, base, layouts):
        if self.during_prepare:
            await self.during_prepare()
        return []

    def send_all(self, **command) -> None:
        self.sent.append(command)


def test_an_abort_while_begin_update_prepares_is_not_erased():
    """Item 6: a worker judged stale while BeginUpdate waits for the ranks' Prepare replies aborts
    the update; BeginUpdate must answer ABORTED and leave the phase ABORT (it set TRANSFER after,
    and the trainer waited out its deadline)."""
    cfg = model_config("tiny")
    src, dst = megatron_layout(cfg, 2), vllm_layout(cfg, 2)
    hub = Hub(dst)
    ctl = InferenceController(hub, "tiny", Deadlines())
    plan = make_plan(src, dst, plan_options(0, "gloo"))
    req = pb.BeginUpdateRequest(update_id="u1", version=pb.Version(run="r", step=1), plan_digest=plan.digest,
                                session=pb.Session(id="s1", transport="gloo", src_world=2, dst_world=2,
                                                   store_host="127.0.0.1", store_port=1234),
                                src_layout=layout_bytes(src), src_fingerprint=layout_fingerprint(src), timeout_s=30, epoch=3)
    ctl.epoch = 3  # granted to this trainer

    async def stale_abort():
        await ctl._abort(ctl.update, "inference worker rank 1 (pid 42) stopped answering during the update")

    hub.during_prepare = stale_abort

    async def go():
        ctx = Context()
        with pytest.raises(Aborted, match="stopped answering"):
            await ctl.BeginUpdate(req, ctx)
        return ctx.code

    assert asyncio.run(go()) == grpc.StatusCode.ABORTED
    assert ctl.update.phase == "ABORT"
