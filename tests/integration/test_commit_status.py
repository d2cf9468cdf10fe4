"""What the inference controller says right after an update committed: every rank READY at the new
version, not HELD. A worker clears its hold as it commits, before it replies; the controller must
not wait for the worker's next heartbeat to say so (a status read between the two once showed a
committed rank HELD). The workers here beat every 2 s, so a status read right after the update
lands between heartbeats. Both controllers in this process, real gRPC and gloo."""

import time

import grpc
import pytest
import torch
from google.protobuf import json_format

from reshard.common.models.presets import megatron_layout, model_config, vllm_layout
from reshard.proto import reshard_pb2 as pb
from reshard.proto import reshard_pb2_grpc as rgrpc
from reshard.tools.synth import tensor_value
from reshard.trainer_svc.worker import TrainerWorker

from .inprocess import deployment

pytestmark = pytest.mark.integration


def _status(addr: str) -> dict:
    with grpc.insecure_channel(addr) as ch:
        st = rgrpc.InferenceServiceStub(ch).GetStatus(pb.StatusRequest(), timeout=10)
    return json_format.MessageToDict(st, preserving_proto_field_name=True)


def test_a_committed_rank_is_ready_before_its_next_heartbeat():
    cfg = model_config("tiny")
    src, dst = megatron_layout(cfg, 2), vllm_layout(cfg, 2)
    addrs: dict = {}
    with deployment(dst, run="rl", heartbeat_s=2.0, addresses=addrs) as (tr_w, workers):
        inferences = list(workers)
        trainers = []
        for r in range(2):
            bufs = {d.name: (d, torch.zeros(d.shape, dtype=torch.bfloat16)) for d in src.ranks[r]}
            trainers.append(TrainerWorker(tr_w, r, 2, src.tensors, bufs, run="rl").start())
        workers += trainers
        for w in workers:
            assert w.wait_connected(60)
        before = _status(addrs["inference"])
        assert [w["state"] for w in before["workers"]] == ["HELD", "HELD"], before["workers"]  # no version yet
        for step in (1, 2):
            full = {n: tensor_value(3, n, step, t.shape, torch.bfloat16) for n, t in cfg.tensors().items()}
            for r, w in enumerate(trainers):
                for desc in src.ranks[r]:
                    for p in desc.pieces:
                        w.live[desc.name][p.region.slices()].copy_(full[p.tensor][p.box.slices()])
            handles = [w.publish(step) for w in trainers]
            for h in handles:
                assert h.wait_outcome(60) is True, h.error
            t0 = time.monotonic()
            st = _status(addrs["inference"])
            took = time.monotonic() - t0
            assert st["serving_state"] == "SERVING", st
            for w in st["workers"]:
                assert w["state"] == "READY" and w["version"] == {"run": "rl", "step": str(step)}, (took, w)
            assert all(w.version is not None and w.version.step == step for w in inferences)
