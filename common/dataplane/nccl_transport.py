"""The NCCL data plane behind the `Transport` interface (CUDA buffers).

One communicator per session. Its `ncclUniqueId` is made by trainer worker 0 (whose
process hosts NCCL's bootstrap root) and relayed to every worker by the controllers in
`reshard.v1.Session.nccl_unique_id`; a retried update gets a new session and a fresh id.

Never hanging: the communicator is created non-blocking (`ncclCommInitRankConfig` with
`blocking=0`) and every wait polls `ncclCommGetAsyncError` against a deadline; on an
error or when the deadline passes the communicator is aborted (`ncclCommAbort`), so a
peer that never joins, dies or freezes fails the update instead of hanging a survivor.
The deadline is always the current update's (a session is reused by later updates): a
caller's timeout, or what the engine gave `set_deadline()` for the waits the transport
makes by itself (a group still connecting before the next launch; the copy stream at the
end of an engine's run, polled through an event rather than synchronized).
Every call here blocks or polls, so it runs on the worker's data-plane thread, never
on its event loop. The one exception is `abort()`, made from another thread when the
controller aborts the update: it takes the lock that every use of the communicator
handle holds, aborts the communicator (which stops a kernel that waits for a peer),
and the data-plane thread's next poll fails with the abort's reason.

Streams: the engine packs and unpacks on this transport's copy stream
(`copy_context()`); a round's sends and receives are posted, then `flush()` fuses them
in one `ncclGroupStart/End` on a dedicated communication stream that first waits for
the copies. The transport is stream-ordered: the engine queues rounds back to back,
and `Work.device_wait()` makes the copy stream wait for a round's group (an event
recorded after it on the comm stream) before unpacking it or reusing its staging;
the host waits only through `Work.wait()`, polling with the deadline. NCCL has no tags:
operations between two ranks match in posting order, so a group posts them sorted by
(peer, direction, tag), which both ends compute alike from the same plan.

Connections: NCCL connects to a peer in the first group that uses it. `warm_up` does
that for a plan's pairs in one tiny group before the first round, under the connect
deadline. Broadcasts among a subset of the session (the serialized baseline) run on a
communicator split off for those members (`ncclCommSplit`, NCCL 2.18+, made once by
`prepare_broadcast` on every rank), or as point-to-point sends from the root where the
library cannot split.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

import torch

from reshard.common.dataplane.nccl import (
    NCCL_SPLIT_NOCOLOR,
    NcclError,
    NcclLibrary,
    NcclUnavailable,
    load_library,
    ncclInProgress,
    ncclSuccess,
)
from reshard.common.dataplane.transport import Transport, TransportError, Work

log = logging.getLogger("reshard.nccl")

CLOSE_TIMEOUT_S = 10.0
DRAIN_AFTER_ABORT_S = 0.5  # the most an engine that failed waits for its copy stream (past the deadline: not at all)
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
    event: torch.cuda.Event | None = None  # recorded on the comm stream once the group is on it
    done: bool = False  # seen complete by the host
    fenced: bool = False  # the copy stream waits for it already
    new_peers: bool = False  # it set up connections: measure NCCL's memory after it
    comm: object = None  # the communicator it runs on: None for the session's, else a broadcast group's


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

    def device_wait(self, timeout_s: float) -> None:
        self._t._device_wait(self._g, timeout_s, self._what)


class NcclTransport(Transport):
    name = "nccl"
    stream_ordered = True

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
        self._last: _Group | None = None  # the group launched last (stream order: done when it is)
        self._connected: set[tuple[str, int]] = set()  # (send|recv, peer) pairs some group has used
        self._subs: dict[tuple[int, ...], object] = {}  # broadcast members -> split communicator's handle box (None: not a member)
        self._star_logged = False
        self.abort_seconds: float | None = None
        self._deadline = time.monotonic() + timeout_s  # the current update's (set_deadline); first the joining one's
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
            subs = [b for b in self._subs.values() if b is not None and b.value]
            self._subs.clear()
            self._broken = self._broken or why
            if comm is None:
                return
            t0 = time.monotonic()
            for c in (*subs, comm):
                try:
                    self.lib.comm_abort(c)
                except NcclError as e:
                    log.warning("ncclCommAbort (session %s, rank %d): %s", self.session, self.rank, e)
            self.abort_seconds = time.monotonic() - t0
        log.warning("nccl session %s, rank %d: communicator aborted in %.3fs: %s", self.session, self.rank,
                    self.abort_seconds, why)

    @contextlib.contextmanager
    def _aborted_on_error(self):
        """Around a launch (a group, a broadcast, a split): an error NCCL returns (not ncclInProgress)
        leaves the communicator failed, and NCCL says to abort it; the session is aborted (so a
        peer's deadline is not all that ends the update, and no later round is posted on it), and
        the error raised."""
        try:
            yield
        except NcclError as e:
            self._abort(f"{e}; the communicator was aborted")
            raise

    def _usable(self) -> None:
        if self._comm is None:
            raise TransportError(self.aborted or f"NCCL session {self.session} is unusable: {self._broken or 'closed'}")

    def _async_error(self, what: str, comm=None) -> int:
        with self._lock:
            self._usable()
            comm = self._comm if comm is None else comm
            code = self.lib.comm_async_error(comm)
            if code not in (ncclSuccess, ncclInProgress):
                last = self.lib.last_error(comm)
                err = NcclError("ncclCommGetAsyncError", code, self.lib.error_string(code),
                                f"{what}; communicator aborted" + (f"; {last}" if last else ""))
                self._abort(str(err))
                raise err
        return code

    def _settle(self, deadline: float, timeout_s: float, what: str, comm=None) -> None:
        """Poll until the communicator's pending non-blocking call completed (init, a group's
        connection setup, a split, finalize); abort the session on an error or at the deadline."""
        delay = _POLL_MIN_S
        while self._async_error(what, comm) == ncclInProgress:
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
    def set_deadline(self, deadline: float) -> None:
        self._deadline = deadline

    @contextlib.contextmanager
    def copy_context(self):
        """The engine's copies run on the copy stream: it first waits for what the calling thread's
        stream queued, and before leaving, the last unpack has landed (verification reads next),
        by the current update's deadline. Left by an error while a group may still run, the session
        is aborted first: the copy stream may wait for that group, and a peer that stopped posting
        would never complete it."""
        self.copy_stream.wait_stream(self._cuda.current_stream())
        try:
            with self._cuda.use_stream(self.copy_stream):
                yield
        except BaseException as e:
            last = self._last
            if self._comm is not None and last is not None and not last.done:
                self._abort(f"the data plane stopped with NCCL work in flight: {e}")
            try:  # aborted, its kernels have stopped: what waited for them runs at once
                self._copies_landed(min(self._deadline, time.monotonic() + DRAIN_AFTER_ABORT_S))
            except TransportError as late:
                log.warning("nccl session %s, rank %d: %s", self.session, self.rank, late)
            raise
        self._copies_landed(self._deadline)

    def _copies_landed(self, deadline: float) -> None:
        """Wait on the host, until `deadline`, for what the copy stream queued (an event polled: a
        stream synchronization has no timeout, and the copies may wait for a group whose peer
        froze); past it the session is aborted."""
        done = self._cuda.event()
        done.record(self.copy_stream)
        delay, timeout_s = _POLL_MIN_S, max(0.0, deadline - time.monotonic())
        while not done.query():
            if time.monotonic() >= deadline:
                msg = (f"NCCL session {self.session}: the copy stream was not done within the update's deadline "
                       f"({timeout_s:.1f}s left when the engine finished); the communicator was aborted")
                self._abort(msg)
                raise TransportError(msg)
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)

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

    def _on_stream(self, g: _Group, deadline: float, timeout_s: float, what: str) -> None:
        """Make sure the group's operations are queued on the comm stream, with an event after them:
        a launch that returned ncclInProgress (connections being set up) is settled on the host first."""
        if not g.launched:
            if g is not self._open:
                raise TransportError(f"nccl {what}: waited on work that was never posted")
            self.flush()
        if g.event is None:
            self._settle(deadline, timeout_s, f"NCCL {what} in session {self.session}", g.comm)
            g.event = self._record()

    def _launching(self) -> None:
        """Before a launch: NCCL takes no new call on a communicator while the last one is in progress."""
        last = self._last
        if last is not None and last.event is None:
            self._on_stream(last, self._deadline, max(0.0, self._deadline - time.monotonic()), "a group still connecting")
        self._after_producer()

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
        self._launching()
        pairs = {(op.kind, op.peer) for op in g.ops}
        g.new_peers = not pairs <= self._connected
        self._connected |= pairs
        stream = self.comm_stream.cuda_stream
        with self._lock, self._aborted_on_error():
            self._usable()
            self.lib.group_start()
            try:
                for op in sorted(g.ops, key=lambda o: (o.peer, o.kind, o.tag)):
                    call = self.lib.send if op.kind == "send" else self.lib.recv
                    call(op.buf.data_ptr(), op.buf.numel(), op.peer, self._comm, stream)
            finally:
                code = self.lib.group_end()
        g.launched = True
        self._last = g
        if code == ncclSuccess:
            g.event = self._record()
        # else ncclInProgress: connections to new peers are being set up; settled before the next use.

    def _device_wait(self, g: _Group, timeout_s: float, what: str) -> None:
        if g.done or g.fenced:
            return
        self._usable()
        self._on_stream(g, time.monotonic() + max(0.0, timeout_s), timeout_s, what)
        self._cuda.current_stream().wait_event(g.event)
        g.fenced = True

    def _wait(self, g: _Group, timeout_s: float, what: str) -> None:
        if g.done:
            return
        self._usable()
        deadline = time.monotonic() + max(0.0, timeout_s)
        self._on_stream(g, deadline, timeout_s, what)
        delay = _POLL_MIN_S
        while not g.event.query():
            self._async_error(f"NCCL {what} in session {self.session}", g.comm)
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

    def warm_up(self, sends_to: set[int], recvs_from: set[int], timeout_s: float) -> None:
        """One group of 1-byte sends and receives with each pair no group has used yet, waited on with
        the deadline: connecting belongs to joining the session, not to the first round's transfer."""
        self._deadline = time.monotonic() + timeout_s
        pairs = [(kind, p) for kind, peers in (("send", sends_to), ("recv", recvs_from)) for p in sorted(peers)
                 if (kind, p) not in self._connected]
        if not pairs:
            return
        buf = torch.zeros(len(pairs), dtype=torch.uint8, device=self.device)
        g = None
        for i, (kind, peer) in enumerate(pairs):
            g = self._post(kind, buf[i : i + 1], peer, 0)
        self._wait(g, timeout_s, f"warm-up (connecting to ranks {sorted({p for _, p in pairs})})")

    def prepare_broadcast(self, groups: list[tuple[int, ...]], timeout_s: float) -> None:
        """Split a communicator off for each group of members (every rank takes part in each split:
        a non-member with NCCL_SPLIT_NOCOLOR), then connect it with a 1-byte broadcast."""
        deadline = self._deadline = time.monotonic() + timeout_s
        for members in groups:
            if len(members) < 2 or members in self._subs or sorted(members) == list(range(self.world)):
                continue  # nothing to move, made already, or the session's own communicator
            if not self.lib.has("ncclCommSplit"):
                if not self._star_logged:
                    self._star_logged = True
                    log.warning("NCCL %s has no ncclCommSplit (2.18+): broadcasts among part of session %s are sent "
                                "from the root to each member", self.lib.version, self.session)
                return
            what = f"splitting a communicator for ranks {list(members)} off NCCL session {self.session}"
            member = self.rank in members
            self._usable()
            self._launching()
            with self._lock, self._aborted_on_error():
                self._usable()
                box = self.lib.comm_split(self._comm, 0 if member else NCCL_SPLIT_NOCOLOR, self.rank)
                self._subs[members] = box if member else None  # abort() now reaches it
            # NCCL fills the new handle in once the parent has settled (NVIDIA/nccl#1472), sometimes a little later.
            self._settle(deadline, timeout_s, what)
            delay = _POLL_MIN_S
            while member and not box.value:
                if time.monotonic() >= deadline:
                    msg = f"{what}: no communicator within {timeout_s:.1f}s; the session was aborted"
                    self._abort(msg)
                    raise TransportError(msg)
                self._usable()
                time.sleep(delay)
                delay = min(delay * 2, _POLL_MAX_S)
            if member:
                self._settle(deadline, timeout_s, what, box)
                self.broadcast(torch.zeros(1, dtype=torch.uint8, device=self.device), members).wait(
                    max(0.0, deadline - time.monotonic()))

    def broadcast(self, buf: torch.Tensor, members: tuple[int, ...]) -> Work:
        if self.rank not in members:
            raise TransportError(f"rank {self.rank} is not among the broadcast's members {members}")
        self._usable()
        self.flush()
        root = members[0]
        what = f"broadcast from rank {root}"
        if len(members) == 1:
            return _NcclWork(self, _Group(done=True), what)  # a broadcast among one member moves nothing
        if sorted(members) == list(range(self.world)):
            return self._broadcast(buf, root, None, what)
        sub = self._subs.get(members)
        if sub is not None:  # its ranks are the members in ascending order (the split's key is the session rank)
            return self._broadcast(buf, sorted(members).index(root), sub, what)
        if self.lib.has("ncclCommSplit"):
            raise TransportError(f"nccl {what} to ranks {list(members)}: no communicator for them "
                                 "(every rank must call prepare_broadcast with this group first)")
        # No ncclCommSplit: the root sends to each member (NCCL has no tags; the tag is 0).
        if self.rank == root:
            for m in members[1:]:
                self._post("send", buf, m, 0)
        else:
            self._post("recv", buf, root, 0)
        g = self._open
        self.flush()
        return _NcclWork(self, g, what)

    def _broadcast(self, buf: torch.Tensor, root: int, comm, what: str) -> Work:
        self._usable()
        self._launching()
        g = _Group(launched=True, new_peers=True, comm=comm)
        with self._lock, self._aborted_on_error():
            self._usable()
            code = self.lib.broadcast(buf.data_ptr(), buf.data_ptr(), buf.numel(), root,
                                      self._comm if comm is None else comm, self.comm_stream.cuda_stream)
        self._last = g
        if code == ncclSuccess:
            g.event = self._record()
        return _NcclWork(self, g, what)

    def close(self) -> None:
        """Finalize and destroy the communicators, the broadcast groups' first (bounded: the session
        is aborted if a peer does not finalize)."""
        self._open = None
        try:
            for key in [k for k, b in self._subs.items() if b is not None]:
                self._close_comm(key)
            self._close_comm(None)
        except TransportError as e:  # _settle aborted it already, or abort() did meanwhile
            log.warning("nccl session %s, rank %d: %s", self.session, self.rank, e)
            if self._comm is not None:
                self._abort(str(e))

    def _close_comm(self, key: tuple[int, ...] | None) -> None:
        """Finalize and destroy the session's communicator (key None) or a broadcast group's."""
        with self._lock:
            comm = self._comm if key is None else self._subs.get(key)
            if self._comm is None or comm is None:
                return
            finalize = self.lib.has("ncclCommFinalize")
            if finalize:
                self.lib.comm_finalize(comm)
        if finalize:
            self._settle(time.monotonic() + CLOSE_TIMEOUT_S, CLOSE_TIMEOUT_S, f"closing NCCL session {self.session}",
                         None if key is None else comm)
        with self._lock:
            if self._comm is None:
                return  # aborted meanwhile
            if key is None:
                self._comm, self._broken = None, "closed"
            else:
                del self._subs[key]
            self.lib.comm_destroy(comm)
