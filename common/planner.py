"""The planner: from a source and a destination layout to deterministic transfers.

Pure and deterministic: every rank computes the same plan (and digest) from the
same two layouts, with no communication.

A plan is a list of *messages*. Each carries one or more *segments* (one box of
one canonical tensor, from a region of a source buffer to a region of a
destination buffer) between one source rank and one destination rank, in a
*round*. Rounds are globally matched: a message has the same round (and tag) on
both of its ranks, and a rank runs its rounds in order, posting every send and
receive of a round before waiting on any, so grouped point-to-point cannot
deadlock. Small segments travel packed in one staged message per peer and
round; a large segment whose region is contiguous is sent from (or received
into) tensor storage directly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections import defaultdict

from .layout import Box, Layout, LayoutError, contiguous_strides, itemsize

ALIGN = 64


@dataclasses.dataclass(kw_only=True, slots=True)
class PlanOptions:
    bucket_bytes: int = 16 << 20
    """Upper bound on the staged bytes of one message (and on one peer's staged bytes per round)."""
    direct_min_bytes: int = 256 << 10
    """A contiguous segment at least this large bypasses staging on the side(s) where it is contiguous."""
    max_message_bytes: int = 64 << 20
    """Direct segments are split into messages of at most this size (progress, pipelining)."""
    relay: bool = True
    """Destination replicas (ranks with identical buffers, e.g. DP copies) get their bytes from a
    replica that received them in an earlier round, so trainer egress carries each byte once."""

    def __post_init__(self) -> None:
        if self.bucket_bytes < 4096:
            raise ValueError(f"bucket_bytes={self.bucket_bytes} is too small; use at least 4096")
        if self.max_message_bytes < self.bucket_bytes:
            raise ValueError("max_message_bytes must be at least bucket_bytes")


@dataclasses.dataclass(frozen=True, slots=True)
class Side:
    """Where one end of a segment lives: a strided view into a flattened buffer."""

    buffer: str
    start: int
    strides: tuple[int, ...]

    def shifted(self, delta: tuple[int, ...]) -> Side:
        return Side(self.buffer, self.start + sum(d * s for d, s in zip(delta, self.strides)), self.strides)

    def contiguous(self, size: tuple[int, ...]) -> bool:
        want = contiguous_strides(size)
        return all(n == 1 or s == w for n, s, w in zip(size, self.strides, want))

    def view(self, buf, size: tuple[int, ...]):
        flat = buf.reshape(-1)
        return flat.as_strided(size, self.strides, flat.storage_offset() + self.start)

    def __str__(self) -> str:
        return f"{self.buffer}@{self.start}/{self.strides}"


@dataclasses.dataclass(frozen=True, slots=True)
class Segment:
    tensor: str
    box: Box  # in canonical coordinates
    src: Side
    dst: Side
    dst_piece: int  # index of the destination piece in its buffer (checksum key)
    src_dtype: str
    dst_dtype: str

    @property
    def src_buffer(self) -> str:
        return self.src.buffer

    @property
    def dst_buffer(self) -> str:
        return self.dst.buffer

    @property
    def nbytes(self) -> int:
        return self.box.numel * itemsize(self.dst_dtype)


@dataclasses.dataclass(frozen=True, slots=True)
class Message:
    src: int
    dst: int
    round: int
    tag: int
    segments: tuple[Segment, ...]
    send_direct: bool  # one segment, sent straight from source storage
    recv_direct: bool  # one segment, received straight into destination storage
    nbytes: int
    relay: bool = False  # src is a destination rank forwarding what it received earlier

    def offsets(self) -> list[int]:
        """Byte offset of each segment inside the staged message."""
        out, pos = [], 0
        for s in self.segments:
            out.append(pos)
            pos += _align(s.nbytes)
        return out

    @property
    def staged_bytes(self) -> int:
        return sum(_align(s.nbytes) for s in self.segments)

    @property
    def wire_bytes(self) -> int:
        """Bytes on the wire: the packed size, or the bare segment when either end is direct."""
        return self.nbytes if (self.send_direct or self.recv_direct) else self.staged_bytes


@dataclasses.dataclass(slots=True)
class Plan:
    src_world: int
    dst_world: int
    messages: list[Message]
    num_rounds: int
    digest: str
    sends: dict[int, list[Message]]
    recvs: dict[int, list[Message]]
    relay_sends: dict[int, list[Message]] = dataclasses.field(default_factory=dict)
    primary_of: dict[int, int] = dataclasses.field(default_factory=dict)
    """Destination rank -> the replica whose pieces (and expected checksums) it mirrors."""
    relay_pieces: dict[int, list[tuple[str, int]]] = dataclasses.field(default_factory=dict)
    """Destination rank -> the (buffer, piece) it receives through relays (to verify them)."""

    @property
    def total_bytes(self) -> int:
        return sum(m.nbytes for m in self.messages)

    @property
    def source_bytes(self) -> int:
        """Bytes leaving the source ranks (relays excluded): trainer egress."""
        return sum(m.nbytes for m in self.messages if not m.relay)

    def expected_checksums(self, sent: dict[tuple[int, str, int], int]) -> dict[tuple[int, str, int], int]:
        """Sender checksums per destination piece, extended to the replicas fed by relays
        (a replica must hold exactly what its primary received)."""
        out = dict(sent)
        for (r, b, i), v in sent.items():
            for rep, prim in self.primary_of.items():
                if prim == r:
                    out[(rep, b, i)] = v
        return out

    def send_bytes(self, src: int) -> int:
        return sum(m.nbytes for m in self.sends.get(src, ()))

    def recv_bytes(self, dst: int) -> int:
        return sum(m.nbytes for m in self.recvs.get(dst, ()))

    def expected_pieces(self, dst: int) -> dict[tuple[str, int], list[Segment]]:
        """The destination pieces this rank receives (to checksum), with their source segments
        (none listed for pieces that arrive inside a whole-buffer relay)."""
        out: dict[tuple[str, int], list[Segment]] = defaultdict(list)
        for m in self.recvs.get(dst, ()):
            for s in m.segments:
                if s.dst_piece >= 0:
                    out[(s.dst_buffer, s.dst_piece)].append(s)
        for key in self.relay_pieces.get(dst, ()):
            out.setdefault(key, [])
        return out


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def select_tensors(layout: Layout, patterns: list[str] | tuple[str, ...]) -> set[str] | None:
    """Canonical names matching any of the patterns (names or shell-style globs); None for all."""
    import fnmatch

    if not patterns:
        return None
    out: set[str] = set()
    for pat in patterns:
        hits = {n for n in layout.tensors if fnmatch.fnmatchcase(n, pat)}
        if not hits:
            raise LayoutError(f"partial update: {pat!r} matches no canonical tensor of the destination")
        out |= hits
    return out


def check_compatible(src: Layout, dst: Layout, tensors: set[str] | None = None) -> None:
    """Raise LayoutError naming the first mismatch between the two layouts."""
    for name in sorted(dst.tensors):
        if tensors is not None and name not in tensors:
            continue
        d = dst.tensors[name]
        s = src.tensors.get(name)
        if s is None:
            raise LayoutError(f"tensor {name!r}: the destination needs it but the source layout has no such tensor (unknown name)")
        if s.shape != d.shape:
            raise LayoutError(f"tensor {name!r}: shape mismatch, source {list(s.shape)} vs destination {list(d.shape)}")
        if s.dtype != d.dtype:
            raise LayoutError(f"tensor {name!r}: dtype mismatch, source {s.dtype} vs destination {d.dtype}")


def _split_box(size: tuple[int, ...], max_elems: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Split a box (relative coordinates) into sub-boxes of at most max_elems elements.

    Splits along the outermost dimension first, so contiguous boxes stay contiguous."""
    n = math.prod(size)
    if n <= max_elems or not size:
        return [(tuple(0 for _ in size), size)]
    inner = math.prod(size[1:])
    if inner <= max_elems:
        rows = max(1, max_elems // inner)
        return [
            ((r, *(0 for _ in size[1:])), (min(rows, size[0] - r), *size[1:]))
            for r in range(0, size[0], rows)
        ]
    out = []
    for r in range(size[0]):
        for off, sz in _split_box(size[1:], max_elems):
            out.append(((r, *off), (1, *sz)))
    return out


def make_plan(src: Layout, dst: Layout, options: PlanOptions | None = None, tensors: set[str] | None = None) -> Plan:
    """Plan the transfer of every destination piece (of `tensors`, or all) from the source layout."""
    options = options or PlanOptions()
    bucket = options.bucket_bytes // ALIGN * ALIGN  # aligned segments then never exceed it
    src.validate("source", require_full_buffers=False)
    dst.validate("destination", require_full_buffers=True)
    check_compatible(src, dst, tensors)

    # Distinct source boxes per tensor, each with the (rank, buffer, region) replicas holding it.
    holders: dict[str, dict[Box, list[tuple[int, Side, str]]]] = defaultdict(lambda: defaultdict(list))
    for rank, bufs in enumerate(src.ranks):
        for buf in bufs:
            for p in buf.pieces:
                start, strides = p.base(buf.shape)
                holders[p.tensor][p.box].append((rank, Side(buf.name, start, strides), buf.dtype))
    src_boxes: dict[str, list[Box]] = {}
    for name, by_box in holders.items():
        boxes = sorted(by_box, key=lambda b: (b.offset, b.size))
        for i, a in enumerate(boxes):
            for b in boxes[i + 1 :]:
                if a.intersect(b) is not None:
                    raise LayoutError(
                        f"tensor {name!r}: source boxes {a} (rank {by_box[a][0][0]}) and {b} "
                        f"(rank {by_box[b][0][0]}) overlap without being identical replicas"
                    )
        src_boxes[name] = boxes

    # Assign every (destination piece x source box) intersection to one source replica,
    # balancing the bytes each source rank sends (largest first, least-loaded replica).
    primary_of = _replica_groups(dst) if options.relay else {}
    pending: list[tuple] = []  # (dst rank, order, piece idx, box, dst side, dtype, tensor, source box)
    for drank, bufs in enumerate(dst.ranks):
        if primary_of.get(drank, drank) != drank:
            continue  # a replica: fed by a relay below
        for buf in bufs:
            for pi, p in enumerate(buf.pieces):
                if tensors is not None and p.tensor not in tensors:
                    continue
                covered = 0
                start, strides = p.base(buf.shape)
                base = Side(buf.name, start, strides)
                for sbox in src_boxes.get(p.tensor, ()):
                    inter = sbox.intersect(p.box)
                    if inter is None:
                        continue
                    covered += inter.numel
                    delta = tuple(i - b for i, b in zip(inter.offset, p.box.offset))
                    pending.append((drank, len(pending), pi, inter, base.shifted(delta), buf.dtype, p.tensor, sbox))
                if covered != p.box.numel:
                    raise LayoutError(
                        f"tensor {p.tensor!r}: destination rank {drank} buffer {buf.name!r} needs box {p.box}, "
                        f"but the source layout covers only {covered} of its {p.box.numel} elements (coverage gap)"
                    )

    load: dict[int, int] = defaultdict(int)
    pair_segments: dict[tuple[int, int], list[Segment]] = defaultdict(list)
    order = sorted(pending, key=lambda t: (-t[3].numel * itemsize(t[5]), t[0], t[1]))
    for drank, _, pi, inter, dside, ddtype, tname, sbox in order:
        reps = holders[tname][sbox]
        nbytes = inter.numel * itemsize(ddtype)
        # Least-loaded replica; ties broken by a rotation on the destination rank.
        best = min(range(len(reps)), key=lambda i: (load[reps[i][0]], (i - drank) % len(reps)))
        srank, sbase, sdtype = reps[best]
        load[srank] += nbytes
        delta = tuple(i - b for i, b in zip(inter.offset, sbox.offset))
        pair_segments[(srank, drank)].append(Segment(tname, inter, sbase.shifted(delta), dside, pi, sdtype, ddtype))

    messages: list[Message] = []
    num_rounds = 0
    for (srank, drank) in sorted(pair_segments):
        msgs = _pair_messages(srank, drank, pair_segments[(srank, drank)], options, bucket, 0, False)
        messages += msgs
        num_rounds = max(num_rounds, max(m.round for m in msgs) + 1)
    # Relays: replicas forward what they hold, in rounds after every source round, along a
    # pipelined chain per replica group, so no replica's link carries the data more than once.
    relay_pieces: dict[int, list[tuple[str, int]]] = defaultdict(list)
    relay_end = num_rounds
    for link, a, b in _relay_chains(primary_of):
        segs = []
        for buf in dst.ranks[b]:
            picked = [(pi, p) for pi, p in enumerate(buf.pieces) if tensors is None or p.tensor in tensors]
            relay_pieces[b] += [(buf.name, pi) for pi, _ in picked]
            if tensors is None:
                # A whole update: the buffer's non-padding bytes in a few contiguous runs
                # (raw segments: dst_piece -1, a 1-D box over the flattened buffer).
                for start, n in _payload_ranges(buf):
                    side = Side(buf.name, start, (1,))
                    segs.append(Segment("", Box((0,), (n,)), side, side, -1, buf.dtype, buf.dtype))
                continue
            for pi, p in picked:
                start, strides = p.base(buf.shape)
                side = Side(buf.name, start, strides)
                segs.append(Segment(p.tensor, p.box, side, side, pi, buf.dtype, buf.dtype))
        if segs:
            # Link k of a chain runs one round behind link k-1: message j leaves a replica the
            # round after it arrived there, so every link carries the data once, pipelined.
            msgs = _pair_messages(a, b, segs, options, bucket, num_rounds + link, True)
            messages += msgs
            relay_end = max(relay_end, max(m.round for m in msgs) + 1)
    num_rounds = relay_end

    messages.sort(key=lambda m: (m.round, m.relay, m.src, m.dst, m.tag))
    sends: dict[int, list[Message]] = defaultdict(list)
    relay_sends: dict[int, list[Message]] = defaultdict(list)
    recvs: dict[int, list[Message]] = defaultdict(list)
    for m in messages:
        (relay_sends if m.relay else sends)[m.src].append(m)
        recvs[m.dst].append(m)
    return Plan(src.world, dst.world, messages, num_rounds, _digest(src, dst, messages, tensors), dict(sends), dict(recvs),
                dict(relay_sends), {r: p for r, p in primary_of.items() if r != p}, dict(relay_pieces))


def _flat_runs(box: Box, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """A box of a tensor as contiguous (start, count) runs of its flattened elements."""
    rng = box.contiguous_range(shape)
    if rng is not None or box.numel == 0:
        return [rng] if rng and rng[1] else []
    runs = []
    for r in range(box.offset[0], box.end[0]):
        runs += _flat_runs(Box((r, *box.offset[1:]), (1, *box.size[1:])), shape)
    return runs


def _payload_ranges(buf) -> list[tuple[int, int]]:
    """The buffer's elements outside declared padding, as contiguous (start, count) runs."""
    pads = sorted(run for p in buf.padding for run in _flat_runs(p, buf.shape))
    out, pos = [], 0
    for start, n in pads:
        if start > pos:
            out.append((pos, start - pos))
        pos = max(pos, start + n)
    if pos < buf.numel:
        out.append((pos, buf.numel - pos))
    return out


def _replica_groups(dst: Layout) -> dict[int, int]:
    """Destination rank -> primary rank of its replica group (ranks holding identical buffers)."""
    first: dict[tuple, int] = {}
    out = {}
    for r, bufs in enumerate(dst.ranks):
        out[r] = first.setdefault(bufs, r)
    return out


def _relay_chains(primary_of: dict[int, int]) -> list[tuple[int, int, int]]:
    """(link index, from, to) along one chain per replica group: primary -> r1 -> r2 -> ..."""
    groups: dict[int, list[int]] = defaultdict(list)
    for r, p in sorted(primary_of.items()):
        if r != p:
            groups[p].append(r)
    out = []
    for p, reps in sorted(groups.items()):
        chain = [p, *reps]
        out += [(k, chain[k], chain[k + 1]) for k in range(len(reps))]
    return out


def _pair_messages(srank: int, drank: int, segments: list[Segment], options: PlanOptions, bucket: int,
                   first_round: int, relay: bool) -> list[Message]:
    """One pair's segments, split to buckets, packed or direct, in rounds from `first_round`."""
    segs = sorted(segments, key=lambda s: (s.dst.buffer, s.dst.start, s.tensor, s.box.offset))
    pair_msgs: list[tuple[list[Segment], bool, bool]] = []
    packed: list[Segment] = []
    packed_bytes = 0

    def flush() -> None:
        nonlocal packed, packed_bytes
        if packed:
            pair_msgs.append((packed, False, False))
            packed, packed_bytes = [], 0

    for seg in segs:
        isz = itemsize(seg.dst_dtype)
        s_contig = seg.src_dtype == seg.dst_dtype and seg.src.contiguous(seg.box.size)
        d_contig = seg.dst.contiguous(seg.box.size)
        direct = (s_contig or d_contig) and seg.nbytes >= options.direct_min_bytes
        limit = (options.max_message_bytes if (s_contig and d_contig) else bucket) // isz
        for off, size in _split_box(seg.box.size, max(1, limit if direct else bucket // isz)):
            sub = _sub_segment(seg, off, size)
            if direct:
                sc = s_contig and sub.src.contiguous(size)
                dc = d_contig and sub.dst.contiguous(size)
                pair_msgs.append(([sub], sc, dc))
                continue
            if packed_bytes + _align(sub.nbytes) > bucket:
                flush()
            packed.append(sub)
            packed_bytes += _align(sub.nbytes)
    flush()
    # Rounds: consecutive messages of a pair share a round while their staged bytes fit a bucket.
    out = []
    rnd, staged, total = first_round, 0, 0
    for tag, (msegs, sd, rd) in enumerate(pair_msgs):
        nbytes = sum(s.nbytes for s in msegs)
        st = 0 if (sd and rd) else sum(_align(s.nbytes) for s in msegs)
        if tag and (staged + st > bucket or total + nbytes > options.max_message_bytes):
            rnd, staged, total = rnd + 1, 0, 0
        staged += st
        total += nbytes
        out.append(Message(srank, drank, rnd, tag, tuple(msegs), sd, rd, nbytes, relay))
    return out


def _sub_segment(seg: Segment, off: tuple[int, ...], size: tuple[int, ...]) -> Segment:
    box = Box(tuple(o + d for o, d in zip(seg.box.offset, off)), size)
    return dataclasses.replace(seg, box=box, src=seg.src.shifted(off), dst=seg.dst.shifted(off))


def _digest(src: Layout, dst: Layout, messages: list[Message], tensors: set[str] | None = None) -> str:
    h = hashlib.sha256()
    h.update(src.fingerprint().encode())
    h.update(dst.fingerprint().encode())
    h.update(("*" if tensors is None else ",".join(sorted(tensors))).encode())
    for m in messages:
        h.update(f"{m.src},{m.dst},{m.round},{m.tag},{int(m.send_direct)}{int(m.recv_direct)}{int(m.relay)}".encode())
        for s in m.segments:
            h.update(f"|{s.tensor}{s.box}{s.src}{s.dst}{s.dst_piece}".encode())
    return h.hexdigest()[:16]
