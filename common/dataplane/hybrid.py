"""Hybrid sessions: NCCL between GPUs, CUDA IPC within one.

The colocated RL setup on several GPUs puts a trainer rank and an inference rank (or a few
inference ranks: small replicas) on each GPU, in separate processes. NCCL cannot hold two
ranks of one GPU in a communicator, so such a session gives each GPU one place in it: its
*host*, the lowest session rank on it (the trainer rank, where there is one). The other
ranks on that GPU, its *guests* (inference ranks), take no part in NCCL: each puts CUDA IPC
handles of its buffers in the session's rendezvous store, and the host maps them and does
the guests' shares of the plan into them, while it does its own:

- what the host sends a guest is one device copy per segment, no message;
- what other GPUs send a guest arrives at the host over NCCL, straight into the guest's
  buffers (or through the host's staging, then unpacked into them);
- what the host sends other GPUs, or receives for itself, goes over NCCL as in any session.

The host then drops its mappings and marks each guest's pieces written (or says why not),
and each guest sums what landed in its own buffers for VERIFY, as every destination rank
does. So the bytes cross each GPU boundary once, over NCCL, and never stage through a
second copy on the GPU that shares them: the two-hop alternative (reshard among the
trainer ranks, then IPC) would hold a second copy of the inference weights on every GPU.

Limits: each GPU holds at most one trainer rank (two are refused by name: a guest's sends
would need its sums reported by its host); plans have no relays, as in IPC sessions; the
`serialized` method needs messages between every rank and is refused
(`moves_messages_between_all_pairs` is False). Every wait polls
against the update's deadline and fails at once on an abort; a host that fails marks its
guests' pieces failed, so they fail at once with the host's reason.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import torch

from reshard.common.dataplane.cuda_ipc import SessionStore, export_buffers, import_buffers
from reshard.common.dataplane.engine import receiver_checksums
from reshard.common.dataplane.rank_update import RankUpdate
from reshard.common.dataplane.transport import Transport, TransportError, Work


class Placement:
    """Where each session rank's bytes move: `hosts[r]`, the session rank that moves them (itself, or
    the host of its GPU), and `comm[r]`, its host's rank in the NCCL communicator (one per GPU)."""

    def __init__(self, gpus: Sequence[str], src_world: int) -> None:
        if any(not u for u in gpus):
            missing = [r for r, u in enumerate(gpus) if not u]
            raise TransportError(f"a hybrid session needs every rank's GPU UUID; session ranks {missing} have none")
        self.src_world = src_world
        on: dict[str, list[int]] = {}
        for r, u in enumerate(gpus):
            on.setdefault(u, []).append(r)
        for u, ranks in on.items():
            trainers = [r for r in ranks if r < src_world]
            if len(trainers) > 1:
                raise TransportError(f"trainer ranks {trainers} share GPU {u}: a hybrid session takes at most one "
                                     "trainer rank per GPU")
        order = list(on)  # GPUs in the order of their lowest session rank: trainer worker 0's comes first
        self.hosts = [on[u][0] for u in gpus]
        self.comm = [order.index(u) for u in gpus]
        self.world = len(order)
        self.guests = {ranks[0]: ranks[1:] for ranks in on.values() if len(ranks) > 1}  # host -> its guests (session ranks)

    def describe(self, r: int) -> str:
        return f"trainer rank {r}" if r < self.src_world else f"inference rank {r - self.src_world}"


class HybridTransport(Transport):
    """One rank of a hybrid session: the session's store, and for a GPU's host its place in the
    NCCL communicator (`net`), addressed by session rank (mapped to the host's)."""

    name = "hybrid"
    moves_messages_between_all_pairs = False  # ranks sharing a GPU have none between them

    @classmethod
    def for_session(cls, session, rank: int, world: int, timeout_s: float, device: str = "cpu",
                    on_connecting: Callable[[Transport], None] | None = None) -> "HybridTransport":
        from reshard.common.dataplane.nccl_transport import NcclTransport

        placement = Placement(list(session.device_uuids), session.src_world)
        if len(placement.hosts) != world:
            raise TransportError(f"session {session.id} names the GPUs of {len(placement.hosts)} ranks, not {world}")
        if not session.nccl_unique_id:
            raise TransportError(f"session {session.id} uses NCCL between GPUs but carries no nccl_unique_id")

        def net(attach: Callable[[Transport], None]) -> Transport:
            return NcclTransport(bytes(session.nccl_unique_id), placement.comm[rank], placement.world, timeout_s,
                                 device=device, session=session.id, on_connecting=attach)

        store = lambda: SessionStore(session.store_host, session.store_port, session.id, rank, timeout_s, session.key)  # noqa: E731
        return cls(placement, rank, store, net, device=device, on_connecting=on_connecting)

    def __init__(self, placement: Placement, rank: int, store: Callable[[], SessionStore],
                 net: Callable[[Callable[[Transport], None]], Transport], *, device: str = "cpu",
                 on_connecting: Callable[[Transport], None] | None = None) -> None:
        self.placement, self.rank, self.device = placement, rank, torch.device(device)
        self.host = placement.hosts[rank]
        self.guests: list[int] = placement.guests.get(rank, [])  # the session ranks it moves bytes for, besides its own
        self.net: Transport | None = None
        self.store: SessionStore | None = None
        self._lock = threading.Lock()
        if on_connecting is not None:
            on_connecting(self)
        self._check()
        made = store()
        with self._lock:
            self.store = made
            if self.aborted:
                made.abort(self.aborted)
        self._check()
        if self.host == rank:
            net(self._attach)
            self._check()

    def _check(self) -> None:
        if self.aborted:
            raise TransportError(self.aborted)

    def _attach(self, net: Transport) -> None:
        with self._lock:
            self.net = net
            why = self.aborted
        if why:
            net.abort(why)

    def abort(self, reason: str) -> None:
        with self._lock:
            if self.aborted:
                return
            self.aborted = reason
            parts = [p for p in (self.store, self.net) if p is not None]
        for p in parts:
            p.abort(reason)

    @property
    def stream_ordered(self) -> bool:
        return self.net is not None and self.net.stream_ordered

    @property
    def connection_bytes(self) -> int:
        return self.net.connection_bytes if self.net is not None else 0

    def _net(self) -> Transport:
        self._check()
        if self.net is None:
            raise TransportError(f"{self.placement.describe(self.rank)} moves no bytes of its own: its GPU's host "
                                 f"({self.placement.describe(self.host)}) does")
        return self.net

    def send(self, buf: torch.Tensor, peer: int, tag: int) -> Work:
        return self._net().send(buf, self.placement.comm[peer], tag)

    def recv(self, buf: torch.Tensor, peer: int, tag: int) -> Work:
        return self._net().recv(buf, self.placement.comm[peer], tag)

    def set_deadline(self, deadline: float) -> None:
        if self.net is not None:
            self.net.set_deadline(deadline)

    def flush(self) -> None:
        self._net().flush()

    def copy_context(self):
        return self._net().copy_context()

    def warm_up(self, sends_to: set[int], recvs_from: set[int], timeout_s: float) -> None:
        comm = self.placement.comm
        self._net().warm_up({comm[p] for p in sends_to}, {comm[p] for p in recvs_from}, timeout_s)

    def close(self) -> None:
        for p in (self.net, self.store):
            if p is not None:
                p.close()

    def run_update(self, u: RankUpdate) -> tuple[dict, int, float]:
        """This rank's share of an update: a guest publishes its buffers' handles and waits for its host to
        write its pieces; a host runs its own share and its guests' in one engine (see the module doc)."""
        if u.prelude is not None:
            raise TransportError(f"the {self.name} transport moves no message between trainer ranks: trainer shards "
                                 "that split rows of FP8 blocks need gloo or nccl (or shards on block boundaries)")
        me, where = self.rank, self.placement.describe
        update_id, plan, rank, buffers, shapes = u.update_id, u.plan, u.rank, u.buffers, u.shapes
        if self.host != me:  # a guest: its GPU's host writes its pieces
            self.store.put(f"{update_id}/handles/{me}", export_buffers(buffers), slot="handles")
            u.connected()
            mark = f"{update_id}/written/{me}"
            self.store.wait_keys([mark], u.deadline,
                                 f"{where(self.host)}, the host of this GPU, did not write this rank's pieces in time")
            said = self.store.get(mark, take=True)
            if said != b"ok":
                raise TransportError(f"{where(self.host)}, the host of this GPU, failed: {said.decode(errors='replace')}")
            t0 = time.perf_counter()
            sums = receiver_checksums(plan, rank, buffers, u.dst, shapes)  # what landed, read where it landed
            total = plan.recv_bytes(rank)
            if u.progress:
                u.progress(total, total)
            return sums, total, time.perf_counter() - t0
        S = plan.src_world
        for g in self.guests:
            self.store.wait_keys([f"{update_id}/handles/{g}"], u.deadline,
                                 f"{where(g)}, on this GPU, did not publish its buffers' handles in time")
        guests = {g - S: import_buffers(self.store.get(f"{update_id}/handles/{g}", take=True), self.device.index)
                  for g in self.guests}

        def mark(said: bytes) -> None:
            for g in guests.values():
                g.clear()  # the mappings go before the guests read or change their buffers
            for g in self.guests:
                self.store.put(f"{update_id}/written/{g}", said, slot=f"written/{g}")

        try:
            engine = u.engine(self, guests=guests)
            self.warm_up(*engine.peers(), max(0.0, u.deadline - time.monotonic()))
            u.connected()
            sums = engine.run()  # the copy stream has landed every piece when it returns
        except BaseException as e:
            if self.guests and self.store is not None and not self.aborted:
                try:
                    mark(self.store.redact(str(e) or type(e).__name__).encode())  # guests report it: never the secret
                except Exception:  # noqa: BLE001 - the guests then fail at their deadline or abort
                    pass
            raise
        mark(b"ok")
        return sums, engine.bytes_done, engine.checksum_seconds
