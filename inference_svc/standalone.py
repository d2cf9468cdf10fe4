"""A standalone inference worker holding a synthetic model (vLLM TP layout),
with a synthetic serving loop: small computations over the live weights at a
steady rate, each request tagged with the version it used.

Started by `reshard inference` (one process per worker); run it by hand as
`python -m reshard.inference_svc.standalone --controller HOST:PORT --rank R --world N --model NAME`."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

import torch

from reshard.common.control.supervisor import watch_controller
from reshard.common.dataplane.backend import worker_device
from reshard.common.layout.core import dtype_of
from reshard.common.models.frameworks import build
from reshard.proto import reshard_pb2 as pb
from reshard.tools.synth import init_box

from .stagings import STANDALONE
from .worker import InferenceWorker

log = logging.getLogger("reshard.inference")
CHECKPOINT = pb.Version(run="checkpoint", step=0)


def make_worker(controller: str, rank: int, world: int, model: str, seed: int, staging: str, fault: dict,
                layout_spec: str = "", device: str = "cpu", pool_bytes: int = 256 << 20) -> InferenceWorker:
    layout = build(model, layout_spec or f"framework=vllm,tp={world}")
    if layout.world != world:
        raise SystemExit(f"layout {layout_spec!r} has {layout.world} ranks, not {world}")
    buffers = {}
    for desc in layout.ranks[rank]:
        t = torch.zeros(desc.shape, dtype=dtype_of(desc.dtype), device=worker_device(device, rank))
        for p in desc.pieces:  # the checkpoint the engine loaded at start: synthetic step 0
            init_box(p.view(t), seed, p.tensor, p.box.offset, layout.tensors[p.tensor].shape)
        buffers[desc.name] = (desc, t)
    # The serving loop looks its weights up at each step, so a shadow commit swaps the two copies
    return InferenceWorker(controller, rank, world, layout.tensors, buffers, staging=staging, version=CHECKPOINT,
                           model=model, fault=fault, pool_bytes=pool_bytes, flip=staging == "shadow")


def serve_forever(worker: InferenceWorker, stop: threading.Event, interval: float = 0.01) -> None:
    """The synthetic serving loop: one small request every `interval` seconds."""
    # A small matrix-vector product over the first rows of this rank's first 2-D buffer, looked up in
    # `worker.live` at each step (a shadow commit swaps the copies: see InferenceWorker's `flip`).
    name = next(n for n, t in worker.live.items() if t.dim() >= 2)
    w = worker.live[name].flatten(1)
    x = torch.ones(w.shape[1], dtype=torch.float32, device=w.device)
    while not stop.is_set():
        with worker.serving() as version:
            if version is not None:
                w = worker.live[name].flatten(1)
                _ = torch.mv(w[:64].float(), x).sum().item()
                worker.record_request(version)
        stop.wait(interval)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="standalone synthetic inference worker")
    ap.add_argument("--controller", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--staging", default=None, choices=STANDALONE, help="how updates are staged (default shadow)")
    ap.add_argument("--mode", dest="deprecated_mode", default=None, choices=STANDALONE,
                    help=argparse.SUPPRESS)  # the earlier name of --staging: still taken, with a warning
    ap.add_argument("--layout", default="", help="layout spec, e.g. framework=vllm,tp=2,dp=2 (default: vllm TP over all ranks)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda (GPU rank %% count) or cuda:N")
    ap.add_argument("--pool-bytes", type=int, default=256 << 20, help="staging bounded: the pool updates go through")
    a = ap.parse_args(argv)
    from reshard.common.control.logs import configure

    configure(os.environ.get("RESHARD_LOG_LEVEL", "INFO"), text_format=f"%(asctime)s inference-worker[{a.rank}] %(levelname)s %(message)s",
              role=f"inference-worker-{a.rank}")
    from reshard.common.control.tracing import configure_from_env

    configure_from_env("inference-worker")  # traces when the OTEL_ environment asks for them
    if a.deprecated_mode is not None:
        if a.staging not in (None, a.deprecated_mode):
            ap.error(f"--staging {a.staging} and --mode {a.deprecated_mode} (its deprecated name) disagree")
        log.warning("--mode is deprecated: use --staging %s", a.deprecated_mode)
    staging = a.staging or a.deprecated_mode or "shadow"
    torch.set_num_threads(1)
    fault = {}
    if os.environ.get("RESHARD_FAULT_RANK", "") == str(a.rank):
        fault = {"slow_after": float(os.environ.get("RESHARD_FAULT_SLOW_AFTER", "-1")),
                 "slow_seconds": float(os.environ.get("RESHARD_FAULT_SLOW_SECONDS", "0")),
                 "once": os.environ.get("RESHARD_FAULT_ONCE", "") == "1",
                 "commit_seconds": float(os.environ.get("RESHARD_FAULT_COMMIT_SECONDS", "0"))}
    try:
        worker_device(a.device, a.rank)
    except ValueError as e:
        raise SystemExit(f"inference worker {a.rank}: {e}") from None
    worker = make_worker(a.controller, a.rank, a.world, a.model, a.seed, staging, fault, a.layout, a.device, a.pool_bytes)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    watch_controller(stop, lambda: worker.controller_pid, lambda: worker.refused)
    worker.start()
    try:
        serve_forever(worker, stop)
    finally:
        worker.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
