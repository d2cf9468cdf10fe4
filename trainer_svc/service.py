"""trainer_svc: the controller users talk to. It drives the update lifecycle:

NEGOTIATE (layouts, validation, plan digest) -> CONNECT (reuse or open the
session) -> TRANSFER -> VERIFY (checksums) -> COMMIT -> done; any failure or
deadline -> ABORT on both sides. Updates requested faster than they complete
coalesce to the newest; versions never go backwards within a run."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
import uuid

import grpc

from reshard.common.control import faults, tracing
from reshard.common.control.hub import WorkerConn, WorkerError, WorkerHub, local_host, serve_controller
from reshard.common.control.logs import set_update
from reshard.common.control.methods import RESHARD, transfer_methods
from reshard.common.control.phases import AT_REST, Phase
from reshard.common.control.rpc import RECONNECT_S, Deadlines, channel, clamp_timeout, parse_address, run_main, status_error
from reshard.common.control.supervisor import module_command
from reshard.common.dataplane.backend import BACKENDS, BackendError, plan_options, select_backend
from reshard.common.dataplane.transport import serve_store
from reshard.common.layout.core import Layout, LayoutError, dtype_casts
from reshard.common.layout.quantized import fp8_tensors, quantized_source, with_scales
from reshard.common.layout.wire import layout_bytes, layout_fingerprint, layout_from_bytes
from reshard.common.plan import verify
from reshard.common.plan.cache import PlanCache
from reshard.common.plan.planner import select_tensors
from reshard.proto import reshard_pb2 as pb
from reshard.proto import reshard_pb2_grpc as rgrpc
from reshard.proto import worker_pb2 as wpb

log = logging.getLogger("reshard.trainer_svc")


def _v(v: pb.Version | None) -> str:
    return f"{v.run}:{v.step}" if v is not None else "none"


class UpdateFailed(RuntimeError):
    pass


def _unreachable(e: grpc.aio.AioRpcError) -> str:
    """How a failed call to inference reads: refused credentials are not 'unreachable'."""
    if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return "refused this trainer's credentials"
    if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "did not answer in time"
    return "unreachable"


class Deployment:
    """One attached inference deployment: its channel, data-plane session, plans and state."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.chan = channel(address)
        self.stub = rgrpc.InferenceServiceStub(self.chan)
        self.session: tuple[str, tuple, bytes, str] | None = None  # (id, what it was opened for, ncclUniqueId, secret)
        self.backend = ""
        self.dst: tuple[str, Layout, bytes] | None = None  # its layout: (fingerprint, layout, bytes)
        self.src_known = ""  # the source layout fingerprint its controller holds (sent once)
        self.committed: pb.Version | None = None
        self.last_error = ""
        self.phase = Phase.IDLE
        self.repair = False  # a rank there lost the committed version: push it again even though committed
        # The epoch this controller was granted there (0: none yet, asked for with the next layout): a newer
        # controller (a restart, a second one) is granted a newer one, and this one is fenced out.
        self.epoch = 0

    def status(self) -> pb.DeploymentStatus:
        st = pb.DeploymentStatus(address=self.address, last_error=self.last_error, phase=self.phase, backend=self.backend)
        if self.committed is not None:
            st.committed.CopyFrom(self.committed)
            st.has_committed = True
        return st


class TrainerController(rgrpc.TrainerServiceServicer):
    def __init__(self, hub: WorkerHub, model: str, inference: list[str], run: str, store_host: str, deadlines: Deadlines,
                 bucket_bytes: int = 0, backend: str = "auto", allow_rollback: bool = False, method: str = RESHARD) -> None:
        self.hub, self.model, self.run = hub, model, run
        if method not in transfer_methods():
            raise ValueError(f"unknown transfer method {method!r}; installed: {', '.join(transfer_methods())}")
        self.method = method  # how every update moves: the parallel reshard, or a measurement tool's method
        self.allow_rollback = allow_rollback  # the operator's choice: another run, or older steps
        self.deployments: dict[str, Deployment] = {a: Deployment(a) for a in inference}
        self.plans = PlanCache(8)  # recent plans of every deployment, by what determines them
        self._casts_logged: set[str] = set()  # plans whose sender casts were logged
        self._quantized: dict[tuple[str, str], tuple[Layout, str, bytes]] = {}  # (source, destination) -> sent from
        self.deadlines, self.bucket_bytes = deadlines, bucket_bytes
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; valid backends: {', '.join(BACKENDS)}")
        self.backend = backend  # auto | gloo | nccl
        # The session rendezvous store; lives as long as the controller.
        self.store, self._store_socket = serve_store(store_host, deadlines.update_s)
        log.info("session store on %s:%d", store_host, self.store.port)
        self.store_host = store_host
        hub.on_event = self._on_event
        hub.default_run = run
        hub.on_disconnect = self._on_disconnect
        hub.on_stale = self._on_disconnect
        hub.on_attach = self._on_attach
        self.published: pb.Version | None = None
        self.wait_detail = ""  # what phase WAITING waits for (status)
        self.last_release: wpb.Release | None = None  # sent again to a worker that attaches after it
        self.target_step = 0
        self.auto_push = True  # embedded workers: every publish(step) is pushed
        self.requested: tuple | None = None  # (version, tensor patterns or None)
        self.outcomes: dict[str, pb.UpdateOutcome] = {}  # by version string
        self.history: list[pb.UpdateRecord] = []
        self.last_error = ""
        self.phase, self.progress_done, self.progress_total = Phase.IDLE, {}, 0
        self.current: pb.Version | None = None
        self.wake = asyncio.Event()
        self.changed = asyncio.Condition()
        self._done: dict[int, wpb.TransferDone] = {}
        self._connected: set[int] = set()  # ranks that joined the session and connected to their peers
        self._update_id = ""
        self._done_event = asyncio.Event()
        self._devices: list[str] = []  # the deployment being updated: its workers' devices, GPUs and membership
        self._gpus: list[str] = []
        self._membership = ""

    @property
    def committed(self) -> pb.Version | None:
        """The newest version every attached deployment has committed."""
        vs = [d.committed for d in self.deployments.values()]
        if not vs or any(v is None for v in vs) or len({v.run for v in vs}) > 1:
            return None
        return min(vs, key=lambda v: v.step)

    # -- events ------------------------------------------------------------------------
    def _on_event(self, conn: WorkerConn, msg: wpb.WorkerMessage) -> None:
        kind = msg.WhichOneof("kind")
        if kind == "published":
            msg.published.version.CopyFrom(self.hub.own(msg.published.version))  # a worker made without run=
            conn.version = msg.published.version
            versions = {_v(w.version) for w in self.hub.alive()}
            if self.hub.complete() and len(versions) == 1:
                self.published = msg.published.version
                if self.auto_push:
                    self._request(msg.published.version)
        elif kind == "progress" and msg.progress.update_id == self._update_id:
            if msg.progress.connected:
                self._connected.add(conn.rank)
                self._done_event.set()
            else:
                self.progress_done[conn.rank] = msg.progress.bytes_done
        elif kind == "done" and msg.done.update_id == self._update_id:
            self._done[conn.rank] = msg.done
            self._done_event.set()

    def _on_attach(self, conn: WorkerConn) -> None:
        """A worker that (re)attaches gets the last Release: one sent while its stream was down (its
        update failed because of it) would otherwise never reach it, and its publish handle would wait
        for good. A restarted controller recovers what its workers published (their hellos carry it):
        an embedded trainer whose publish reached the dead controller still gets it pushed."""
        if self.last_release is not None:
            self.hub.send(conn, release=self.last_release)
        versions = {_v(w.version): w.version for w in self.hub.alive() if w.version is not None}
        if not self.hub.complete() or len(versions) != 1 or any(w.version is None for w in self.hub.alive()):
            return
        v = next(iter(versions.values()))
        p = self.published
        if p is None or (p.run == v.run and p.step < v.step):
            log.info("recovered published version %s from the workers", _v(v))
            self.published = v
            if self.auto_push:
                self._request(v)

    def _on_disconnect(self, conn: WorkerConn) -> None:
        self._done_event.set()

    def _request(self, version: pb.Version, tensors: tuple[str, ...] = ()) -> None:
        """Ask for an update; one not yet started is replaced by the newest (a partial one widened to
        the union of what both asked for, so nothing requested is lost)."""
        patterns: frozenset[str] | None = frozenset(tensors) if tensors else None
        if self.requested is not None:
            old = self.requested[1]
            patterns = None if patterns is None or old is None else patterns | old
        self.requested = (version, patterns)
        self.wake.set()

    # -- RPCs ----------------------------------------------------------------------------
    async def TriggerUpdate(self, req: pb.TriggerUpdateRequest, context):
        if len(req.tensors) > 4096 or any(not 0 < len(t) <= 256 for t in req.tensors):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "TriggerUpdateRequest.tensors: at most 4096 names or "
                                "patterns, each of 1 to 256 characters")
        if not self.auto_push:
            # The step itself is taken by the update loop right before the transfer, so
            # triggers that arrive during an update coalesce into one step to the newest.
            # A restarted controller of the same run continues after what inference already committed.
            await self._learn_committed()
            done = [d.committed.step for d in self.deployments.values() if d.committed is not None and d.committed.run == self.run]
            base = max(self.target_step, self.published.step if self.published and self.published.run == self.run else 0, *done)
            self.target_step = base + 1
            version = pb.Version(run=self.run, step=self.target_step)
            self._request(version, tensors=tuple(req.tensors))
            return pb.TriggerUpdateReply(version=version)
        if self.published is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "nothing published yet: the trainer has not called publish(step)")
        self._request(self.published, tensors=tuple(req.tensors))
        return pb.TriggerUpdateReply(version=self.published)

    async def WaitForVersion(self, req: pb.WaitForVersionRequest, context):
        if not 0 < len(req.version.run) <= 256:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "WaitForVersionRequest.version.run: 1 to 256 characters")
        wait = clamp_timeout(req.timeout_s, self.deadlines.update_s * 2, 24 * 3600.0)  # nobody parks a call for years
        deadline = time.monotonic() + wait
        async with self.changed:
            while True:
                out = self._outcome_for(req.version)
                if out is not None:
                    return out
                left = deadline - time.monotonic()
                if left <= 0:
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"version {_v(req.version)} not committed within {wait:.0f}s")
                try:
                    await asyncio.wait_for(self.changed.wait(), left)
                except asyncio.TimeoutError:
                    pass

    def _outcome_for(self, v: pb.Version) -> pb.UpdateOutcome | None:
        c = self.committed
        if c is not None and c.run == v.run and c.step >= v.step:
            out = pb.UpdateOutcome(ok=True, committed=c, superseded=c.step > v.step)
            rec = self.outcomes.get(_v(c))
            if rec is not None:
                out.record.CopyFrom(rec.record)
            return out
        failed = self.outcomes.get(_v(v))
        if failed is not None and not failed.ok:
            return failed
        return None

    async def AttachInference(self, req: pb.AttachRequest, context):
        if len(req.address) > 300:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "AttachRequest.address: at most 300 characters")
        try:
            parse_address(req.address, "inference address")
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if req.address not in self.deployments:
            self.deployments[req.address] = Deployment(req.address)
            log.info("attached inference deployment %s", req.address)
        return pb.AttachReply(deployments=list(self.deployments))

    async def DetachInference(self, req: pb.AttachRequest, context):
        d = self.deployments.pop(req.address, None)
        if d is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no inference deployment {req.address!r} is attached; attached: {', '.join(self.deployments) or 'none'}")
        log.info("detached inference deployment %s", req.address)
        return pb.AttachReply(deployments=list(self.deployments))

    async def GetStatus(self, request, context):
        st = pb.Status(role="trainer", model=self.model, last_error=self.last_error, worker_address=self.hub.worker_address)
        st.deployments.extend(d.status() for d in self.deployments.values())
        if self.published is not None:
            st.version.CopyFrom(self.published)
            st.has_version = True
        if self.committed is not None:
            st.committed.CopyFrom(self.committed)
            st.has_committed = True
        busy = self.phase not in AT_REST
        st.update_in_progress = busy
        st.progress.CopyFrom(pb.UpdateProgress(phase=self.phase, bytes_done=sum(self.progress_done.values()),
                                               bytes_total=self.progress_total, detail=self.wait_detail))
        if self.current is not None:
            st.progress.version.CopyFrom(self.current)
        st.serving_state = "SERVING" if self.hub.complete() else ("DEGRADED" if self.hub.alive() else "NOT_SERVING")
        for r in range(self.hub.world):
            w = self.hub.workers.get(r)
            state, detail = self.hub.worker_state(r)
            h = pb.WorkerHealth(rank=r, state=state, detail=detail)
            if w is not None:
                h.pid = w.pid
                w.health(h)
                if w.version is not None:
                    h.version.CopyFrom(w.version)
                    h.has_version = True
            st.workers.append(h)
        st.history.extend(self.history[-20:])
        return st

    # -- the update loop ---------------------------------------------------------------
    @staticmethod
    def _learned(d: Deployment, st: pb.Status) -> None:
        if d.committed is None and st.has_version:  # what it serves, learned after our (re)start
            d.committed = pb.Version(run=st.version.run, step=st.version.step)

    async def _learn_committed(self) -> None:
        for d in list(self.deployments.values()):
            if d.committed is None:
                try:
                    self._learned(d, await d.stub.GetStatus(pb.StatusRequest(), timeout=min(2.0, self.deadlines.rpc_s)))
                except grpc.aio.AioRpcError:
                    pass

    async def watch(self, every: float = 1.0) -> None:
        """Repair: when a deployment has a rank that does not hold its committed version (a worker
        restarted with its checkpoint, held and not serving), push that version again at once, if
        this trainer still holds it (standalone workers keep their weights until the next step;
        embedded trainers may have written theirs since, so such a deployment heals at the next publish)."""
        warned: set[str] = set()
        while True:
            await asyncio.sleep(every)
            if self.requested is not None or self.phase not in AT_REST:
                continue
            for d in list(self.deployments.values()):
                try:
                    st = await d.stub.GetStatus(pb.StatusRequest(), timeout=self.deadlines.rpc_s)
                except grpc.aio.AioRpcError:
                    continue
                self._learned(d, st)
                v = self.published
                if (st.has_version and d.committed is not None and _v(st.version) != _v(d.committed)
                        and not any(w.state not in ("READY", "HELD") for w in st.workers)):
                    # It lost what we committed there (its controller and workers restarted from their
                    # checkpoint): it no longer has that version, so push again what we hold.
                    log.warning("deployment %s serves %s, not %s committed there: it restarted", d.address,
                                _v(st.version), _v(d.committed))
                    d.committed = pb.Version(run=st.version.run, step=st.version.step)
                    if v is not None and not self.auto_push:
                        self._request(v)
                    continue
                if not st.needs_repair or any(w.state not in ("READY", "HELD") for w in st.workers):
                    continue
                if v is None or self.auto_push:
                    if d.address not in warned:
                        warned.add(d.address)
                        log.warning("deployment %s has ranks that do not hold its version; it is repaired by the next "
                                    "published version", d.address)
                    continue
                warned.discard(d.address)
                log.warning("deployment %s has ranks that do not hold its version: pushing %s to it again", d.address, _v(v))
                d.repair = True
                self._request(v)

    async def runner(self) -> None:
        """The update loop; an unexpected error is logged and the loop goes on."""
        while True:
            await self.wake.wait()
            self.wake.clear()
            if self.requested is None:
                continue
            version, patterns = self.requested
            self.requested = None
            c = self.committed
            if c is not None and c.run == version.run and c.step >= version.step and not any(
                    d.repair for d in self.deployments.values()):
                self._release(wpb.Release(version=version, has_outcome=True, ok=True, delivered=c))
                continue  # already there
            out = None
            try:
                out = await self._one_request(version, patterns)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - never let the loop die silently
                log.exception("update loop error")
                self.phase, self.last_error = Phase.ABORT, f"update {_v(version)}: internal error: {e!r}"
                out = pb.UpdateOutcome(ok=False, error=self.last_error, record=pb.UpdateRecord(version=version, ok=False, error=self.last_error))
            finally:
                # Every deployment has this version now, or failed and will get a newer one: the
                # trainer may write its weights again (never earlier: a later deployment still reads them).
                rel = wpb.Release(version=version)
                if out is not None:
                    rel.has_outcome, rel.ok, rel.error = True, out.ok, out.error
                    if out.ok and out.HasField("committed"):
                        rel.delivered.CopyFrom(out.committed)
                self._release(rel)
            self.outcomes[_v(version)] = out
            if len(self.outcomes) > 1000:
                self.outcomes.pop(next(iter(self.outcomes)))
            async with self.changed:
                self.changed.notify_all()

    def _release(self, rel: wpb.Release) -> None:
        """Tell every trainer worker the controller is done with versions up to rel.version: those
        attached now, and (on_attach) any that attaches later."""
        last = self.last_release
        if last is None or last.version.run != rel.version.run or last.version.step <= rel.version.step:
            self.last_release = rel
        self.hub.send_all(release=rel)

    async def _one_request(self, version, patterns) -> pb.UpdateOutcome:
        out = None
        if not self.auto_push and (self.published is None or self.published.step < version.step):
            out = await self.take_step(version)
        if out is None:
            out = await self.run_update(version, tuple(sorted(patterns)) if patterns else ())
        return out

    async def take_step(self, version: pb.Version) -> pb.UpdateOutcome | None:
        """Standalone workers: take the simulated optimizer step(s) up to `version` and publish it."""
        self.current = version
        try:
            await self._wait_workers(time.monotonic() + self.deadlines.update_s)
            self.phase = Phase.STEP
            await self.hub.call_all(self.deadlines.update_s, step=wpb.Step(version=version))
        except WorkerError as e:
            msg = f"trainer workers could not take step {version.step}: {e}"
            self.phase, self.last_error = Phase.ABORT, f"update {_v(version)}: {msg}"
            log.error("%s", msg)
            return pb.UpdateOutcome(ok=False, error=msg, record=pb.UpdateRecord(version=version, ok=False, error=msg))
        for w in self.hub.alive():
            w.version = version
        self.published = version
        return None

    async def _wait_workers(self, deadline: float) -> None:
        """An update asked for before every trainer worker attached (they import torch first: seconds
        on a loaded machine) waits for them within its own deadline, in phase WAITING, which status
        shows with the ranks it waits for."""
        if self.hub.complete():
            return
        self.phase, self.wait_detail = Phase.WAITING, "trainer workers not attached yet"
        missing = sorted(set(range(self.hub.world)) - {w.rank for w in self.hub.alive()})
        log.info("update waits for trainer workers %s to attach (up to %.0fs)", missing, deadline - time.monotonic())
        self.wait_detail = f"trainer workers {missing} not attached yet"
        try:
            await self.hub.wait_complete(max(0.0, deadline - time.monotonic()))
        finally:
            self.wait_detail = ""

    async def run_update(self, version: pb.Version, patterns: tuple[str, ...] = ()) -> pb.UpdateOutcome:
        """Push `version` to every attached deployment, one after the other: each has its own
        session, so one that fails or restarts does not abort the others."""
        if not self.deployments:
            msg = "no inference deployment is attached (reshard attach, or trainer --inference)"
            self.last_error = f"update {_v(version)}: {msg}"
            return pb.UpdateOutcome(ok=False, error=msg, record=pb.UpdateRecord(version=version, ok=False, error=msg))
        outs: list[tuple[Deployment, pb.UpdateOutcome]] = []  # each outcome with the deployment it belongs to
        targets = list(self.deployments.values())  # attach or detach during the update changes the next one
        for d in targets:
            c = d.committed
            if c is not None and c.run == version.run and c.step >= version.step and not (d.repair and c.step == version.step):
                outs.append((d, pb.UpdateOutcome(ok=True, committed=c, record=pb.UpdateRecord(version=c, ok=True, deployment=d.address))))
                continue
            outs.append((d, await self._update_one(d, version, patterns)))
        failed = [(d, o) for d, o in outs if not o.ok]
        out = pb.UpdateOutcome(ok=not failed, record=outs[-1][1].record)
        if failed:
            out.error = "; ".join(f"{d.address}: {o.error}" for d, o in failed) if len(targets) > 1 else failed[0][1].error
            out.record.CopyFrom(failed[0][1].record)
        else:
            out.committed.CopyFrom(version)
        out.deployments.extend(d.status() for d, _ in outs)
        return out

    async def _inference_cause(self, d: Deployment, uid: str, wait: float) -> str:
        """Why inference aborted update `uid`, if it did within `wait` seconds ('' otherwise)."""
        until = time.monotonic() + wait
        while True:
            try:
                st = await d.stub.GetStatus(pb.StatusRequest(), timeout=min(2.0, self.deadlines.rpc_s))
                if st.progress.update_id == uid and st.progress.phase == Phase.ABORT and st.last_error:
                    return f"inference aborted the update: {st.last_error}"
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() >= until:
                return ""
            await asyncio.sleep(0.1)

    async def _check_inference(self, d: Deployment, uid: str) -> None:
        """Fail the transfer at once when the inference side has aborted the update: our ranks may
        be blocked sending to a frozen one of its ranks, which no error of ours would reveal."""
        try:
            st = await d.stub.GetStatus(pb.StatusRequest(), timeout=min(2.0, self.deadlines.rpc_s))
        except grpc.aio.AioRpcError:
            return  # unreachable for a moment: the deadline still bounds the wait
        if st.progress.update_id == uid and st.progress.phase == Phase.ABORT:
            raise UpdateFailed(f"inference aborted the update: {st.last_error}")

    async def _finish_update(self, d: Deployment, req: pb.FinishUpdateRequest, deadline: float,
                             span=None) -> pb.FinishUpdateReply:
        """FinishUpdate, retried while the inference controller cannot be reached: it verifies and
        commits once and answers a retry with that outcome."""
        while True:
            left = deadline - time.monotonic()
            try:
                return await d.stub.FinishUpdate(req, timeout=max(1.0, left + 5), metadata=tracing.metadata(span))
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE and deadline - time.monotonic() > 1.0:
                    log.warning("FinishUpdate on %s: %s; retrying", d.address, status_error(e))
                    await asyncio.sleep(0.5)
                    continue
                raise UpdateFailed(e.details()) from None  # inference aborted it itself, or the deadline passed

    async def _dest_layout(self, d: Deployment, deadline: float) -> tuple[str, Layout, bytes]:
        """The deployment's layout; only its fingerprint travels while it is unchanged."""
        known = d.dst[0] if d.dst else ""
        req = pb.GetLayoutRequest(known_fingerprint=known, acquire_epoch=not d.epoch)
        while True:
            try:
                # The update's first call to inference: an inference controller that came up (or back) while
                # this channel was between connection attempts is waited for, not reported unreachable.
                lr = await d.stub.GetLayout(req, timeout=min(self.deadlines.rpc_s, RECONNECT_S + 0.5), wait_for_ready=True)
                break
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE and "are not attached" in (e.details() or ""):
                    # Reachable, its workers still starting: waited for within the update's deadline.
                    if time.monotonic() + 0.5 < deadline:
                        self.phase, self.wait_detail = Phase.WAITING, f"inference at {d.address}: {e.details()}"
                        await asyncio.sleep(0.5)
                        continue
                    raise UpdateFailed(f"inference at {d.address} is not ready: {e.details()}") from None
                raise UpdateFailed(f"inference at {d.address} {_unreachable(e)}: {status_error(e)}") from None
            finally:
                self.wait_detail = ""
        self.hub.meter.add("GetLayoutRequest", req)
        self.hub.meter.add("LayoutReply", lr)
        if lr.model and self.model and lr.model != self.model:
            log.warning("trainer model %s vs inference model %s: layouts decide compatibility", self.model, lr.model)
        if req.acquire_epoch:
            if not lr.epoch:
                raise UpdateFailed(f"inference at {d.address} granted no epoch (an older reshard version?)")
            d.epoch = lr.epoch
            log.info("inference at %s granted this controller epoch %d", d.address, d.epoch)
        self._devices, self._gpus, self._membership = list(lr.devices), list(lr.device_uuids), lr.membership
        if d.dst is None or lr.fingerprint != known or lr.layout:
            if not lr.layout:
                raise UpdateFailed(f"inference at {d.address} sent no layout for fingerprint {lr.fingerprint}")
            data = lr.layout
            dst = await asyncio.get_running_loop().run_in_executor(None, layout_from_bytes, data)
            d.dst = (lr.fingerprint, dst, data)
        return d.dst

    async def _begin_update(self, d: Deployment, req: pb.BeginUpdateRequest, src_bytes: bytes, deadline: float,
                            span=None) -> None:
        """BeginUpdate on the deployment; the source layout's bytes go along only the first time
        (or when its controller, restarted, no longer holds them)."""
        for attempt in range(2):
            if d.src_known != req.src_fingerprint or attempt:
                req.src_layout = src_bytes
            left = deadline - time.monotonic()
            req.timeout_s = left
            self.hub.meter.add("BeginUpdateRequest", req)
            try:
                rep = await d.stub.BeginUpdate(req, timeout=max(left, self.deadlines.rpc_s),  # it may plan, cold
                                               metadata=tracing.metadata(span))
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND and not req.src_layout:
                    d.src_known = ""
                    continue  # it does not hold our layout (restarted): send it
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                                grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL):
                    # Not a refusal: unreachable, gone while the call was in flight, or not ready.
                    raise UpdateFailed(f"BeginUpdate at inference controller {d.address} failed "
                                       f"({e.code().name}: {e.details()})") from None
                if "not granted: epoch" in (e.details() or ""):
                    d.epoch = 0  # it lost the epochs it granted (its state): the next update asks for a new one
                raise UpdateFailed(f"inference refused the update ({e.code().name}): {e.details()}") from None
            self.hub.meter.add("BeginUpdateReply", rep)
            d.src_known = req.src_fingerprint
            return
        raise UpdateFailed("inference refused the update: it does not accept the source layout")

    async def _await_ranks(self, d: Deployment, uid: str, deadline: float, ready, during: str) -> None:
        """Until `ready()`: fails at once when a rank reports a failed transfer, a worker dies or goes
        silent, inference aborts, or the update's deadline passes."""
        while True:
            failed = [td for td in self._done.values() if not td.ok]
            if failed:
                # A rank's data-plane error ("connection closed by peer") is the symptom; when inference
                # aborted the update it knows the cause (a rank of its own died or froze): say that.
                cause = await self._inference_cause(d, uid, min(2.0, max(0.0, deadline - time.monotonic())))
                rank = next(r for r, td in self._done.items() if not td.ok)
                raise UpdateFailed(f"{cause} (trainer rank {rank} saw: {failed[0].error})" if cause
                                   else f"trainer rank {rank} transfer failed: {failed[0].error}")
            if ready():
                return
            if not self.hub.complete():
                raise UpdateFailed(f"a trainer worker died {during}")
            if stale := self.hub.stale_error():
                raise UpdateFailed(f"{during}, {stale}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise UpdateFailed(f"update deadline ({self.deadlines.update_s:.0f}s) passed {during}")
            self._done_event.clear()
            try:
                await asyncio.wait_for(self._done_event.wait(), min(left, 1.0))
            except asyncio.TimeoutError:
                await self._check_inference(d, uid)  # it may have aborted (a frozen rank of its own)

    async def _update_one(self, d: Deployment, version: pb.Version, patterns: tuple[str, ...]) -> pb.UpdateOutcome:
        """One update of one deployment, phase by phase: any failure, the unexpected ones too, aborts
        it everywhere (every worker, inference) and drops its data-plane session."""
        u = self._begin_attempt(d, version)
        set_update(u.uid, version, d.address)  # every log line of this update says so (--log-format json)
        u.span = tracing.start("reshard.update", attributes={"reshard.update_id": u.uid, "reshard.version": _v(version),
                                                             "reshard.deployment": d.address, "reshard.method": self.method})
        try:
            await self._wait_workers(u.deadline)
            self._enter(u, Phase.NEGOTIATE)
            await self._negotiate(u, patterns)
            self._enter(u, Phase.CONNECT)
            await self._connect(u)
            self._enter(u, Phase.TRANSFER)
            await self._await_ranks(d, u.uid, u.deadline, lambda: len(self._done) >= self.hub.world, "during the transfer")
            self._enter(u, Phase.VERIFY)
            rep = await self._verify_and_commit(u)
            faults.at_phase("trainer", "COMMIT", workers=self.hub)  # committed on inference, not yet here
            return self._committed(u, rep)
        except Exception as e:  # noqa: BLE001 - every failure aborts everywhere
            return await self._failed(u, e)
        finally:
            self.history = self.history[-100:]

    def _begin_attempt(self, d: Deployment, version: pb.Version) -> "_Attempt":
        self.current = version
        self._update_id = uid = uuid.uuid4().hex[:12]
        self._done, self._connected, self.progress_done, self.progress_total = {}, set(), {}, 0
        t0 = time.monotonic()
        return _Attempt(d, version, uid, t0, t0 + self.deadlines.update_s,
                        pb.UpdateRecord(version=version, method=self.method, deployment=d.address, update_id=uid))

    def _enter(self, u: "_Attempt", phase: Phase) -> None:
        """Into `phase`: status shows it, the fault hook may strike, the phase before is timed."""
        now = time.monotonic()
        if u.phase is not None:
            u.record.phase_seconds[u.phase.value.lower()] = now - (u.t0 if u.phase == Phase.NEGOTIATE else u.entered)
            if u.phase == Phase.TRANSFER:
                u.record.transfer_seconds = now - u.entered
        u.phase, u.entered = phase, now
        self.phase = u.d.phase = phase
        if u.span is not None:  # traced: a span per phase, the parent of what workers do in it
            tracing.end(u.phase_span)
            u.phase_span = tracing.start(f"trainer.{phase.value.lower()}", u.span, {"reshard.role": "trainer"})
            tracing.set_current(u.phase_span)
        faults.at_phase("trainer", phase.value, workers=self.hub)

    async def _negotiate(self, u: "_Attempt", patterns: tuple[str, ...]) -> None:
        """Both layouts (kept while unchanged: fingerprints alone travel), the backend, the plan."""
        self.hub.meter.reset()
        u.src, u.src_fp, u.src_bytes = await self.hub.layout()
        u.dst_fp, u.dst, u.dst_bytes = await self._dest_layout(u.d, u.deadline)
        try:
            u.src, u.src_fp, u.src_bytes = await self._quantized_source(u.src, u.src_fp, u.src_bytes, u.dst, u.dst_fp)
        except LayoutError as e:
            raise UpdateFailed(f"incompatible layouts, nothing transferred: {e}") from None
        try:
            u.backend = select_backend(self.backend, {w.rank: w.device for w in self.hub.alive()}, dict(enumerate(self._devices)),
                                       {w.rank: w.hello.device_uuid for w in self.hub.alive()}, dict(enumerate(self._gpus)))
        except BackendError as e:
            raise UpdateFailed(f"{e}; nothing transferred") from None
        opts = plan_options(self.bucket_bytes, u.backend)
        try:
            subset = with_scales(select_tensors(u.dst, patterns), u.dst)
        except LayoutError as e:
            raise UpdateFailed(str(e)) from None
        u.names = sorted(subset) if subset is not None else []
        try:
            u.plan = await asyncio.get_running_loop().run_in_executor(None, self.plans.plan, u.src, u.dst, opts, subset)
        except LayoutError as e:
            raise UpdateFailed(f"incompatible layouts, nothing transferred: {e}") from None
        self.progress_total = u.plan.total_bytes
        if u.plan.digest not in self._casts_logged:
            if len(self._casts_logged) > 64:
                self._casts_logged.clear()
            self._casts_logged.add(u.plan.digest)
            casts = dtype_casts(u.src, u.dst, subset)
            if casts:
                log.info("the trainer holds %s: cast on the sender, the wire carries what inference serves",
                         ", ".join(f"{n} tensors as {a} for {b}" for (a, b), n in sorted(casts.items())))

    async def _quantized_source(self, src: Layout, src_fp: str, src_bytes: bytes, dst: Layout,
                                dst_fp: str) -> tuple[Layout, str, bytes]:
        """The source layout this destination is sent from: block FP8 is quantized on the trainer
        ranks, into derived buffers of values and scales (common/layout/quantized.py). Kept per pair."""
        key = (src_fp, dst_fp)
        if key not in self._quantized:
            def build() -> tuple[Layout, str, bytes]:
                q = quantized_source(src, dst)
                if q is src:
                    return src, src_fp, src_bytes
                n = len(fp8_tensors(src, dst))
                log.info("inference serves %d tensors as block FP8: the trainer ranks quantize them, FP8 values and "
                         "scales on the wire", n)
                return q, layout_fingerprint(q), layout_bytes(q)
            if len(self._quantized) > 8:
                self._quantized.clear()
            self._quantized[key] = await asyncio.get_running_loop().run_in_executor(None, build)
        return self._quantized[key]

    async def _connect(self, u: "_Attempt") -> None:
        """The data-plane session (reused while membership is unchanged), BeginUpdate on inference,
        Prepare on every trainer worker; ends when every trainer rank joined the session and reached
        its peers (which needs the inference ranks too), so that TRANSFER times the rounds alone."""
        d, backend = u.d, u.backend
        # Inference membership too: a worker restarted there must not be handed a session its
        # peers cached with the dead process.
        gpus = ([w.hello.device_uuid for w in self.hub.alive()] + list(self._gpus)
                if backend == "hybrid" else [])  # each session rank's GPU: hosts and guests follow from it
        key_of = (u.dst_fp, self._membership, u.src_fp, self.hub.generation, backend, tuple(gpus))
        if d.session is None or d.session[1] != key_of:
            sid, nccl_id = uuid.uuid4().hex[:12], b""
            key = secrets.token_hex(16)  # the session's keys in the store live under it: never logged
            if backend in ("nccl", "hybrid"):  # a fresh id per session (so per retry): trainer worker 0 hosts its root
                rep = await self.hub.call(self.hub.workers[0], self.deadlines.rpc_s, nccl_unique_id=wpb.NcclUniqueId(session=sid))
                nccl_id = rep.nccl_unique_id
            d.session = (sid, key_of, nccl_id, key)
        d.backend = backend
        session = pb.Session(id=d.session[0], store_host=self.store_host, store_port=self.store.port,
                             src_world=u.src.world, dst_world=u.dst.world, transport=backend, nccl_unique_id=d.session[2],
                             key=d.session[3], device_uuids=gpus)
        begin = pb.BeginUpdateRequest(
            update_id=u.uid, version=u.version, plan_digest=u.plan.digest, session=session,
            timeout_s=u.deadline - time.monotonic(), method=self.method, bucket_bytes=self.bucket_bytes, tensors=u.names,
            epoch=d.epoch, allow_rollback=self.allow_rollback, src_fingerprint=u.src_fp)
        await self._begin_update(d, begin, u.src_bytes, u.deadline, u.span)
        u.began = True
        prep = wpb.Prepare(update_id=u.uid, version=u.version, plan_digest=u.plan.digest, session=session,
                           timeout_s=u.deadline - time.monotonic(), method=self.method, bucket_bytes=self.bucket_bytes,
                           tensors=u.names, src_fingerprint=u.src_fp, dst_fingerprint=u.dst_fp)
        # A cold prepare plans (seconds at scale): it has the update's deadline, and fails at once
        # if a worker goes silent.
        await self.hub.prepare_all(max(self.deadlines.rpc_s, u.deadline - time.monotonic()), prep,
                                   {u.src_fp: u.src_bytes, u.dst_fp: u.dst_bytes})
        await self._await_ranks(d, u.uid, u.deadline, lambda: len(self._connected | set(self._done)) >= self.hub.world,
                                "while connecting")

    async def _verify_and_commit(self, u: "_Attempt") -> pb.FinishUpdateReply:
        """The sources' checksums to inference, which verifies and commits on all its ranks or none."""
        reports = [td.checksums for td in self._done.values() if td.HasField("checksums")]
        values = await asyncio.get_running_loop().run_in_executor(None, verify.merge_reports, u.plan, reports)
        req = pb.FinishUpdateRequest(update_id=u.uid, expected=verify.dense(u.plan, values))
        self.hub.meter.add("FinishUpdateRequest", req)
        u.began = False  # from here inference owns the outcome: it commits on every rank or aborts itself
        return await self._finish_update(u.d, req, u.deadline, u.span)

    def _committed(self, u: "_Attempt", rep: pb.FinishUpdateReply) -> pb.UpdateOutcome:
        d, record = u.d, u.record
        self.phase = d.phase = Phase.DONE
        d.committed, d.repair = rep.committed, False
        d.last_error = ""
        record.ok, record.verified, record.verify_seconds = True, True, rep.verify_seconds
        phases = record.phase_seconds
        phases["verify"], phases["commit"] = rep.verify_seconds, rep.commit_seconds
        record.bytes, record.requests_during = rep.bytes, rep.requests_during
        record.tensors = len(u.names) if u.names else len(u.dst.tensors)
        record.seconds = time.monotonic() - u.t0
        self.hub.meter.add("FinishUpdateReply", rep)
        self.hub.finished(record)
        log.info("update %s committed in %.2fs (%s, %d bytes)", _v(u.version), record.seconds, self.method, rep.bytes)
        self.history.append(record)
        self._end_trace(u)
        return pb.UpdateOutcome(ok=True, committed=rep.committed, record=record)

    async def _failed(self, u: "_Attempt", e: Exception) -> pb.UpdateOutcome:
        """ABORT: every trainer worker and inference are told (inference even when the update never
        began there: ranks waiting to serve this version stop waiting), the session is dropped."""
        d, version = u.d, u.version
        if isinstance(e, (UpdateFailed, WorkerError, LayoutError)):
            msg = str(e)
        else:
            log.error("update %s: internal error", _v(version), exc_info=e)
            msg = f"internal error: {type(e).__name__}: {e}"
        self.phase = d.phase = Phase.ABORT
        self.last_error = f"update {_v(version)}: {msg}" if len(self.deployments) == 1 else f"update {_v(version)} on {d.address}: {msg}"
        d.last_error = msg
        log.error("update %s failed: %s", _v(version), msg)
        self.hub.send_all(abort=wpb.Abort(update_id=u.uid, reason=msg))
        d.session, d.repair = None, False
        try:
            await d.stub.AbortUpdate(pb.AbortUpdateRequest(update_id=u.uid, reason=msg, version=version),
                                     timeout=self.deadlines.rpc_s, metadata=tracing.metadata(u.span))
        except grpc.aio.AioRpcError as e2:
            if u.began:
                log.warning("abort on inference failed: %s", status_error(e2))
        u.record.ok, u.record.error, u.record.seconds = False, msg, time.monotonic() - u.t0
        self.hub.finished(u.record)
        self.history.append(u.record)
        self._end_trace(u, msg)
        return pb.UpdateOutcome(ok=False, error=msg, record=u.record)

    @staticmethod
    def _end_trace(u: "_Attempt", error: str = "") -> None:
        if u.span is None:
            return
        tracing.end(u.phase_span, error)
        tracing.set_current(None)
        tracing.end(u.span, error, {"reshard.bytes": u.record.bytes, "reshard.ok": not error})


@dataclasses.dataclass(slots=True)
class _Attempt:
    """One update of one deployment, as it goes through its phases."""

    d: Deployment
    version: pb.Version
    uid: str
    t0: float
    deadline: float
    record: pb.UpdateRecord
    phase: Phase | None = None
    entered: float = 0.0  # when the current phase began
    began: bool = False  # BeginUpdate succeeded on inference (and FinishUpdate not yet sent)
    src: Layout | None = None
    src_fp: str = ""
    src_bytes: bytes = b""
    dst: Layout | None = None
    dst_fp: str = ""
    dst_bytes: bytes = b""
    backend: str = ""
    names: list[str] = dataclasses.field(default_factory=list)
    plan: object = None
    span: object = None  # the update's trace (None: tracing is off)
    phase_span: object = None

async def serve(listen: str, workers: int, model: str, inference: list[str], *, seed: int = 0, run: str = "",
                deadlines: Deadlines | None = None, bucket_bytes: int = 0, layout_fault: str = "",
                stop: asyncio.Event, spawn_workers: bool = True, store_host: str = "", layout: str = "",
                master_dtype: str = "", backend: str = "auto", device: str = "cpu", allow_rollback: bool = False,
                worker_listen: str = "", method: str = RESHARD, metrics_listen: str = "") -> int:
    deadlines = deadlines or Deadlines()
    run = run or f"run-{uuid.uuid4().hex[:8]}"
    hub = WorkerHub(workers, "trainer")
    store_host = store_host or local_host(listen)
    ctl = TrainerController(hub, model, inference, run, store_host, deadlines, bucket_bytes=bucket_bytes, backend=backend,
                            allow_rollback=allow_rollback, method=method)
    ctl.auto_push = not spawn_workers  # standalone workers step and publish when an update is triggered

    def command(addr: str, rank: int) -> list[str]:
        cmd = module_command("reshard.trainer_svc.standalone") + ["--controller", addr, "--rank", str(rank),
               "--world", str(workers), "--model", model, "--seed", str(seed), "--run", run, "--device", device]
        return (cmd + (["--layout-fault", layout_fault] if layout_fault else []) + (["--layout", layout] if layout else [])
                + (["--master-dtype", master_dtype] if master_dtype else []))

    return await serve_controller(
        listen, hub, lambda server: rgrpc.add_TrainerServiceServicer_to_server(ctl, server),
        pb.DESCRIPTOR.services_by_name["TrainerService"].full_name, stop,
        lambda addr, waddr: f"trainer_svc listening on {addr} (run {run}, "
                     + (f"model {model}, {workers} standalone workers" if spawn_workers else
                        f"{workers} external workers{f', model label {model}' if model else ''}")
                     + f" on {waddr}, inference {', '.join(inference) or 'none'})",
        command if spawn_workers else None, (ctl.runner(), ctl.watch()), worker_timeout=deadlines.worker_s,
        worker_listen=worker_listen, metrics_listen=metrics_listen, status=lambda: ctl.GetStatus(pb.StatusRequest(), None))


def main(listen: str, workers: int, model: str, inference: list[str], seed: int, run: str, deadlines: Deadlines,
         bucket_bytes: int, layout_fault: str, spawn_workers: bool = True, store_host: str = "", layout: str = "",
         master_dtype: str = "", backend: str = "auto", device: str = "cpu", allow_rollback: bool = False,
         worker_listen: str = "", method: str = RESHARD, metrics_listen: str = "") -> int:
    return run_main(lambda stop: serve(listen, workers, model, inference, seed=seed, run=run, deadlines=deadlines,
                                       bucket_bytes=bucket_bytes, layout_fault=layout_fault, stop=stop,
                                       spawn_workers=spawn_workers, store_host=store_host, layout=layout,
                                       master_dtype=master_dtype, backend=backend, device=device,
                                       allow_rollback=allow_rollback, worker_listen=worker_listen, method=method,
                                       metrics_listen=metrics_listen))
