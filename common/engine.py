"""The engine: executes one rank's share of a plan over a Transport.

Sender: pack strided slices into a staging bucket (casting to the wire dtype),
send; contiguous segments go straight from tensor storage. Receiver: receive
into staging and unpack, or straight into destination storage. Staging is a
pool allocated once and reused across updates; packing round k+1 overlaps the
transfer of round k. Checksums of what is sent are computed on the sender, per
destination piece, so the receiver can verify what it holds.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

import torch

from .checksum import P, box_checksum
from .layout import Box, dtype_of
from .planner import Message, Plan, Segment, Side
from .transport import Transport, TransportError, Work


class StagingPool:
    """A grow-only uint8 buffer, allocated once and reused for every update."""

    def __init__(self) -> None:
        self._buf = torch.empty(0, dtype=torch.uint8)
        self.allocations = 0

    def get(self, nbytes: int) -> torch.Tensor:
        if self._buf.numel() < nbytes:
            self._buf = torch.empty(nbytes, dtype=torch.uint8)
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
    for seg, off in zip(m.segments, m.offsets()):
        view = out[off : off + seg.nbytes].view(dtype_of(seg.dst_dtype)).view(seg.box.size)
        view.copy_(seg.src.view(buffers[seg.src.buffer], seg.box.size))


def unpack(m: Message, buffers: dict[str, torch.Tensor], staged: torch.Tensor) -> None:
    for seg, off in zip(m.segments, m.offsets()):
        view = staged[off : off + seg.nbytes].view(dtype_of(seg.dst_dtype)).view(seg.box.size)
        seg.dst.view(buffers[seg.dst.buffer], seg.box.size).copy_(view)


def execute_in_memory(plan: Plan, src_buffers: list[dict[str, torch.Tensor]], dst_buffers: list[dict[str, torch.Tensor]]) -> None:
    """Run a whole plan inside one process over plain tensors (tests and the planner's users)."""
    for m in plan.messages:
        wire = torch.empty(m.staged_bytes, dtype=torch.uint8)
        pack(m, src_buffers[m.src], wire)
        unpack(m, dst_buffers[m.dst], wire)


PieceKey = tuple[int, str, int]  # (destination rank, destination buffer, piece index)


class Engine:
    """Runs one rank's sends (source side) or receives (destination side) of a plan."""

    def __init__(self, transport: Transport, plan: Plan, side: str, rank: int, buffers: dict[str, torch.Tensor],
                 tensor_shapes: dict[str, tuple[int, ...]], pool: StagingPool, deadline: float,
                 progress: Callable[[int, int], None] | None = None, checksums: bool = True,
                 hook: Callable[[int], None] | None = None, dst_offset: int | None = None) -> None:
        if side not in ("src", "dst"):
            raise ValueError(f"side must be 'src' or 'dst', not {side!r}")
        self.t, self.plan, self.side, self.rank = transport, plan, side, rank
        self.buffers, self.shapes, self.pool = buffers, tensor_shapes, pool
        self.deadline, self.progress, self.do_checksums, self.hook = deadline, progress, checksums, hook
        self.msgs = (plan.sends if side == "src" else plan.recvs).get(rank, [])
        self.src_world = plan.src_world
        self.dst_offset = plan.src_world if dst_offset is None else dst_offset
        self.checksums: dict[PieceKey, int] = defaultdict(int)
        self.bytes_done = 0
        self.checksum_seconds = 0.0

    def _peer(self, m: Message) -> int:
        return self.dst_offset + m.dst if self.side == "src" else m.src

    def _remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TransportError("update deadline passed during transfer")
        return left

    def _rounds(self) -> list[list[Message]]:
        by_round: dict[int, list[Message]] = defaultdict(list)
        for m in self.msgs:
            by_round[m.round].append(m)
        return [by_round[r] for r in sorted(by_round)]

    def _staged(self, m: Message) -> bool:
        return not (m.send_direct if self.side == "src" else m.recv_direct)

    def _sender_checksum(self, dst: int, seg: Segment, wire: torch.Tensor) -> None:
        t0 = time.perf_counter()
        c = box_checksum(wire, seg.box.offset, self.shapes[seg.tensor])
        key = (dst, seg.dst_buffer, seg.dst_piece)
        self.checksums[key] = (self.checksums[key] + c) % P
        self.checksum_seconds += time.perf_counter() - t0

    def run(self) -> dict[PieceKey, int]:
        rounds = self._rounds()
        total = sum(m.nbytes for m in self.msgs)
        sizes = [sum(m.staged_bytes for m in r if self._staged(m)) for r in rounds]
        half = max(sizes, default=0)
        pool = self.pool.get(2 * half) if half else None

        def stage(i: int) -> list[tuple[Message, torch.Tensor]]:
            base = (i % 2) * half
            pos, out = 0, []
            for m in rounds[i]:
                if self._staged(m):
                    buf = pool[base + pos : base + pos + m.staged_bytes]
                    pos += m.staged_bytes
                    if self.side == "src":
                        pack(m, self.buffers, buf)
                else:
                    seg = m.segments[0]
                    if self.side == "src":
                        buf = _flat_bytes(self.buffers[seg.src.buffer], seg.src, seg.box.size)
                    else:
                        buf = _flat_bytes(self.buffers[seg.dst.buffer], seg.dst, seg.box.size)
                out.append((m, buf))
            return out

        def post(items: list[tuple[Message, torch.Tensor]]) -> list[Work]:
            if self.side == "src":
                return [self.t.send(buf[: m.wire_bytes], self._peer(m), m.tag) for m, buf in items]
            return [self.t.recv(buf[: m.wire_bytes], self._peer(m), m.tag) for m, buf in items]

        if not rounds:
            return {}
        current = stage(0)
        works = post(current)
        for i in range(len(rounds)):
            nxt = stage(i + 1) if (i + 1 < len(rounds) and self.side == "src") else None
            if self.side == "src" and self.do_checksums:
                for m, buf in current:
                    if self._staged(m):
                        for seg, off in zip(m.segments, m.offsets()):
                            w = buf[off : off + seg.nbytes].view(dtype_of(seg.dst_dtype)).view(seg.box.size)
                            self._sender_checksum(m.dst, seg, w)
                    else:
                        seg = m.segments[0]
                        self._sender_checksum(m.dst, seg, seg.src.view(self.buffers[seg.src.buffer], seg.box.size))
            for w in works:
                w.wait(self._remaining())
            if self.side == "dst":
                for m, buf in current:
                    if self._staged(m):
                        unpack(m, self.buffers, buf)
            self.bytes_done += sum(m.nbytes for m, _ in current)
            if self.progress:
                self.progress(self.bytes_done, total)
            if self.hook:
                self.hook(i)
            if i + 1 < len(rounds):
                current = nxt if nxt is not None else stage(i + 1)
                works = post(current)
        return dict(self.checksums)


def receiver_checksums(plan: Plan, rank: int, buffers: dict[str, torch.Tensor], layout_pieces, shapes) -> dict[PieceKey, int]:
    """Checksum every destination piece this rank receives in `plan`, from what it holds now."""
    out: dict[PieceKey, int] = {}
    for (bname, pi) in sorted(plan.expected_pieces(rank)):
        piece = layout_pieces[(bname, pi)]
        out[(rank, bname, pi)] = box_checksum(piece.view(buffers[bname]), piece.box.offset, shapes[piece.tensor])
    return out
