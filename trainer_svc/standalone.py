"""A standalone trainer worker holding a synthetic model (Megatron TP layout).

When an update is triggered it takes a simulated optimizer step (every element
changes by a pseudo-random amount, see tools/synth.py) and publishes it."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import threading

import torch

from reshard.common.control.supervisor import watch_controller
from reshard.common.dataplane.backend import worker_device
from reshard.common.layout.core import dtype_of
from reshard.common.models.frameworks import build
from reshard.proto import worker_pb2 as wpb
from reshard.tools.synth import advance_box, init_box

from .worker import TrainerWorker


class SyntheticTrainer(TrainerWorker):
    def __init__(self, *args, seed: int = 0, layout_fault: str = "", **kw) -> None:
        super().__init__(*args, **kw)
        self.seed, self.step, self.layout_fault = seed, 0, layout_fault
        self._fill(init=True)
        self._apply_fault()

    def _fill(self, init: bool) -> None:
        for name, desc in self.descs.items():
            t = self.live[name]
            for p in desc.pieces:
                shape = self.tensors[p.tensor].shape
                view = p.view(t)
                if init:
                    init_box(view, self.seed, p.tensor, p.box.offset, shape)
                else:
                    advance_box(view, self.seed, p.tensor, self.step, p.box.offset, shape)

    def _apply_fault(self) -> None:
        """swap-kv: a deliberately wrong interleave, the first group's k and v rows trade places
        while the layout still declares them in Megatron's order. Applying it twice undoes it."""
        if self.layout_fault != "swap-kv":
            return
        for name, desc in self.descs.items():
            if name.endswith("linear_qkv.weight"):
                k = next(p for p in desc.pieces if ".k_proj" in p.tensor)
                v = next(p for p in desc.pieces if ".v_proj" in p.tensor)
                kk = k.view(self.live[name]).clone()
                k.view(self.live[name]).copy_(v.view(self.live[name]))
                v.view(self.live[name]).copy_(kk)

    async def _on_step(self, s: wpb.Step, cid: int) -> dict:
        if s.version.step < self.step:
            raise ValueError(f"step {s.version.step} is behind this worker's step {self.step}")
        if s.version.step - self.step > MAX_STEPS_AT_ONCE:  # each simulated step costs a pass over the weights
            raise ValueError(f"step {s.version.step} is {s.version.step - self.step} steps ahead of this worker's step "
                             f"{self.step}: a standalone synthetic worker takes at most {MAX_STEPS_AT_ONCE} at once "
                             "(start the run afresh, or with another --run)")
        loop = asyncio.get_running_loop()

        def work() -> None:
            self._apply_fault()  # undo, so the optimizer steps the true weights
            while self.step < s.version.step and not self._stopping:
                self.step += 1
                self._fill(init=False)
            self._apply_fault()
            self.publish(self.step, s.version.run)

        await loop.run_in_executor(self._dp, work)
        return {}


MAX_STEPS_AT_ONCE = 10_000


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="standalone synthetic trainer worker")
    ap.add_argument("--controller", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run", required=True)
    ap.add_argument("--layout-fault", default="", choices=["", "swap-kv"])
    ap.add_argument("--layout", default="", help="layout spec, e.g. framework=megatron,tp=2,pp=2 (default: megatron TP over all ranks)")
    ap.add_argument("--master-dtype", default="", help="hold the weights in this dtype (e.g. float32 masters), cast on send")
    ap.add_argument("--device", default="cpu", help="cpu, cuda (GPU rank %% count) or cuda:N")
    a = ap.parse_args(argv)
    from reshard.common.control.logs import configure

    configure(os.environ.get("RESHARD_LOG_LEVEL", "INFO"), text_format=f"%(asctime)s trainer-worker[{a.rank}] %(levelname)s %(message)s",
              role=f"trainer-worker-{a.rank}")
    from reshard.common.control.tracing import configure_from_env

    configure_from_env("trainer-worker")  # traces when the OTEL_ environment asks for them
    torch.set_num_threads(1)
    layout = build(a.model, a.layout or f"framework=megatron,tp={a.world}")
    if layout.world != a.world:
        raise SystemExit(f"layout {a.layout!r} has {layout.world} ranks, not {a.world}")
    descs = layout.ranks[a.rank]
    if a.master_dtype:
        dtype_of(a.master_dtype)
        descs = tuple(dataclasses.replace(d, dtype=a.master_dtype) for d in descs)
    try:
        device = worker_device(a.device, a.rank)
    except ValueError as e:
        raise SystemExit(f"trainer worker {a.rank}: {e}") from None
    buffers = {d.name: (d, torch.zeros(d.shape, dtype=dtype_of(d.dtype), device=device)) for d in descs}
    worker = SyntheticTrainer(a.controller, a.rank, a.world, layout.tensors, buffers, run=a.run, model=a.model,
                              seed=a.seed, layout_fault=a.layout_fault, snapshot=False,
                              allow_casts=bool(a.master_dtype))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    watch_controller(stop, lambda: worker.controller_pid, lambda: worker.refused)
    worker.start()
    stop.wait()
    worker.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
