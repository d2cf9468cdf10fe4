"""The worker library's shared core, embedded in the user's process (one per GPU).

A worker runs its own event loop (uvloop) on a background thread: it never
touches the host program's loop or event-loop policy. It opens one gRPC stream
to its controller, answers commands, and runs data-plane work on a separate
thread so the loop keeps answering while bytes move.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import os
import threading
import time

import grpc
import torch

from reshard.common.control import faults, tracing
from reshard.common.control.logs import set_update
from reshard.common.control.methods import RESHARD, transfer_method
from reshard.common.control.rpc import CHANNEL_OPTIONS, keep_task, new_event_loop, parse_target
from reshard.common.control.security import Security
from reshard.common.control.supervisor import CONTROLLER_PID_KEY
from reshard.common.dataplane.backend import buffers_device, device_uuid, plan_options
from reshard.common.dataplane.engine import StagingPool
from reshard.common.dataplane.rank_update import RankUpdate
from reshard.common.dataplane.transport import Transport, TransportError, transport_class
from reshard.common.layout.core import Layout, LayoutError, LocalBuffer, TensorSpec, dtype_of
from reshard.common.layout.wire import layout_bytes, layout_from_bytes
from reshard.common.plan.cache import BuildOnceLRU, PlanCache
from reshard.common.plan.planner import Plan
from reshard.common.plan.verify import sender_report
from reshard.proto import reshard_pb2 as pb
from reshard.proto import worker_pb2 as wpb
from reshard.proto import worker_pb2_grpc as wgrpc

log = logging.getLogger("reshard.worker")

# Reconnecting to a lost controller: the first try at once plus this, doubling up to the cap (a
# restarted controller is back within about a second; the worker's own attempts add at most 0.5 s).
RECONNECT_MIN_S, RECONNECT_MAX_S = 0.1, 0.5
# What a controller answers a hello it will not take (the rank is held, or the rank, world or role
# does not fit its deployment): the worker is refused, not unreachable (`refused`, `wait_connected`).
REFUSALS = frozenset({grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.INVALID_ARGUMENT,
                      grpc.StatusCode.FAILED_PRECONDITION})
# Messages queued for the controller, besides publishes, before the worker gives its stream up as
# unread (a frozen controller, say): heartbeats and byte counts are merged while they wait, so only
# replies, transfer reports and read-back pieces count, and a controller that reads never comes near.
OUT_LIMIT = 1024
ABORTED_KEPT = 256  # the ids of the last aborted updates (an abort may come before its update's prepare)


class RecentIds:
    """A set of the last `size` ids added: the oldest is forgotten first."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._ids: collections.OrderedDict[str, None] = collections.OrderedDict()

    def add(self, key: str) -> None:
        self._ids[key] = None
        self._ids.move_to_end(key)
        while len(self._ids) > self.size:
            self._ids.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        return key in self._ids

    def __len__(self) -> int:
        return len(self._ids)


_LAYOUTS: BuildOnceLRU[Layout] = BuildOnceLRU(8)  # fingerprint -> Layout, shared by the workers of a process
_PLANS = PlanCache(8)  # the plans of this process's workers (common/plan/cache.py: the controllers' kind)


def _layout(fingerprint: str, data: bytes, what: str) -> Layout:
    if not fingerprint:
        return layout_from_bytes(data)
    if not data:
        if fingerprint not in _LAYOUTS:
            raise LayoutError(f"the {what} layout {fingerprint} is not known to this worker; its controller must send it")
    return _LAYOUTS.get(fingerprint, lambda: layout_from_bytes(data))


_RANK_LAYOUTS: collections.OrderedDict = collections.OrderedDict()  # ids of buffers -> (buffers, bytes)
_RANK_LAYOUTS_LOCK = threading.Lock()


def rank_layout_bytes(tensors: dict[str, TensorSpec], buffers: list[LocalBuffer], allow_casts: bool = False,
                      receive_window: int = 0) -> bytes:
    """One rank's layout as its hello carries it. Workers of one process that hold the same
    buffer objects (replicas built from one layout) share the encoding."""
    key = (tuple(map(id, buffers)), id(tensors), allow_casts, receive_window)
    with _RANK_LAYOUTS_LOCK:
        hit = _RANK_LAYOUTS.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], buffers)) and hit[1] is tensors:
        return hit[2]
    used = {p.tensor for b in buffers for p in b.pieces}
    data = layout_bytes(Layout({n: t for n, t in tensors.items() if n in used}, (tuple(buffers),), allow_casts=allow_casts,
                                     receive_window=receive_window))
    with _RANK_LAYOUTS_LOCK:
        _RANK_LAYOUTS[key] = (tuple(buffers), tensors, data)  # the references keep the ids from being reused
        while len(_RANK_LAYOUTS) > 16:
            _RANK_LAYOUTS.popitem(last=False)
    return data


class WorkerBase:
    """Common machinery of TrainerWorker and InferenceWorker."""

    role = "?"
    side = "?"  # src | dst
    heartbeat_s = 0.5  # between heartbeats (the controller flags a worker silent for its worker timeout)

    def __init__(self, controller: str, rank: int, world: int, tensors: dict[str, TensorSpec],
                 buffers: dict[str, tuple[LocalBuffer, torch.Tensor]], *, model: str = "",
                 fault: dict[str, float] | None = None, allow_casts: bool = False, security: Security | None = None) -> None:
        parse_target(controller, "controller address")  # its worker listener: HOST:PORT or unix:/PATH
        # TLS and the worker token: given, or from RESHARD_TLS_* and RESHARD_TOKEN_FILE / RESHARD_TOKEN_WORKER.
        self.security = security or Security.from_env()
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside a world of {world}")
        for name, (desc, t) in buffers.items():
            if tuple(t.shape) != desc.shape or t.dtype != dtype_of(desc.dtype):
                raise ValueError(f"buffer {name!r}: tensor is {tuple(t.shape)} {t.dtype}, layout says {desc.shape} {desc.dtype}")
            if not t.is_contiguous():
                raise ValueError(f"buffer {name!r} must be contiguous")
        self.controller, self.rank, self.world, self.model = controller, rank, world, model
        self.allow_casts = allow_casts  # buffers may hold tensors in another dtype (cast on the sender)
        self.receive_window = 0  # a destination that stages bounded: what it may hold of an update at once
        self.tensors = tensors
        self.descs = {n: d for n, (d, _) in buffers.items()}
        self.live = {n: t for n, (_, t) in buffers.items()}
        self.shapes = {n: t.shape for n, t in tensors.items()}
        self.version: pb.Version | None = None
        self.fault = fault or {}
        self.device = buffers_device(self.live.values())  # cpu | cuda:N: reported in hello, picks the backend
        self.device_uuid = device_uuid(self.device)  # its GPU, the same in every process: colocated ranks use CUDA IPC
        self._pool = StagingPool(self.device)
        self.memory: dict[str, int] = {}  # the last memory report (bytes by category)
        self._mem_high = 0
        self._prepared: tuple[str, Plan, Layout] | None = None  # (update id, plan, destination layout)
        self._landed: tuple[str, dict] = ("", {})  # receiver: (update id, sums per piece of what landed)
        self._sessions: dict[str, Transport] = {}  # one per attached deployment
        self._update_session: dict[str, str] = {}
        self._dp = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"reshard-{self.role}{rank}-dp")
        self._aborted = RecentIds(ABORTED_KEPT)
        self._current: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._out: asyncio.Queue | None = None
        self._queued_heartbeat: wpb.WorkerMessage | None = None  # one waiting in _out: a newer one updates it
        self._queued_progress: dict[str, wpb.WorkerMessage] = {}  # update id -> its byte count waiting in _out
        self._shedding = ""  # why the stream is being given up (its controller stopped reading it)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._call = None
        self._connected = threading.Event()
        self._emit_lock = threading.Lock()  # orders messages emitted before the loop runs before later ones
        self._early: list[wpb.WorkerMessage] = []  # emitted before the loop's queue existed
        self._tasks: set[asyncio.Task] = set()  # asyncio keeps only weak references to tasks
        self.last_error = ""
        self.controller_pid = 0  # the controller process this worker attached to last (0: not known)
        self.refused = False  # the controller refused its hello: another process holds this rank
        self._refusal_logged = False
        self._instance = os.urandom(16)  # proves a reattach is this worker (hello.instance); never shown
        self.requests_served = 0
        self.requests_during_update = 0
        self.requests_by_version: dict[str, int] = {}

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> "WorkerBase":
        self._thread = threading.Thread(target=self._run_loop, name=f"reshard-{self.role}{self.rank}", daemon=True)
        self._thread.start()
        return self

    def wait_connected(self, timeout: float = 30.0) -> bool:
        """True once a controller accepted this worker for its rank; False at the timeout, or as soon as
        the controller refuses the rank (another worker holds it: `last_error` says which)."""
        deadline = time.monotonic() + timeout
        while not self._connected.wait(min(0.05, max(0.0, deadline - time.monotonic()))):
            if self.refused or time.monotonic() >= deadline:
                return False
        return True

    def stop(self) -> None:
        self._stopping = True
        if self._loop and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._wake_stop)
        if self._thread:
            self._thread.join(10)
        # Close the data-plane sessions here, not at interpreter exit: a gloo group torn down then
        # (its threads still joinable) aborts the process ("terminate called without an active
        # exception").
        sessions = list(self._sessions.values())
        self._sessions.clear()
        self._dp.shutdown(wait=False, cancel_futures=True)
        for t in sessions:
            try:
                t.close()
            except Exception as e:  # noqa: BLE001 - stopping anyway
                log.debug("%s worker %d: closing a session: %s", self.role, self.rank, e)

    def _wake_stop(self) -> None:
        if self._out is not None:
            self._out.put_nowait(None)
        if self._call is not None:
            self._call.cancel()

    def _run_loop(self) -> None:
        loop = new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        finally:
            loop.close()

    def _spawn(self, coro) -> asyncio.Task:
        """A task on this worker's loop, referenced until it ends."""
        return keep_task(self._tasks, coro)

    async def _main(self) -> None:
        with self._emit_lock:
            self._out = asyncio.Queue()  # survives reconnects: what is queued waits for the next stream
            for m in self._early:
                self._enqueue(m)
            self._early.clear()
        backoff = RECONNECT_MIN_S
        warned = False  # this outage was logged: its further failed attempts go to the debug log
        while not self._stopping:
            try:
                await self._serve_stream()
            except asyncio.CancelledError:
                if self._stopping:
                    break
                if not self._shedding:
                    raise
                log.warning("%s worker %d: %s; reconnecting", self.role, self.rank, self._shedding)
            except (grpc.aio.AioRpcError, OSError) as e:
                if self._stopping:
                    break
                if self._connected.is_set():
                    warned = False  # the stream had been accepted: a new outage begins
                level = logging.DEBUG if warned else logging.WARNING
                warned = True
                code = e.code() if isinstance(e, grpc.aio.AioRpcError) else None
                if code in REFUSALS:
                    # Another worker holds this rank there (an orphan that came too late, a second replica
                    # with the same ranks), or the rank, world or role does not fit that deployment: said
                    # once; it tries again in case the holder goes away or the controller is redeployed.
                    self.refused = True
                    self.last_error = f"controller {self.controller} refused this rank: {e.details()}"
                    if not self._refusal_logged:
                        self._refusal_logged = True
                        log.error("%s worker %d: %s", self.role, self.rank, self.last_error)
                elif code == grpc.StatusCode.UNIMPLEMENTED:
                    log.log(level, "%s worker %d: %s serves no worker protocol: point the worker at the controller's "
                            "worker listener (--worker-listen; printed when it starts and in `reshard status`); retrying",
                            self.role, self.rank, self.controller)
                else:
                    log.log(level, "%s worker %d: controller %s unreachable (%s); retrying", self.role, self.rank,
                            self.controller, e.details() if isinstance(e, grpc.aio.AioRpcError) else e)
            self._shedding = ""
            if self._connected.is_set():
                backoff = RECONNECT_MIN_S  # it had been accepted: the controller went away just now
            self._connected.clear()
            if self._stopping:
                break
            self.on_controller_lost()
            # Whatever the lost controller started cannot finish (its store, its commit): stop it, so
            # the data-plane thread is free for the next controller's first update.
            self._abort_in_flight(f"the connection to controller {self.controller} was lost")
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, RECONNECT_MAX_S)

    async def _serve_stream(self) -> None:
        hello = wpb.Hello(rank=self.rank, world=self.world, pid=os.getpid(), role=self.role, model=self.model,
                          rank_layout=rank_layout_bytes(self.tensors, list(self.descs.values()), self.allow_casts,
                                                        self.receive_window),
                          device=self.device, device_uuid=self.device_uuid, instance=self._instance,
                          staging=getattr(self, "staging", ""))
        if self.version is not None:
            hello.version.CopyFrom(self.version)
            hello.has_version = True

        async def outgoing():
            yield wpb.WorkerMessage(hello=hello)
            while True:
                m = await self._out.get()
                if m is None:
                    return
                if m is self._queued_heartbeat:
                    self._queued_heartbeat = None
                elif m.WhichOneof("kind") == "progress" and self._queued_progress.get(m.progress.update_id) is m:
                    del self._queued_progress[m.progress.update_id]
                yield m

        async with self.security.channel(self.controller, CHANNEL_OPTIONS) as ch:
            stub = wgrpc.WorkerControlStub(ch)
            call = stub.Attach(outgoing())
            self._call = call
            md = dict(await call.initial_metadata() or ())
            pid = str(md.get(CONTROLLER_PID_KEY, ""))
            if pid.isdigit():
                # Accepted by a controller for this rank (it sends this only then; a call that failed, or
                # nothing listening, leaves the metadata empty): the controller that took this worker (a
                # restarted one adopts its predecessor's).
                self.controller_pid = int(pid)
                self.refused = False
                self._refusal_logged = False
                self._connected.set()
            # Otherwise the call's status comes with its first read below (refused, unreachable).
            hb = asyncio.get_running_loop().create_task(self._heartbeats())
            try:
                async for cmd in call:
                    self._spawn(self._handle(cmd))
            finally:
                hb.cancel()

    async def _heartbeats(self) -> None:
        while True:
            self.emit(self._heartbeat())
            await asyncio.sleep(self.heartbeat_s)

    def _heartbeat(self) -> wpb.WorkerMessage:
        hb = wpb.Heartbeat(requests_served=self.requests_served, requests_during_update=self.requests_during_update,
                           requests_by_version=self.requests_by_version)
        if self.version is not None:
            hb.version.CopyFrom(self.version)
            hb.has_version = True
        return wpb.WorkerMessage(heartbeat=hb)

    def emit(self, msg: wpb.WorkerMessage) -> None:
        """Queue a message to the controller (from any thread). Nothing is dropped: a message
        emitted before the worker's loop runs (or while it reconnects) waits in order."""
        with self._emit_lock:
            loop, out = self._loop, self._out
            if loop is None or out is None:
                self._early.append(msg)
                return
        if threading.current_thread() is self._thread:
            self._enqueue(msg)
        else:
            try:
                loop.call_soon_threadsafe(self._enqueue, msg)
            except RuntimeError:  # the loop closed: the worker stopped
                raise RuntimeError(f"{self.role} worker {self.rank} is stopped") from None

    def _enqueue(self, msg: wpb.WorkerMessage) -> None:
        """On the worker's loop: queue a message for the controller. A heartbeat, or a transfer's byte
        count, that still waits in the queue is brought up to date instead of queued again: a
        controller that stops reading (frozen) does not make the queue grow with time. Anything else
        (replies, transfer reports, read-back pieces) is never dropped while the stream lives: past
        OUT_LIMIT of them, the stream is given up (its controller sees this worker gone and fails
        what it waits for; the worker aborts what that controller started) and only publishes are
        kept for the next stream."""
        kind = msg.WhichOneof("kind")
        if kind == "heartbeat" and self._queued_heartbeat is not None:
            self._queued_heartbeat.CopyFrom(msg)
            return
        if kind == "progress" and not msg.progress.connected:
            queued = self._queued_progress.get(msg.progress.update_id)
            if queued is not None:
                queued.CopyFrom(msg)
                return
        if kind != "published" and self._out.qsize() >= OUT_LIMIT:
            self._shed(f"controller {self.controller} did not read its last {OUT_LIMIT} messages")
            return
        if kind == "heartbeat":
            self._queued_heartbeat = msg
        elif kind == "progress" and not msg.progress.connected:
            self._queued_progress[msg.progress.update_id] = msg
        self._out.put_nowait(msg)

    def _shed(self, why: str) -> None:
        """Give the stream up: what it queued goes with it, but publishes (and a stop) wait for the next."""
        kept = []
        while not self._out.empty():
            m = self._out.get_nowait()
            if m is None or m.WhichOneof("kind") == "published":
                kept.append(m)
        for m in kept:
            self._out.put_nowait(m)
        self._queued_heartbeat = None
        self._queued_progress.clear()
        if self._call is not None and not self._call.done() and not self._shedding:
            self._shedding = why
            self._call.cancel()

    # -- commands ------------------------------------------------------------------------
    async def _handle(self, cmd: wpb.ControllerMessage) -> None:
        kind = cmd.WhichOneof("command")
        t0 = time.perf_counter()
        span = None
        if cmd.trace:  # traced: this command's span, a child of the controller's phase (a transfer's parent too)
            span = tracing.start(f"{self.role}-worker.{kind}", cmd.trace, self._span_attributes())
            tracing.set_current(span)
        try:
            handler = getattr(self, f"_on_{kind}")
            extra = await handler(getattr(cmd, kind), cmd.id)
            reply = wpb.Reply(id=cmd.id, ok=True, seconds=time.perf_counter() - t0, **(extra or {}))
        except Exception as e:  # noqa: BLE001 - every failure goes back to the controller
            log.debug("%s worker %d: %s failed", self.role, self.rank, kind, exc_info=True)
            reply = wpb.Reply(id=cmd.id, ok=False, error=f"{type(e).__name__}: {e}" if not isinstance(e, (LayoutError, TransportError)) else str(e))
        tracing.end(span, reply.error)
        if kind not in ("abort", "release", "serve"):  # sent without waiting for a reply
            self.emit(wpb.WorkerMessage(reply=reply))

    def _span_attributes(self) -> dict:
        return {"reshard.role": self.role, "reshard.rank": self.rank}

    async def _on_abort(self, a: wpb.Abort, cid: int) -> None:
        self._aborted.add(a.update_id)
        log.warning("%s worker %d: update %s aborted: %s", self.role, self.rank, a.update_id, a.reason)
        self._drop_session(a.update_id, f"update {a.update_id} aborted: {a.reason}")
        self.on_abort(a.update_id)

    def on_abort(self, update_id: str) -> None:
        pass

    def on_controller_lost(self) -> None:
        """The stream to the controller ended (its process died, say); it reconnects next."""

    def _abort_in_flight(self, why: str) -> None:
        uid = self._current
        if uid and uid not in self._aborted:
            self._aborted.add(uid)
            log.warning("%s worker %d: update %s aborted: %s", self.role, self.rank, uid, why)
            self._drop_session(uid, f"update {uid} aborted: {why}")
            self.on_abort(uid)

    def _drop_session(self, update_id: str, abort: str = "") -> None:
        """Forget the update's session: one that failed or was aborted is never reused. With `abort`
        (the reason), abort it first, from a thread of its own: the data-plane thread may be blocked in it."""
        t = self._sessions.pop(self._update_session.get(update_id, ""), None)
        if t is None:
            return
        if abort:
            threading.Thread(target=t.abort, args=(abort,), name=f"reshard-{self.role}{self.rank}-abort",
                             daemon=True).start()
        # Close on the data-plane thread, after whatever it still runs there.
        self._dp.submit(t.close)

    async def _on_nccl_unique_id(self, u: wpb.NcclUniqueId, cid: int) -> dict:
        """Make the ncclUniqueId of a new NCCL session: this process hosts its bootstrap root."""
        from reshard.common.dataplane.nccl import NcclUnavailable, load_library

        def make() -> bytes:
            try:
                return load_library().unique_id()
            except NcclUnavailable as e:
                raise TransportError(f"{self.role} rank {self.rank} cannot make an NCCL session id: {e}") from None

        uid = await asyncio.get_running_loop().run_in_executor(None, make)
        log.debug("%s worker %d: ncclUniqueId for session %s", self.role, self.rank, u.session)
        return {"nccl_unique_id": uid}

    async def _on_prepare(self, p: wpb.Prepare, cid: int) -> dict:
        set_update(p.update_id, p.version)  # this task's log lines (and its transfer's) name the update
        faults.at_phase(f"{self.role}-worker", "CONNECT", self.rank)
        loop = asyncio.get_running_loop()
        opts = plan_options(p.bucket_bytes, p.session.transport)
        subset = set(p.tensors) if p.tensors else None
        method = p.method or RESHARD
        if method != RESHARD:
            transfer_method(method)  # known here, or the update fails before any byte moves
            if subset is not None:
                raise LayoutError(f"transfer method {method!r} moves whole models: it takes no partial updates")
        # Layouts and plans are kept per fingerprint (a trainer feeding two deployments keeps both),
        # and built off the loop, once per process.
        src, dst = await asyncio.gather(loop.run_in_executor(None, _layout, p.src_fingerprint, p.src_layout, "source"),
                                        loop.run_in_executor(None, _layout, p.dst_fingerprint, p.dst_layout, "destination"))
        plan = await loop.run_in_executor(None, _PLANS.plan, src, dst, opts, subset)
        if method == RESHARD and plan.digest != p.plan_digest:
            raise LayoutError(f"plan digest mismatch on {self.role} rank {self.rank}: {plan.digest} != {p.plan_digest}")
        self._prepared = (p.update_id, plan, dst)
        await loop.run_in_executor(None, self.before_transfer, p)  # may wait for the engine's step (a lock)
        self._current = p.update_id
        total = plan.send_bytes(self.rank) if self.side == "src" else plan.recv_bytes(self.rank)
        self._spawn(self._transfer(p, plan, src, dst))
        return {"bytes_total": total}

    def before_transfer(self, p: wpb.Prepare) -> None:
        pass

    def transfer_buffers(self) -> dict[str, torch.Tensor]:
        return self.live

    def with_derived(self, src: Layout, buffers: dict[str, torch.Tensor], plan: Plan):
        """(buffers, canonical shapes, what runs before the first byte or None) of this update: a
        sender adds the buffers it derives (block FP8)."""
        return buffers, self.shapes, None

    def after_round(self, rnd: int) -> None:
        """On the data-plane thread, after this rank's `rnd`-th round of bytes landed (a subclass's hook)."""

    def sums_as_landed(self) -> bool:
        """Whether the engine sums what a destination receives as it lands (VERIFY compares those)."""
        return True

    def received_sums(self, sums: dict) -> dict:
        """The sums VERIFY compares, from what the transfer returned (a subclass may add its own)."""
        return sums

    async def _transfer(self, p: wpb.Prepare, plan: Plan, src: Layout, dst: Layout) -> None:
        loop = asyncio.get_running_loop()
        done = wpb.TransferDone(update_id=p.update_id)
        t0 = time.perf_counter()
        parent = tracing.current()  # the prepare's span, when traced
        span = tracing.start(f"{self.role}-worker.transfer", parent, self._span_attributes()) if parent is not None else None
        try:
            sums, nbytes, csum_s = await loop.run_in_executor(self._dp, self._measured_transfer, p, plan, src, dst)
            done.ok, done.bytes, done.checksum_seconds = True, nbytes, csum_s
            done.memory.update(self.memory)
            if self.side == "src" and sums:  # a source rank's sums per destination piece, as (slot, value) pairs
                done.checksums.CopyFrom(sender_report(plan, sums, strict=not p.method or p.method == RESHARD))
            elif self.side == "dst":  # what landed, summed as it landed: VERIFY compares these
                self._landed = (p.update_id, self.received_sums(sums))
        except Exception as e:  # noqa: BLE001
            log.warning("%s worker %d: transfer of %s failed: %s", self.role, self.rank, p.update_id, e)
            self._drop_session(p.update_id)
            done.ok, done.error = False, str(e) if isinstance(e, TransportError) else f"{type(e).__name__}: {e}"
            self.last_error = done.error
        done.seconds = time.perf_counter() - t0
        tracing.end(span, done.error, {"reshard.bytes": done.bytes})
        self.emit(wpb.WorkerMessage(done=done))

    def _transport(self, s: pb.Session, timeout: float, update_id: str = "") -> Transport:
        t = self._sessions.get(s.id)
        if t is not None:
            return t
        while len(self._sessions) >= 8:  # deployments detached long ago
            self._sessions.pop(next(iter(self._sessions))).close()
        rank = self.rank if self.side == "src" else s.src_world + self.rank

        def connecting(t: Transport) -> None:
            self._sessions[s.id] = t  # from here on, an abort of the update reaches it while it joins
            if update_id in self._aborted:  # the abort came first and found no session
                t.abort(f"update {update_id} aborted")

        return transport_class(s.transport or "gloo").for_session(s, rank, s.src_world + s.dst_world, timeout,
                                                                  device=self.device, on_connecting=connecting)

    def memory_report(self) -> dict[str, int]:
        """This rank's memory by category, bytes: the staging pool, shadow buffers (inference),
        snapshot (trainer), NCCL's connection buffers, and on CUDA the allocator's peak above
        its level before an update, for the first update (connections being set up) and the last."""
        rep = {"staging": self._pool.nbytes}
        for name in ("shadow", "snapshot"):
            held = getattr(self, name, None)
            if held is not None:
                rep[name] = sum(t.numel() * t.element_size() for t in held.values())
        t = self._sessions.get(next(iter(self._update_session.values()), ""))
        if t is not None and t.connection_bytes:
            rep["nccl"] = int(t.connection_bytes)
        return rep

    def _measured_transfer(self, p: wpb.Prepare, plan: Plan, src: Layout, dst: Layout):
        """On the data-plane thread: `_run_transfer`, and the memory it took."""
        cuda = self.device.startswith("cuda")
        if cuda:  # sampled at round boundaries: resetting torch's peak statistics would clobber the host's
            torch.cuda.set_device(self.device)
            base = self._mem_high = torch.cuda.memory_allocated(self.device)
        first = not self.memory  # no update has finished on this rank yet
        out = self._run_transfer(p, plan, src, dst)
        rep = self.memory_report()
        if cuda:
            rep["update_peak"] = max(self._mem_high, torch.cuda.memory_allocated(self.device)) - base
        if first:
            if "update_peak" in rep:
                rep["first_update_peak"] = rep["update_peak"]
            if "nccl" in rep:
                rep["first_update_nccl"] = rep["nccl"]
        else:
            rep.update({k: v for k, v in self.memory.items() if k.startswith("first_update")})
        self.memory = rep
        return out

    def _run_transfer(self, p: wpb.Prepare, plan: Plan, src: Layout, dst: Layout):
        """On the data-plane thread: connect (or reuse) the session and move this rank's bytes."""
        deadline = time.monotonic() + p.timeout_s
        if p.update_id in self._aborted:
            raise TransportError(f"update {p.update_id} was aborted")
        self._update_session = {p.update_id: p.session.id}
        t_connect = time.monotonic()
        transport = self._transport(p.session, p.timeout_s, p.update_id)
        buffers, shapes, prelude = self.with_derived(src, self.transfer_buffers(), plan)

        def connected() -> None:  # the CONNECT phase ends on the controller when every rank said so
            self.emit(wpb.WorkerMessage(progress=wpb.Progress(update_id=p.update_id, connected=True,
                                                              connect_seconds=time.monotonic() - t_connect)))
        last = [0.0]

        cuda = self.device.startswith("cuda")

        def progress(done: int, total: int) -> None:
            if cuda:
                self._mem_high = max(self._mem_high, torch.cuda.memory_allocated(self.device))
            now = time.monotonic()
            if now - last[0] > 0.1 or done == total:
                last[0] = now
                self.emit(wpb.WorkerMessage(progress=wpb.Progress(update_id=p.update_id, bytes_done=done, bytes_total=total)))

        slow_after = int(self.fault.get("slow_after", -1))
        slow_seconds = float(self.fault.get("slow_seconds", 0))
        if self.fault.get("once"):  # the first update this rank transfers, whether or not it gets that far
            self.fault = {k: v for k, v in self.fault.items() if k not in ("slow_after", "slow_seconds", "once")}

        def hook(rnd: int) -> None:
            faults.at_phase(f"{self.role}-worker", "TRANSFER", self.rank)  # after a round of bytes
            if rnd == slow_after:  # a data plane that stalls while the control plane still answers
                until = time.monotonic() + slow_seconds
                while time.monotonic() < until and p.update_id not in self._aborted:
                    time.sleep(0.05)
            if p.update_id in self._aborted:
                raise TransportError(transport.aborted or f"update {p.update_id} aborted")
            self.after_round(rnd)

        if p.method and p.method != RESHARD:  # a tool's method (checked known at prepare)
            if not transport.moves_messages_between_all_pairs:
                raise TransportError(f"transfer method {p.method!r} sends messages between every pair of ranks, and a "
                                     f"{transport.name} session (workers sharing GPUs) has none between ranks on one GPU")
            connected()
            return transfer_method(p.method)(self.side, transport, p.session, self.rank, src, dst, buffers, shapes,
                                             self._pool, deadline, progress, timeout=p.timeout_s)
        # Whatever the session's backend: its transport moves this rank's share (gloo and NCCL by messages,
        # through the engine; CUDA IPC and hybrid sessions their own way).
        return transport.run_update(RankUpdate(p.update_id, plan, self.side, self.rank, buffers, shapes, dst,
                                               self._pool, deadline, connected=connected, progress=progress, hook=hook,
                                               sums_as_landed=self.sums_as_landed(), prelude=prelude))

    def prepared(self, update_id: str) -> tuple[Plan, Layout]:
        """The plan and destination layout of the update this rank prepared last."""
        if self._prepared is None or self._prepared[0] != update_id:
            raise LayoutError(f"{self.role} rank {self.rank} has not prepared update {update_id}")
        return self._prepared[1], self._prepared[2]
