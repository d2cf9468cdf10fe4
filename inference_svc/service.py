"""inference_svc: the inference deployment's controller.

Exposes the deployment's layout, takes part in updates (validate, plan, receive,
verify, commit on all ranks or none), reports what it serves, and reassembles
canonical tensors for operators (`Dump`)."""

from __future__ import annotations

import asyncio
import logging
import sys
import time

import grpc

from reshard.common.hub import WorkerConn, WorkerError, WorkerHub, merge_rank_layouts, serve_controller
from reshard.common.layout import Layout, LayoutError, dtype_of
from reshard.common.planner import PlanOptions, make_plan
from reshard.common.rpc import Deadlines, run_main
from reshard.common.supervisor import module_command
from reshard.proto import reshard_pb2 as pb
from reshard.proto import reshard_pb2_grpc as rgrpc
from reshard.proto import worker_pb2 as wpb

log = logging.getLogger("reshard.inference_svc")

DUMP_CHUNK = 1 << 20


def _v(version: pb.Version | None) -> str:
    return f"{version.run}:{version.step}" if version is not None else "none"


class _Update:
    def __init__(self, req: pb.BeginUpdateRequest, world: int) -> None:
        self.id, self.version, self.mode = req.update_id, req.version, req.mode or "reshard"
        self.phase = "NEGOTIATE"
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


class InferenceController(rgrpc.InferenceServiceServicer):
    def __init__(self, hub: WorkerHub, model: str, deadlines: Deadlines) -> None:
        self.hub, self.model, self.deadlines = hub, model, deadlines
        hub.on_event = self._on_event
        hub.on_disconnect = self._on_disconnect
        self.update: _Update | None = None
        self.committed: pb.Version | None = None
        self.history: list[pb.UpdateRecord] = []
        self.last_error = ""
        self._layout: tuple[int, Layout] | None = None
        self._lock = asyncio.Lock()
        self._not_serving = False  # an in-place update failed midway

    # -- state -----------------------------------------------------------------------------
    def layout(self) -> Layout:
        if self._layout is None or self._layout[0] != self.hub.generation:
            self._layout = (self.hub.generation, merge_rank_layouts(self.hub.alive()))
        return self._layout[1]

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

    def _on_disconnect(self, conn: WorkerConn) -> None:
        u = self.update
        if u is not None and u.phase not in ("DONE", "ABORT"):
            u.error = u.error or f"inference worker rank {conn.rank} (pid {conn.pid}) died during the update"
            u.changed.set()

    def serving_state(self) -> str:
        alive = self.hub.alive()
        if self._not_serving:
            return "NOT_SERVING"
        if not alive:
            return "NOT_SERVING"
        versions = {_v(w.version) for w in alive}
        if len(alive) < self.hub.world or len(versions) > 1:
            return "DEGRADED"
        return "SERVING"

    def served_version(self) -> pb.Version | None:
        alive = self.hub.alive()
        versions = {_v(w.version) for w in alive}
        if alive and len(versions) == 1 and alive[0].version is not None:
            return alive[0].version
        return None

    # -- RPCs ----------------------------------------------------------------------------
    async def GetLayout(self, request, context):
        try:
            await self.hub.wait_complete(self.deadlines.rpc_s)
            layout = self.layout()
        except (WorkerError, LayoutError) as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return pb.LayoutReply(model=self.model, layout=layout.to_bytes(), fingerprint=layout.fingerprint(), workers=self.hub.world,
                              devices=[w.device for w in self.hub.alive()])

    async def BeginUpdate(self, req: pb.BeginUpdateRequest, context):
        if not req.update_id or not req.version.run or not req.src_layout or not req.session.id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "BeginUpdate needs update_id, version.run, src_layout and session")
        async with self._lock:
            if self.update is not None and self.update.phase not in ("DONE", "ABORT"):
                await self._abort(self.update, f"superseded by update {req.update_id}")
            served = self.committed
            if served is not None and served.run == req.version.run and req.version.step <= served.step:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"version {_v(req.version)} does not advance the committed {_v(served)} of the same run")
            u = _Update(req, self.hub.world)
            self.update = u
            try:
                await self.hub.wait_complete(self.deadlines.rpc_s)
                dst = self.layout()
                src = Layout.from_bytes(req.src_layout)
                opts = PlanOptions(bucket_bytes=req.bucket_bytes) if req.bucket_bytes else PlanOptions()
                subset = set(req.tensors) if req.tensors else None
                plan = await asyncio.get_running_loop().run_in_executor(None, make_plan, src, dst, opts, subset)
                u.tensors = len(subset) if subset else len(dst.tensors)
                if plan.digest != req.plan_digest:
                    raise LayoutError(f"plan digest mismatch: trainer {req.plan_digest}, inference {plan.digest}")
                u.bytes_total = plan.total_bytes
                u.phase = "CONNECT"
                u.requests_at_start = sum(w.requests_served for w in self.hub.alive())
                prep = wpb.Prepare(update_id=u.id, version=req.version, src_layout=req.src_layout, dst_layout=dst.to_bytes(),
                                   plan_digest=plan.digest, session=req.session, timeout_s=req.timeout_s, mode=u.mode,
                                   bucket_bytes=req.bucket_bytes, tensors=req.tensors)
                await self.hub.call_all(self.deadlines.rpc_s, prepare=prep)
                u.phase = "TRANSFER"
            except LayoutError as e:
                await self._fail(u, str(e))
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
            except WorkerError as e:
                await self._abort(u, str(e))
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return pb.BeginUpdateReply(bytes_total=u.bytes_total)

    async def FinishUpdate(self, req: pb.FinishUpdateRequest, context):
        u = self.update
        if u is None or u.id != req.update_id:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no update {req.update_id!r} in progress")
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
            u.phase = "VERIFY"
            t0 = time.perf_counter()
            left = max(1.0, u.deadline - time.monotonic())
            await self.hub.call_all(left, verify=wpb.Verify(update_id=u.id, expected=req.expected))
            verify_s = time.perf_counter() - t0
            u.phase = "COMMIT"
            await self.hub.call_all(max(1.0, u.deadline - time.monotonic()), commit=wpb.Commit(update_id=u.id, version=u.version))
        except (WorkerError, LayoutError) as e:
            await self._abort(u, str(e))
            await context.abort(grpc.StatusCode.ABORTED, f"update {_v(u.version)} failed: {e}")
        u.phase = "DONE"
        self.committed = u.version
        self._not_serving = False
        for w in self.hub.alive():
            w.version = u.version
        nbytes = sum(d.bytes for d in u.done.values())
        during = sum(w.requests_served for w in self.hub.alive()) - u.requests_at_start
        self.history.append(pb.UpdateRecord(version=u.version, ok=True, seconds=time.monotonic() - u.started, bytes=nbytes,
                                            verified=True, verify_seconds=verify_s, mode=u.mode, requests_during=max(0, during),
                                            tensors=u.tensors))
        self.history = self.history[-100:]
        log.info("committed %s (%s, %d bytes)", _v(u.version), u.mode, nbytes)
        return pb.FinishUpdateReply(committed=u.version, verify_seconds=verify_s, bytes=nbytes, requests_during=max(0, during))

    async def AbortUpdate(self, req: pb.AbortUpdateRequest, context):
        u = self.update
        if u is not None and u.id == req.update_id and u.phase not in ("DONE", "ABORT"):
            await self._abort(u, req.reason or "aborted by the trainer")
        return pb.AbortUpdateReply()

    async def expire(self) -> None:
        """Abort an update whose deadline passed without the trainer finishing or aborting it."""
        u = self.update
        if u is not None and u.phase not in ("DONE", "ABORT") and time.monotonic() > u.deadline + self.deadlines.rpc_s:
            await self._abort(u, "update deadline passed without FinishUpdate (trainer gone?)")

    async def _fail(self, u: _Update, error: str) -> None:
        u.phase, u.error = "ABORT", u.error or error
        self.last_error = error
        self.history.append(pb.UpdateRecord(version=u.version, ok=False, error=error, mode=u.mode, seconds=time.monotonic() - u.started))
        self.history = self.history[-100:]
        log.error("update %s failed: %s", _v(u.version), error)

    async def _abort(self, u: _Update, reason: str) -> None:
        if u.phase in ("DONE", "ABORT"):
            return
        in_flight = u.phase in ("TRANSFER", "VERIFY", "COMMIT")
        self.hub.send_all(abort=wpb.Abort(update_id=u.id, reason=reason))
        if in_flight and self.inplace:
            self._not_serving = True
        await self._fail(u, reason)

    inplace = False

    async def GetStatus(self, request, context):
        st = pb.Status(role="inference", model=self.model, serving_state=self.serving_state(), last_error=self.last_error)
        v = self.served_version()
        if v is not None:
            st.version.CopyFrom(v)
            st.has_version = True
        u = self.update
        if u is not None:
            st.update_in_progress = u.phase not in ("DONE", "ABORT")
            st.progress.CopyFrom(pb.UpdateProgress(phase=u.phase, bytes_done=sum(u.progress.values()), bytes_total=u.bytes_total, version=u.version))
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
            st.workers.append(h)
        st.requests_served = sum(w.requests_served for w in self.hub.workers.values())
        st.requests_during_updates = sum(w.requests_during_update for w in self.hub.workers.values())
        st.history.extend(self.history[-20:])
        return st

    async def Dump(self, req: pb.DumpRequest, context):
        if not req.tensor:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "DumpRequest.tensor is required")
        try:
            layout = self.layout()
        except LayoutError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        spec = layout.tensors.get(req.tensor)
        if spec is None:
            close = sorted(n for n in layout.tensors if req.tensor.split(".")[-2:] == n.split(".")[-2:])[:3]
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown tensor {req.tensor!r}" + (f"; did you mean {', '.join(close)}?" if close else ""))
        import torch

        dt = dtype_of(spec.dtype)
        full = torch.empty(spec.shape, dtype=dt)
        covered = torch.zeros(spec.shape, dtype=torch.bool)
        version = None
        sources = self.hub.alive()
        if req.HasField("rank"):
            sources = [w for w in sources if w.rank == req.rank]
            if not sources:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"inference worker rank {req.rank} is not attached")
        for w in sources:
            try:
                pieces = await self.hub.read(w, req.tensor, self.deadlines.rpc_s)
            except WorkerError as e:
                log.warning("dump: %s", e)
                continue
            boxes: dict[tuple, bytearray] = {}
            for p in pieces:
                boxes.setdefault((tuple(p.offset), tuple(p.size)), bytearray()).extend(p.data)
                if p.HasField("version"):
                    if version is not None and _v(version) != _v(p.version):
                        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                            f"workers hold different versions ({_v(version)} and {_v(p.version)}); the deployment is degraded")
                    version = p.version
            for (off, size), data in boxes.items():
                sl = tuple(slice(o, o + s) for o, s in zip(off, size))
                full[sl] = torch.frombuffer(bytes(data), dtype=dt).view(size)
                covered[sl] = True
        if not bool(covered.all()):
            missing = int((~covered).sum())
            who = f"worker rank {req.rank}" if req.HasField("rank") else "any live worker"
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"tensor {req.tensor!r}: {missing} elements are not held by {who}")
        data = full.view(-1).view(torch.uint8).numpy().tobytes()
        for off in range(0, len(data), DUMP_CHUNK):
            chunk = pb.DumpChunk(name=req.tensor, shape=list(spec.shape), dtype=spec.dtype, offset=off,
                                 data=data[off : off + DUMP_CHUNK], total_bytes=len(data))
            if version is not None:
                chunk.version.CopyFrom(version)
            yield chunk


async def serve(listen: str, workers: int, model: str, *, seed: int = 0, mode: str = "shadow", layout: str = "",
                deadlines: Deadlines | None = None, stop: asyncio.Event, spawn_workers: bool = True, device: str = "cpu") -> int:
    deadlines = deadlines or Deadlines()
    hub = WorkerHub(workers, "inference")
    ctl = InferenceController(hub, model, deadlines)
    ctl.inplace = mode == "inplace"

    def command(addr: str, rank: int) -> list[str]:
        return module_command("reshard.inference_svc.standalone") + ["--controller", addr, "--rank", str(rank),
                "--world", str(workers), "--model", model, "--seed", str(seed), "--mode", mode, "--device", device] + (
                    ["--layout", layout] if layout else [])

    async def watchdog() -> None:
        while True:
            await asyncio.sleep(1.0)
            await ctl.expire()

    return await serve_controller(
        listen, hub, lambda server: rgrpc.add_InferenceServiceServicer_to_server(ctl, server),
        pb.DESCRIPTOR.services_by_name["InferenceService"].full_name, stop,
        lambda addr: f"inference_svc listening on {addr} (model {model}, {workers} workers, {mode} mode)",
        command if spawn_workers else None, (watchdog(),))


def main(listen: str, workers: int, model: str, seed: int, mode: str, deadlines: Deadlines, spawn_workers: bool = True,
         layout: str = "", device: str = "cpu") -> int:
    return run_main(lambda stop: serve(listen, workers, model, seed=seed, mode=mode, deadlines=deadlines, stop=stop,
                                       spawn_workers=spawn_workers, layout=layout, device=device))
