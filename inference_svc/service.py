"""inference_svc: the inference deployment's controller.

Exposes the deployment's layout, takes part in updates (validate, plan, receive,
verify, commit on all ranks or none), reports what it serves, and reassembles
canonical tensors for operators (`Dump`)."""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import sys
import time
import uuid

import grpc

from reshard.common.control import faults, tracing
from reshard.common.control.hub import WorkerConn, WorkerError, WorkerHub, serve_controller
from reshard.common.control.logs import set_update
from reshard.common.control.phases import FINISHING, TERMINAL, Phase
from reshard.common.control.rpc import Deadlines, clamp_timeout, keep_task, run_main
from reshard.common.control.security import current as current_security
from reshard.common.control.supervisor import module_command
from reshard.common.dataplane.backend import plan_options
from reshard.common.layout.core import Layout, LayoutError, dtype_of
from reshard.common.layout.wire import layout_fingerprint, layout_from_bytes
from reshard.common.plan import verify
from reshard.common.plan.cache import PlanCache
from reshard.common.plan.planner import Plan
from reshard.inference_svc.stagings import TEARS
from reshard.proto import reshard_pb2 as pb
from reshard.proto import reshard_pb2_grpc as rgrpc
from reshard.proto import worker_pb2 as wpb

log = logging.getLogger("reshard.inference_svc")

DUMP_CHUNK = 1 << 20  # bytes of one DumpChunk
DUMP_REGION_BYTES = 4 << 20  # a dump reads, assembles and streams the tensor this many bytes at a time
MAX_CONCURRENT_DUMPS = 2  # dumps streaming at once from one controller; one more is refused (RESOURCE_EXHAUSTED)


def _v(version: pb.Version | None) -> str:
    return f"{version.run}:{version.step}" if version is not None else "none"


class _Update:
    def __init__(self, req: pb.BeginUpdateRequest, world: int) -> None:
        self.id, self.version, self.method = req.update_id, req.version, req.method or "reshard"
        self.phase = Phase.NEGOTIATE
        self.started = time.monotonic()
        self.deadline = self.started + (req.timeout_s or 120.0)
        self.done: dict[int, wpb.TransferDone] = {}
        self.progress: dict[int, int] = {}
        self.bytes_total = 0
        self.error = ""
        self.changed = asyncio.Event()
        self.world = world
        self.requests_at_start = 0
        self.tensors = 0
        self.names: set[str] | None = set(req.tensors) if req.tensors else None  # what it carries (None: all)
        self.all_names: tuple[str, ...] = ()  # every tensor of the deployment's layout
        self.begin_reply: pb.BeginUpdateReply | None = None  # a retried BeginUpdate gets it again
        self.note = ""  # recorded with the outcome (a rollback the operator allowed)
        self.finish: asyncio.Task | None = None  # verify + commit, run once whoever asks
        self.plan: Plan | None = None
        self.trace = None  # the trainer's trace context (from BeginUpdate's metadata), when tracing is on
        self.span = None  # this phase's span in it


def _read_epoch(path: str) -> int:
    if not path:
        return 0
    try:
        with open(path) as f:
            return max(0, int(f.read().strip() or 0))
    except FileNotFoundError:
        return 0
    except (OSError, ValueError) as e:
        raise RuntimeError(f"the epoch file {path} cannot be read ({e}): remove it to start fencing afresh") from None


def _write_epoch(path: str, epoch: int) -> None:
    if not path:
        return
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"{epoch}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


MAX_NAME = 256  # run names, tensor names and patterns
MAX_STEP = 1 << 53  # steps: exact in every JSON reader
MAX_WORLD = 1 << 20
MAX_TENSORS = 1 << 20


def _ident_ok(s: str) -> bool:
    return 0 < len(s) <= 64 and all(c.isascii() and (c.isalnum() or c in "-_.") for c in s)


def _bucket_ok(bucket_bytes: int, transport: str) -> bool:
    try:
        plan_options(bucket_bytes, transport)
    except ValueError:
        return False
    return True


class _UnknownSource(Exception):
    """BeginUpdate named a source layout by fingerprint that this controller does not hold."""


class _Aborted(Exception):
    """The update was aborted (a worker died or froze) while a call still prepared it."""


class _Failed(Exception):
    """An update failed; the message says why (recorded for retried calls)."""


class InferenceController(rgrpc.InferenceServiceServicer):
    def __init__(self, hub: WorkerHub, model: str, deadlines: Deadlines, epoch_file: str = "") -> None:
        self.hub, self.model, self.deadlines = hub, model, deadlines
        hub.on_event = self._on_event
        hub.on_disconnect = self._on_disconnect
        hub.on_attach = self._on_attach
        hub.on_stale = self._on_stale
        self.update: _Update | None = None
        self.committed: pb.Version | None = None
        self.history: list[pb.UpdateRecord] = []
        self.last_error = ""
        self._sources: collections.OrderedDict[str, tuple[Layout, bytes]] = collections.OrderedDict()  # by fingerprint
        self._plans = PlanCache(4)
        self._lock = asyncio.Lock()
        self.torn: set[str] = set()  # tensors a failed in-place update left half-written: not served until carried again
        self.instance = uuid.uuid4().hex[:8]  # a restarted controller is a new membership
        self.finished: collections.OrderedDict[str, tuple[pb.FinishUpdateReply | None, str]] = collections.OrderedDict()
        self._tasks: set[asyncio.Task] = set()
        self.epoch_file = epoch_file  # where the newest epoch granted is kept across restarts ('' : memory only)
        self.epoch = _read_epoch(epoch_file)  # the newest epoch granted to a trainer controller: only it may push
        self._dumps = 0  # dumps streaming now: at most MAX_CONCURRENT_DUMPS
        self._staging_said = ""  # how the workers stage, as last logged
        self._dump_buffers: list = []  # (region bytes, coverage) buffers, one per dump streaming at once

    # -- state -----------------------------------------------------------------------------
    async def _source_layout(self, req: pb.BeginUpdateRequest) -> tuple[Layout, bytes]:
        """The trainer's layout and its bytes: sent with its first BeginUpdate, then named by fingerprint."""
        fp = req.src_fingerprint
        if fp and fp in self._sources:
            self._sources.move_to_end(fp)
            return self._sources[fp]
        if not req.src_layout:
            raise _UnknownSource(f"source layout {fp or '(no fingerprint)'} is not held here: send it")
        src = await asyncio.get_running_loop().run_in_executor(None, layout_from_bytes, req.src_layout)
        if fp:
            self._sources[fp] = (src, req.src_layout)
            while len(self._sources) > 4:
                self._sources.popitem(last=False)
        return src, req.src_layout

    async def _plan(self, src: Layout, dst: Layout, req: pb.BeginUpdateRequest) -> Plan:
        """The update's plan, kept by what determines it: planned off the loop, once."""
        opts = plan_options(req.bucket_bytes, req.session.transport)
        subset = set(req.tensors) if req.tensors else None
        return await asyncio.get_running_loop().run_in_executor(None, self._plans.plan, src, dst, opts, subset)

    def _on_event(self, conn: WorkerConn, msg: wpb.WorkerMessage) -> None:
        u = self.update
        kind = msg.WhichOneof("kind")
        if u is None:
            return
        if kind == "progress" and msg.progress.update_id == u.id:
            u.progress[conn.rank] = msg.progress.bytes_done
        elif kind == "done" and msg.done.update_id == u.id:
            u.done[conn.rank] = msg.done
            if not msg.done.ok and not u.error:
                u.error = f"inference rank {conn.rank}: {msg.done.error}"
            u.changed.set()

    def _on_attach(self, conn: WorkerConn) -> None:
        self._reconcile()
        if self.hub.complete():
            stagings: dict[str, list[int]] = {}
            for w in self.hub.alive():
                stagings.setdefault(w.hello.staging or "unknown", []).append(w.rank)
            said = "; ".join(f"{m} on ranks {r}" for m, r in sorted(stagings.items()))
            if said != self._staging_said:  # said once per change, where it applies: what the workers do
                self._staging_said = said
                log.info("workers stage updates: %s", said)

    @property
    def inplace(self) -> bool:
        """Whether a failed transfer tears what ranks serve: some worker receives in place."""
        return any(w.hello.staging in TEARS for w in self.hub.alive())

    def _on_disconnect(self, conn: WorkerConn) -> None:
        u = self.update
        if u is not None and u.phase not in TERMINAL:
            why = f"inference worker rank {conn.rank} (pid {conn.pid}) died during the update"
            u.error = u.error or why
            u.changed.set()
            if u.finish is None and u.phase != Phase.NEGOTIATE:  # as for a frozen worker: abort now, the cause on record
                keep_task(self._tasks, self._abort(u, u.error))
        self._reconcile()

    def _on_stale(self, conn: WorkerConn) -> None:
        """A frozen worker fails the update in flight at once: the abort breaks every rank's data plane,
        so the trainer's ranks (blocked sending to it) fail too, long before the deadline."""
        u = self.update
        if u is not None and u.phase not in TERMINAL:
            why = f"inference worker rank {conn.rank} (pid {conn.pid}) stopped answering during the update"
            u.error = u.error or why
            u.changed.set()
            if u.finish is None:  # once FinishUpdate runs, it aborts on u.error itself
                keep_task(self._tasks, self._abort(u, why))

    def _reconcile(self) -> None:
        """A rank serves only the deployment's committed version: hold the others until an update
        (or a repair) brings them to it. A restarted controller first learns that version from its
        workers (the one most ranks hold, the newest on a tie) once every rank has attached."""
        alive = self.hub.alive()
        if self.committed is None:
            held = [w.version for w in alive if w.version is not None]
            if not self.hub.complete() or not held:
                return
            counts: dict[str, int] = {}
            for v in held:
                counts[_v(v)] = counts.get(_v(v), 0) + 1
            self.committed = max(held, key=lambda v: (counts[_v(v)], v.step))
            log.info("serving version %s, learned from the workers (%s)", _v(self.committed),
                     ", ".join(f"{k} on {n} rank(s)" for k, n in sorted(counts.items())))
        for w in alive:
            want = w.version is not None and _v(w.version) == _v(self.committed)
            if w.allowed != want:
                w.allowed = want
                why = (f"it holds the deployment's version {_v(self.committed)}" if want else
                       f"it holds {_v(w.version)}, the deployment serves {_v(self.committed)}: held until a repair")
                self.hub.send(w, serve=wpb.Serve(allow=want, reason=why))

    def needs_repair(self) -> bool:
        return self.committed is not None and any(
            w.version is None or _v(w.version) != _v(self.committed) for w in self.hub.alive())

    def serving_state(self) -> str:
        alive = self.hub.alive()
        if self.torn or not alive or all(w.held for w in alive):
            return "NOT_SERVING"
        if len(alive) < self.hub.world or any(w.held or w.stale for w in alive) or self.needs_repair():
            return "DEGRADED"
        return "SERVING"

    def served_version(self) -> pb.Version | None:
        alive = self.hub.alive()
        versions = {_v(w.version) for w in alive}
        if alive and len(versions) == 1 and alive[0].version is not None:
            return alive[0].version
        return None

    # -- RPCs ----------------------------------------------------------------------------
    async def _peer(self, context) -> None:
        """With --allow-peer: only those trainer identities (client certificate names) may push here."""
        why = current_security().check_peer(context.auth_context())
        if why:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)

    async def GetLayout(self, request, context):
        await self._peer(context)
        try:
            # Answered within the caller's deadline: workers still attaching are said to be so (the
            # trainer waits for them within its update's deadline), not left to a DEADLINE_EXCEEDED.
            left = context.time_remaining()
            wait = self.deadlines.rpc_s if left is None else max(0.05, min(self.deadlines.rpc_s, left - 0.5))
            await self.hub.wait_complete(wait)
            _, fp, data = await self.hub.layout()
        except (WorkerError, LayoutError) as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        reply = pb.LayoutReply(model=self.model, layout=b"" if request.known_fingerprint == fp else data, fingerprint=fp,
                               workers=self.hub.world, devices=[w.device for w in self.hub.alive()], membership=self.membership(),
                               device_uuids=[w.hello.device_uuid for w in self.hub.alive()])
        if request.acquire_epoch:
            reply.epoch = await self._grant_epoch(context)
        return reply

    async def _grant_epoch(self, context) -> int:
        """A new epoch for the trainer controller asking: one more than any granted before, written
        down before it is given (a restarted controller never grants it again, and never takes back
        the fence). Clocks play no part; callers cannot name their own."""
        async with self._lock:  # not while an update of the previous holder is between its calls
            epoch = self.epoch + 1
            try:
                await asyncio.get_running_loop().run_in_executor(None, _write_epoch, self.epoch_file, epoch)
            except OSError as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot record a new epoch in {self.epoch_file}: {e}")
            if self.epoch:
                log.warning("granted epoch %d to a trainer controller: the holder of epoch %d is fenced out", epoch, self.epoch)
            self.epoch = epoch
            return epoch

    def membership(self) -> str:
        """Who the data plane would connect to: this controller's life and its workers' processes."""
        return f"{self.instance}:{self.hub.generation}:" + ",".join(f"{w.rank}/{w.pid}" for w in self.hub.alive())

    def _check_begin(self, req: pb.BeginUpdateRequest) -> str:
        """What is wrong with a BeginUpdate, naming the field ('' if nothing): every value is checked at
        the door, so none fails later on the workers, or leaves the update half begun."""
        from reshard.common.dataplane.backend import BACKENDS
        from reshard.common.control.methods import transfer_methods

        if not req.update_id or not req.version.run or not (req.src_layout or req.src_fingerprint) or not req.session.id:
            return "BeginUpdate needs update_id, version.run, src_layout (or src_fingerprint) and session"
        s = req.session
        checks = [
            (_ident_ok(req.update_id), "update_id: 1 to 64 letters, digits, '-', '_' or '.'"),
            (_ident_ok(s.id), "session.id: 1 to 64 letters, digits, '-', '_' or '.'"),
            (len(req.version.run) <= MAX_NAME, f"version.run: at most {MAX_NAME} characters"),
            (0 <= req.version.step <= MAX_STEP, f"version.step: 0 to {MAX_STEP}"),
            (s.transport in BACKENDS and s.transport != "auto", f"session.transport: one of {', '.join(BACKENDS[1:])}"),
            (0 < s.src_world <= MAX_WORLD, f"session.src_world: 1 to {MAX_WORLD}"),
            (s.dst_world == self.hub.world, f"session.dst_world: this deployment's {self.hub.world} ranks"),
            (0 < s.store_port < 65536, "session.store_port: 1 to 65535"),
            (0 < len(s.store_host) <= 255, "session.store_host: a host name or address"),
            (len(s.key) <= 128 and len(s.nccl_unique_id) in (0, 128), "session.key / nccl_unique_id: malformed"),
            (len(s.device_uuids) in (0, s.src_world + s.dst_world), "session.device_uuids: one per session rank"),
            (req.bucket_bytes == 0 or _bucket_ok(req.bucket_bytes, s.transport), "bucket_bytes: 0, or what the planner takes"),
            (len(req.tensors) <= MAX_TENSORS and all(0 < len(t) <= MAX_NAME for t in req.tensors),
             f"tensors: at most {MAX_TENSORS} names or patterns of at most {MAX_NAME} characters"),
            (not req.method or req.method in transfer_methods(), "method: a transfer method installed here"),
            (req.timeout_s == req.timeout_s and req.timeout_s >= 0, "timeout_s: seconds, 0 or more"),
            (0 <= req.epoch, "epoch: 0 or more"),
            (len(req.plan_digest) <= 128 and len(req.src_fingerprint) <= 128, "plan_digest / src_fingerprint: malformed"),
        ]
        for ok, why in checks:
            if not ok:
                return f"invalid BeginUpdate: {why}"
        return ""

    async def BeginUpdate(self, req: pb.BeginUpdateRequest, context):
        set_update(req.update_id, req.version if req.HasField("version") else None)  # its log lines say so
        await self._peer(context)
        if why := self._check_begin(req):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        async with self._lock:
            cur = self.update
            if cur is not None and cur.id == req.update_id:  # a retried call
                if cur.phase == Phase.ABORT:
                    await context.abort(grpc.StatusCode.ABORTED, f"update {req.update_id} was aborted: {cur.error}")
                if cur.begin_reply is not None:
                    return cur.begin_reply
            if req.update_id in self.finished:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"update {req.update_id} already finished")
            if not req.src_layout and req.src_fingerprint not in self._sources:
                # before any state changes: the trainer resends under the same update id
                await context.abort(grpc.StatusCode.NOT_FOUND,
                                    f"source layout {req.src_fingerprint or '(no fingerprint)'} is not held here: send it")
            if req.epoch != self.epoch or not self.epoch:
                if 0 < req.epoch < self.epoch:
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                        f"fenced: trainer controller epoch {req.epoch} is older than epoch {self.epoch}, which "
                                        "has taken over this deployment (a restarted or second trainer controller)")
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"epoch {req.epoch} was not granted here (the newest granted is {self.epoch or 'none'}): "
                                    "acquire one (GetLayout acquire_epoch); not granted: epoch")
            if cur is not None and cur.phase in FINISHING:
                await context.abort(grpc.StatusCode.UNAVAILABLE,
                                    f"update {cur.id} ({_v(cur.version)}) is in {cur.phase} on every rank; "
                                    "a new update can begin when it ends")
            if cur is not None and cur.phase not in TERMINAL:
                await self._abort(cur, f"superseded by update {req.update_id}")
            try:  # a restarted controller learns the served version from its workers before it accepts anything
                await self.hub.wait_complete(self.deadlines.rpc_s)
            except WorkerError as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            self._reconcile()
            served = self.committed
            repair = self.needs_repair() and served is not None and _v(served) == _v(req.version)
            backwards = ""
            if served is not None and not repair:
                if served.run == req.version.run and req.version.step <= served.step:
                    backwards = f"version {_v(req.version)} does not advance the committed {_v(served)} of the same run"
                elif served.run != req.version.run and served.step > 0:  # step 0: the checkpoint the engine loaded
                    backwards = f"version {_v(req.version)} is of another run than the committed {_v(served)}"
            if backwards and not req.allow_rollback:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"{backwards}; moving to another run or back in steps is an operator's choice "
                                    "(reshard trainer --allow-rollback)")
            # A caller's deadline is clamped by ours: a timeout_s of 1e9 must not pin the data plane.
            req.timeout_s = clamp_timeout(req.timeout_s, self.deadlines.update_s, self.deadlines.update_s)
            u = _Update(req, self.hub.world)
            self.hub.meter.reset()
            self.hub.meter.add("BeginUpdateRequest", req)
            if backwards:
                u.note = f"rollback allowed by the operator: from {_v(served)} to {_v(req.version)}"
                log.warning("update %s: %s", req.update_id, u.note)
            self.update = u
            if tracing.enabled():  # the trainer's trace context, from the call's metadata
                md = context.invocation_metadata() if hasattr(context, "invocation_metadata") else None
                if tracing.has_context(md):
                    u.trace = md
                    self._trace_phase(u)
            faults.at_phase("inference", Phase.NEGOTIATE.value, workers=self.hub)
            try:
                await self.hub.wait_complete(self.deadlines.rpc_s)
                self._reconcile()
                dst, dst_fp, dst_bytes = await self.hub.layout()
                src, src_bytes = await self._source_layout(req)
                plan = await self._plan(src, dst, req)
                u.tensors = len(req.tensors) if req.tensors else len(dst.tensors)
                u.all_names = tuple(dst.tensors)
                if plan.digest != req.plan_digest:
                    raise LayoutError(f"plan digest mismatch: trainer {req.plan_digest}, inference {plan.digest}")
                u.plan = plan
                u.bytes_total = plan.total_bytes
                self._advance(u, Phase.CONNECT)
                u.requests_at_start = sum(w.requests_served for w in self.hub.alive())
                prep = wpb.Prepare(update_id=u.id, version=req.version, plan_digest=plan.digest, session=req.session,
                                   timeout_s=req.timeout_s, method=u.method, bucket_bytes=req.bucket_bytes, tensors=req.tensors,
                                   src_fingerprint=layout_fingerprint(src), dst_fingerprint=dst_fp)
                await self.hub.prepare_all(max(self.deadlines.rpc_s, u.deadline - time.monotonic()), prep,
                                           {prep.src_fingerprint: src_bytes, dst_fp: dst_bytes})
                self._advance(u, Phase.TRANSFER)
            except _Aborted:
                await context.abort(grpc.StatusCode.ABORTED, f"update {u.id} was aborted: {u.error}")
            except _UnknownSource as e:
                self._tell_workers(u, str(e))
                await self._fail(u, str(e))
                await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
            except LayoutError as e:
                self._tell_workers(u, str(e))
                await self._fail(u, str(e))
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
            except WorkerError as e:
                await self._abort(u, str(e))
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            u.begin_reply = pb.BeginUpdateReply(bytes_total=u.bytes_total)
            self.hub.meter.add("BeginUpdateReply", u.begin_reply)
        return u.begin_reply

    @classmethod
    def _enter(cls, u: _Update, phase: Phase) -> None:
        """Into `phase` (the fault hook may strike there)."""
        u.phase = phase
        cls._trace_phase(u)
        faults.at_phase("inference", phase.value)

    @staticmethod
    def _trace_phase(u: _Update, error: str = "") -> None:
        """Traced: the span of the phase `u` is in now (the one before ends), a child of the trainer's
        update span, and the parent of what workers do in it; none once it ended."""
        if u.trace is None:
            return
        tracing.end(u.span, error)
        u.span = None if u.phase in TERMINAL else tracing.start(
            f"inference.{u.phase.value.lower()}", u.trace, {"reshard.role": "inference", "reshard.update_id": u.id})
        tracing.set_current(u.span)

    @classmethod
    def _advance(cls, u: _Update, phase: Phase) -> None:
        """Into `phase`, unless an abort (a stale or dead worker, seen while this call awaited) ended
        the update meanwhile: an ABORT is never overwritten."""
        if u.phase in TERMINAL:
            raise _Aborted(u.error)
        cls._enter(u, phase)

    async def FinishUpdate(self, req: pb.FinishUpdateRequest, context):
        """Verify and commit on every rank, once: a retried call (or one that arrives while the
        first still runs) gets the same outcome, and a caller that goes away does not stop it."""
        set_update(req.update_id)  # its log lines say so
        await self._peer(context)
        if not _ident_ok(req.update_id):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "FinishUpdateRequest.update_id: 1 to 64 letters, "
                                "digits, '-', '_' or '.'")
        done = self.finished.get(req.update_id)
        u = self.update
        if done is None and (u is None or u.id != req.update_id):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no update {req.update_id!r} in progress")
        if done is None and u.phase == Phase.ABORT:
            await context.abort(grpc.StatusCode.ABORTED, f"update {_v(u.version)} failed: {u.error}")
        if done is None:
            set_update(req.update_id, u.version)
            if u.finish is None:
                u.finish = keep_task(self._tasks, self._finish(u, req))
            try:
                await asyncio.shield(u.finish)
            except _Failed:
                pass
            done = self.finished[req.update_id]
        reply, error = done
        if reply is None:
            await context.abort(grpc.StatusCode.ABORTED, error)
        return reply

    def _record(self, update_id: str, reply: pb.FinishUpdateReply | None, error: str = "") -> None:
        self.finished[update_id] = (reply, error)
        while len(self.finished) > 64:
            self.finished.popitem(last=False)

    async def _finish(self, u: _Update, req: pb.FinishUpdateRequest) -> pb.FinishUpdateReply:
        try:
            while len(u.done) < u.world and not u.error:
                left = u.deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(u.world)) - set(u.done))
                    raise WorkerError(f"update deadline passed with inference ranks {missing} still receiving")
                u.changed.clear()
                try:
                    await asyncio.wait_for(u.changed.wait(), left)
                except asyncio.TimeoutError:
                    pass
            if u.error:
                raise WorkerError(u.error)
            self._enter(u, Phase.VERIFY)
            t0 = time.perf_counter()
            self.hub.meter.add("FinishUpdateRequest", req)
            values = verify.slot_values(u.plan, req.expected)
            left = max(1.0, u.deadline - time.monotonic())
            await self.hub.call_all(left, lambda w: {"verify": wpb.Verify(
                update_id=u.id, expected=verify.rank_expected(u.plan, w.rank, values))})
            verify_s = time.perf_counter() - t0
            self._enter(u, Phase.COMMIT)
            t0 = time.perf_counter()
            await self.hub.call_all(max(1.0, u.deadline - time.monotonic()), commit=wpb.Commit(update_id=u.id, version=u.version))
            commit_s = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - every failure is recorded for the callers
            if not isinstance(e, (WorkerError, LayoutError)):
                log.exception("update %s: unexpected error while finishing", _v(u.version))
            await self._abort(u, str(e), finishing=True)
            self._record(u.id, None, f"update {_v(u.version)} failed: {e}")
            raise _Failed(str(e)) from None
        u.phase = Phase.DONE
        self._trace_phase(u)
        self.committed = u.version
        self.torn = set() if u.names is None else self.torn - u.names
        if self.torn:
            self.last_error = (f"committed {_v(u.version)}, a partial update; {len(self.torn)} tensor(s) torn by a failed "
                               f"in-place update are not carried yet (e.g. {sorted(self.torn)[0]}): NOT_SERVING until "
                               "an update carries them (a full update does)")
            log.error("%s", self.last_error)
        for w in self.hub.alive():
            # A commit ends every rank's hold: the worker cleared it before its reply. Its next heartbeat
            # would say so up to a period later; a status read in between must not show it HELD.
            w.version, w.allowed, w.held = u.version, True, False
        self._reconcile()
        nbytes = u.bytes_total  # the payload, each destination byte once (a relaying rank also sends: not counted again)
        during = sum(w.requests_served for w in self.hub.alive()) - u.requests_at_start
        reply = pb.FinishUpdateReply(committed=u.version, verify_seconds=verify_s, bytes=nbytes, requests_during=max(0, during),
                                     commit_seconds=commit_s)
        self.hub.meter.add("FinishUpdateReply", reply)
        record = pb.UpdateRecord(version=u.version, ok=True, seconds=time.monotonic() - u.started, bytes=nbytes, verified=True,
                                 verify_seconds=verify_s, method=u.method, requests_during=max(0, during), tensors=u.tensors,
                                 update_id=u.id, note=u.note)
        self.hub.finished(record)
        self.history.append(record)
        self.history = self.history[-100:]
        log.info("committed %s (%s, %d bytes)", _v(u.version), u.method, nbytes)
        self._record(u.id, reply)
        return reply

    async def AbortUpdate(self, req: pb.AbortUpdateRequest, context):
        set_update(req.update_id, req.version if req.HasField("version") else None)  # its log lines say so
        await self._peer(context)
        if not _ident_ok(req.update_id) or len(req.version.run) > MAX_NAME:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "AbortUpdateRequest.update_id: 1 to 64 letters, digits, "
                                f"'-', '_' or '.'; version.run: at most {MAX_NAME} characters")
        req.reason = req.reason[:1024]  # told to every worker and recorded: bounded
        u = self.update
        if u is not None and u.id == req.update_id and u.phase in FINISHING:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"update {req.update_id} is in {u.phase}: it ends by itself (committed on every rank, or aborted)")
        if u is not None and u.id == req.update_id and u.phase not in TERMINAL:
            await self._abort(u, req.reason or "aborted by the trainer")
        elif req.HasField("version") and (u is None or u.id != req.update_id):  # it never began here
            self.hub.send_all(abort=wpb.Abort(update_id=req.update_id, reason=req.reason or "aborted by the trainer",
                                              version=req.version))
        return pb.AbortUpdateReply()

    async def expire(self) -> None:
        """Abort an update whose deadline passed without the trainer finishing or aborting it."""
        u = self.update
        if (u is not None and u.phase not in TERMINAL and u.finish is None
                and time.monotonic() > u.deadline + self.deadlines.rpc_s):
            await self._abort(u, "update deadline passed without FinishUpdate (trainer gone?)")

    async def _fail(self, u: _Update, error: str) -> None:
        u.phase, u.error = Phase.ABORT, u.error or error
        self._trace_phase(u, error)
        self.last_error = error
        record = pb.UpdateRecord(version=u.version, ok=False, error=error, method=u.method, seconds=time.monotonic() - u.started,
                                 update_id=u.id)
        self.hub.finished(record)
        self.history.append(record)
        self.history = self.history[-100:]
        log.error("update %s failed: %s", _v(u.version), error)

    async def _abort(self, u: _Update, reason: str, finishing: bool = False) -> None:
        """Abort `u` on every worker. Once FinishUpdate owns it (VERIFY, COMMIT), only FinishUpdate may."""
        if u.phase in TERMINAL or (u.phase in FINISHING and not finishing):
            return
        in_flight = u.phase in (Phase.TRANSFER, Phase.VERIFY, Phase.COMMIT)
        self._tell_workers(u, reason)
        if in_flight and self.inplace:
            self.torn |= u.names if u.names is not None else set(u.all_names)
        await self._fail(u, reason)

    def _tell_workers(self, u: _Update, reason: str) -> None:
        """Every rank learns that `u` failed, and which version it carried (ranks that never
        prepared it too: an engine waiting to serve that version stops waiting)."""
        self.hub.send_all(abort=wpb.Abort(update_id=u.id, reason=reason, version=u.version))


    async def GetStatus(self, request, context):
        st = pb.Status(role="inference", model=self.model, serving_state=self.serving_state(), last_error=self.last_error,
                       needs_repair=self.needs_repair(), worker_address=self.hub.worker_address)
        v = self.served_version()
        if v is not None:
            st.version.CopyFrom(v)
            st.has_version = True
        u = self.update
        if u is not None:
            st.update_in_progress = u.phase not in TERMINAL
            st.progress.CopyFrom(pb.UpdateProgress(phase=u.phase, bytes_done=sum(u.progress.values()), bytes_total=u.bytes_total,
                                                   version=u.version, update_id=u.id))
        for r in range(self.hub.world):
            w = self.hub.workers.get(r)
            state, detail = self.hub.worker_state(r)
            h = pb.WorkerHealth(rank=r, state=state, detail=detail)
            if w is not None:
                h.pid, h.requests_served = w.pid, w.requests_served
                w.health(h)
                h.requests_by_version.update(w.requests_by_version)
                if w.version is not None:
                    h.version.CopyFrom(w.version)
                    h.has_version = True
                if w.alive and w.held:
                    h.state = "HELD"
                    h.detail = h.detail or (f"not serving: holds {_v(w.version)}, the deployment {_v(self.committed)}"
                                            if self.committed is not None else "not serving: waiting for every rank to attach")
            st.workers.append(h)
        st.requests_served = sum(w.requests_served for w in self.hub.workers.values())
        st.requests_during_updates = sum(w.requests_during_update for w in self.hub.workers.values())
        st.history.extend(self.history[-20:])
        return st


    async def Dump(self, req: pb.DumpRequest, context):
        """Stream one canonical tensor, read back from the workers a region (DUMP_REGION_BYTES) at a time:
        the controller holds one region, never the tensor, and the workers copy without pausing the engine."""
        if not 0 < len(req.tensor) <= MAX_NAME:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"DumpRequest.tensor: 1 to {MAX_NAME} characters")
        if self._dumps >= MAX_CONCURRENT_DUMPS:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{MAX_CONCURRENT_DUMPS} dumps in progress; retry when one ends")
        self._dumps += 1
        chunks = self._dump(req, context)
        try:
            async for chunk in chunks:
                yield chunk
        finally:  # also when the client goes away (the handler is cancelled)
            self._dumps -= 1
            await chunks.aclose()

    async def _dump(self, req: pb.DumpRequest, context):
        import torch

        try:
            for _ in range(3):  # the layout and the workers it was built from (membership may change between)
                layout, _, _ = await self.hub.layout()
                conns = self.hub.alive()
                if len(conns) == layout.world:
                    break
        except LayoutError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        spec = layout.tensors.get(req.tensor)
        if spec is None:
            close = sorted(n for n in layout.tensors if req.tensor.split(".")[-2:] == n.split(".")[-2:])[:3]
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown tensor {req.tensor!r}" + (f"; did you mean {', '.join(close)}?" if close else ""))
        if req.HasField("rank") and not 0 <= req.rank < self.hub.world:  # item 21: not UNAVAILABLE, which says retry
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"DumpRequest.rank {req.rank}: this deployment's ranks are 0 to {self.hub.world - 1}")
        if req.HasField("rank") and not any(w.rank == req.rank for w in conns):
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"inference worker rank {req.rank} is not attached")
        who = f"worker rank {req.rank}" if req.HasField("rank") else "any live worker"
        dt = dtype_of(spec.dtype)
        total = spec.nbytes
        holders, plans, missing = await asyncio.get_running_loop().run_in_executor(
            None, _dump_plans, layout, conns, req.tensor, req.rank if req.HasField("rank") else None)
        if missing:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"tensor {req.tensor!r}: {missing} elements are not held by {who}")
        if not plans:  # no elements (a tensor with an empty dimension): its shape and nothing else
            yield pb.DumpChunk(name=req.tensor, shape=list(spec.shape), dtype=spec.dtype, offset=0, total_bytes=0)
            return
        start = _v(self.committed)
        # One region's bytes and coverage at a time, in buffers kept for the next dumps (one per dump
        # streaming at once): a dump allocates nothing the size of its tensor.
        pool = self._dump_buffers
        bufs = pool.pop() if pool else (torch.empty(DUMP_REGION_BYTES, dtype=torch.uint8),
                                        torch.empty(DUMP_REGION_BYTES, dtype=torch.bool))
        try:
            raw, cov = bufs
            buf = raw.view(dt)  # the region row-major in the tensor's dtype
            version: pb.Version | None = None
            offset = 0
            for region, chosen in plans:
                try:
                    got = await self._dump_region(req.tensor, region, holders, chosen, buf, cov, who)
                except _DumpFailed as e:
                    await context.abort(e.code, str(e))
                for v in got:
                    if version is None:
                        version = v
                    elif _v(v) != _v(version):
                        code, why = self._dump_versions(version, v, start)
                        await context.abort(code, why)
                nbytes = region.numel * dt.itemsize
                for off in range(0, nbytes, DUMP_CHUNK):
                    chunk = pb.DumpChunk(name=req.tensor, shape=list(spec.shape), dtype=spec.dtype, offset=offset + off,
                                         data=raw[off : min(nbytes, off + DUMP_CHUNK)].numpy().tobytes(), total_bytes=total)
                    if version is not None:
                        chunk.version.CopyFrom(version)
                    yield chunk
                offset += nbytes
        finally:
            pool.append(bufs)

    def _dump_versions(self, have: pb.Version, other: pb.Version, start: str) -> tuple[grpc.StatusCode, str]:
        """Two versions in one dump: a commit while it streamed (ABORTED: run it again), or a
        deployment whose workers hold different versions (FAILED_PRECONDITION)."""
        u = self.update
        if _v(self.committed) != start or (u is not None and u.phase == Phase.COMMIT):
            # The newer: the update's (its ranks commit one by one), else the one committed since.
            target = _v(u.version) if u is not None and u.phase in (Phase.COMMIT, Phase.DONE) else _v(self.committed)
            newer, older = (have, other) if _v(have) == target else (other, have)
            return (grpc.StatusCode.ABORTED,
                    f"version {_v(newer)} was committed while the dump of version {_v(older)} streamed; run it again")
        return (grpc.StatusCode.FAILED_PRECONDITION,
                f"workers hold different versions ({_v(have)} and {_v(other)}); the deployment is degraded")

    async def _dump_region(self, tensor: str, region, holders: list, chosen: list[int], buf, cov,
                           who: str) -> list[pb.Version]:
        """Read `region` into buf[:region.numel] (row-major): first from the holders its plan chose (one per
        part, at once), then, for what a failed worker left, from the others that hold it. Returns the
        versions the pieces came with."""
        reg = buf[:region.numel].view(region.size)
        cv = cov[:region.numel].view(region.size)
        cv.zero_()
        asked: set[int] = set()
        errors: list[str] = []
        versions: dict[str, pb.Version] = {}

        async def ask(k: int) -> list[wpb.ReadPiece]:
            asked.add(k)
            conn = holders[k][0]
            return await self.hub.read(conn, tensor, self.deadlines.rpc_s, region.offset, region.size)

        def take(results) -> None:
            for r in results:
                if isinstance(r, WorkerError):
                    log.warning("dump: %s", r)
                    errors.append(str(r))
                elif isinstance(r, BaseException):
                    raise r
                else:
                    for v in _place(r, region, reg, cv, buf.dtype):
                        versions.setdefault(_v(v), v)

        take(await asyncio.gather(*(ask(k) for k in chosen), return_exceptions=True))
        while not bool(cv.all()):
            more = [k for k, (_, boxes) in enumerate(holders) if k not in asked and any(
                not bool(cv[i.slices_in(region)].all()) for b in boxes if (i := b.intersect(region)) is not None)]
            if not more:
                missing = region.numel - int(cv.count_nonzero())
                raise _DumpFailed(grpc.StatusCode.UNAVAILABLE, f"tensor {tensor!r}: {missing} elements are not held by {who}"
                                  + (f" ({'; '.join(errors)})" if errors else ""))
            take(await asyncio.gather(ask(more[0]), return_exceptions=True))
        return list(versions.values())


class _DumpFailed(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _dump_regions(shape: tuple[int, ...], itemsize: int, limit: int = DUMP_REGION_BYTES):
    """A tensor in row-major order as boxes of at most `limit` bytes, each contiguous in its row-major
    bytes: d is the outermost dim whose trailing block (dims after it) fits; every index prefix of the
    dims before d (each of length 1), then ranges of n = limit // block entries along d."""
    import itertools
    import math

    from reshard.common.layout.core import Box

    if math.prod(shape) == 0:
        return
    if not shape or math.prod(shape) * itemsize <= limit:  # a 0-d tensor: one region
        yield Box.full(shape)
        return
    d = next((d for d in range(len(shape)) if math.prod(shape[d + 1:]) * itemsize <= limit), len(shape) - 1)
    n = max(1, limit // (math.prod(shape[d + 1:]) * itemsize))
    for prefix in itertools.product(*(range(s) for s in shape[:d])):
        for at in range(0, shape[d], n):
            yield Box((*prefix, at, *(0 for _ in shape[d + 1:])), (*(1 for _ in prefix), min(n, shape[d] - at), *shape[d + 1:]))


def _contains(outer, inner) -> bool:
    return all(o <= i and i + n <= o + m for o, m, i, n in zip(outer.offset, outer.size, inner.offset, inner.size))


def _dump_plans(layout: Layout, conns: list[WorkerConn], tensor: str, rank: int | None):
    """Off the loop: who holds what of `tensor` ([(conn, boxes)] by rank), the dump's regions each with
    the holders to ask (one per part: a replica of what is chosen adds nothing), and how many elements
    no holder has."""
    import torch

    from reshard.common.layout.core import Box

    spec = layout.tensors[tensor]
    if len(conns) == layout.world:
        by_class: dict[int, list] = {}
        holders = []
        for conn, bufs in zip(conns, layout.ranks):
            boxes = by_class.get(id(bufs))
            if boxes is None:
                boxes = by_class[id(bufs)] = list(dict.fromkeys(p.box for b in bufs for p in b.pieces if p.tensor == tensor))
            if boxes and (rank is None or conn.rank == rank):
                holders.append((conn, boxes))
    else:  # membership kept changing: ask the live workers in turn, as they come
        holders = [(c, [Box.full(spec.shape)]) for c in conns if rank is None or c.rank == rank]
    plans, missing = [], 0
    for region in _dump_regions(spec.shape, spec.nbytes // spec.numel):
        hits = [(k, [i for b in boxes if (i := b.intersect(region)) is not None]) for k, (_, boxes) in enumerate(holders)]
        whole = next((k for k, inters in hits if any(i == region for i in inters)), None)
        if whole is not None:  # the common case: one holder has all of it
            plans.append((region, [whole]))
            continue
        chosen, have = [], []  # the holders to ask, and their intersections with the region
        for k, inters in hits:
            if inters and not all(any(_contains(h, i) for h, _ in have) for i in inters):
                chosen.append(k)
                have += [(i, k) for i in inters]
        if all(a.intersect(b) is None for n, (a, ka) in enumerate(have) for b, kb in have[n + 1:] if ka != kb):
            covered = sum(i.numel for i, _ in have)  # a rank's boxes are disjoint; so are these
        else:  # holders whose parts overlap without one containing the other
            mask = torch.zeros(region.size, dtype=torch.bool)
            for i, _ in have:
                mask[i.slices_in(region)] = True
            covered = int(mask.count_nonzero())  # (a sum would widen the mask to int64)
        missing += region.numel - covered
        plans.append((region, chosen))
    return holders, plans, missing


def _place(pieces: list[wpb.ReadPiece], region, reg, cv, dtype) -> list[pb.Version]:
    """Copy a worker's pieces into the region's buffer `reg` and mark them in `cv`, each chunk where
    it lands (a piece is a box, its data a range of the box's row-major bytes); returns their versions."""
    import math
    import warnings

    import torch

    from reshard.common.layout.core import Box, flat_range_to_boxes

    size_of = torch.empty((), dtype=dtype).element_size()
    versions = []
    for p in pieces:
        if p.HasField("version"):
            versions.append(p.version)
        data = p.data
        box = Box(tuple(p.offset), tuple(p.size))
        if box.ndim != region.ndim or not data or p.byte_offset % size_of or len(data) % size_of:
            continue
        with warnings.catch_warnings():  # read only: the bytes are never written through it
            warnings.simplefilter("ignore", UserWarning)
            src = torch.frombuffer(data, dtype=torch.uint8).view(dtype)
        first = p.byte_offset // size_of
        pos = 0
        for sub in flat_range_to_boxes(first, min(first + len(src), math.prod(box.size)), box.size):
            part = src[pos : pos + sub.numel].view(sub.size)
            pos += sub.numel
            sub = sub.shift(box.offset)
            inter = sub.intersect(region)
            if inter is None or inter.numel == 0:
                continue
            dst = inter.slices_in(region)
            reg[dst] = part[inter.slices_in(sub)]
            cv[dst] = True
    return versions


async def serve(listen: str, workers: int, model: str, *, seed: int = 0, staging: str = "shadow", layout: str = "",
                deadlines: Deadlines | None = None, stop: asyncio.Event, spawn_workers: bool = True, device: str = "cpu",
                worker_listen: str = "", pool_bytes: int = 256 << 20, metrics_listen: str = "") -> int:
    deadlines = deadlines or Deadlines()
    from reshard.common.control.hub import local_host
    from reshard.common.control.supervisor import RunDirError, run_file

    hub = WorkerHub(workers, "inference")
    epoch_file = ""
    if not listen.endswith(":0"):  # an ephemeral port names no deployment that outlives the process
        try:
            epoch_file = run_file("inference", f"{local_host(listen)}:{listen.rpartition(':')[2]}")[:-len(".json")] + ".epoch"
        except RunDirError as e:
            print(f"reshard inference: {e}", file=sys.stderr, flush=True)
            return 2
    ctl = InferenceController(hub, model, deadlines, epoch_file=epoch_file)

    def command(addr: str, rank: int) -> list[str]:
        return module_command("reshard.inference_svc.standalone") + ["--controller", addr, "--rank", str(rank),
                "--world", str(workers), "--model", model, "--seed", str(seed), "--staging", staging, "--device", device,
                "--pool-bytes", str(pool_bytes)] + (
                    ["--layout", layout] if layout else [])

    async def watchdog() -> None:
        while True:
            await asyncio.sleep(1.0)
            await ctl.expire()

    return await serve_controller(
        listen, hub, lambda server: rgrpc.add_InferenceServiceServicer_to_server(ctl, server),
        pb.DESCRIPTOR.services_by_name["InferenceService"].full_name, stop,
        lambda addr, waddr: f"inference_svc listening on {addr} (" + (
            f"model {model}, {workers} standalone workers, {staging} staging)" if spawn_workers else
            f"{workers} external workers on {waddr}{f', model label {model}' if model else ''}; each reports its staging)"),
        command if spawn_workers else None, (watchdog(),), worker_timeout=deadlines.worker_s,
        worker_listen=worker_listen, metrics_listen=metrics_listen, status=lambda: ctl.GetStatus(pb.StatusRequest(), None))


def main(listen: str, workers: int, model: str, seed: int, staging: str, deadlines: Deadlines, spawn_workers: bool = True,
         layout: str = "", device: str = "cpu", worker_listen: str = "", pool_bytes: int = 256 << 20,
         metrics_listen: str = "") -> int:
    return run_main(lambda stop: serve(listen, workers, model, seed=seed, staging=staging, deadlines=deadlines, stop=stop,
                                       spawn_workers=spawn_workers, layout=layout, device=device,
                                       worker_listen=worker_listen, pool_bytes=pool_bytes, metrics_listen=metrics_listen))
