"""Data-plane transports. One interface, several implementations, chosen by name.

A worker moves its share of an update with one call, `Transport.run_update(RankUpdate)`
(common/dataplane/rank_update.py), whatever its session's backend: here, in the base class,
the message-passing transports run the plan's rounds through the engine (`gloo`, below;
`nccl`, common/dataplane/nccl_transport.py); a transport that moves bytes otherwise
overrides it (`ipc`, common/dataplane/cuda_ipc.py: destinations read the sources' buffers;
`hybrid`, common/dataplane/hybrid.py: NCCL between GPUs, CUDA IPC within one). One that
cannot carry a message between every pair of its ranks says so
(`moves_messages_between_all_pairs`): a tool's transfer method, which needs that, is refused.

The engine sees only `Transport`: post a send or a receive of a flat uint8
tensor to/from a session peer with a tag, and wait for posted work with a
deadline. `gloo` runs on CPU (torch's ProcessGroupGloo on a TCPStore, a fresh
PrefixStore per session, no global default group); `nccl` (common/dataplane/nccl_transport.py)
on CUDA. A transport may hold back what was posted until `flush()` (NCCL fuses a
round's operations in one group) and may run the engine's copies on a stream of
its own (`copy_context()`); for gloo both are no-ops.

A `stream_ordered` transport (NCCL) runs posted work in posting order on a device
stream: the engine then queues rounds back to back, orders its copies after posted
work with `Work.device_wait()` (a wait of the copy stream, not of the host) and waits
on the host only to bound how far it runs ahead and at the end. Gloo is not: the engine
waits on the host for each round. `warm_up` connects to a plan's peers before the first
round (a no-op where connections are made with the group: gloo), and `prepare_broadcast`
makes the broadcast groups every rank will use.

A session outlives the update that opened it (it is reused while membership is unchanged):
every wait runs against the deadline of the update running now, never the opening one's.
Waits take their timeout from the caller; what a transport waits for by itself (NCCL: a
group still connecting, the copy stream at the end) ends at the deadline the engine gives
`set_deadline()` as it starts.

`abort(reason)` may be called from any thread (the worker's control loop, when the
controller aborts an update): whatever the data-plane thread is blocked on (joining
the session, waiting for posted work) fails at once with `TransportError(reason)`, as
does every later call. An aborted session is never reused; `close()` still releases it.
"""

from __future__ import annotations

import abc
import contextlib
import datetime
import logging
import threading
import time
from collections.abc import Callable

import torch

log = logging.getLogger("reshard.transport")


class TransportError(RuntimeError):
    """A data-plane operation failed or ran past its deadline."""


class Work(abc.ABC):
    @abc.abstractmethod
    def wait(self, timeout_s: float) -> None: ...

    def device_wait(self, timeout_s: float) -> None:
        """Order what the current stream queues next after this work (a stream-ordered transport
        waits on the device); elsewhere a host wait."""
        self.wait(timeout_s)


def redact(message: str, key: str) -> str:
    """`message` without the session's secret `key`: torch's store errors name the keys they wait
    for, which live under it, and the secret must never reach a log, `status` or a peer."""
    return message.replace(key, "<session key>") if key else message


def serve_store(host: str, timeout_s: float):
    """The session rendezvous store (a TCPStore server), listening on `host`'s address only (torch's
    own binds every interface). Returns (store, its listening socket: keep it alive with the store)."""
    import socket

    from torch.distributed import TCPStore

    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    except OSError as e:
        raise OSError(f"the session store's host {host!r} does not resolve ({e}): set --store-host") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr[:2] if family == socket.AF_INET else addr)
        sock.listen(1024)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot serve the session store on {host} ({e.strerror}): set --store-host to an address "
                      "of this machine that the inference workers reach") from None
    store = TCPStore(host, sock.getsockname()[1], None, True, timeout=datetime.timedelta(seconds=timeout_s),
                     wait_for_workers=False, master_listen_fd=sock.fileno(), use_libuv=True)
    return store, sock


class Transport(abc.ABC):
    name: str = "?"
    connection_bytes: int = 0  # device memory the transport's own connections hold (NCCL's buffers)
    aborted: str = ""  # why abort() was called ("" while the session is usable)
    stream_ordered: bool = False  # posted work runs in posting order on a device stream (see the module doc)
    # Any rank of the session can send any other a message (send/recv): what a tool's transfer method
    # (the serialized baseline) needs. False where ranks sharing a GPU have none between them (ipc, hybrid).
    moves_messages_between_all_pairs: bool = True

    @classmethod
    def for_session(cls, session, rank: int, world: int, timeout_s: float, device: str = "cpu",
                    on_connecting: Callable[["Transport"], None] | None = None) -> "Transport":
        """Join the data-plane session described by a `reshard.v1.Session` as `rank` of `world`.
        `on_connecting(transport)` runs before joining blocks, so that another thread can abort it."""
        return cls(session.store_host, session.store_port, session.id, rank, world, timeout_s, on_connecting=on_connecting,
                   key=session.key)

    def run_update(self, u) -> tuple[dict, int, float]:
        """This rank's share of an update over this session, `u` a RankUpdate (common/dataplane/rank_update.py,
        which imports this module): (its checksums per destination piece, the bytes it moved, seconds spent
        summing). Calls `u.connected()` once the session reaches the peers this rank needs, `u.progress` and
        `u.hook` as bytes move. Message-passing transports (gloo, NCCL) take this one: the plan's rounds
        through the engine; others override it."""
        engine = u.engine(self)
        # Connections to the plan's peers (NCCL makes them in the first group with each): set up here, with
        # the joining, so that the first round moves bytes only. A session reused connects only new pairs.
        self.warm_up(*engine.peers(), max(0.0, u.deadline - time.monotonic()))
        u.connected()
        if u.prelude is not None:
            u.prelude(self, u.deadline)
        sums = engine.run()
        return sums, engine.bytes_done, engine.checksum_seconds

    def abort(self, reason: str) -> None:
        """From any thread: fail what is blocked now and every later call with `TransportError(reason)`."""
        self.aborted = self.aborted or reason

    def set_deadline(self, deadline: float) -> None:
        """The deadline (time.monotonic()) of the update that uses the session now: what the transport
        waits for without a timeout from its caller ends there."""

    def flush(self) -> None:
        """Start whatever was posted and not started yet (one round's sends and receives)."""

    def copy_context(self):
        """A context in which the engine packs and unpacks (a copy stream of the transport's own)."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def send(self, buf: torch.Tensor, peer: int, tag: int) -> Work: ...

    @abc.abstractmethod
    def recv(self, buf: torch.Tensor, peer: int, tag: int) -> Work: ...

    def warm_up(self, sends_to: set[int], recvs_from: set[int], timeout_s: float) -> None:
        """Set up the connections a plan uses (to `sends_to`, from `recvs_from`) before its first round.
        Every peer must call it with the mirror image (the plan's pairs, seen from its side)."""

    def broadcast(self, buf: torch.Tensor, members: tuple[int, ...]) -> Work:
        """Broadcast from members[0] to the other members (the serialized baseline's collective)."""
        raise NotImplementedError(f"transport {self.name} has no broadcast")

    def prepare_broadcast(self, groups: list[tuple[int, ...]], timeout_s: float) -> None:
        """Make what `broadcast` needs for each group of members, within `timeout_s` (the current
        update's). Collective: every rank of the session calls it, members or not, with the same
        groups in the same order, in every update that broadcasts."""

    @abc.abstractmethod
    def close(self) -> None: ...


# abort() breaks a group with a receive nobody sends (this tag is outside any plan's) waited on for a
# millisecond: gloo answers a timed-out wait by failing every pending operation of the group's context and
# closing its connections, so the blocked thread wakes with an error and the peers see the group close.
# (torch 2.13's ProcessGroupGloo.abort() and shutdown() return at once and leave a pending receive waiting.)
_BREAK_TAG = 2**31 - 1


def _break(pg) -> None:
    if pg.size() < 2:
        return  # nothing to wait for in a group of one
    try:
        pg.recv([torch.empty(1, dtype=torch.uint8)], (pg.rank() + 1) % pg.size(), _BREAK_TAG).wait(
            datetime.timedelta(milliseconds=1))
    except RuntimeError:
        pass  # the expected timeout, or a group that was broken already


def _gloo_group(store, prefix: str, rank: int, size: int, timeout_s: float):
    """A gloo group of `size` under `prefix` in the session's store (every member calls this; it waits
    there for all of them, at most `timeout_s`), whose rendezvous keys are then taken out of the store:
    the store is the trainer controller's, which outlives every session. Gloo puts one key per
    member (`PREFIX/0/RANK`: its one device's addresses); each member reads every other's before its
    group is made, so the last member to count itself done deletes them all. A member whose
    rendezvous fails deletes them too: the group can no longer form (a member that comes later puts
    its key back and deletes it when it fails in turn)."""
    from torch.distributed import PrefixStore
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    keys = [f"{prefix}/0/{r}" for r in range(size)] + [f"{prefix}/done"]
    last = False
    try:
        pg = ProcessGroupGloo(PrefixStore(prefix, store), rank, size, datetime.timedelta(seconds=max(0.001, timeout_s)))
        last = store.add(keys[-1], 1) == size
    except RuntimeError:
        last = True
        raise
    finally:
        if last:
            for k in keys:
                try:
                    store.delete_key(k)
                except RuntimeError:  # the store went away: nothing left to clean
                    break
    return pg


class _GlooWork(Work):
    __slots__ = ("_t", "_w", "_what")

    def __init__(self, transport: "GlooTransport", w, what: str) -> None:
        self._t, self._w, self._what = transport, w, what

    def wait(self, timeout_s: float) -> None:
        try:
            self._w.wait(datetime.timedelta(seconds=max(0.001, timeout_s)))
        except RuntimeError as e:
            raise self._t._error(self._what, e) from e


class GlooTransport(Transport):
    """A side gloo group on a TCPStore served by the trainer controller."""

    name = "gloo"

    def __init__(self, store_host: str, store_port: int, session: str, rank: int, world: int, timeout_s: float, *,
                 on_connecting: Callable[[Transport], None] | None = None, key: str = "") -> None:
        self.rank, self.world, self.session = rank, world, session
        # The session's keys in the store live under its secret (sent only over the authenticated
        # control plane): a process that reaches the store without it can neither join nor disturb.
        self._prefix, self._key = f"reshard/{key or session}", key
        self._groups: dict[tuple[int, ...], object] = {}
        self._store = self._pg = None
        self._lock = threading.Lock()  # orders abort() (any thread) against groups being made
        self._waiting: set[threading.Event] = set()  # rendezvous waited on now: abort() sets them
        if on_connecting is not None:
            on_connecting(self)
            if self.aborted:
                raise TransportError(self.aborted)
        t0 = time.monotonic()

        def join():
            from torch.distributed import TCPStore

            store = TCPStore(store_host, store_port, world_size=None, is_master=False,
                             timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
            return store, _gloo_group(store, self._prefix, rank, world, timeout_s)

        def keep(made) -> None:
            self._store, self._pg = made

        try:
            self._rendezvous(join, keep, lambda made: made[1], f"gloo-join-{session}-{rank}")
        except TransportError:
            raise
        except RuntimeError as e:
            raise TransportError(
                f"gloo rendezvous for session {session} (rank {rank} of {world}) at {store_host}:{store_port} "
                f"failed after {time.monotonic() - t0:.1f}s: {self._redact(str(e).splitlines()[0])}"
            ) from None
        log.debug("gloo session %s: rank %d/%d connected in %.2fs", session, rank, world, time.monotonic() - t0)

    def _rendezvous(self, make: Callable[[], object], keep: Callable[[object], None], group: Callable[[object], object],
                    name: str) -> None:
        """`make()` waits on the store for every peer (a gloo group's rendezvous), so it runs on a thread
        of its own, and abort() releases this one at once; the thread ends at the rendezvous' own
        timeout, and breaks what it made after an abort. `keep(made)` runs under the lock unless
        aborted; `group(made)` is the group to break then. Raises what `make` raised."""
        done = threading.Event()
        failed: list[RuntimeError] = []

        def run() -> None:
            try:
                made = make()
                with self._lock:
                    late = bool(self.aborted)
                    if not late:
                        keep(made)
                if late:
                    _break(group(made))
            except RuntimeError as e:
                failed.append(e)
            finally:
                done.set()

        with self._lock:
            if self.aborted:
                raise TransportError(self.aborted)
            self._waiting.add(done)
        try:
            threading.Thread(target=run, daemon=True, name=f"reshard-{name}").start()
            done.wait()
        finally:
            with self._lock:
                self._waiting.discard(done)
        if self.aborted:
            raise TransportError(self.aborted)
        if failed:
            raise failed[0]

    def abort(self, reason: str) -> None:
        with self._lock:
            if self.aborted:
                return
            self.aborted = reason
            groups = [pg for pg in (self._pg, *self._groups.values()) if pg is not None]
            waiting = list(self._waiting)
        for done in waiting:
            done.set()
        t0 = time.monotonic()
        for pg in groups:
            _break(pg)
        log.info("gloo session %s, rank %d: aborted in %.3fs: %s", self.session, self.rank, time.monotonic() - t0, reason)

    def _error(self, what: str, e: RuntimeError) -> TransportError:
        if self.aborted:
            return TransportError(self.aborted)
        return TransportError(f"gloo {what} failed: {self._redact(str(e).splitlines()[0])}")

    def _redact(self, message: str) -> str:
        return redact(message, self._key)

    def _post(self, op: str, buf: torch.Tensor, peer: int, tag: int, what: str) -> Work:
        pg = self._pg
        if self.aborted:
            raise TransportError(self.aborted)
        if pg is None:
            raise TransportError(f"gloo session {self.session} is closed")
        try:
            return _GlooWork(self, getattr(pg, op)([buf], peer, tag), what)
        except RuntimeError as e:
            raise self._error(what, e) from e

    def send(self, buf: torch.Tensor, peer: int, tag: int) -> Work:
        return self._post("send", buf, peer, tag, f"send to rank {peer} (tag {tag})")

    def recv(self, buf: torch.Tensor, peer: int, tag: int) -> Work:
        return self._post("recv", buf, peer, tag, f"receive from rank {peer} (tag {tag})")

    def prepare_broadcast(self, groups: list[tuple[int, ...]], timeout_s: float) -> None:
        """A gloo group of its own for each group this rank is a member of, made in the given order
        (every member makes them in the same order) on a side thread that abort() releases; a group
        made in an earlier update of the session is kept, and given this update's timeout."""
        deadline = time.monotonic() + timeout_s
        for members in groups:
            if self.rank not in members or len(members) < 2:
                continue
            left = deadline - time.monotonic()
            pg = self._groups.get(members)
            if pg is not None:
                pg.set_timeout(datetime.timedelta(seconds=max(0.001, left)))  # a collective's own timeout
                continue
            name = "-".join(map(str, members))
            store = self._store
            if store is None:
                raise TransportError(self.aborted or f"gloo session {self.session} is closed")

            def keep(pg, members=members) -> None:
                self._groups[members] = pg

            try:
                self._rendezvous(lambda: _gloo_group(store, f"{self._prefix}/group/{name}", members.index(self.rank),
                                                     len(members), left),
                                 keep, lambda pg: pg, f"gloo-group-{self.session}-{name}")
            except RuntimeError as e:
                raise self._error(f"rendezvous of the group {name} (within {timeout_s:.1f}s)", e) from None

    def broadcast(self, buf: torch.Tensor, members: tuple[int, ...]) -> Work:
        from torch.distributed import BroadcastOptions

        what = f"broadcast from rank {members[0]}"
        if self.aborted:
            raise TransportError(self.aborted)
        pg = self._groups.get(members)
        if pg is None:
            raise TransportError(f"gloo {what} to ranks {list(members)}: no group for them "
                                 "(every rank must call prepare_broadcast with this group first)")
        opts = BroadcastOptions()
        opts.rootRank = 0
        try:
            return _GlooWork(self, pg.broadcast([buf], opts), what)
        except RuntimeError as e:
            raise self._error(what, e) from e

    def close(self) -> None:
        with self._lock:
            self._groups.clear()
            self._pg = None
            self._store = None


TRANSPORTS = {"gloo": GlooTransport}
_LAZY = {"nccl": ("reshard.common.dataplane.nccl_transport", "NcclTransport"),  # imported when first asked for
         "ipc": ("reshard.common.dataplane.cuda_ipc", "IpcTransport"),
         "hybrid": ("reshard.common.dataplane.hybrid", "HybridTransport")}


def transport_class(name: str) -> type[Transport]:
    if name not in TRANSPORTS and name in _LAZY:
        import importlib

        module, cls = _LAZY[name]
        TRANSPORTS[name] = getattr(importlib.import_module(module), cls)
    try:
        return TRANSPORTS[name]
    except KeyError:
        valid = sorted({*TRANSPORTS, *_LAZY})
        raise ValueError(f"unknown transport {name!r}; valid transports: {', '.join(valid)}") from None
