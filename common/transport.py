"""Data-plane transports. One interface, several implementations, chosen by name.

The engine sees only `Transport`: post a send or a receive of a flat uint8
tensor to/from a session peer with a tag, and wait for posted work with a
deadline. `gloo` runs on CPU (torch's ProcessGroupGloo on a TCPStore, a fresh
PrefixStore per session, no global default group); `nccl` (common/nccl_transport.py)
on CUDA. A transport may hold back what was posted until `flush()` (NCCL fuses a
round's operations in one group) and may run the engine's copies on a stream of
its own (`copy_context()`); for gloo both are no-ops.
"""

from __future__ import annotations

import abc
import contextlib
import datetime
import logging
import time

import torch

log = logging.getLogger("reshard.transport")


class TransportError(RuntimeError):
    """A data-plane operation failed or ran past its deadline."""


class Work(abc.ABC):
    @abc.abstractmethod
    def wait(self, timeout_s: float) -> None: ...


class Transport(abc.ABC):
    name: str = "?"
    connection_bytes: int = 0  # device memory the transport's own connections hold (NCCL's buffers)

    @classmethod
    def for_session(cls, session, rank: int, world: int, timeout_s: float, device: str = "cpu") -> "Transport":
        """Join the data-plane session described by a `reshard.v1.Session` as `rank` of `world`."""
        return cls(session.store_host, session.store_port, session.id, rank, world, timeout_s)

    def flush(self) -> None:
        """Start whatever was posted and not started yet (one round's sends and receives)."""

    def copy_context(self):
        """A context in which the engine packs and unpacks (a copy stream of the transport's own)."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def send(self, buf: torch.Tensor, peer: int, tag: int) -> Work: ...

    @abc.abstractmethod
    def recv(self, buf: torch.Tensor, peer: int, tag: int) -> Work: ...

    def broadcast(self, buf: torch.Tensor, members: tuple[int, ...]) -> Work:
        """Broadcast from members[0] to the other members (the serialized baseline's collective)."""
        raise NotImplementedError(f"transport {self.name} has no broadcast")

    @abc.abstractmethod
    def close(self) -> None: ...


class _GlooWork(Work):
    __slots__ = ("_w", "_what")

    def __init__(self, w, what: str) -> None:
        self._w, self._what = w, what

    def wait(self, timeout_s: float) -> None:
        try:
            self._w.wait(datetime.timedelta(seconds=max(0.001, timeout_s)))
        except RuntimeError as e:
            raise TransportError(f"gloo {self._what} failed: {str(e).splitlines()[0]}") from e


class GlooTransport(Transport):
    """A side gloo group on a TCPStore served by the trainer controller."""

    name = "gloo"

    def __init__(self, store_host: str, store_port: int, session: str, rank: int, world: int, timeout_s: float) -> None:
        from torch.distributed import PrefixStore, TCPStore
        from torch.distributed.distributed_c10d import ProcessGroupGloo

        self.rank, self.world, self.session = rank, world, session
        self._groups: dict[tuple[int, ...], object] = {}
        timeout = datetime.timedelta(seconds=timeout_s)
        self._timeout = timeout
        t0 = time.monotonic()
        try:
            self._store = TCPStore(store_host, store_port, world_size=None, is_master=False, timeout=timeout, wait_for_workers=False)
            prefix = PrefixStore(f"reshard/{session}", self._store)
            self._pg = ProcessGroupGloo(prefix, rank, world, timeout)
        except RuntimeError as e:
            raise TransportError(
                f"gloo rendezvous for session {session} (rank {rank} of {world}) at {store_host}:{store_port} "
                f"failed after {time.monotonic() - t0:.1f}s: {str(e).splitlines()[0]}"
            ) from e
        log.debug("gloo session %s: rank %d/%d connected in %.2fs", session, rank, world, time.monotonic() - t0)

    def send(self, buf: torch.Tensor, peer: int, tag: int) -> Work:
        return _GlooWork(self._pg.send([buf], peer, tag), f"send to rank {peer} (tag {tag})")

    def recv(self, buf: torch.Tensor, peer: int, tag: int) -> Work:
        return _GlooWork(self._pg.recv([buf], peer, tag), f"receive from rank {peer} (tag {tag})")

    def broadcast(self, buf: torch.Tensor, members: tuple[int, ...]) -> Work:
        from torch.distributed import BroadcastOptions, PrefixStore
        from torch.distributed.distributed_c10d import ProcessGroupGloo

        pg = self._groups.get(members)
        if pg is None:
            name = "-".join(map(str, members))
            pg = ProcessGroupGloo(PrefixStore(f"reshard/{self.session}/group/{name}", self._store),
                                  members.index(self.rank), len(members), self._timeout)
            self._groups[members] = pg
        opts = BroadcastOptions()
        opts.rootRank = 0
        return _GlooWork(pg.broadcast([buf], opts), f"broadcast from rank {members[0]}")

    def close(self) -> None:
        self._groups.clear()
        self._pg = None
        self._store = None


TRANSPORTS = {"gloo": GlooTransport}
_LAZY = {"nccl": ("reshard.common.nccl_transport", "NcclTransport")}  # imported when first asked for


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
