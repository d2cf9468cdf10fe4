"""Controller side of the internal worker protocol: the workers attached to one
controller, each over one bidirectional gRPC stream it opened.

Commands are sent by id; replies resolve futures; events (progress, transfer
done, published) go to the controller's callbacks. A stream that ends marks the
worker dead and fails its pending calls at once."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import itertools
import logging
import os
import sys
import time
from collections.abc import Callable

import grpc

from reshard.common.control import tracing
from reshard.common.control.rpc import keep_task
from reshard.common.control.supervisor import CONTROLLER_PID_KEY
from reshard.common.layout.core import Layout, merge_ranks
from reshard.common.layout.wire import layout_bytes, layout_fingerprint, layout_from_bytes
from reshard.proto import reshard_pb2 as pb
from reshard.proto import worker_pb2 as wpb
from reshard.proto import worker_pb2_grpc as wgrpc

log = logging.getLogger("reshard.hub")


class ControlMeter:
    """Control-plane bytes of one update: the total and the largest message (by serialized size)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.total, self.largest, self.largest_kind = 0, 0, ""

    def add(self, kind: str, msg) -> None:
        n = msg.ByteSize()
        self.total += n
        if n > self.largest:
            self.largest, self.largest_kind = n, kind

    def record(self, r: pb.UpdateRecord) -> None:
        r.control_bytes, r.max_control_message_bytes, r.max_control_message = self.total, self.largest, self.largest_kind


_UNMETERED = ("heartbeat", "piece")  # not part of an update: liveness, and dumps

# Commands queued for one worker's stream at most. A worker reads them as they come (a handful per
# update); one that stops reading (frozen, or its process stalled) while commands keep coming is
# dropped when this many wait: its stream is cancelled, the queue emptied, its pending calls fail, and
# the worker, when it runs again, finds its stream gone and aborts what it had in flight.
QUEUE_LIMIT = 256
TRACED = frozenset({"prepare", "verify", "commit", "step", "release"})  # commands a worker traces (tracing.py)


class WorkerError(RuntimeError):
    """A worker answered a command with an error, died, or did not answer in time."""


@dataclasses.dataclass(slots=True)
class WorkerConn:
    rank: int
    hello: wpb.Hello
    queue: asyncio.Queue
    pending: dict[int, asyncio.Future] = dataclasses.field(default_factory=dict)
    pieces: dict[int, list[wpb.ReadPiece]] = dataclasses.field(default_factory=dict)
    alive: bool = True
    busy: bool = False
    requests_served: int = 0
    requests_during_update: int = 0
    requests_by_version: dict[str, int] = dataclasses.field(default_factory=dict)
    version: pb.Version | None = None
    stale: bool = False  # silent for longer than the hub's worker timeout (frozen?)
    held: bool = True  # inference: not serving requests (it says so in every heartbeat)
    allowed: bool | None = None  # inference: what its controller last told it (serve or hold)
    last_seen: float = dataclasses.field(default_factory=time.monotonic)
    memory: dict[str, int] = dataclasses.field(default_factory=dict)  # from its last finished transfer
    layouts: set[str] = dataclasses.field(default_factory=set)  # layout fingerprints sent on this stream

    @property
    def pid(self) -> int:
        return self.hello.pid

    @property
    def device(self) -> str:
        return self.hello.device or "cpu"

    def health(self, h: pb.WorkerHealth) -> None:
        """Fill in what every worker reports: device and memory."""
        h.device = self.device
        h.memory.update(self.memory)


class WorkerHub(wgrpc.WorkerControlServicer):
    def __init__(self, world: int, role: str) -> None:
        self.world, self.role = world, role
        self.workers: dict[int, WorkerConn] = {}
        self._ids = itertools.count(1)
        self.changed = asyncio.Condition()
        self.on_event: Callable[[WorkerConn, wpb.WorkerMessage], None] | None = None
        self.on_disconnect: Callable[[WorkerConn], None] | None = None
        self.on_attach: Callable[[WorkerConn], None] | None = None
        self.on_stale: Callable[[WorkerConn], None] | None = None
        self.generation = 0  # bumps whenever membership changes
        self.stopping = False
        self.supervisor = None  # common.supervisor.Supervisor, when this controller runs standalone workers
        self.worker_address = ""  # where its workers attach (serve_controller's worker listener)
        self.default_run = ""  # the run of versions a worker reports without one (a trainer made without run=)
        self.meter = ControlMeter()  # the controller resets it when an update begins
        self.metrics = None  # common.control.metrics.ControllerMetrics, with --metrics-listen
        self._layout: tuple[int, asyncio.Future] | None = None  # (generation, (layout, fingerprint, bytes))
        self._tasks: set[asyncio.Task] = set()

    def own(self, v: pb.Version) -> pb.Version:
        """A version a worker reported, with this controller's run filled in when it gave none."""
        if not v.run and self.default_run:
            v = pb.Version(run=self.default_run, step=v.step)
        return v

    def why_missing(self, rank: int) -> str:
        """Why a rank's worker is not attached, when its supervisor knows ('' otherwise)."""
        return self.supervisor.error(rank) if self.supervisor is not None else ""

    def missing_error(self, missing: list[int], what: str) -> str:
        reasons = [f"rank {r}: {why}" for r in missing if (why := self.why_missing(r))]
        return f"{self.role} workers {missing} {what}" + ("; " + "; ".join(reasons) if reasons else "")

    def worker_state(self, rank: int) -> tuple[str, str]:
        """(state, detail) of a rank for status: READY, or DEAD/STARTING/RESTARTING/FAILED and why."""
        w = self.workers.get(rank)
        if w is not None and w.alive:
            return ("UNRESPONSIVE", f"silent for {time.monotonic() - w.last_seen:.1f}s") if w.stale else ("READY", "")
        if self.supervisor is not None:
            st = self.supervisor.state(rank)
            state = "STARTING" if st == "RUNNING" else ("DEAD" if st == "STOPPED" else st)
            return state, self.supervisor.error(rank)
        return "DEAD", ""

    # -- the stream ------------------------------------------------------------------
    async def Attach(self, request_iterator, context):
        try:
            first = await request_iterator.__anext__()
        except StopAsyncIteration:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a worker stream must begin with hello; it was empty")
        if first.WhichOneof("kind") != "hello":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message of a worker stream must be hello")
        h = first.hello
        if h.role != self.role:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"a {h.role} worker attached to the {self.role} controller")
        if not 0 <= h.rank < self.world or h.world != self.world:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"worker rank {h.rank} of world {h.world} does not fit this deployment of {self.world} workers")
        sup = self.supervisor
        if sup is not None and not sup.accepts(h.rank, h.pid):
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"{self.role} rank {h.rank} is held by worker pid {sup.holder(h.rank)}, not pid {h.pid}")
        old = self.workers.get(h.rank)
        if old is not None and old.alive:
            # A rank's live worker is never swapped out by a newcomer: only the same worker (its pid and
            # the nonce only it knows) may take over its rank on a new stream.
            if old.pid != h.pid or not hmac.compare_digest(old.hello.instance, h.instance):
                await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                    f"{self.role} rank {h.rank} is held by live worker pid {old.pid}"
                                    + (f", not pid {h.pid}" if old.pid != h.pid else " (another worker claimed its pid)"))
            self._drop(old, "its worker attached again")  # the same process, on a new stream
        # Accepted: the first metadata says so (a worker is connected only once it has it), and who
        # adopted it (a worker whose controller died waits for a restarted one: common/control/supervisor.py).
        await context.send_initial_metadata(((CONTROLLER_PID_KEY, str(os.getpid())),))
        conn = WorkerConn(h.rank, h, asyncio.Queue(), version=self.own(h.version) if h.has_version else None)
        self.workers[h.rank] = conn
        self.generation += 1
        log.info("%s worker rank %d attached (pid %d)", self.role, h.rank, h.pid)
        if self.supervisor is not None:
            self.supervisor.attached(h.rank, h.pid)
        if self.on_attach:
            self.on_attach(conn)
        if self.complete():  # build the layout now, not inside the first update's deadline
            keep_task(self._tasks, self._prewarm())
        await self._notify()

        async def reader() -> None:
            try:
                async for msg in request_iterator:
                    conn.last_seen = time.monotonic()
                    if conn.stale:
                        conn.stale = False
                        log.warning("%s worker rank %d (pid %d) answers again", self.role, conn.rank, conn.pid)
                    self._dispatch(conn, msg)
            except (grpc.aio.AioRpcError, asyncio.CancelledError):
                pass
            finally:
                conn.queue.put_nowait(None)

        task = asyncio.get_running_loop().create_task(reader())
        try:
            while True:
                item = await conn.queue.get()
                if item is None:
                    break
                yield item
        finally:
            task.cancel()
            if self.workers.get(h.rank) is conn:
                self._drop(conn, "its stream ended")
                await self._notify()

    def finished(self, record, deployment: str = "") -> None:
        """An update ended (committed or failed): its control-plane figures, and the metrics."""
        self.meter.record(record)
        if self.metrics is not None:
            self.metrics.record(record, deployment)

    async def layout(self) -> tuple[Layout, str, bytes]:
        """This side's layout from its workers' hellos, with its fingerprint and bytes: built off
        the loop once per membership (callers at the same time share the one build)."""
        gen = self.generation
        if self._layout is None or self._layout[0] != gen:
            conns = self.alive()

            def build() -> tuple[Layout, str, bytes]:
                lay = merge_rank_layouts(conns)
                return lay, layout_fingerprint(lay), layout_bytes(lay)

            self._layout = (gen, asyncio.get_running_loop().run_in_executor(None, build))
        return await asyncio.shield(self._layout[1])

    async def _prewarm(self) -> None:
        try:
            await self.layout()
        except Exception as e:  # noqa: BLE001 - the call that needs the layout reports it
            log.debug("building the %s layout failed: %s", self.role, e)

    def _drop(self, conn: WorkerConn, why: str) -> None:
        if not conn.alive:
            return
        conn.alive = False
        while not conn.queue.empty():  # nothing queued reaches a stream that ends
            conn.queue.get_nowait()
        conn.queue.put_nowait(None)
        (log.info if self.stopping else log.warning)("%s worker rank %d (pid %d) lost: %s", self.role, conn.rank, conn.pid, why)
        for fut in conn.pending.values():
            if not fut.done():
                fut.set_exception(WorkerError(f"{self.role} worker rank {conn.rank} died ({why})"))
        conn.pending.clear()
        self.generation += 1
        if self.on_disconnect:
            self.on_disconnect(conn)

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    def _dispatch(self, conn: WorkerConn, msg: wpb.WorkerMessage) -> None:
        kind = msg.WhichOneof("kind")
        if kind not in _UNMETERED:
            self.meter.add(f"worker:{kind}", msg)
        if kind == "done" and msg.done.memory:
            conn.memory = dict(msg.done.memory)
        if kind == "reply":
            fut = conn.pending.pop(msg.reply.id, None)
            if fut is not None and not fut.done():
                fut.set_result(msg.reply)
        elif kind == "piece":
            conn.pieces.setdefault(msg.piece.id, []).append(msg.piece)
        elif kind == "heartbeat":
            conn.requests_served = msg.heartbeat.requests_served
            conn.requests_during_update = msg.heartbeat.requests_during_update
            conn.requests_by_version = dict(msg.heartbeat.requests_by_version)
            conn.version = self.own(msg.heartbeat.version) if msg.heartbeat.has_version else None
            conn.held = msg.heartbeat.held
        elif self.on_event:
            self.on_event(conn, msg)

    async def watch_stale(self, after: float) -> None:
        """Flag workers that sent nothing (heartbeats come every 0.5 s) for `after` seconds: a frozen
        process keeps its stream open, so only its silence tells."""
        period = min(0.25, after / 4)
        last = time.monotonic()
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            if now - last > max(1.0, after / 2):
                # This controller did not run meanwhile (frozen, or its host stalled): the silence is
                # its own. Its workers' heartbeats wait in the socket; give each a fresh window.
                log.warning("%s controller did not run for %.1fs: not judging its workers' silence for that time",
                            self.role, now - last)
                for w in self.alive():
                    w.last_seen = max(w.last_seen, now)
            last = now
            for w in self.alive():
                if not w.stale and now - w.last_seen > after:
                    w.stale = True
                    log.warning("%s worker rank %d (pid %d) has been silent for %.1fs", self.role, w.rank, w.pid, now - w.last_seen)
                    # A call may wait as long as its deadline while the worker works (planning a
                    # large pair takes seconds); a silent one fails it now.
                    for fut in w.pending.values():
                        if not fut.done():
                            fut.set_exception(WorkerError(f"{self.role} worker rank {w.rank} (pid {w.pid}) stopped "
                                                          f"answering (silent for {now - w.last_seen:.1f}s)"))
                    w.pending.clear()
                    if self.on_stale:
                        self.on_stale(w)

    def stale_error(self) -> str:
        stale = [w for w in self.alive() if w.stale]
        return ", ".join(f"{self.role} worker rank {w.rank} (pid {w.pid}) stopped answering "
                         f"(silent for {time.monotonic() - w.last_seen:.1f}s)" for w in stale)

    # -- commands --------------------------------------------------------------------
    def alive(self) -> list[WorkerConn]:
        return [w for r, w in sorted(self.workers.items()) if w.alive]

    def complete(self) -> bool:
        return len(self.alive()) == self.world

    async def wait_complete(self, timeout: float) -> None:
        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait_for(self.complete), timeout)
            except asyncio.TimeoutError:
                missing = sorted(set(range(self.world)) - {w.rank for w in self.alive()})
                raise WorkerError(self.missing_error(missing, f"are not attached after {timeout:.0f}s")) from None

    async def call(self, conn: WorkerConn, timeout: float, **command) -> wpb.Reply:
        if not conn.alive:
            raise WorkerError(f"{self.role} worker rank {conn.rank} is not attached")
        cid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        conn.pending[cid] = fut
        self._put(conn, wpb.ControllerMessage(id=cid, **command))
        try:
            reply = await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            conn.pending.pop(cid, None)
            name = next(iter(command))
            raise WorkerError(f"{self.role} worker rank {conn.rank} (pid {conn.pid}) did not answer {name} within {timeout:.1f}s") from None
        if not reply.ok:
            raise WorkerError(f"{self.role} worker rank {conn.rank}: {reply.error}")
        return reply

    def _put(self, conn: WorkerConn, msg: wpb.ControllerMessage) -> None:
        kind = msg.WhichOneof("command")
        if (span := tracing.current()) is not None and kind in TRACED:  # the worker's span is a child of our phase
            msg.trace.update(tracing.carrier(span))
        if kind != "read":
            self.meter.add(f"controller:{kind}", msg)
        self._queue(conn, msg)

    def _queue(self, conn: WorkerConn, msg: wpb.ControllerMessage) -> None:
        """Queue a command on the worker's stream; a worker that left QUEUE_LIMIT unread is dropped."""
        if not conn.alive:
            return
        if conn.queue.qsize() >= QUEUE_LIMIT:
            self._drop(conn, f"it stopped reading its stream ({QUEUE_LIMIT} commands unread)")
            return
        conn.queue.put_nowait(msg)

    async def call_all(self, timeout: float, each: Callable[[WorkerConn], dict] | None = None, **command) -> list[wpb.Reply]:
        """One command to every worker, and their replies; `each(conn)` makes each worker's own."""
        if not self.complete():
            missing = sorted(set(range(self.world)) - {w.rank for w in self.alive()})
            raise WorkerError(self.missing_error(missing, "are not attached (deployment degraded)"))
        results = await asyncio.gather(*(self.call(w, timeout, **(each(w) if each else command)) for w in self.alive()),
                                       return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results

    async def prepare_all(self, timeout: float, base: wpb.Prepare, layouts: dict[str, bytes]) -> list[wpb.Reply]:
        """Prepare every worker. A layout's bytes (fingerprint -> bytes) go only to a worker that
        was not sent them on its current stream: steady updates carry fingerprints alone."""
        def each(conn: WorkerConn) -> dict:
            p = wpb.Prepare()
            p.CopyFrom(base)
            for fp, field in ((base.src_fingerprint, "src_layout"), (base.dst_fingerprint, "dst_layout")):
                if fp not in conn.layouts:
                    setattr(p, field, layouts[fp])
                    conn.layouts.add(fp)
            return {"prepare": p}

        try:
            return await self.call_all(timeout, each)
        except BaseException:
            for w in self.workers.values():  # whatever they hold now, the next update sends them again
                w.layouts.clear()
            raise

    def send(self, conn: WorkerConn, **command) -> None:
        """Fire and forget to one worker."""
        if conn.alive:
            self._put(conn, wpb.ControllerMessage(id=next(self._ids), **command))

    def send_all(self, **command) -> None:
        """Fire and forget (abort): no reply awaited."""
        for w in self.alive():
            self._put(w, wpb.ControllerMessage(id=next(self._ids), **command))

    async def read(self, conn: WorkerConn, tensor: str, timeout: float, offset: tuple[int, ...] = (),
                   size: tuple[int, ...] = ()) -> list[wpb.ReadPiece]:
        """The pieces of `tensor` a worker holds within the region (offset, size) (empty: the whole
        tensor): each intersection of its boxes with the region, in one or more pieces (byte_offset).
        A read that times out or whose caller goes away drops the pieces that still arrive for it."""
        if not conn.alive:
            raise WorkerError(f"{self.role} worker rank {conn.rank} is not attached")
        cid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        conn.pending[cid] = fut
        self._queue(conn, wpb.ControllerMessage(id=cid, read=wpb.Read(tensor=tensor, offset=offset, size=size)))

        def drop(f: asyncio.Future) -> None:  # the reply ends the pieces: drop any that came for nobody
            conn.pieces.pop(cid, None)
            if not f.cancelled():
                f.exception()  # retrieved: not logged as never retrieved

        try:
            reply = await asyncio.wait_for(asyncio.shield(fut), timeout)
        except BaseException as e:
            conn.pieces.pop(cid, None)
            if fut.done():
                drop(fut)
            else:
                fut.add_done_callback(drop)  # stays pending until the worker answers, dies or falls silent
            if isinstance(e, asyncio.TimeoutError):
                raise WorkerError(f"{self.role} worker rank {conn.rank} did not answer the read within {timeout:.1f}s") from None
            raise
        pieces = conn.pieces.pop(cid, [])
        if not reply.ok:
            raise WorkerError(f"{self.role} worker rank {conn.rank}: {reply.error}")
        return pieces


def merge_rank_layouts(conns: list[WorkerConn]) -> Layout:
    """One side's layout, assembled from the rank layouts its workers declared in their hello:
    in columns, each distinct rank layout decoded once (replicas declare the same bytes)."""
    parts: list[Layout] = []
    index: dict[bytes, int] = {}
    rank_part = []
    for c in sorted(conns, key=lambda c: c.rank):
        k = index.get(c.hello.rank_layout)
        if k is None:
            k = index[c.hello.rank_layout] = len(parts)
            parts.append(layout_from_bytes(c.hello.rank_layout))
        rank_part.append(k)
    return merge_ranks(parts, rank_part)


def local_host(listen: str) -> str:
    """The host to reach a server listening on `listen` from this machine (wildcards -> loopback)."""
    host = listen.rpartition(":")[0]
    return "127.0.0.1" if host in ("0.0.0.0", "[::]", "") else host


async def serve_controller(listen: str, hub: WorkerHub, add_servicer, service: str, stop: asyncio.Event,
                           banner: Callable[[str, str], str], command: Callable[[str, int], list[str]] | None,
                           background: tuple = (), worker_timeout: float = 5.0, worker_listen: str = "",
                           on_listen: Callable[[str], None] | None = None, metrics_listen: str = "",
                           status=None) -> int:
    """Run a controller until `stop`: its gRPC service (with health and reflection) on `listen`,
    the worker protocol on a listener of its own (`worker_listen`: HOST:PORT, or by default a
    Unix socket in the private run folder), its background coroutines, and (when `command` is
    given) standalone workers as supervised processes, which get a worker token made for them.
    Shutdown: health NOT_SERVING, workers stopped, servers drained."""
    import secrets

    from reshard.common.control.rpc import start_server, stop_server
    from reshard.common.control.security import set_client_roles
    from reshard.common.control.supervisor import RunDirError, Supervisor, recorded_worker_token, run_dir, run_file

    uses_run_dir = bool(command) or not worker_listen  # run files, or the default worker socket
    if uses_run_dir:
        try:
            run_dir()  # before anything listens: a folder others could write into is refused
        except RunDirError as e:
            print(f"reshard {hub.role}: {e}", file=sys.stderr, flush=True)
            return 2

    # A controller process accepts every role's token it holds, but calls as one role only: the
    # trainer controller calls inference as a peer; the inference controller calls nobody.
    set_client_roles(("peer",) if hub.role == "trainer" else ())

    def register(server):
        add_servicer(server)
        return [service]

    def register_workers(server):
        wgrpc.add_WorkerControlServicer_to_server(hub, server)
        return [wpb.DESCRIPTOR.services_by_name["WorkerControl"].full_name]

    if metrics_listen:  # Prometheus metrics (common/control/metrics.py): the registry before the server it counts
        from reshard.common.control.metrics import ControllerMetrics

        hub.metrics = ControllerMetrics(hub.role, status, asyncio.get_running_loop(),
                                        restarts=lambda: max(0, hub.supervisor.starts - hub.world) if hub.supervisor else 0)
    server, hs, port = await start_server(listen, register, services=[service],
                                          interceptors=[hub.metrics.interceptor()] if hub.metrics else [])
    if hub.metrics is not None:
        from reshard.common.control.security import SecurityError, current

        try:
            mport = hub.metrics.serve(metrics_listen, current())
        except (SecurityError, OSError, ValueError) as e:
            await stop_server(server, hs, 0)
            print(f"reshard {hub.role}: --metrics-listen {metrics_listen}: {e}", file=sys.stderr, flush=True)
            return 2
        log.info("%s controller metrics on %s:%d/metrics", hub.role, local_host(metrics_listen), mport)
    addr = f"{local_host(listen)}:{port}"
    runs = run_file(hub.role, addr) if uses_run_dir else ""
    worker_listen = worker_listen or f"unix:{runs[:-len('.json')]}.sock"
    # Standalone workers hold a token made for them (kept in the run file, so that a restarted
    # controller accepts the workers it adopts); external workers bring a configured one.
    token = (recorded_worker_token(runs) or secrets.token_urlsafe(32)) if command else ""
    try:
        wserver, whs, wport = await start_server(worker_listen, register_workers, worker_tokens=[token] if token else [],
                                                 what="worker listen address",
                                                 services=[wpb.DESCRIPTOR.services_by_name["WorkerControl"].full_name])
    except BaseException:
        await stop_server(server, hs, 0)
        raise
    waddr = worker_listen if worker_listen.startswith("unix:") else f"{local_host(worker_listen)}:{wport}"
    hub.worker_address = waddr
    if on_listen:
        on_listen(waddr)
    if os.environ.get("RESHARD_LOG_FORMAT", "text") != "json":  # JSON logs: the log line below is the banner
        print(banner(addr, waddr), file=sys.stderr, flush=True)
    log.info("%s", banner(addr, waddr))
    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(coro) for coro in (*background, hub.watch_stale(worker_timeout))]
    sup = Supervisor(hub.role, hub.world, lambda rank: command(waddr, rank), run_file=runs,
                     env={"RESHARD_TOKEN_WORKER": token}) if command else None
    hub.supervisor = sup
    if sup:
        tasks.append(loop.create_task(sup.run()))
    await stop.wait()
    log.info("%s controller shutting down", hub.role)
    hub.stopping = True
    if sup:
        await sup.stop()
    for t in tasks:
        t.cancel()
    await stop_server(server, hs)
    await stop_server(wserver, whs)
    if hub.metrics is not None:
        hub.metrics.stop()
    if waddr.startswith("unix:"):
        with contextlib.suppress(OSError):
            os.unlink(waddr[len("unix:"):])
    return 0
