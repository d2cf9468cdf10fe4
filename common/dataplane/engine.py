"""The engine: executes one rank's share of a plan over a Transport.

Sender: pack strided slices into a staging bucket (casting to the wire dtype),
send; contiguous segments go straight from tensor storage. Receiver: receive
into staging and unpack, or straight into destination storage. Staging is a
pool allocated once and reused across updates; packing round k+1 overlaps the
transfer of round k. Checksums of what is sent are computed on the sender, per
destination piece, so the receiver can verify what it holds.

Rounds are matched globally, so on a stream-ordered transport (NCCL) the engine
queues them back to back without waiting on the host: the copy stream waits (on the
device) for round k's group before unpacking it, which also orders the packing of
round k+2 into round k's half of the staging, and of a relay after the receive it
forwards. Checksums are then queued on the copy stream too (`box_checksum_tensor`)
and read once at the end; a round's sender sums are queued after the next round is
posted (that round's group waits only for its packing, not for them) and before the
round after it packs into their half of the staging. The host waits for round k only
once ROUNDS_AHEAD later rounds are queued (bounding what is queued on the device behind
a peer that may have died) and for the rest at the end; progress and the hook follow
those waits. On a host-waited transport (gloo) a round's progress and hook run once the
next round is posted, so what the hook does (bounded staging loads what the round
completed) overlaps the next round's bytes.

In a hybrid session (common/dataplane/hybrid.py) a rank may also host the destination
ranks on its GPU (`guests`): it receives their messages into their buffers (mapped
through CUDA IPC), and a source rank writes what it sends them by device copies.
"""

from __future__ import annotations

import logging
import os
import time
from collections import defaultdict, deque
from collections.abc import Callable

import torch

from reshard.common.dataplane.checksum import P, box_checksum, box_checksum_tensor, box_checksums, read_sums
from reshard.common.dataplane.transport import Transport, TransportError, Work
from reshard.common.layout.core import Layout, dtype_of
from reshard.common.plan.planner import Message, Plan, Segment, Side

log = logging.getLogger("reshard.engine")

# Staging per rank beyond which the pool warns (the plan's bucket size decides what it needs).
DEFAULT_STAGING_LIMIT = int(os.environ.get("RESHARD_STAGING_LIMIT_BYTES", 256 << 20))
ROUNDS_AHEAD = 4  # stream-ordered transports: rounds queued on the device beyond the oldest one not seen done


class StagingPool:
    """A grow-only uint8 buffer on the worker's device, allocated once and reused for every update."""

    def __init__(self, device: str | torch.device = "cpu", limit_bytes: int = DEFAULT_STAGING_LIMIT) -> None:
        self.device = torch.device(device)
        self.limit_bytes = limit_bytes
        self._buf = torch.empty(0, dtype=torch.uint8, device=self.device)
        self.allocations = 0

    @property
    def nbytes(self) -> int:
        return self._buf.numel()

    def get(self, nbytes: int) -> torch.Tensor:
        if self._buf.numel() < nbytes:
            if nbytes > self.limit_bytes:
                log.warning("staging needs %.1f MiB on %s, over the %.0f MiB limit: use a smaller bucket size "
                            "(--bucket-bytes) to bound it", nbytes / 2**20, self.device, self.limit_bytes / 2**20)
            self._buf = torch.empty(0, dtype=torch.uint8, device=self.device)  # free the old one first
            self._buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self.allocations += 1
        return self._buf[:nbytes]


def _flat_bytes(t: torch.Tensor, side: Side, size: tuple[int, ...]) -> torch.Tensor:
    assert side.contiguous(size), "direct segment over a non-contiguous region"
    n = 1
    for d in size:
        n *= d
    return t.reshape(-1)[side.start : side.start + n].view(torch.uint8)


def pack(m: Message, buffers: dict[str, torch.Tensor], out: torch.Tensor) -> None:
    """Copy (and cast) the message's source regions into a staged uint8 buffer."""
    for seg, off, n in zip(m.segments, m.segment_offsets, m.segment_bytes):
        view = out[off : off + n].view(dtype_of(seg.dst_dtype)).view(seg.box.size)
        view.copy_(seg.src.view(buffers[seg.src.buffer], seg.box.size))


def unpack(m: Message, buffers: dict[str, torch.Tensor], staged: torch.Tensor) -> None:
    for seg, off, n in zip(m.segments, m.segment_offsets, m.segment_bytes):
        view = staged[off : off + n].view(dtype_of(seg.dst_dtype)).view(seg.box.size)
        seg.dst.view(buffers[seg.dst.buffer], seg.box.size).copy_(view)


def execute_in_memory(plan: Plan, src_buffers: list[dict[str, torch.Tensor]], dst_buffers: list[dict[str, torch.Tensor]]) -> None:
    """Run a whole plan inside one process over plain tensors (tests and the planner's users).
    Messages run in round order, so relays forward what their rank received earlier."""
    for m in sorted(plan.messages, key=lambda m: m.round):
        wire = torch.empty(m.staged_bytes, dtype=torch.uint8)
        pack(m, (dst_buffers if m.relay else src_buffers)[m.src], wire)
        unpack(m, dst_buffers[m.dst], wire)


PieceKey = tuple[int, str, int]  # (destination rank, destination buffer, piece index)


class Engine:
    """Runs one rank's share of a plan: a source rank's sends, or a destination rank's receives
    and the relays it forwards to its replicas."""

    def __init__(self, transport: Transport, plan: Plan, side: str, rank: int, buffers: dict[str, torch.Tensor],
                 tensor_shapes: dict[str, tuple[int, ...]], pool: StagingPool, deadline: float,
                 progress: Callable[[int, int], None] | None = None, checksums: bool = True,
                 hook: Callable[[int], None] | None = None, dst_offset: int | None = None,
                 receiver_sums: bool = False, guests: dict[int, dict[str, torch.Tensor]] | None = None) -> None:
        if side not in ("src", "dst"):
            raise ValueError(f"side must be 'src' or 'dst', not {side!r}")
        if guests and any(m.relay for m in plan.messages):
            raise ValueError("a rank hosting other ranks' receives runs plans without relays (PlanOptions(relay=False))")
        self.t, self.plan, self.side, self.rank = transport, plan, side, rank
        self.buffers, self.shapes, self.pool = buffers, tensor_shapes, pool
        self.deadline, self.progress, self.do_checksums, self.hook = deadline, progress, checksums, hook
        self.receiver_sums = receiver_sums and side == "dst"  # sum what lands, per piece, as it lands
        # A hybrid session's rank may host the destination ranks on its GPU (`guests`: destination rank ->
        # its buffers, mapped through CUDA IPC): it receives their messages into them, and what a source
        # rank sends them itself is a device copy (`local`), no message.
        self.guests = dict(guests or {})
        self.local: list[Message] = []
        if side == "src":
            sends = plan.sends.get(rank, [])
            self.work = [(m, "send") for m in sends if m.dst not in self.guests]
            self.local = [m for m in sends if m.dst in self.guests]
        else:
            self.work = [(m, "recv") for m in plan.recvs.get(rank, [])] + [(m, "send") for m in plan.relay_sends.get(rank, [])]
        for g in sorted(self.guests):
            self.work += [(m, "recv") for m in plan.recvs.get(g, []) if not (side == "src" and m.src == rank)]
        self.src_world = plan.src_world
        self.dst_offset = plan.src_world if dst_offset is None else dst_offset
        self.checksums: dict[PieceKey, int] = defaultdict(int)
        self._queued_sums: list[tuple[PieceKey, torch.Tensor]] = []  # stream-ordered: sums on the device, not read yet
        self.bytes_done = 0  # this rank's own bytes (a hosted rank's receives are its own to report)
        self.checksum_seconds = 0.0

    def _own(self, m: Message, role: str) -> bool:
        """Whether the item is this rank's own (a hosted rank's receives are its own to count and sum)."""
        return role == "send" or (self.side == "dst" and m.dst == self.rank)

    def _recv_buffers(self, m: Message) -> dict[str, torch.Tensor]:
        return self.guests.get(m.dst, self.buffers)

    def _peer(self, m: Message, role: str) -> int:
        if role == "send":
            return self.dst_offset + m.dst
        return self.src_world + m.src if m.relay else m.src

    def _remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TransportError("update deadline passed during transfer")
        return left

    def _rounds(self) -> list[list[tuple[Message, str]]]:
        by_round: dict[int, list[tuple[Message, str]]] = defaultdict(list)
        for m, role in self.work:
            by_round[m.round].append((m, role))
        return [by_round[r] for r in sorted(by_round)]

    @staticmethod
    def _staged(m: Message, role: str) -> bool:
        return not (m.send_direct if role == "send" else m.recv_direct)

    def peers(self) -> tuple[set[int], set[int]]:
        """The session ranks this rank sends to and receives from (what `Transport.warm_up` takes):
        every peer derives the mirror image from the same plan."""
        return ({self._peer(m, role) for m, role in self.work if role == "send"},
                {self._peer(m, role) for m, role in self.work if role == "recv"})

    def _add_sum(self, key: PieceKey, values: torch.Tensor, offset: tuple[int, ...], shape: tuple[int, ...],
                 dtype: torch.dtype | None = None) -> None:
        if self.t.stream_ordered:  # queued on the copy stream, before the staging is reused; read at the end
            self._queued_sums.append((key, box_checksum_tensor(values, offset, shape, dtype=dtype)))
        else:
            self.checksums[key] = (self.checksums[key] + box_checksum(values, offset, shape, dtype=dtype)) % P

    def _read_sums(self) -> None:
        if self._queued_sums:
            t0 = time.perf_counter()
            for key, c in read_sums(self._queued_sums).items():
                self.checksums[key] = (self.checksums[key] + c) % P
            self._queued_sums.clear()
            self.checksum_seconds += time.perf_counter() - t0

    def _sender_checksum(self, dst: int, seg: Segment, wire: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        t0 = time.perf_counter()
        self._add_sum((dst, seg.dst_buffer, seg.dst_piece), wire, seg.box.offset, self.shapes[seg.tensor], dtype)
        self.checksum_seconds += time.perf_counter() - t0

    def _sender_checksums(self, items: list[tuple[Message, str, torch.Tensor]]) -> None:
        """Sums of a round's sends per destination piece, of the bytes as sent: from the staging where
        packed (in the wire dtype), else the source's view. A relay sends none: the plan extends its
        source's sums to the replicas it feeds."""
        for m, role, buf in items:
            if role != "send" or m.relay:
                continue
            if self._staged(m, role):
                for seg, off, n in zip(m.segments, m.segment_offsets, m.segment_bytes):
                    self._sender_checksum(m.dst, seg, buf[off : off + n].view(dtype_of(seg.dst_dtype)).view(seg.box.size))
            else:
                seg = m.segments[0]
                self._sender_checksum(m.dst, seg, seg.src.view(self.buffers[seg.src.buffer], seg.box.size))

    def run(self) -> dict[PieceKey, int]:
        self.t.set_deadline(self.deadline)  # a session reused by this update waits by its deadline
        with self.t.copy_context():  # the transport's copy stream, where it has one
            return self._run()

    def _run(self) -> dict[PieceKey, int]:
        rounds = self._rounds()
        ordered = self.t.stream_ordered
        total = sum(m.nbytes for m, role in self.work if self._own(m, role)) + sum(m.nbytes for m in self.local)
        sizes = [sum(m.staged_bytes for m, role in r if self._staged(m, role)) for r in rounds]
        half = max(sizes, default=0)
        pool = self.pool.get(2 * half) if half else None

        def stage(i: int) -> list[tuple[Message, str, torch.Tensor]]:
            base = (i % 2) * half
            pos, out = 0, []
            for m, role in rounds[i]:
                if self._staged(m, role):
                    buf = pool[base + pos : base + pos + m.staged_bytes]
                    pos += m.staged_bytes
                    if role == "send":
                        pack(m, self.buffers, buf)
                else:
                    seg = m.segments[0]
                    side = seg.src if role == "send" else seg.dst
                    buf = _flat_bytes((self.buffers if role == "send" else self._recv_buffers(m))[side.buffer], side, seg.box.size)
                out.append((m, role, buf))
            return out

        def post(items: list[tuple[Message, str, torch.Tensor]]) -> list[Work]:
            works = [(self.t.send if role == "send" else self.t.recv)(buf[: m.wire_bytes], self._peer(m, role), m.tag)
                     for m, role, buf in items]
            self.t.flush()  # one group per round (NCCL); gloo started each one already
            return works

        def prepackable(i: int) -> bool:
            # A relay forwards what this rank received: pack it only once earlier rounds landed.
            return not any(m.relay and role == "send" for m, role in rounds[i])

        def landed(i: int, items: list[tuple[Message, str, torch.Tensor]]) -> None:
            self.bytes_done += sum(m.nbytes for m, role, _ in items if self._own(m, role))
            if self.progress:
                self.progress(self.bytes_done, total)
            if self.hook:
                self.hook(i)

        if not rounds:
            self._copy_local(total)
            self._read_sums()
            return dict(self.checksums)
        queued: deque = deque()  # stream-ordered: rounds not yet seen done on the host
        current = stage(0)
        works = post(current)
        self._copy_local(total)  # while the first round is on the wire
        for i in range(len(rounds)):
            nxt = stage(i + 1) if (i + 1 < len(rounds) and prepackable(i + 1)) else None
            if self.do_checksums and not ordered:
                self._sender_checksums(current)  # on the host, while round i is on the wire
            for w in works:
                # Stream-ordered: what the copy stream queues from here on (this round's unpack, the
                # packing of round i + 2 into this round's half, a relay's packing) runs after round i.
                (w.device_wait if ordered else w.wait)(self._remaining())
            for m, role, buf in current:
                if role == "recv" and self._staged(m, role):
                    unpack(m, self._recv_buffers(m), buf)
            done, done_works = current, works
            if i + 1 < len(rounds):
                current = nxt if nxt is not None else stage(i + 1)
                works = post(current)
            if not ordered:
                # With round i + 1 on the wire: what the hook does with round i (bounded staging loads
                # the groups it completed) overlaps the next round's bytes.
                landed(i, done)
            if self.do_checksums and ordered:
                # Queued on the copy stream after round i + 1 was posted, whose group then waits only for its
                # packing, and before round i + 2 packs into round i's half of the staging (next iteration).
                self._sender_checksums(done)
            if self.receiver_sums:
                self._receiver_checksums(done)  # while the next round is on the wire
            if ordered:
                queued.append((i, done, done_works))
                while len(queued) > (ROUNDS_AHEAD if i + 1 < len(rounds) else 0):
                    j, items, ws = queued.popleft()
                    for w in ws:
                        w.wait(self._remaining())
                    landed(j, items)
        self._read_sums()
        return dict(self.checksums)

    def _copy_local(self, total: int) -> None:
        """What this rank sends the destination ranks it hosts: one device copy per segment (cast where
        the plan says), summed as the destination will hold it."""
        for m in self.local:
            for seg in m.segments:
                view = seg.src.view(self.buffers[seg.src.buffer], seg.box.size)
                seg.dst.view(self.guests[m.dst][seg.dst.buffer], seg.box.size).copy_(view)
                if self.do_checksums:  # cast tile by tile where the destination's dtype differs
                    self._sender_checksum(m.dst, seg, view, dtype_of(seg.dst_dtype))
            self.bytes_done += m.nbytes
        if self.local and self.progress:
            self.progress(self.bytes_done, total)

    def _receiver_checksums(self, items) -> None:
        """A receiver's sums per piece of what landed, read where it landed (each segment's
        place in its buffer): VERIFY then compares numbers instead of reading every piece."""
        t0 = time.perf_counter()
        for m, role, _ in items:
            if role != "recv" or m.dst != self.rank:  # a hosted rank sums what it holds itself
                continue
            for seg in m.segments:
                if seg.dst_piece < 0:
                    continue
                self._add_sum((self.rank, seg.dst_buffer, seg.dst_piece), seg.dst.view(self.buffers[seg.dst.buffer], seg.box.size),
                              seg.box.offset, self.shapes[seg.tensor])
        self.checksum_seconds += time.perf_counter() - t0


def receiver_checksums(plan: Plan, rank: int, buffers: dict[str, torch.Tensor], dst: Layout, shapes) -> dict[PieceKey, int]:
    """Checksum every destination piece this rank receives in `plan`, from what it holds now (on a
    GPU, queued there, a large piece in tiles, and all read back once)."""
    pieces = dst.rank_pieces(rank)
    keys = sorted(plan.expected_pieces(rank))
    boxes = [(pieces[k].view(buffers[k[0]]), pieces[k].box.offset, shapes[pieces[k].tensor]) for k in keys]
    return {(rank, bname, pi): c for (bname, pi), c in zip(keys, box_checksums(boxes))}
