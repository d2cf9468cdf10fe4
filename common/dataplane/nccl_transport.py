"""The NCCL data plane behind the `Transport` interface (CUDA buffers).

One communicator per session. Its `ncclUniqueId` is made by trainer worker 0 (whose
process hosts NCCL's bootstrap root) and relayed to every worker by the controllers in
`reshard.v1.Session.nccl_unique_id`; a retried update gets a new session and a fresh id.

Never hanging: the communicator is created non-blocking (`ncclCommInitRankConfig` with
`blocking=0`) and every wait polls `ncclCommGetAsyncError` against a deadline; on an
error or when the deadline passes the communicator is aborted (`ncclCommAbort`), so a
peer that never joins, dies or freezes fails the update instead of hanging a survivor.
Every call here blocks or polls, so it runs on the worker's data-plane thread, never
on its event loop. The one exception is `abort()`, made from another thread when the
controller aborts the update: it takes the lock that every use of the communicator
handle holds, aborts the communicator (which stops a kernel that waits for a peer),
and the data-plane thread's next poll fails with the abort's reason.

Streams: the engine packs and unpacks on this transport's copy stream
(`copy_context()`); a round's sends and receives are posted, then `flush()` fuses them
in one `ncclGroupStart/End` on a dedicated communication stream that first waits for
the copies. Packing round k+1 (copy stream) overlaps the transfer of round k (comm
stream); the engine's double-buffered staging keeps the two apart. NCCL has no tags:
operations between two ranks match in posting order, so a group posts them sorted by
(peer, direction, tag), which both ends compute alike from the same plan.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

import torch

from reshard.common.dataplane.nccl import NcclError, NcclLibrary, NcclUnavailable, load_library, ncclInProgress, ncclSuccess
from reshard.common.dataplane.transport import Transport, TransportError, Work

log = logging.getLogger("reshard.nccl")

CLOSE_TIMEOUT_S = 10.0
_POLL_MIN_S, _POLL_MAX_S = 50e-6, 2e-3


@dataclasses.dataclass(slots=True)
class _Op:
    kind: str  # send | recv
    buf: torch.Tensor
    peer: int
    tag: int


@dataclasses.dataclass(slots=True)
class _Group:
    ops: list[_Op] = dataclasses.field(default_factory=list)
    launched: bool = False
    event: torch.cuda.Event | None = None
    done: bool = False
    new_peers: bool = False


class CudaOps:
    """The torch.cuda calls the transport makes, in one place (CPU tests pass a fake)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def set_device(self) -> None:
        torch.cuda.set_device(self.device)

    def stream(self):
        return torch.cuda.Stream(self.device)

    def event(self):
        return torch.cuda.Event()

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def use_stream(self, stream):
        return torch.cuda.stream(stream)

    def free_bytes(self) -> int:
        return torch.cuda.mem_get_info(self.device)[0]

    def reserved_bytes(self) -> int:
        return torch.cuda.memory_reserved(self.device)


class _NcclWork(Work):
    __slots__ = ("_t", "_g", "_what")

    def __init__(self, transport: "NcclTransport", group: _Group, what: str) -> None:
        self._t, self._g, self._what = transport, group, what

    def wait(self, timeout_s: float) -> None:
        self._t._wait(self._g, timeout_s, self._what)


class NcclTransport(Transport):
    name = "nccl"

    @classmethod
    def for_session(cls, session, rank: int, world: int, timeout_s: float, device: str = "cpu",
                    on_connecting: Callable[[Transport], None] | None = None) -> "NcclTransport":
        if not session.nccl_unique_id:
            raise TransportError(f"session {session.id} uses nccl but carries no nccl_unique_id")
        return cls(bytes(session.nccl_unique_id), rank, world, timeout_s, device=device, session=session.id,
                   on_connecting=on_connecting)

    def __init__(self, unique_id: bytes, rank: int, world: int, timeout_s: float, *, device: str | torch.device,
                 session: str = "", library: NcclLibrary | None = None, cuda: CudaOps | None = None,
                 on_connecting: Callable[[Transport], None] | None = None) -> None:
        dev = torch.device(device)
        if cuda is None:
            if dev.type != "cuda":
                raise TransportError(f"the nccl transport moves CUDA buffers; this worker's are on {dev}")
            if not torch.cuda.is_available():
                raise TransportError("the nccl transport needs CUDA, and torch sees no CUDA device here")
            dev = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
            cuda = CudaOps(dev)
        self.device, self._cuda = dev, cuda
        self.rank, self.world, self.session, self.timeout_s = rank, world, session, timeout_s
        self._comm = None
        self._lock = threading.RLock()  # held around every use of the communicator handle (abort() comes from any thread)
        self._broken = ""
        self._open: _Group | None = None
        self._peers: set[int] = set()
        self.abort_seconds: float | None = None
        cuda.set_device()  # this (data-plane) thread's device
        try:
            self.lib = library or load_library()
        except NcclUnavailable as e:
            raise TransportError(str(e)) from None
        self.comm_stream = cuda.stream()
        self.copy_stream = cuda.stream()
        self._free0 = cuda.free_bytes()
        self._reserved0 = cuda.reserved_bytes()
        if on_connecting is not None:
            on_connecting(self)
        t0 = time.monotonic()
        comm = self.lib.comm_init_rank(world, unique_id, rank, blocking=False)
        with self._lock:
            self._comm = comm
            if self.aborted:  # abort() came before there was a communicator to abort
                self._abort(self.aborted)
        self._settle(t0 + timeout_s, timeout_s, f"joining NCCL session {session} as rank {rank} of {world}")
        self.init_seconds = time.monotonic() - t0
        self._measure()
        log.debug("nccl session %s: rank %d/%d on %s joined in %.2fs (NCCL %s)", session, rank, world, self.device,
                  self.init_seconds, self.lib.version)

    # -- failure handling ------------------------------------------------------------------
    def abort(self, reason: str) -> None:
        """From any thread: abort the communicator; what the data-plane thread waits on, and every
        later call, fails with `TransportError(reason)`."""
        with self._lock:
            if self.aborted:
                return
            self.aborted = reason
            self._abort(reason)

    def _abort(self, why: str) -> None:
        with self._lock:
            comm, self._comm = self._comm, None
            self._broken = self._broken or why
            if comm is None:
                return
            t0 = time.monotonic()
            try:
                self.lib.comm_abort(comm)
            except NcclError as e:
                log.warning("ncclCommAbort (session %s, rank %d): %s", self.session, self.rank, e)
            self.abort_seconds = time.monotonic() - t0
        log.warning("nccl session %s, rank %d: communicator aborted in %.3fs: %s", self.session, self.rank,
                    self.abort_seconds, why)

    def _usable(self) -> None:
        if self._comm is None:
            raise TransportError(self.aborted or f"NCCL session {self.session} is unusable: {self._broken or 'closed'}")

    def _async_error(self, what: str) -> int:
        with self._lock:
            self._usable()
            code = self.lib.comm_async_error(self._comm)
            if code not in (ncclSuccess, ncclInProgress):
                last = self.lib.last_error(self._comm)
                err = NcclError("ncclCommGetAsyncError", code, self.lib.error_string(code),
                                f"{what}; communicator aborted" + (f"; {last}" if last else ""))
                self._abort(str(err))
                raise err
        return code

    def _settle(self, deadline: float, timeout_s: float, what: str) -> None:
        """Poll until the communicator's pending non-blocking call completed (init, a group's
        connection setup, finalize); abort it on an error or at the deadline."""
        delay = _POLL_MIN_S
        while self._async_error(what) == ncclInProgress:
            if time.monotonic() >= deadline:
                msg = (f"{what}: not done within {timeout_s:.1f}s (a peer never joined, died or froze); "
                       "the communicator was aborted")
                self._abort(msg)
                raise TransportError(msg)
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)

    def _measure(self) -> None:
        """NCCL's own device memory: the drop in free memory since before init, less what torch's
        allocator reserved meanwhile (other processes on the same GPU blur it)."""
        free = self._cuda.free_bytes()
        grown = self._cuda.reserved_bytes() - self._reserved0
        self.connection_bytes = max(self.connection_bytes, self._free0 - free - grown)

    # -- the Transport interface -----------------------------------------------------------
    @contextlib.contextmanager
    def copy_context(self):
        """The engine's copies run on the copy stream: it first waits for what the calling thread's
        stream queued, and before leaving, the last unpack has landed (verification reads next)."""
        self.copy_stream.wait_stream(self._cuda.current_stream())
        with self._cuda.use_stream(self.copy_stream):
            yield
        self.copy_stream.synchronize()

    def _after_producer(self) -> None:
        """The comm stream waits for what the current stream (the copies) has queued so far."""
        producer = self._cuda.current_stream()
        if producer != self.comm_stream:
            ready = self._cuda.event()
            ready.record(producer)
            self.comm_stream.wait_event(ready)

    def _record(self):
        ev = self._cuda.event()
        ev.record(self.comm_stream)
        return ev

    def _post(self, kind: str, buf: torch.Tensor, peer: int, tag: int) -> _Group:
        self._usable()
        if buf.device != self.device or buf.dtype != torch.uint8 or not buf.is_contiguous():
            raise TransportError(f"nccl {kind}: needs a contiguous uint8 tensor on {self.device}, got {buf.dtype} on {buf.device}")
        if not 0 <= peer < self.world:
            raise TransportError(f"nccl {kind}: peer {peer} is outside a session of {self.world} ranks")
        if self._open is None:
            self._open = _Group()
        self._open.ops.append(_Op(kind, buf, peer, tag))
        return self._open

    def send(self, buf: torch.Tensor, peer: int, tag: int) -> Work:
        return _NcclWork(self, self._post("send", buf, peer, tag), f"send to rank {peer} (tag {tag})")

    def recv(self, buf: torch.Tensor, peer: int, tag: int) -> Work:
        return _NcclWork(self, self._post("recv", buf, peer, tag), f"receive from rank {peer} (tag {tag})")

    def flush(self) -> None:
        g, self._open = self._open, None
        if g is None or not g.ops:
            return
        self._usable()
        self._after_producer()
        peers = {op.peer for op in g.ops}
        g.new_peers = not peers <= self._peers
        self._peers |= peers
        stream = self.comm_stream.cuda_stream
        with self._lock:
            self._usable()
            self.lib.group_start()
            try:
                for op in sorted(g.ops, key=lambda o: (o.peer, o.kind, o.tag)):
                    call = self.lib.send if op.kind == "send" else self.lib.recv
                    call(op.buf.data_ptr(), op.buf.numel(), op.peer, self._comm, stream)
            finally:
                code = self.lib.group_end()
        g.launched = True
        if code == ncclSuccess:
            g.event = self._record()
        # else ncclInProgress: connections to new peers are being set up; _wait settles it first.

    def _wait(self, g: _Group, timeout_s: float, what: str) -> None:
        if g.done:
            return
        self._usable()
        deadline = time.monotonic() + max(0.0, timeout_s)
        if not g.launched:
            if g is self._open:
                self.flush()
            else:
                raise TransportError(f"nccl {what}: waited on work that was never posted")
        if g.event is None:
            self._settle(deadline, timeout_s, f"NCCL {what} in session {self.session}")
            g.event = self._record()
        delay = _POLL_MIN_S
        while not g.event.query():
            self._async_error(f"NCCL {what} in session {self.session}")
            if time.monotonic() >= deadline:
                msg = (f"NCCL {what} in session {self.session} not done within {timeout_s:.1f}s (the peer died, froze "
                       "or never posted it); the communicator was aborted")
                self._abort(msg)
                raise TransportError(msg)
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)
        g.done = True
        if g.new_peers:
            self._measure()

    def broadcast(self, buf: torch.Tensor, members: tuple[int, ...]) -> Work:
        if self.rank not in members:
            raise TransportError(f"rank {self.rank} is not among the broadcast's members {members}")
        self.flush()
        root = members[0]
        if sorted(members) == list(range(self.world)):
            self._usable()
            self._after_producer()
            g = _Group(launched=True, new_peers=not set(members) <= self._peers)
            self._peers |= set(members)
            with self._lock:
                self._usable()
                code = self.lib.broadcast(buf.data_ptr(), buf.data_ptr(), buf.numel(), root, self._comm,
                                          self.comm_stream.cuda_stream)
            if code == ncclSuccess:
                g.event = self._record()
            return _NcclWork(self, g, f"broadcast from rank {root}")
        # A subset of the session: the root sends to each member (NCCL has no tags; the tag is 0).
        if self.rank == root:
            for m in members[1:]:
                self._post("send", buf, m, 0)
        else:
            self._post("recv", buf, root, 0)
        g = self._open or _Group(done=True)  # a broadcast among one member moves nothing
        self.flush()
        return _NcclWork(self, g, f"broadcast from rank {root}")

    def close(self) -> None:
        """Finalize and destroy the communicator (bounded: abort it if a peer does not finalize)."""
        self._open = None
        try:
            if self.lib.has("ncclCommFinalize"):
                with self._lock:
                    if self._comm is None:
                        return
                    self.lib.comm_finalize(self._comm)
                self._settle(time.monotonic() + CLOSE_TIMEOUT_S, CLOSE_TIMEOUT_S, f"closing NCCL session {self.session}")
            with self._lock:
                comm, self._comm = self._comm, None
                if comm is None:
                    return
                self.lib.comm_destroy(comm)
                self._broken = "closed"
        except TransportError as e:  # _settle aborted it already, or abort() did meanwhile
            log.warning("nccl session %s, rank %d: %s", self.session, self.rank, e)
            if self._comm is not None:
                self._abort(str(e))
