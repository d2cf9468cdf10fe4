"""InferenceWorker: the inference side of the worker library, embedded in a serving engine.

How it stages an update (`staging=`): shadow (default): updates are received into
shadow buffers while serving continues; at COMMIT the engine is paused at a step
boundary, the shadow is copied into the live parameters (addresses stay put, so CUDA
graphs stay valid), the commit hooks run, and serving resumes. In place (`inplace`):
serving is paused for the whole transfer; if it fails, the worker reports NOT_SERVING
until a full update succeeds. Bounded (`bounded`): no copy of the weights at all; the
update is received through a pool of `pool_bytes` (inference_svc/pool.py), each group of
buffers handed to `load` as soon as it has landed, serving paused for the whole update;
verified at the end like the others, and a failure leaves what it loaded torn (NOT_SERVING
until a full update succeeds). Staged (`staged`): received through the pool as in bounded,
but `load` writes each buffer into a copy the engine keeps elsewhere (host memory, so the
device holds only the pool) while the engine serves; the engine loads that copy when it
asks for the version. A failure leaves that copy torn (NOT_SERVING until a full update),
never what the engine serves."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
import warnings
from collections.abc import Callable, Iterator

import torch

from reshard.common.control import faults
from reshard.common.control.methods import RESHARD
from reshard.common.control.security import Security
from reshard.common.control.worker import WorkerBase
from reshard.common.dataplane.checksum import box_checksum
from reshard.common.layout.core import Box, LayoutError, LocalBuffer, TensorSpec, dtype_of
from reshard.common.plan.verify import check_rank
from reshard.inference_svc.pool import DEFAULT_POOL_BYTES, BoundedStaging, LoadFn
from reshard.inference_svc.stagings import POOLED, STAGINGS, TEARS
from reshard.proto import reshard_pb2 as pb
from reshard.proto import worker_pb2 as wpb

log = logging.getLogger("reshard.inference")

READ_CHUNK = 1 << 20  # bytes of one ReadPiece message: an intersection larger than this comes in several
READ_LOCK_TIMEOUT = 5.0  # a read back waits at most this long for a commit's copy to end
READ_RETRIES = 8  # copies of a region a read back makes while commits overlap it
READ_WAIT_S = 0.002  # between looks at a commit in progress
_mode_warned = False


def _warn_mode() -> None:
    """`mode`, the earlier name of `staging`, still works: it says so once per process."""
    global _mode_warned
    if not _mode_warned:
        _mode_warned = True
        warnings.warn("InferenceWorker's `mode` is deprecated: it is `staging` now (shadow | inplace)",
                      DeprecationWarning, stacklevel=3)


class InferenceWorker(WorkerBase):
    role = "inference"
    side = "dst"
    box_checksum = staticmethod(box_checksum)  # what VERIFY computes per piece (common.checksum)

    def __init__(self, controller: str, rank: int, world: int, tensors: dict[str, TensorSpec],
                 buffers: dict[str, tuple[LocalBuffer, torch.Tensor]], *, staging: str | None = None,
                 pause: Callable[[], None] | None = None, resume: Callable[[], None] | None = None,
                 commit_hooks: tuple[Callable[[pb.Version], None], ...] = (), version: pb.Version | None = None,
                 model: str = "", fault: dict[str, float] | None = None, security: Security | None = None,
                 mode: str | None = None, pool_bytes: int = DEFAULT_POOL_BYTES, load: LoadFn | None = None,
                 load_groups: dict[str, str] | None = None, device: str | None = None, flip: bool = False) -> None:
        """`staging`: "shadow" (the default), "inplace", "bounded" or "staged" (see the module doc).
        `flip` (shadow staging only): the engine looks its weights up in `worker.live` at every step
        (inside `serving()`) and holds no reference to them between steps, so COMMIT swaps the shadow
        and the live copies instead of copying one into the other (the pause is a swap of references,
        not a copy of the rank's weights; the weights' addresses change, so not for CUDA graphs). `mode` is its
        deprecated earlier name (a DeprecationWarning, once). Bounded staging only: `pool_bytes`, the
        pool it receives through; `load(tensors)`, which loads a complete group of buffers (name ->
        tensor, valid during the call) into the engine (default: copied into the buffers given here);
        `load_groups`, buffer name -> the group it loads with (default: each buffer alone); `device`, where
        the engine's weights live when the buffers given are meta tensors (bounded staging with a `load`:
        the engine holds the weights, this worker no copy of them)."""
        if mode is not None:
            _warn_mode()
            if staging is not None and staging != mode:
                raise ValueError(f"staging={staging!r} and mode={mode!r} (its deprecated name) disagree: pass staging only")
            staging = mode
        staging = "shadow" if staging is None else staging
        if staging not in STAGINGS:
            raise ValueError(f"staging must be one of {', '.join(STAGINGS)}, not {staging!r}")
        super().__init__(controller, rank, world, tensors, buffers, model=model, fault=fault, security=security)
        self.staging = staging
        self.holds_copy = self.device != "meta"  # False: the engine holds the weights (bounded, meta buffers)
        if not self.holds_copy and staging in POOLED:
            if load is None or device is None:
                raise ValueError(f"{staging} staging over meta buffers (no copy of the weights) needs a load function and device=")
            from reshard.common.dataplane.backend import device_uuid
            from reshard.common.dataplane.engine import StagingPool

            self.device, self.device_uuid = device, device_uuid(device)
            self._pool = StagingPool(self.device)
        elif device is not None and device != self.device:
            raise ValueError(f"device={device!r}, but the buffers are on {self.device}")
        self.pause_hook, self.resume_hook, self.commit_hooks = pause, resume, tuple(commit_hooks)
        self.version = version
        # Allocated once, as a copy of the live weights: a partial update (and padding, which no
        # update writes) commits what the shadow holds for what it does not carry.
        self.shadow = {n: t.clone() for n, t in self.live.items()} if staging == "shadow" else None
        if flip and (staging != "shadow" or not self.holds_copy):
            raise ValueError(f"flip swaps the shadow and live copies at COMMIT: it needs shadow staging with the weights "
                             f"held here, not {staging!r}{'' if self.holds_copy else ' over meta buffers'}")
        self.flip = flip
        self._flipping = False  # this update's COMMIT swaps (flip, and a session that maps buffers per update)
        # Flip: the buffers whose shadow holds an older version than the live one (swapped at a COMMIT),
        # brought level before an update that writes them in part
        self._behind: set[str] = set()
        self.bounded = BoundedStaging(self.descs, self.shapes, self.device, pool_bytes, load_groups) \
            if staging in POOLED else None
        if self.bounded is not None:  # the plan sends this rank's buffers in order, half the pool at a time
            self.receive_window = max(1, pool_bytes // 2)
        self._load = load or self._load_into_live
        self._serving = threading.Lock()
        self._paused = False  # the engine is paused by this worker (it holds _serving)
        self._committed = threading.Condition()
        self.serving_ok = True  # False while any tensor is torn (an in-place update failed midway)
        self.torn: set[str] = set()  # tensors a failed in-place update left half-written
        self._carrying: set[str] | None = None  # the tensors of the update in flight (None: all)
        # Held until the controller has seen this rank's version: a rank serves only its deployment's
        # committed version (one restarted with its checkpoint beside peers at step N must not).
        self.held = True
        self.updating = False
        self._verifying = ""  # the update this rank was asked to verify, until it commits (or aborts)
        self._commit_gen = 0  # the commit generation: odd while `_commit` changes the live weights (see `_read`)
        self.failures: collections.OrderedDict[tuple[str, int], str] = collections.OrderedDict()
        """(run, step) -> why the update carrying it failed, for the last few failed versions."""

    @contextlib.contextmanager
    def serving(self) -> Iterator[pb.Version | None]:
        """Hold around one engine step: COMMIT waits for the step boundary. Yields the live version
        (None while NOT_SERVING)."""
        with self._serving:
            yield self.version if self.serving_ok and not self.held else None

    def wait_for_version(self, step: int, run: str | None = None, timeout: float | None = None) -> pb.Version | None:
        """Block until this rank serves version (run, step) or a newer step of that run (any run when
        `run` is None); returns the version served, or None at the timeout or when the update
        carrying that step failed (`failure(step, run)` says why)."""
        def ready() -> bool:
            v = self.version
            return self.serving_ok and not self.held and v is not None and (run is None or v.run == run) and v.step >= step

        with self._committed:
            if not self._committed.wait_for(lambda: ready() or self.failure(step, run) is not None, timeout) or not ready():
                return None
            return self.version

    def failure(self, step: int, run: str | None = None) -> str | None:
        """Why the update carrying (run, step) failed, if it did (the latest such failure)."""
        for (r, s), why in reversed(self.failures.items()):
            if s == step and (run is None or r == run):
                return why
        return None

    async def _on_abort(self, a: wpb.Abort, cid: int) -> None:
        await super()._on_abort(a, cid)
        if a.HasField("version"):
            with self._committed:
                self.failures[(a.version.run, a.version.step)] = a.reason
                while len(self.failures) > 16:
                    self.failures.popitem(last=False)
                self._committed.notify_all()

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
            try:
                self.pause_hook()
            except BaseException:
                self._serving.release()
                raise
        self._paused = True

    def _resume(self) -> None:
        if not self._paused:  # never paused (a pause hook that failed), or resumed already
            return
        self._paused = False
        try:
            if self.resume_hook:
                self.resume_hook()
        finally:
            self._serving.release()

    @property
    def mode(self) -> str:
        """Deprecated: `staging` (a DeprecationWarning, once)."""
        _warn_mode()
        return self.staging

    def _pauses(self) -> bool:
        """Whether this staging overwrites, during the transfer, what the engine serves or (staged) the
        one copy it loads from: the rank is held (`serving()` waits) and a failure leaves it torn."""
        return self.staging in TEARS

    def before_transfer(self, p: wpb.Prepare) -> None:
        if self.bounded is not None:
            self._check_bounded(p)
        self.updating = True
        self._carrying = set(p.tensors) if p.tensors else None
        self.transfer_deadline = time.monotonic() + max(0.0, p.timeout_s)  # what a pause hook may wait, at most
        if self._pauses():
            self._pause()
            self.serving_ok = False  # live weights are about to be overwritten
        if self.flip:
            # CUDA IPC and hybrid sessions map a guest's buffers once per session: those commit by copy
            self._flipping = p.session.transport not in ("ipc", "hybrid")
            self._level_shadow()
        if self.bounded is not None:
            self.bounded.begin(self.prepared(p.update_id)[0], self.rank, self._load)

    def _check_bounded(self, p: wpb.Prepare) -> None:
        """What bounded staging cannot take, refused before anything moves (the update fails with it)."""
        if p.method and p.method != RESHARD:
            raise LayoutError(f"inference rank {self.rank} stages {self.staging}: transfer method {p.method!r} writes whole "
                              "models at once; use the reshard method")
        if p.session.transport in ("ipc", "hybrid"):
            raise LayoutError(f"inference rank {self.rank} stages {self.staging}: a {p.session.transport} session writes "
                              "its buffers directly; stage inplace or shadow with workers sharing a GPU")
        if p.tensors:
            carried = set(p.tensors)
            for name, desc in self.descs.items():
                held = {q.tensor for q in desc.pieces}
                if held & carried and not held <= carried:
                    other = sorted(held - carried)[0]
                    raise LayoutError(f"inference rank {self.rank} stages {self.staging} and loads whole buffers: buffer "
                                      f"{name!r} also holds {other!r}, which this partial update does not carry "
                                      "(carry it too, or stage inplace or shadow)")
            for group, names in self.bounded.members.items():
                hit = [n for n in names if any(q.tensor in carried for q in self.descs[n].pieces)]
                if hit and len(hit) < len(names):
                    other = sorted({q.tensor for n in names if n not in hit for q in self.descs[n].pieces})[0]
                    raise LayoutError(f"inference rank {self.rank} stages {self.staging} and loads whole modules: {group!r} "
                                      f"also holds {other!r}, which this partial update does not carry (carry it too, "
                                      "or stage inplace or shadow)")

    def transfer_buffers(self) -> dict[str, torch.Tensor]:
        if self.bounded is not None:
            return self.bounded
        return self.shadow if self.shadow is not None else self.live

    def after_round(self, rnd: int) -> None:
        if self.bounded is not None:
            self.bounded.round_done(rnd)  # load what completed, free its space

    def received_sums(self, sums: dict) -> dict:
        if self.bounded is not None:
            return {**sums, **self.bounded.finish()}  # taken as each buffer completed, before its space went
        return sums

    def sums_as_landed(self) -> bool:
        return self.bounded is None  # bounded: the pool sums each buffer when complete (its space is reused)

    def _load_into_live(self, tensors: dict[str, torch.Tensor]) -> None:
        for n, t in tensors.items():
            self.live[n].copy_(t)

    def memory_report(self) -> dict[str, int]:
        rep = super().memory_report()
        if self.bounded is not None:
            rep["pool"] = self.bounded.pool_bytes
            rep["pool_high_water"] = self.bounded.high_water
            rep["pool_overflow"] = self.bounded.overflow_bytes
        return rep

    def on_abort(self, update_id: str) -> None:
        if self._verifying == update_id:
            self._verifying = ""  # aborted by the controller: it tells every rank what to serve
        if self.updating and self._pauses():
            # What it carried may be half-written: not served until an update carries it again. Bounded:
            # only what it began to load into the engine (the rest never left the pool).
            if self.bounded is not None:
                self.torn |= {p.tensor for n in self.bounded.touched_buffers() for p in self.descs[n].pieces}
                self._dp.submit(self.bounded.release)  # after the data-plane thread let go of the update
            else:
                self.torn |= set(self.tensors) if self._carrying is None else self._carrying
            self.serving_ok = not self.torn
            self._resume()
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
        self._behind = set()

    def _overwrites(self, name: str) -> bool:
        """Whether the update in flight writes buffer `name` whole (every tensor it holds is carried;
        padding, which no update writes, is the same in both copies)."""
        return self._carrying is None or all(p.tensor in self._carrying for p in self.descs[name].pieces)

    def _carried(self, name: str) -> bool:
        """Whether the update in flight writes any of buffer `name`."""
        return self._carrying is None or any(p.tensor in self._carrying for p in self.descs[name].pieces)

    def _level_shadow(self) -> None:
        """Flip: before a transfer into the shadow, its buffers that a swap left a version behind and
        that this update writes in part get the live version (one it overwrites whole needs nothing,
        so a full update copies nothing; one it does not carry stays behind until one does)."""
        for n in sorted(self._behind):
            if self._carried(n):
                if not self._overwrites(n):
                    self.shadow[n].copy_(self.live[n])
                self._behind.discard(n)

    async def _on_verify(self, v: wpb.Verify, cid: int) -> dict:
        self._verifying = v.update_id  # from here, its peers may commit: see on_controller_lost
        faults.at_phase("inference-worker", "VERIFY", self.rank)
        plan, dst = self.prepared(v.update_id)
        pieces = dst.rank_pieces(self.rank)
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
        if self.staging == "shadow":
            self._pause()
        try:
            # Odd while the live weights and the version change: a read back (`_read`) waits for it
            # to be even, and copies again if it changed meanwhile (a seqlock).
            self._commit_gen += 1
            if self.fault.get("commit_seconds"):  # test hook: a commit that takes a while
                time.sleep(self.fault["commit_seconds"])
            if self.shadow is not None:
                cuda = self.device.startswith("cuda")
                if cuda:
                    # The engine is paused at a step boundary, but a step returns before its kernels end:
                    # whatever any stream of this process queued (reading the live weights) runs first.
                    torch.cuda.synchronize(self.device)
                # The buffers this update wrote (a partial update: those holding a tensor it carried);
                # the others' live weights already are the committed version.
                written = [n for n in self.live if self._carried(n)]
                if self._flipping:  # the engine looks its weights up at each step: swap, copy nothing
                    live, shadow = dict(self.live), dict(self.shadow)
                    for n in written:
                        live[n], shadow[n] = self.shadow[n], self.live[n]
                    self.live, self.shadow = live, shadow
                    self._behind |= set(written)
                else:
                    for n in written:
                        self.live[n].copy_(self.shadow[n])
                if cuda:  # and the engine's next step sees whole weights
                    torch.cuda.current_stream(self.device).synchronize()
            for hook in self.commit_hooks:
                hook(version)
            with self._committed:
                self.version = pb.Version(run=version.run, step=version.step)
                for key in [k for k in self.failures if k[0] == version.run and k[1] <= version.step]:
                    del self.failures[key]  # a retry of a failed version made it
                if self._pauses():  # what this update carried is whole again; the rest may not be
                    self.torn = set() if self._carrying is None else self.torn - self._carrying
                self.serving_ok = not self.torn
                self.held = False  # every rank of the deployment commits this version
                self._verifying = ""
                self._committed.notify_all()
        finally:
            if self._commit_gen & 1:
                self._commit_gen += 1  # even again: the version is set (or the commit failed)
            self.updating = False
            self._resume()
        log.info("inference worker %d: committed %s:%d", self.rank, version.run, version.step)

    async def _on_read(self, r: wpb.Read, cid: int) -> dict:
        if r.tensor not in self.tensors:
            return {}
        # Off the loop (the copy of a region takes a while, and may wait for a commit's copy to
        # end): the loop must keep answering meanwhile. The engine is never paused for it.
        await asyncio.get_running_loop().run_in_executor(None, self._read, r, cid)
        return {}

    def _read_region(self, r: wpb.Read) -> Box:
        """The region a Read asks for, in canonical coordinates (no offset and size: the whole tensor)."""
        shape = self.tensors[r.tensor].shape
        if not r.offset and not r.size:
            return Box.full(shape)
        region = Box(tuple(r.offset), tuple(r.size))  # LayoutError on a negative offset or size, or ranks that differ
        if not region.within(shape):
            raise ValueError(f"read region {region} of {r.tensor!r} lies outside its shape {list(shape)}")
        return region

    def _read_views(self, tensor: str, region: Box) -> list[tuple[Box, torch.Tensor]]:
        """(intersection, view of the live weights) for each box of `tensor` this rank holds that
        meets `region`; a tied tensor held by two buffers counts each box once."""
        out, seen = [], set()
        for name, desc in self.descs.items():
            for p in desc.pieces:
                if p.tensor != tensor or p.box in seen:
                    continue
                seen.add(p.box)
                inter = p.box.intersect(region)
                if inter is None or inter.numel == 0:
                    continue
                out.append((inter, p.view(self.live[name])[inter.slices_in(p.box)]))
        return out

    def _refuse_inplace(self) -> None:
        if self.updating and self._pauses():
            raise RuntimeError(f"inference rank {self.rank} is receiving an update in place ({self.staging}): its weights "
                               "are being overwritten and cannot be read back until the update ends")

    def _read(self, r: wpb.Read, cid: int) -> None:
        """Copy the region's intersections with this rank's boxes, then send them. No lock: a seqlock on
        the commit generation (odd while `_commit` copies shadow -> live and sets the version). A copy
        that overlapped a commit is made again, so a region is never torn and its version is the one
        it was copied under."""
        if not self.holds_copy:
            raise RuntimeError(f"inference rank {self.rank} stages {self.staging} and holds no copy of its weights (the engine "
                               "does): read them back from the engine, or stage inplace or shadow")
        self._refuse_inplace()
        region = self._read_region(r)
        dtype = dtype_of(self.tensors[r.tensor].dtype)  # a buffer that holds it cast sends the canonical dtype
        deadline = time.monotonic() + READ_LOCK_TIMEOUT
        for _ in range(READ_RETRIES):
            gen = self._commit_gen
            while gen & 1:  # a commit is copying into the live weights: wait for it to end
                if time.monotonic() > deadline:
                    raise RuntimeError(f"inference rank {self.rank}: a commit held its weights for "
                                       f"{READ_LOCK_TIMEOUT:.0f}s; read back later")
                time.sleep(READ_WAIT_S)
                gen = self._commit_gen
            self._refuse_inplace()
            version, ok = self.version, self.serving_ok
            views = self._read_views(r.tensor, region)  # after the commit: with flip, it swaps the copies
            copies = [(inter, v.to(device="cpu", dtype=dtype, memory_format=torch.contiguous_format, copy=True))
                      for inter, v in views]
            # An in-place transfer that began meanwhile writes into the weights just copied (one
            # that failed meanwhile left them torn: copied again, as they now stay).
            self._refuse_inplace()
            if self._commit_gen == gen and self.serving_ok == ok:
                break
        else:
            raise RuntimeError(f"inference rank {self.rank}: {READ_RETRIES} commits overlapped the read back of "
                               f"{r.tensor!r}; read back later")
        for i, (inter, t) in enumerate(copies):
            raw = t.reshape(-1).view(torch.uint8).numpy()
            for off in range(0, len(raw), READ_CHUNK):  # messages of READ_CHUNK bytes at most
                piece = wpb.ReadPiece(id=cid, offset=list(inter.offset), size=list(inter.size), byte_offset=off,
                                      data=raw[off : off + READ_CHUNK].tobytes(),
                                      last=i == len(copies) - 1 and off + READ_CHUNK >= len(raw))
                if version is not None:
                    piece.version.CopyFrom(version)
                self.emit(wpb.WorkerMessage(piece=piece))
