"""InferenceWorker: the inference side of the worker library, embedded in a serving engine.

Shadow mode (default): updates are received into shadow buffers while serving
continues; at COMMIT the engine is paused at a step boundary, the shadow is
copied into the live parameters (addresses stay put, so CUDA graphs stay valid),
the commit hooks run, and serving resumes. In-place mode: serving is paused for
the whole transfer; if it fails, the worker reports NOT_SERVING until a full
update succeeds."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

import torch

from reshard.common import faults
from reshard.common.checksum import box_checksum
from reshard.common.layout import LocalBuffer, TensorSpec
from reshard.common.security import Security
from reshard.common.verify import check_rank
from reshard.common.worker import WorkerBase
from reshard.proto import reshard_pb2 as pb
from reshard.proto import worker_pb2 as wpb

log = logging.getLogger("reshard.inference")

READ_CHUNK = 1 << 20
READ_LOCK_TIMEOUT = 5.0


class InferenceWorker(WorkerBase):
    role = "inference"
    side = "dst"
    box_checksum = staticmethod(box_checksum)  # what VERIFY computes per piece (common.checksum)

    def __init__(self, controller: str, rank: int, world: int, tensors: dict[str, TensorSpec],
                 buffers: dict[str, tuple[LocalBuffer, torch.Tensor]], *, mode: str = "shadow",
                 pause: Callable[[], None] | None = None, resume: Callable[[], None] | None = None,
                 commit_hooks: tuple[Callable[[pb.Version], None], ...] = (), version: pb.Version | None = None,
                 model: str = "", fault: dict[str, float] | None = None, security: Security | None = None) -> None:
        if mode not in ("shadow", "inplace"):
            raise ValueError(f"mode must be 'shadow' or 'inplace', not {mode!r}")
        super().__init__(controller, rank, world, tensors, buffers, model=model, fault=fault, security=security)
        self.mode = mode
        self.pause_hook, self.resume_hook, self.commit_hooks = pause, resume, tuple(commit_hooks)
        self.version = version
        # Allocated once, reused by every update.
        self.shadow = {n: torch.empty_like(t) for n, t in self.live.items()} if mode == "shadow" else None
        self._serving = threading.Lock()
        self._committed = threading.Condition()
        self.serving_ok = True  # False after an in-place update failed midway: the weights are torn
        # Held until the controller has seen this rank's version: a rank serves only its deployment's
        # committed version (one restarted with its checkpoint beside peers at step N must not).
        self.held = True
        self.updating = False
        self._verifying = ""  # the update this rank was asked to verify, until it commits (or aborts)

    @contextlib.contextmanager
    def serving(self) -> Iterator[pb.Version | None]:
        """Hold around one engine step: COMMIT waits for the step boundary. Yields the live version
        (None while NOT_SERVING)."""
        with self._serving:
            yield self.version if self.serving_ok and not self.held else None

    def wait_for_version(self, step: int, run: str | None = None, timeout: float | None = None) -> pb.Version | None:
        """Block until this rank serves version (run, step) or a newer step of that run (any run when
        `run` is None); returns the version served, or None at the timeout."""
        def ready() -> bool:
            v = self.version
            return self.serving_ok and not self.held and v is not None and (run is None or v.run == run) and v.step >= step

        with self._committed:
            if not self._committed.wait_for(ready, timeout):
                return None
            return self.version

    async def _on_serve(self, s: wpb.Serve, cid: int) -> None:
        with self._committed:
            if self.held == s.allow:
                log.log(logging.INFO if s.allow else logging.WARNING, "inference worker %d: %s (%s)", self.rank,
                        "serving" if s.allow else "held: not serving", s.reason)
            self.held = not s.allow
            self._committed.notify_all()
        self.emit(self._heartbeat())

    def _heartbeat(self) -> wpb.WorkerMessage:
        msg = super()._heartbeat()
        msg.heartbeat.held = self.held
        return msg

    def record_request(self, version: pb.Version) -> None:
        """Count one request served with `version` (reported per version in status)."""
        key = f"{version.run}:{version.step}"
        self.requests_by_version[key] = self.requests_by_version.get(key, 0) + 1
        self.requests_served += 1
        if self.updating:
            self.requests_during_update += 1

    def _pause(self) -> None:
        self._serving.acquire()
        if self.pause_hook:
            self.pause_hook()

    def _resume(self) -> None:
        if self.resume_hook:
            self.resume_hook()
        self._serving.release()

    def before_transfer(self, p: wpb.Prepare) -> None:
        self.updating = True
        if self.mode == "inplace":
            self._pause()
            self.serving_ok = False  # live weights are about to be overwritten

    def transfer_buffers(self) -> dict[str, torch.Tensor]:
        return self.shadow if self.shadow is not None else self.live

    def on_abort(self, update_id: str) -> None:
        if self._verifying == update_id:
            self._verifying = ""  # aborted by the controller: it tells every rank what to serve
        if self.updating and self.mode == "inplace":
            self._resume()  # serving_ok stays False: NOT_SERVING until a full update
        if self.updating and self.shadow is not None:
            # The shadow may hold part of the failed version: bring it back to the live weights,
            # so a later partial update commits the untouched tensors unchanged.
            self._dp.submit(self._resync_shadow)
        self.updating = False

    def on_controller_lost(self) -> None:
        """Lost between VERIFY and COMMIT, this rank cannot know whether its peers committed: it stops
        serving until a controller (this one restarted, or its successor) says which version the
        deployment serves. Lost at any other time, it keeps serving what it holds."""
        if self._verifying:
            with self._committed:
                self.held = True
                self._committed.notify_all()
            log.warning("inference worker %d: lost the controller between VERIFY and COMMIT of update %s: "
                        "held until a controller says what the deployment serves", self.rank, self._verifying)
            self._verifying = ""

    def _resync_shadow(self) -> None:
        for n, t in self.live.items():
            self.shadow[n].copy_(t)

    async def _on_verify(self, v: wpb.Verify, cid: int) -> dict:
        self._verifying = v.update_id  # from here, its peers may commit: see on_controller_lost
        faults.at_phase("inference-worker", "VERIFY", self.rank)
        plan, dst = self.prepared(v.update_id)
        pieces = {(b.name, i): p for b in dst.ranks[self.rank] for i, p in enumerate(b.pieces)}
        uid, landed = self._landed
        await asyncio.get_running_loop().run_in_executor(self._dp, check_rank, plan, self.rank, v.expected,
                                                         self.transfer_buffers(), pieces, self.shapes, self.box_checksum,
                                                         landed if uid == v.update_id else None)
        return {}

    async def _on_commit(self, c: wpb.Commit, cid: int) -> dict:
        faults.at_phase("inference-worker", "COMMIT", self.rank)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._dp, self._commit, c.version)
        return {}

    def _commit(self, version: pb.Version) -> None:
        if self.mode == "shadow":
            self._pause()
        try:
            if self.fault.get("commit_seconds"):  # test hook: a commit that takes a while
                time.sleep(self.fault["commit_seconds"])
            if self.shadow is not None:
                for n, t in self.live.items():
                    t.copy_(self.shadow[n])
                if self.device.startswith("cuda"):  # the engine's streams must not see half-copied weights
                    torch.cuda.current_stream(self.device).synchronize()
            for hook in self.commit_hooks:
                hook(version)
            with self._committed:
                self.version = pb.Version(run=version.run, step=version.step)
                self.serving_ok = True
                self.held = False  # every rank of the deployment commits this version
                self._verifying = ""
                self._committed.notify_all()
        finally:
            self.updating = False
            self._resume()
        log.info("inference worker %d: committed %s:%d", self.rank, version.run, version.step)

    async def _on_read(self, r: wpb.Read, cid: int) -> dict:
        if r.tensor not in self.tensors:
            return {}
        # Off the loop: the serving lock may be held (an engine step, a commit, an in-place transfer),
        # and the loop must keep answering meanwhile.
        await asyncio.get_running_loop().run_in_executor(None, self._read, r, cid)
        return {}

    def _read(self, r: wpb.Read, cid: int) -> None:
        if self.updating and self.mode == "inplace":
            raise RuntimeError(f"inference rank {self.rank} is receiving an update in place: its weights are being "
                               "overwritten and cannot be read back until the update ends")
        if not self._serving.acquire(timeout=READ_LOCK_TIMEOUT):
            raise RuntimeError(f"inference rank {self.rank}: the engine held its weights for {READ_LOCK_TIMEOUT:.0f}s; "
                               "read back later")
        try:
            version = self.version
            seen = set()  # a tied tensor is held by two buffers: send each box once
            for name, desc in self.descs.items():
                for p in desc.pieces:
                    if p.tensor != r.tensor or p.box in seen:
                        continue
                    seen.add(p.box)
                    data = p.view(self.live[name]).contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()
                    for off in range(0, max(1, len(data)), READ_CHUNK):
                        piece = wpb.ReadPiece(id=cid, offset=list(p.box.offset), size=list(p.box.size), byte_offset=off,
                                              data=data[off : off + READ_CHUNK], last=off + READ_CHUNK >= len(data))
                        if version is not None:
                            piece.version.CopyFrom(version)
                        self.emit(wpb.WorkerMessage(piece=piece))
        finally:
            self._serving.release()
