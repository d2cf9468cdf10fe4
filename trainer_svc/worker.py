"""TrainerWorker: the trainer side of the worker library, embedded in a training loop.

    worker = TrainerWorker("trainer-svc:50051", rank, world, tensors, buffers).start()
    ...
    optimizer.step()
    handle = worker.publish(step)     # on every rank, at the same point
    handle.wait()                     # before writing the weights again

With `snapshot=True` the weights are copied at publish time (memory permitting)
and the handle is writable at once; otherwise it becomes writable when the
controller is done with that version: every attached deployment has received it
(or failed and will get a newer one). The stall is measured (`handle.stall_seconds`).

The snapshot holds one version. A transfer reads it under a lock: a `publish()` that
comes while the previous version is being sent waits for that read to end (the wait is
its stall) rather than overwrite bytes in flight, and a transfer asked for a version the
snapshot no longer holds (a newer publish came first) fails at once, naming both: the
controller sends the newer one next. A version is never sent with another step's bytes.

`run` names the training run (versions are (run, step)); left empty, the
controller's run (`reshard trainer --run`) is used."""

from __future__ import annotations

import logging
import threading
import time

import torch

from reshard.common.control import faults
from reshard.common.control.security import Security
from reshard.common.control.worker import WorkerBase
from reshard.common.dataplane.transport import TransportError
from reshard.common.layout.core import LocalBuffer, TensorSpec
from reshard.proto import reshard_pb2 as pb
from reshard.proto import worker_pb2 as wpb

log = logging.getLogger("reshard.trainer")


class PublishHandle:
    """Says when the trainer may write its weights again, and whether the version reached inference.

    `wait()` returns once the weights are writable (every attached deployment has the version, or
    its update failed); then `ok` says whether the update that carried it (this version, or a
    newer one it was coalesced into: `delivered`) committed on every deployment, and `error` why
    not. With `snapshot=True` the weights are writable at once and the outcome comes later:
    `wait_outcome()` waits for it."""

    def __init__(self, version: pb.Version, writable: bool) -> None:
        self.version = version
        self._event = threading.Event()
        self._outcome = threading.Event()
        self._t0 = time.perf_counter()
        self.stall_seconds = 0.0
        self.ok: bool | None = None
        """True: committed everywhere; False: the update failed (`error`); None: not known (yet)."""
        self.error = ""
        self.delivered: pb.Version | None = None
        if writable:
            self._event.set()

    def _release(self, ok: bool | None = None, error: str = "", delivered: pb.Version | None = None) -> None:
        self.ok, self.error, self.delivered = ok, error, delivered
        if not self._event.is_set():
            self.stall_seconds = time.perf_counter() - self._t0
            self._event.set()
        self._outcome.set()

    @property
    def writable(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """True once the weights may be written again (False: the timeout passed first)."""
        return self._event.wait(timeout)

    def wait_outcome(self, timeout: float | None = None) -> bool | None:
        """The update's outcome (`ok`), waiting for it up to `timeout`; None if still unknown."""
        self._outcome.wait(timeout)
        return self.ok


class TrainerWorker(WorkerBase):
    role = "trainer"
    side = "src"

    def __init__(self, controller: str, rank: int, world: int, tensors: dict[str, TensorSpec],
                 buffers: dict[str, tuple[LocalBuffer, torch.Tensor]], *, run: str = "", snapshot: bool = False,
                 model: str = "", fault: dict[str, float] | None = None, allow_casts: bool = False,
                 security: Security | None = None) -> None:
        super().__init__(controller, rank, world, tensors, buffers, model=model, fault=fault, allow_casts=allow_casts,
                         security=security)
        self.run_id = run
        self.snapshot = {n: torch.empty_like(t) for n, t in self.live.items()} if snapshot else None
        self._snap_lock = threading.Lock()  # held by a copy into the snapshot, and by a transfer reading it
        self._snap_version: pb.Version | None = None  # the version the snapshot holds
        self._handles: list[PublishHandle] = []
        self._lock = threading.Lock()

    @classmethod
    def from_module(cls, controller: str, module: torch.nn.Module, *, names=None, rank: int | None = None,
                    world: int | None = None, **kw) -> "TrainerWorker":
        """A worker for a live model: its layout read from the parameters, which it sends in place at
        each publish. A Megatron-core model's layout comes from its sharded state dict
        (`reshard.integrations.megatron`); any other module's from its parameters, DTensors (FSDP2,
        tensor parallel) or plain tensors (`reshard.integrations.dtensor`), where `names` maps
        parameter names to canonical (Hugging Face) ones where they differ. Rank and world default
        to torch.distributed's."""
        if type(module).__module__.startswith("megatron.") and hasattr(module, "sharded_state_dict"):
            from reshard.integrations import megatron

            rank, world, tensors, buffers = megatron.module_layout(module, rank=rank, world=world)
        else:
            from reshard.integrations.dtensor import module_layout

            rank, world, tensors, buffers = module_layout(module, names=names, rank=rank, world=world)
        kw.setdefault("model", type(module).__name__)
        return cls(controller, rank, world, tensors, buffers, **kw)

    def publish(self, step: int, run: str | None = None) -> PublishHandle:
        """Publish the current weights as version (run, step); call on every rank. May be called
        right after `start()`: the message waits until the worker is connected."""
        if self._stopping:
            raise RuntimeError(f"trainer worker {self.rank} is stopped: publish() needs a started worker")
        if step < 0:
            raise ValueError(f"step must be >= 0, not {step}")
        version = pb.Version(run=run or self.run_id, step=step)
        stall = 0.0
        if self.snapshot is not None:
            if not self._snap_lock.acquire(blocking=False):  # a transfer still reads the previous version
                t0 = time.perf_counter()
                self._snap_lock.acquire()
                stall = time.perf_counter() - t0
            try:
                for n, t in self.live.items():
                    self.snapshot[n].copy_(t)
                self._sync_caller_stream()
                self._snap_version = version
            finally:
                self._snap_lock.release()
        else:
            self._sync_caller_stream()
        handle = PublishHandle(version, writable=self.snapshot is not None)
        handle.stall_seconds = stall
        with self._lock:
            self._handles.append(handle)
        self.version = version
        self.emit(wpb.WorkerMessage(published=wpb.Published(version=version)))
        return handle

    def _sync_caller_stream(self) -> None:
        if self.device.startswith("cuda"):
            # The data plane reads on its own streams: what the caller's stream queued (the
            # optimizer step, the snapshot copy) must have run first.
            torch.cuda.current_stream(self.device).synchronize()

    def transfer_buffers(self) -> dict[str, torch.Tensor]:
        return self.snapshot if self.snapshot is not None else self.live

    def with_derived(self, src, buffers, plan):
        """A destination that serves block FP8 gets values and scales quantized here, from the weights
        this rank holds, piece by piece (common/layout/quantized.py), as the transfer first reads them
        (common/quant.py): made for each transfer, dropped after. Where pieces of several ranks split
        a row of blocks, their partial maxima are exchanged first (the prelude)."""
        from reshard.common.layout.quantized import amax_exchange, has_derived, split_rows
        from reshard.common.quant import QuantizedBuffers

        if not has_derived(src, self.rank):  # nothing to quantize: the buffers as they are, not copied
            return buffers, self.shapes, None
        split = amax_exchange(src, self.rank, plan.moved_tensors()) if split_rows(src) else None
        q = QuantizedBuffers(src.ranks[self.rank], self.descs, buffers, split)
        if not q.pending:
            return buffers, self.shapes, None
        shapes = dict(self.shapes)
        shapes.update((n, t.shape) for n, t in src.tensors.items() if n not in shapes)
        return q, shapes, (q.exchange if split else None)

    def _run_transfer(self, p, plan, src, dst):
        """With a snapshot: send it only if it holds the update's version, and keep it from being
        overwritten (by the next publish) until every byte left and every sum was taken."""
        if self.snapshot is None:
            return super()._run_transfer(p, plan, src, dst)
        with self._snap_lock:
            held = self._snap_version
            if held is None or held.step != p.version.step or (held.run and p.version.run and held.run != p.version.run):
                have = f"{held.run or '(run)'}:{held.step}" if held is not None else "nothing"
                raise TransportError(f"trainer rank {self.rank}: its snapshot holds {have}, not "
                                     f"{p.version.run}:{p.version.step} (a newer publish came first; that one is sent next)")
            return super()._run_transfer(p, plan, src, dst)

    def _release_upto(self, step: int | None, ok: bool | None = None, error: str = "",
                      delivered: pb.Version | None = None) -> None:
        with self._lock:
            keep = []
            for h in self._handles:
                if step is None or h.version.step <= step:
                    h._release(ok, error, delivered)
                else:
                    keep.append(h)
            self._handles = keep

    async def _on_release(self, r: wpb.Release, cid: int) -> None:
        """The controller is done with every version up to r.version on every deployment."""
        faults.at_phase("trainer-worker", "COMMIT", self.rank)
        if r.has_outcome:
            self._release_upto(r.version.step, r.ok, r.error, r.delivered if r.HasField("delivered") else None)
        else:
            self._release_upto(r.version.step)

    def stop(self) -> None:
        super().stop()
        self._release_upto(None, None, f"trainer worker {self.rank} stopped")  # nothing reads the weights any more
