"""CUDA IPC: the same-host fast path for processes that share a GPU or a node.

A process exports CUDA IPC handles of its buffers (torch's own CUDA tensor reduction, the
one torch.multiprocessing uses); the handles travel as `reshard.worker.v1.CudaIpcHandle`
protobuf messages, so any gRPC message can carry them; the peer maps the buffers into its
own address space and copies what the plan says straight from them, with no staging and
no network: each segment is one device copy (`run_plan_from_peers`).

Rules of the road: the exporting process must keep the buffers alive and unchanged until
the importer is done reading (the trainer's publish handle is released after the update);
the importer drops its views (`del`) before the exporter frees them; both processes must
see the same device (same CUDA_VISIBLE_DEVICES mapping, or device UUIDs compared by the
caller). Handles of the caching allocator are per allocation: exporting a slice of a
larger block maps the whole block once (torch caches opened handles).

In the update lifecycle (`IpcTransport`, backend "ipc"): chosen when every trainer and
inference worker holds its buffers on one GPU (matched by device UUID, not by index:
CUDA_VISIBLE_DEVICES differs between processes). Each source rank puts the handles of its
buffers in the session's rendezvous store (on the trainer controller, under the session's
secret), computes its checksums per destination piece from the buffers themselves, and
waits until every destination rank it feeds says it is done reading; each destination
rank maps its sources' buffers, copies its pieces (`run_plan_from_peers`), sums what
landed, drops the mappings and says so. Plans of such sessions have no relays. Every wait
polls the store against the update's deadline and fails at once on an abort.

Status: `make gpu-check` runs two processes on one GPU and a full update through the
services with both sides on the GPU; neither has run on a GPU yet.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import time
from collections.abc import Callable

import torch

from reshard.common.dataplane.checksum import box_checksum_tensor, read_sums
from reshard.common.dataplane.engine import receiver_checksums
from reshard.common.dataplane.rank_update import RankUpdate
from reshard.common.dataplane.transport import Transport, TransportError, Work, redact
from reshard.common.layout.core import Layout, dtype_of
from reshard.common.plan.planner import Plan


@dataclasses.dataclass(frozen=True, slots=True)
class IpcHandle:
    """One buffer's CUDA IPC handle: torch's CUDA tensor reduction, field by field (the
    `reshard.worker.v1.CudaIpcHandle` message has the same fields)."""

    name: str
    device: int
    handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def to_proto(self):
        from reshard.proto import worker_pb2 as wpb

        return wpb.CudaIpcHandle(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    @classmethod
    def from_proto(cls, m) -> "IpcHandle":
        kw = {f.name: getattr(m, f.name) for f in dataclasses.fields(cls)}
        return cls(**dict(kw, shape=tuple(m.shape), stride=tuple(m.stride)))


def export_tensor(t: torch.Tensor, name: str = "") -> IpcHandle:
    """An IPC handle of CUDA tensor `t` (a view of its allocation)."""
    from torch.multiprocessing.reductions import reduce_tensor

    if t.device.type != "cuda":
        raise ValueError(f"CUDA IPC exports CUDA tensors; {name or 'this tensor'} is on {t.device}")
    torch.cuda.current_stream(t.device).synchronize()  # what the importer reads must be written
    _, args = reduce_tensor(t)
    (_cls, size, stride, offset, _scls, dtype, device, handle, storage_bytes, storage_offset, _grad,
     ref_handle, ref_offset, event_handle, event_sync) = args
    return IpcHandle(name=name, device=int(device), handle=handle, storage_bytes=storage_bytes,
                     storage_offset=storage_offset, ref_counter_handle=ref_handle or b"", ref_counter_offset=ref_offset or 0,
                     event_handle=event_handle or b"", event_sync_required=bool(event_sync),
                     dtype=str(dtype).removeprefix("torch."), shape=tuple(size), stride=tuple(stride), offset=offset)


def import_tensor(h: IpcHandle, device: int | None = None) -> torch.Tensor:
    """The exporter's tensor, mapped into this process (a view of its memory, not a copy). `device`:
    this process's index of the exporter's GPU (matched by UUID), when its numbering may differ."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(torch.Tensor, torch.Size(h.shape), tuple(h.stride), h.offset, torch.UntypedStorage,
                               getattr(torch, h.dtype), h.device if device is None else device, h.handle, h.storage_bytes, h.storage_offset, False,
                               h.ref_counter_handle or None, h.ref_counter_offset, h.event_handle or None,
                               h.event_sync_required)


def export_buffers(buffers: dict[str, torch.Tensor]) -> bytes:
    """Every buffer's handle, as one serialized `CudaIpcHandles` message (fits any gRPC message)."""
    from reshard.proto import worker_pb2 as wpb

    return wpb.CudaIpcHandles(handles=[export_tensor(t, n).to_proto() for n, t in buffers.items()]).SerializeToString()


def import_buffers(data: bytes, device: int | None = None) -> dict[str, torch.Tensor]:
    from reshard.proto import worker_pb2 as wpb

    return {h.name: import_tensor(IpcHandle.from_proto(h), device) for h in wpb.CudaIpcHandles.FromString(data).handles}


def run_plan_from_peers(plan: Plan, rank: int, src_buffers: dict[int, dict[str, torch.Tensor]],
                        dst_buffers: dict[str, torch.Tensor]) -> int:
    """Destination `rank`'s share of `plan`, read straight from the source ranks' mapped buffers
    (`src_buffers[src rank]`): one device copy per segment (casting where the plan declares it).
    Returns the bytes written. Every source is mapped, so plan without relays
    (`PlanOptions(relay=False)`): a relay would read another destination rank."""
    nbytes = 0
    for m in sorted(plan.recvs.get(rank, []), key=lambda m: m.round):
        if m.relay:
            raise ValueError("CUDA IPC reads every source directly: make the plan with PlanOptions(relay=False)")
        bufs = src_buffers[m.src]
        for seg in m.segments:
            seg.dst.view(dst_buffers[seg.dst.buffer], seg.box.size).copy_(seg.src.view(bufs[seg.src.buffer], seg.box.size),
                                                                          non_blocking=True)
            nbytes += seg.nbytes
    if any(t.is_cuda for t in dst_buffers.values()):
        torch.cuda.current_stream().synchronize()  # landed before anyone reads or sums it
    return nbytes


class SessionStore:
    """A rank's client of the session's rendezvous store (the trainer controller's, under the
    session's secret): the keys of CUDA IPC handles and completion marks. Every wait polls
    against a deadline and fails at once on an abort. The store lives as long as the trainer
    controller, so keys do not pile up: a key read by its one reader is taken (read and
    deleted), and a key put in a `slot` deletes the one this rank put there last (an earlier
    update's, read or left by a failure)."""

    def __init__(self, store_host: str, store_port: int, session: str, rank: int, timeout_s: float, key: str = "") -> None:
        from torch.distributed import PrefixStore, TCPStore

        self.session, self.rank, self.aborted, self._key = session, rank, "", key
        try:  # the store is the controller's: reached at once, or not at all
            store = TCPStore(store_host, store_port, world_size=None, is_master=False,
                             timeout=datetime.timedelta(seconds=max(1.0, timeout_s)), wait_for_workers=False)
        except RuntimeError as e:
            raise TransportError(f"session {session} (rank {rank}): the rendezvous store at "
                                 f"{store_host}:{store_port} is unreachable: {self.redact(str(e).splitlines()[0])}") from None
        self._store = PrefixStore(f"reshard/{key or session}/ipc", store)
        self._slots: dict[str, str] = {}

    def redact(self, message: str) -> str:
        """`message` without the session's secret (as the gloo transport's errors)."""
        return redact(message, self._key)

    def _op(self, what: str, op: Callable, *args):
        """A store operation; torch's errors name the keys, which live under the session's secret:
        they become a TransportError without it (and without the original as its cause)."""
        try:
            return op(*args)
        except RuntimeError as e:
            if self.aborted:
                raise TransportError(self.aborted) from None
            raise TransportError(f"session {self.session}, rank {self.rank}: the rendezvous store failed to {what}: "
                                 f"{self.redact(str(e).splitlines()[0] if str(e) else type(e).__name__)}") from None

    def abort(self, reason: str) -> None:
        self.aborted = self.aborted or reason

    def close(self) -> None:
        self._store = None

    def _usable(self) -> None:
        if self.aborted:
            raise TransportError(self.aborted)
        if self._store is None:
            raise TransportError(f"session {self.session} is closed")

    def put(self, key: str, value: bytes, slot: str = "") -> None:
        self._usable()
        last = self._slots.get(slot) if slot else None
        if last is not None and last != key:
            self._op("delete a key", self._store.delete_key, last)
        if slot:
            self._slots[slot] = key
        self._op("set a key", self._store.set, key, value)

    def delete(self, key: str) -> None:
        self._usable()
        self._op("delete a key", self._store.delete_key, key)

    def wait_keys(self, keys: list[str], deadline: float, what: str) -> None:
        """Until every key is in the store: fails at the deadline or at once on an abort."""
        delay = 0.001
        while True:
            self._usable()
            if not keys or self._op("check keys", self._store.check, keys):
                return
            if time.monotonic() >= deadline:
                raise TransportError(f"session {self.session}, rank {self.rank}: {what}")
            time.sleep(delay)
            delay = min(delay * 2, 0.02)

    def get(self, key: str, take: bool = False) -> bytes:
        """The key's value; with `take` (its one reader), deleted from the store too."""
        self._usable()
        value = bytes(self._op("get a key", self._store.get, key))
        if take:
            self._op("delete a key", self._store.delete_key, key)
        return value


class IpcTransport(Transport):
    """A session whose ranks share one GPU: no messages, only handles and completion marks
    through the session's rendezvous store (see the module doc). `send`/`recv` are refused."""

    name = "ipc"
    moves_messages_between_all_pairs = False

    @classmethod
    def for_session(cls, session, rank: int, world: int, timeout_s: float, device: str = "cpu",
                    on_connecting: Callable[[Transport], None] | None = None) -> "IpcTransport":
        return cls(session.store_host, session.store_port, session.id, rank, world, timeout_s, device=device,
                   key=session.key, on_connecting=on_connecting)

    def __init__(self, store_host: str, store_port: int, session: str, rank: int, world: int, timeout_s: float, *,
                 device: str = "cpu", key: str = "", on_connecting: Callable[[Transport], None] | None = None) -> None:
        if not str(device).startswith("cuda"):
            raise TransportError(f"session {session} uses CUDA IPC, but rank {rank}'s buffers are on {device}")
        self.rank, self.world, self.session, self.device = rank, world, session, torch.device(device)
        self.store: SessionStore | None = None
        if on_connecting is not None:
            on_connecting(self)
            if self.aborted:
                raise TransportError(self.aborted)
        self.store = SessionStore(store_host, store_port, session, rank, timeout_s, key)
        if self.aborted:
            self.store.abort(self.aborted)

    def abort(self, reason: str) -> None:
        self.aborted = self.aborted or reason
        if self.store is not None:
            self.store.abort(reason)

    def send(self, buf: torch.Tensor, peer: int, tag: int) -> Work:
        raise TransportError("a CUDA IPC session moves no messages: its destination ranks read the sources' buffers")

    recv = send

    def run_update(self, u: RankUpdate) -> tuple[dict, int, float]:
        """This rank's share of an update, by no message: a source puts its buffers' handles in the
        store, sums what its destinations will read and waits until they are done; a destination
        maps its sources' buffers, copies its pieces and sums what landed."""
        if u.prelude is not None:
            raise TransportError(f"the {self.name} transport moves no message between trainer ranks: trainer shards "
                                 "that split rows of FP8 blocks need gloo or nccl (or shards on block boundaries)")
        update_id, plan, side, rank, buffers, shapes = u.update_id, u.plan, u.side, u.rank, u.buffers, u.shapes
        u.connected()  # every rank on this GPU: nothing to connect beyond the store
        if side == "src":
            total = plan.send_bytes(rank)
            self.store.put(f"{update_id}/handles/{rank}", export_buffers(buffers), slot="handles")
            t0 = time.perf_counter()
            sums = source_checksums(plan, rank, buffers, shapes)
            csum = time.perf_counter() - t0
            readers = sorted({m.dst for m in plan.sends.get(rank, [])})
            # The buffers stay as they are until every destination rank that reads them is done.
            self.store.wait_keys([f"{update_id}/read/{d}" for d in readers], u.deadline,
                                 f"destination ranks {readers} did not finish reading this rank's buffers in time")
            self.store.delete(f"{update_id}/handles/{rank}")  # every reader has mapped and dropped them
            if u.progress:
                u.progress(total, total)
            return sums, total, csum
        sources = sorted({m.src for m in plan.recvs.get(rank, [])})
        self.store.wait_keys([f"{update_id}/handles/{s}" for s in sources], u.deadline,
                             f"source ranks {sources} did not publish their buffers' handles in time")
        # Every rank of the session is on this GPU (matched by UUID): map on this process's index of it.
        mapped = {s: import_buffers(self.store.get(f"{update_id}/handles/{s}"), self.device.index) for s in sources}
        try:
            with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
                nbytes = run_plan_from_peers(plan, rank, mapped, buffers)
        finally:
            mapped.clear()  # the mappings go before the sources may change
        t0 = time.perf_counter()
        sums = receiver_checksums(plan, rank, buffers, u.dst, shapes)  # what landed, read where it landed
        csum = time.perf_counter() - t0
        self.store.put(f"{update_id}/read/{rank}", b"1", slot="read")  # read by each source: the next update's deletes it
        if u.progress:
            u.progress(nbytes, nbytes)
        return sums, nbytes, csum

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


def source_checksums(plan: Plan, rank: int, buffers: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]]):
    """A source rank's sums per destination piece of what its destinations will read (each segment
    as the destination holds it: cast to its dtype, tile by tile), queued on the buffers' device and
    read once; a piece's segments add up on the host."""
    queued: list[tuple[tuple[int, str, int], torch.Tensor]] = []
    for m in plan.sends.get(rank, []):
        for seg in m.segments:
            view = seg.src.view(buffers[seg.src.buffer], seg.box.size)
            c = box_checksum_tensor(view, seg.box.offset, shapes[seg.tensor], dtype=dtype_of(seg.dst_dtype))
            queued.append(((m.dst, seg.dst_buffer, seg.dst_piece), c))
    return read_sums(queued)


def run_ipc(t: IpcTransport, update_id: str, plan: Plan, side: str, rank: int, buffers: dict[str, torch.Tensor],
            shapes: dict[str, tuple[int, ...]], dst: Layout, deadline: float,
            progress: Callable[[int, int], None] | None = None):
    """`t.run_update` with its arguments spelled out (the form earlier callers use): one rank's share of
    an update in a CUDA IPC session, (checksums, bytes, checksum seconds)."""
    return t.run_update(RankUpdate(update_id, plan, side, rank, buffers, shapes, dst, None, deadline, progress=progress))
