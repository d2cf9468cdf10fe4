"""Both controllers in the test's own process (their real gRPC servers, on an event loop of their
own in a thread), with external workers: the embedding API's TrainerWorker and InferenceWorker,
started by the test, moving real bytes over gloo. For tests that need to see inside the process
(an in-memory span exporter) or to hand workers layouts of their own."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import torch

from reshard.inference_svc.worker import InferenceWorker

from .cluster import free_port


def _controllers(inf, tr, inf_w, tr_w, stop: list, src_world: int, dst_world: int, run: str) -> threading.Thread:
    """Both controllers, external workers, on one event loop in a thread (until stop[0] is set)."""
    from reshard.inference_svc.service import serve as serve_inference
    from reshard.trainer_svc.service import serve as serve_trainer

    ready = threading.Event()

    def main_thread() -> None:
        async def main() -> None:
            ev = asyncio.Event()
            stop.append((asyncio.get_running_loop(), ev))
            ready.set()
            await asyncio.gather(
                serve_inference(inf, dst_world, "tiny", stop=ev, spawn_workers=False, worker_listen=inf_w),
                serve_trainer(tr, src_world, "tiny", [inf], run=run, stop=ev, spawn_workers=False, worker_listen=tr_w))
        asyncio.run(main())

    t = threading.Thread(target=main_thread, name="controllers", daemon=True)
    t.start()
    assert ready.wait(30)
    return t


@contextlib.contextmanager
def deployment(dst, *, src_world: int = 2, run: str = "traced", heartbeat_s: float | None = None,
               addresses: dict | None = None):
    """Both controllers in this process and one inference worker per rank of `dst` (buffers of
    zeros in each buffer's dtype); yields the trainer's worker listener and the list of workers to
    stop at the end (add the trainer's). `heartbeat_s` sets the inference workers' heartbeat period;
    `addresses`, when given, receives the controllers' gRPC addresses ("inference", "trainer")."""
    from reshard.common.control.security import set_client_roles

    inf, tr, inf_w, tr_w = (f"127.0.0.1:{free_port()}" for _ in range(4))
    stop: list = []
    roles = set_client_roles(None)  # a controller sets this process's client roles: given back at the end
    if addresses is not None:
        addresses.update(inference=inf, trainer=tr)
    thread = _controllers(inf, tr, inf_w, tr_w, stop, src_world, dst.world, run)
    workers = []
    try:
        for r in range(dst.world):
            bufs = {d.name: (d, torch.zeros(d.shape, dtype=getattr(torch, d.dtype))) for d in dst.ranks[r]}
            w = InferenceWorker(inf_w, r, dst.world, dst.tensors, bufs)
            if heartbeat_s is not None:
                w.heartbeat_s = heartbeat_s
            workers.append(w.start())
        yield tr_w, workers
    finally:
        for w in workers:
            w.stop()
        if stop:
            loop, ev = stop[0]
            loop.call_soon_threadsafe(ev.set)
        thread.join(30)
        set_client_roles(roles)
