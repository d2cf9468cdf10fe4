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

How it is computed, at the scale of a trillion-parameter MoE:
1. Both layouts become numpy tables, one row per piece, read once per replica
   class (`tables.build_table`), and are validated there.
2. Distinct source boxes are found with their holders. Each destination piece is
   intersected with the source boxes that overlap it, searched per tensor along a
   dimension on which its source boxes are disjoint. Every piece must be covered.
3. Each transfer goes to one holder: largest first, to the least-loaded one
   (`_assign`). Replicas of a destination class receive nothing from the sources:
   they get relays instead.
4. Segments become messages and rounds (`_messages`: next-fit buckets, then
   next-fit rounds per pair). Rounds are staggered so that every rank's staging
   stays within `PlanOptions.staging_bytes` (`_stagger`).
5. Relays go down a chain per replica class. A relay message leaves the primary
   the round after its buffers' last source round; each further link runs one
   round later.
6. The plan stays in columns. `Plan` builds one rank's `Message` objects when
   asked for them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import math
import re
import zlib
from collections import defaultdict
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from reshard.common.layout.columns import fit_width
from reshard.common.layout.core import (
    DTYPES,
    Box,
    Layout,
    LayoutError,
    check_compatible,
    contiguous_strides,
    coverage_gap,
    itemsize,
    overlapping_sources,
)
from reshard.common.layout.tables import (
    ITEMSIZE,
    LayoutTable,
    build_table,
    contiguous,
    hash_array,
    row_all,
    row_any,
    row_prod,
    row_strides,
    unique_rows,
)
from reshard.common.layout.tables import dot_rows as _dot

_DTYPE_NAMES = list(DTYPES)

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
    shared_relay_min_bytes: int = 0
    """Buffers that ranks of different classes hold identically (the attention weights of
    expert-parallel DP ranks, which hold different experts) are relayed among all their holders
    when those holders share at least this many bytes (0: one bucket); a smaller shared set, such
    as a norm on every TP rank, goes to each class instead, where a chain through every holder
    would cost more rounds than it saves bytes."""
    staging_bytes: int = 0
    """Upper bound on one rank's staging pool (0: 256 MiB, or 4 buckets if that is more). The
    engine double-buffers a round's staged bytes, so at most staging_bytes // (2 * bucket_bytes)
    of a rank's peers stage in the same round; rounds are staggered to keep to that."""

    def __post_init__(self) -> None:
        if self.bucket_bytes < 4096:
            raise ValueError(f"bucket_bytes={self.bucket_bytes} is too small; use at least 4096")
        if self.max_message_bytes < self.bucket_bytes:
            raise ValueError("max_message_bytes must be at least bucket_bytes")
        if self.staging_bytes and self.staging_bytes < 4 * self.bucket_bytes:
            raise ValueError(f"staging_bytes={self.staging_bytes} must be at least 4 * bucket_bytes "
                             f"({4 * self.bucket_bytes}): a relaying replica stages a receive and a send per round")

    @property
    def staging_limit(self) -> int:
        return self.staging_bytes or max(256 << 20, 4 * self.bucket_bytes)


@dataclasses.dataclass(frozen=True, slots=True)
class Side:
    """Where one end of a segment lives: a strided view into a flattened buffer."""

    buffer: str
    start: int
    strides: tuple[int, ...]

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
    # Derived once, when the message is made: the engine reads them for every segment of every
    # update, and recomputing them was most of its Python time on small messages.
    segment_bytes: tuple[int, ...] = dataclasses.field(default=(), init=False, repr=False, compare=False)
    """Bytes of each segment."""
    segment_offsets: tuple[int, ...] = dataclasses.field(default=(), init=False, repr=False, compare=False)
    """Byte offset of each segment inside the staged message."""
    _staged: int = dataclasses.field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        sizes = tuple(s.nbytes for s in self.segments)
        offsets, pos = [], 0
        for n in sizes:
            offsets.append(pos)
            pos += _align(n)
        object.__setattr__(self, "segment_bytes", sizes)
        object.__setattr__(self, "segment_offsets", tuple(offsets))
        object.__setattr__(self, "_staged", pos)

    @property
    def staged_bytes(self) -> int:
        return self._staged

    @property
    def wire_bytes(self) -> int:
        """Bytes on the wire: the packed size, or the bare segment when either end is direct."""
        return self.nbytes if (self.send_direct or self.recv_direct) else self.staged_bytes


class _RankMessages(Mapping):
    """rank -> that rank's messages, materialized on first access from the plan's columns."""

    def __init__(self, plan: Plan, key: str, relay: bool | None) -> None:
        self._plan, self._key, self._relay, self._cache = plan, key, relay, {}
        self._lo: dict[int, int] | None = None  # the index is built on first use

    def _index(self) -> None:
        m = self._plan._m
        sel = np.ones(len(m["src"]), dtype=bool) if self._relay is None else (m["relay"] == self._relay)
        idx = np.flatnonzero(sel)
        ranks = m[self._key][idx]
        order = np.argsort(ranks, kind="stable")
        self._idx, r = idx[order], ranks[order]
        self._ranks = np.unique(r).tolist()
        self._hi = dict(zip(self._ranks, np.searchsorted(r, self._ranks, "right").tolist()))
        self._lo = dict(zip(self._ranks, np.searchsorted(r, self._ranks, "left").tolist()))

    def __getitem__(self, rank: int) -> list[Message]:
        if self._lo is None:
            self._index()
        if rank not in self._lo:
            raise KeyError(rank)
        out = self._cache.get(rank)
        if out is None:
            out = self._cache[rank] = [self._plan._message(i) for i in self._idx[self._lo[rank]:self._hi[rank]].tolist()]
        return out

    def __iter__(self):
        if self._lo is None:
            self._index()
        return iter(self._ranks)

    def __len__(self) -> int:
        if self._lo is None:
            self._index()
        return len(self._ranks)


class _RelayPieces(Mapping):
    """replica rank -> the (buffer, piece) pairs it receives through relays (to verify them)."""

    def __init__(self, plan: Plan) -> None:
        self._plan, self._cache = plan, {}

    def __getitem__(self, rank: int) -> list[tuple[str, int]]:
        if rank not in self._plan.primary_of:
            raise KeyError(rank)
        out = self._cache.get(rank)
        if out is None:
            out = self._cache[rank] = self._plan._relay_pieces_of(rank)
        return out

    def __iter__(self):
        return iter(sorted(self._plan.primary_of))

    def __len__(self) -> int:
        return len(self._plan.primary_of)


@dataclasses.dataclass(eq=False)
class Plan:
    """A plan in columns (one row per message, one per segment); `sends`, `recvs` and
    `relay_sends` give one rank's `Message` objects, built when first asked for."""

    src_world: int
    dst_world: int
    num_rounds: int
    digest: str
    _m: dict[str, np.ndarray]
    """Messages, in (round, relay, src, dst, tag) order: src, dst, round, tag, sd, rd, relay, nbytes, lo, hi
    (segment rows lo:hi)."""
    _g: dict[str, np.ndarray]
    """Segments: tensor, off, size, ndim, sbuf, sstart, sstrides, dbuf, dstart, dstrides, piece, sdt, ddt."""
    _tensor_names: list[str]
    _buffer_names: list[str]
    primary_of: dict[int, int] = dataclasses.field(default_factory=dict)
    """Destination rank -> the replica whose pieces (and expected checksums) it mirrors."""
    _dst_table: LayoutTable | None = None
    _subset: np.ndarray | None = None
    _relayed: dict[int, list[tuple[int, int]]] = dataclasses.field(default_factory=dict)
    """Destination rank -> (buffer row of the destination table, head rank) of each buffer it gets by relay."""
    sends: Mapping | None = None
    recvs: Mapping | None = None
    relay_sends: Mapping | None = None
    relay_pieces: Mapping | None = None
    _segments: dict[int, Segment] = dataclasses.field(default_factory=dict)
    _memo: dict = dataclasses.field(default_factory=dict)  # derived tables, built on first use

    def __post_init__(self) -> None:
        if self.sends is None:
            self.sends = _RankMessages(self, "src", False)
        if self.recvs is None:
            self.recvs = _RankMessages(self, "dst", None)
        if self.relay_sends is None:
            self.relay_sends = _RankMessages(self, "src", True)
        if self.relay_pieces is None:
            self.relay_pieces = _RelayPieces(self)

    # -- materialization -----------------------------------------------------------------
    def _segment(self, j: int) -> Segment:
        s = self._segments.get(j)
        if s is None:
            g, nd = self._g, int(self._g["ndim"][j])
            t = int(g["tensor"][j])
            box = Box(tuple(g["off"][j, :nd].tolist()), tuple(g["size"][j, :nd].tolist()))
            src = Side(self._buffer_names[g["sbuf"][j]], int(g["sstart"][j]), tuple(g["sstrides"][j, :nd].tolist()))
            dst = Side(self._buffer_names[g["dbuf"][j]], int(g["dstart"][j]), tuple(g["dstrides"][j, :nd].tolist()))
            s = self._segments[j] = Segment(self._tensor_names[t] if t >= 0 else "", box, src, dst, int(g["piece"][j]),
                                            _DTYPE_NAMES[g["sdt"][j]], _DTYPE_NAMES[g["ddt"][j]])
        return s

    def _message(self, i: int) -> Message:
        m = self._m
        segs = tuple(self._segment(j) for j in range(int(m["lo"][i]), int(m["hi"][i])))
        return Message(int(m["src"][i]), int(m["dst"][i]), int(m["round"][i]), int(m["tag"][i]), segs,
                       bool(m["sd"][i]), bool(m["rd"][i]), int(m["nbytes"][i]), bool(m["relay"][i]))

    @property
    def messages(self) -> list[Message]:
        """Every message (materialized: meant for small plans and tests)."""
        return [self._message(i) for i in range(len(self._m["src"]))]

    def message_table(self) -> dict[str, np.ndarray]:
        """Every message as columns (read-only): src, dst, round, tag, nbytes, wire_bytes,
        staged_bytes (packed size, where an end stages), relay,
        sd (sent from storage), rd (received into storage), segments (count). For whole-plan
        figures at scale, where materializing `messages` would be slow."""
        m, g = self._m, self._g
        out = {k: m[k].view() for k in ("src", "dst", "round", "tag", "nbytes", "relay", "sd", "rd")}
        out["segments"] = m["hi"] - m["lo"]
        # Bytes on the wire: the packed (aligned) size, or the bare bytes when either end is direct.
        seg_bytes = row_prod(g["size"]) * ITEMSIZE[g["ddt"]]
        aligned = np.concatenate(([0], np.cumsum(_align_arr(seg_bytes))))
        staged = aligned[m["hi"]] - aligned[m["lo"]]
        out["wire_bytes"] = np.where(m["sd"] | m["rd"], m["nbytes"], staged)
        out["staged_bytes"] = staged
        for v in out.values():
            v.flags.writeable = False
        return out

    @property
    def nbytes(self) -> int:
        """Memory held by the plan's columns."""
        return sum(a.nbytes for d in (self._m, self._g) for a in d.values())

    @property
    def num_messages(self) -> int:
        return len(self._m["src"])

    @property
    def num_segments(self) -> int:
        """Segment rows carried by messages (a relay's segments count once per link)."""
        return int((self._m["hi"] - self._m["lo"]).sum())

    def moved_tensors(self) -> set[str]:
        """The canonical tensors some message carries part of (an update's tensors)."""
        return {self._tensor_names[t] for t in np.unique(self._g["tensor"]) if t >= 0}

    # -- figures ---------------------------------------------------------------------------
    @property
    def total_bytes(self) -> int:
        return int(self._m["nbytes"].sum())

    @property
    def source_bytes(self) -> int:
        """Bytes leaving the source ranks (relays excluded): trainer egress."""
        return int(self._m["nbytes"][~self._m["relay"]].sum())

    def send_bytes(self, src: int) -> int:
        m = self._m
        return int(m["nbytes"][(m["src"] == src) & ~m["relay"]].sum())

    def recv_bytes(self, dst: int) -> int:
        return int(self._m["nbytes"][self._m["dst"] == dst].sum())

    def rank_bytes(self) -> dict[str, np.ndarray]:
        """Per-rank totals: sent by each source rank, received and relayed by each destination rank."""
        m = self._m
        src = np.bincount(m["src"][~m["relay"]], weights=m["nbytes"][~m["relay"]], minlength=self.src_world)
        recv = np.bincount(m["dst"], weights=m["nbytes"], minlength=self.dst_world)
        relay = np.bincount(m["src"][m["relay"]], weights=m["nbytes"][m["relay"]], minlength=self.dst_world)
        return {"send": src.astype(np.int64), "recv": recv.astype(np.int64), "relay": relay.astype(np.int64)}

    def link_bytes(self) -> dict[tuple[bool, int, int], int]:
        """Bytes per link: (relay, src, dst) -> bytes."""
        m = self._m
        uniq, inv = unique_rows(m["relay"], m["src"], m["dst"])
        tot = np.bincount(inv, weights=m["nbytes"], minlength=len(uniq))
        return {(bool(r), int(s), int(d)): int(b) for (r, s, d), b in zip(uniq.tolist(), tot.tolist())}

    # -- verification ----------------------------------------------------------------------
    def expected_checksums(self, sent: dict[tuple[int, str, int], int]) -> dict[tuple[int, str, int], int]:
        """Sender checksums per destination piece, extended to the replicas fed by relays
        (a replica must hold exactly what its primary received)."""
        out = dict(sent)
        reps: dict[tuple[int, str], list[int]] = defaultdict(list)
        names = self._dst_table.buf_str if self._relayed else []
        for rep, items in self._relayed.items():
            for b, head in items:
                reps[(head, names[b])].append(rep)
        for (r, b, i), v in sent.items():
            for rep in reps.get((r, b), ()):
                out[(rep, b, i)] = v
        return out

    # -- checksum slots: verification in compact arrays keyed by the digest -------------------
    # A *slot* is one (destination rank, buffer, piece) that sources send to: the sorted, unique
    # keys of the segments of every non-relay message. Senders report (slot, sum) pairs, the
    # trainer controller adds them into one array over the slots, and each destination rank gets
    # the values of the slots it verifies (a replica fed by relays checks its head's slots).
    # Every end computes the same slots from the same plan: nothing else goes on the wire.

    def _name_ids(self) -> dict[str, int]:
        ids = self._memo.get("name_ids")
        if ids is None:
            ids = self._memo["name_ids"] = {n: i for i, n in enumerate(self._buffer_names)}
        return ids

    def _key_scale(self) -> tuple[int, int]:
        """(buffer names, pieces) bounds of the composite key (rank * NB + name) * NP + piece."""
        g = self._g
        return len(self._buffer_names) + 1, int(g["piece"].max(initial=0)) + 1

    def checksum_keys(self) -> np.ndarray:
        """The plan's slots as sorted composite keys (int64): slot i is checksum_keys()[i]."""
        keys = self._memo.get("checksum_keys")
        if keys is None:
            keys = self._source_keys(~self._m["relay"])
            keys.flags.writeable = False
            self._memo["checksum_keys"] = keys
        return keys

    def source_slots(self, src: int) -> np.ndarray:
        """The slots source rank `src` reports sums for (sorted): those of the pieces it sends to."""
        return np.searchsorted(self.checksum_keys(), self._source_keys(~self._m["relay"] & (self._m["src"] == src)))

    def _source_keys(self, messages: np.ndarray) -> np.ndarray:
        """The sorted, unique composite keys of the destination pieces the selected messages
        (a boolean mask) carry segments of."""
        m, g = self._m, self._g
        sel = np.flatnonzero(messages)
        lo, n = m["lo"][sel], m["hi"][sel] - m["lo"][sel]
        seg = np.repeat(lo - np.concatenate(([0], np.cumsum(n)[:-1])), n) + np.arange(int(n.sum()))
        dst, piece = np.repeat(m["dst"][sel], n), g["piece"][seg]
        ok = piece >= 0
        nb, npc = self._key_scale()
        return np.unique((dst[ok].astype(np.int64) * nb + g["dbuf"][seg][ok]) * npc + piece[ok])

    @property
    def num_checksum_slots(self) -> int:
        return len(self.checksum_keys())

    def checksum_slots(self, sums: dict[tuple[int, str, int], int], strict: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """A sender's per-piece sums ((dst rank, buffer, piece) -> value) as (slots, values), both
        uint32. `strict`: every key must be a slot of this plan (the reshard engine's always are);
        otherwise keys that are not (the serialized baseline's sums for replicas) are left out."""
        if not sums:
            return np.zeros(0, np.uint32), np.zeros(0, np.uint32)
        ids, (nb, npc) = self._name_ids(), self._key_scale()
        items = list(sums.items())
        comp = np.array([(r * nb + ids.get(b, nb - 1)) * npc + (i if 0 <= i < npc else 0) for (r, b, i), _ in items],
                        dtype=np.int64)
        vals = np.array([v for _, v in items], dtype=np.uint32)
        keys = self.checksum_keys()
        slot = np.searchsorted(keys, comp)
        found = slot < len(keys)
        found[found] = keys[slot[found]] == comp[found]
        if strict and not found.all():
            (r, b, i), _ = items[int(np.flatnonzero(~found)[0])]
            raise LayoutError(f"checksum for rank {r} buffer {b!r} piece {i} is not a slot of plan {self.digest}")
        return slot[found].astype(np.uint32), vals[found]

    def verify_pieces(self, rank: int) -> tuple[list[tuple[str, int]], np.ndarray]:
        """What destination `rank` verifies, in order: its (buffer, piece) pairs (every piece of a
        tensor in the update), and the slot whose value each must equal (int64; -1 where no source
        sends to it: an empty piece, whose checksum is 0)."""
        t = self._dst_table
        cache = self._memo.setdefault("verify", {})
        hit = cache.get(rank)
        if hit is not None:
            return hit
        c = int(t.rank_class[rank])
        rows = self._class_piece_rows(c)
        bufs = t.p_buf[rows]
        names = [t.buf_str[b] for b in bufs.tolist()]
        pieces = t.p_index[rows]
        ids, (nb, npc) = self._name_ids(), self._key_scale()
        name_id = np.array([ids.get(n, nb - 1) for n in names], dtype=np.int64)
        owner = np.full(len(rows), rank, dtype=np.int64)  # whose slot each piece checks
        for b, head in self._relayed.get(rank, ()):
            # a buffer row of the head's class with the same name: the head's copy of it
            owner[bufs == b] = head
        comp = (owner * nb + name_id) * npc + pieces
        keys = self.checksum_keys()
        slot = np.searchsorted(keys, comp)
        hit_ = slot < len(keys)
        hit_[hit_] = keys[slot[hit_]] == comp[hit_]
        out = (list(zip(names, pieces.tolist())), np.where(hit_, slot, -1))
        if len(cache) < 1024:
            cache[rank] = out
        return out

    def _class_piece_rows(self, c: int) -> np.ndarray:
        """The destination table's piece rows of class `c` in the update (tensor known and, for a
        partial update, selected), in table order."""
        t = self._dst_table
        by_class = self._memo.get("class_rows")
        if by_class is None:
            keep = t.p_tensor >= 0
            if self._subset is not None:
                keep &= self._subset[np.maximum(t.p_tensor, 0)]
            rows = np.flatnonzero(keep)
            cls = t.buf_class[t.p_buf[rows]]
            order = np.argsort(cls, kind="stable")
            rows, cls = rows[order], cls[order]
            bounds = np.searchsorted(cls, np.arange(t.num_classes + 1))
            by_class = self._memo["class_rows"] = (rows, bounds)
        rows, bounds = by_class
        return rows[bounds[c]:bounds[c + 1]]

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

    def _relay_pieces_of(self, rank: int) -> list[tuple[str, int]]:
        t = self._dst_table
        mine = np.zeros(len(t.buf_class), dtype=bool)
        mine[[b for b, _ in self._relayed.get(rank, ())]] = True
        rows = np.flatnonzero(mine[t.p_buf] & (self._subset[t.p_tensor] if self._subset is not None else True))
        return [(t.buf_str[b], i) for b, i in zip(t.p_buf[rows].tolist(), t.p_index[rows].tolist())]


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


def _align_arr(n: np.ndarray) -> np.ndarray:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _group_starts(keys: list[np.ndarray]) -> np.ndarray:
    """Boolean: row i starts a new run of equal keys (rows already sorted)."""
    n = len(keys[0])
    new = np.zeros(n, dtype=bool)
    if n:
        new[0] = True
        for k in keys:
            new[1:] |= k[1:] != k[:-1] if k.ndim == 1 else row_any(k[1:] != k[:-1])
    return new


def _next_fit(group: np.ndarray, weights: list[tuple[np.ndarray, int]], vectorized: bool | None = None) -> np.ndarray:
    """Next-fit packing of each run of equal `group` values (rows in order) into bins whose
    summed weights stay within each cap; an item alone always fits. Returns the bin index of
    each row within its run. Vectorized over runs: one pass per bin of the longest run."""
    n = len(group)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.flatnonzero(_group_starts([group]))
    ends = np.append(starts[1:], n)
    if vectorized is None:
        vectorized = len(starts) * 64 >= n // 64 and n > 20000
    if not vectorized:
        # Few, long runs: one plain pass over the items beats a numpy pass per bin.
        out = np.empty(n, dtype=np.int64)
        ws = [w.tolist() for w, _ in weights]
        caps = [cap for _, cap in weights]
        g = group.tolist()
        prev, b, fill = None, 0, [0] * len(caps)
        for i in range(n):
            if g[i] != prev:
                prev, b, fill = g[i], 0, [0] * len(caps)
            elif any(f + w[i] > c for f, w, c in zip(fill, ws, caps)):
                b, fill = b + 1, [0] * len(caps)
            fill = [f + w[i] for f, w in zip(fill, ws)]
            out[i] = b
        return out
    cums = [(np.concatenate(([0], np.cumsum(w))), cap) for w, cap in weights]
    marker = np.zeros(n, dtype=bool)
    pos, active = starts.copy(), np.arange(len(starts))
    while active.size:
        p = pos[active]
        marker[p] = True
        e = ends[active]
        for c, cap in cums:
            e = np.minimum(e, np.searchsorted(c, c[p] + cap, "right") - 1)
        e = np.maximum(e, p + 1)
        pos[active] = e
        active = active[e < ends[active]]
    b = np.cumsum(marker) - 1
    run = np.cumsum(_group_starts([group])) - 1
    return b - b[starts][run]


def _split_rows(g: dict[str, np.ndarray], limit: np.ndarray) -> dict[str, np.ndarray]:
    """Rows larger than their element limit, split into sub-boxes (outermost dims first); the
    sub-rows replace their row in place. Also returns the positions of the sub-rows."""
    numel = row_prod(g["size"])
    big = np.flatnonzero(numel > limit)
    if not big.size:
        return g, big
    parts: list[tuple[int, tuple, tuple]] = []
    for j in big.tolist():
        nd = int(g["ndim"][j])
        size = tuple(g["size"][j, :nd].tolist())
        parts += [(j, off, sz) for off, sz in _split_box(size, max(1, int(limit[j])))]
    D = g["off"].shape[1]
    count = np.ones(len(numel), dtype=np.int64)
    count[big] = 0
    np.add.at(count, np.array([p[0] for p in parts], dtype=np.int64), 1)
    idx = np.repeat(np.arange(len(numel)), count)  # sub-rows of a row are consecutive, in split order
    out = _take_all(g, idx)
    pos = np.flatnonzero(np.isin(idx, big))
    rel = np.zeros((len(parts), D), dtype=np.int64)
    sub_size = np.ones((len(parts), D), dtype=np.int64)
    for i, (_, off, sz) in enumerate(parts):
        rel[i, :len(off)] = off
        sub_size[i, :len(sz)] = sz
    out["off"][pos] += rel
    out["size"][pos] = sub_size
    out["sstart"][pos] += _dot(rel, out["sstrides"][pos])
    out["dstart"][pos] += _dot(rel, out["dstrides"][pos])
    return out, pos


def _messages(g: dict[str, np.ndarray], name_rank: np.ndarray, options: PlanOptions, bucket: int):
    """Segments (with pair keys `ps`, `pd`) -> (segments in message order, messages).

    Per pair, segments sort by destination buffer and offset. A segment that is contiguous on a
    side and at least direct_min_bytes goes alone, straight from/into storage on that side;
    the others pack, in order, into staged messages of at most bucket_bytes. Consecutive
    messages of a pair then share a round while their staged bytes fit a bucket and their
    bytes fit max_message_bytes."""
    isz = ITEMSIZE[g["ddt"]]
    nbytes = row_prod(g["size"]) * isz
    g["sc"] = (g["sdt"] == g["ddt"]) & contiguous(g["size"], g["sstrides"], g["ndim"])
    g["dc"] = contiguous(g["size"], g["dstrides"], g["ndim"])
    g["direct"] = (g["sc"] | g["dc"]) & (nbytes >= options.direct_min_bytes)
    limit = np.where(g["direct"] & g["sc"] & g["dc"], options.max_message_bytes, bucket) // isz
    g, pos = _split_rows(g, limit)
    if pos.size:
        # A split row keeps its segment's decision (direct or packed); it is contiguous on a side
        # only if the segment was and its own view is.
        size, nd = g["size"][pos], g["ndim"][pos]
        g["sc"][pos] &= contiguous(size, g["sstrides"][pos], nd)
        g["dc"][pos] &= contiguous(size, g["dstrides"][pos], nd)
        nbytes = row_prod(g["size"]) * ITEMSIZE[g["ddt"]]
    n = len(nbytes)
    # Order: pair, destination buffer (by name), destination offset (unique within a buffer).
    pair_key = (g["ps"] << 20) | g["pd"]
    order = _order(g["ps"], g["pd"], np.take(name_rank, g["dbuf"]), g["dstart"])
    pk_s, nb_s = pair_key[order], nbytes[order]
    direct = g["direct"][order]
    sd, rd = direct & g["sc"][order], direct & g["dc"][order]
    pair_id = np.cumsum(_group_starts([pk_s])) - 1 if n else np.zeros(0, dtype=np.int64)
    # Packed rows: next-fit into buckets per pair; each message sits at its first row.
    pk = np.flatnonzero(~direct)
    first = np.arange(n)
    if pk.size:
        bins = _next_fit(pair_id[pk], [(_align_arr(nb_s[pk]), bucket)])
        bstart = _group_starts([pair_id[pk], bins])
        first[pk] = pk[bstart][np.cumsum(bstart) - 1]
    # Rows grouped by message (a bucket's later rows may sit after direct rows of the pair).
    o2 = np.argsort(first, kind="stable")
    order = order[o2]
    first, nb_s, sd, rd, pair_id = first[o2], nb_s[o2], sd[o2], rd[o2], pair_id[o2]
    ps_o, pd_o = g["ps"][order], g["pd"][order]
    g = _take_all({k: g.pop(k) for k in SEG_KEYS}, order)
    mstart = _group_starts([first]) if n else np.zeros(0, dtype=bool)
    lo = np.flatnonzero(mstart)
    hi = np.append(lo[1:], n)
    m_nbytes = np.add.reduceat(nb_s, lo) if n else np.zeros(0, np.int64)
    m_staged = np.add.reduceat(_align_arr(nb_s), lo) if n else np.zeros(0, np.int64)
    m_sd, m_rd, m_pair = sd[lo], rd[lo], pair_id[lo]
    # Tags: message index within its pair; rounds: next-fit within the pair.
    pstart = _group_starts([m_pair])
    pfirst = np.flatnonzero(pstart)
    m_tag = np.arange(len(lo)) - pfirst[np.cumsum(pstart) - 1] if len(lo) else np.zeros(0, np.int64)
    st = np.where(m_sd & m_rd, 0, m_staged)
    m_round = _next_fit(m_pair, [(st, bucket), (m_nbytes, options.max_message_bytes)])
    msgs = {"src": ps_o[lo], "dst": pd_o[lo], "round": m_round, "tag": m_tag, "sd": m_sd, "rd": m_rd,
            "nbytes": m_nbytes, "lo": lo, "hi": hi}
    return g, msgs


SEG_KEYS = ("tensor", "off", "size", "ndim", "sbuf", "sstart", "sstrides", "dbuf", "dstart", "dstrides", "piece", "sdt", "ddt")


def make_plan(src: Layout, dst: Layout, options: PlanOptions | None = None, tensors: set[str] | None = None) -> Plan:
    """Plan the transfer of every destination piece (of `tensors`, or all) from the source layout.

    It runs inside trainers and engines, so it leaves the process's allocator, garbage collector
    and numpy settings alone; `reshard plan` tunes its own process instead."""
    options = options or PlanOptions()
    bucket = options.bucket_bytes // ALIGN * ALIGN  # aligned segments then never exceed it
    S, T, buffer_names = _tables(src, dst)
    check_compatible(src, dst, tensors)
    # Destination buffers in natural order (layers.2 before layers.10), which every pair and the
    # relays follow: buffers complete in about model order, what bounded staging relies on.
    name_rank = np.empty(len(buffer_names), dtype=np.int64)
    name_rank[sorted(range(len(buffer_names)), key=lambda i: _natural_key(buffer_names[i]))] = np.arange(len(buffer_names))
    D = max(S.D, T.D)
    s_off, s_size, s_strides = (fit_width(a, D, f) for a, f in ((S.p_off, 0), (S.p_size, 1), (S.p_strides, 0)))
    d_off, d_size, d_strides = (fit_width(a, D, f) for a, f in ((T.p_off, 0), (T.p_size, 1), (T.p_strides, 0)))
    t_shape = fit_width(T.tensor_shape, D, 1)

    # Source tensor ids in the destination's numbering (-1: not a destination tensor).
    if S.tensor_names is T.tensor_names:  # one tensor dict (and its columns) for both layouts
        s2d = np.append(np.arange(len(T.tensor_names), dtype=np.int64), -1)
    else:
        d_tid = {n: i for i, n in enumerate(T.tensor_names)}
        s2d = np.array([d_tid.get(n, -1) for n in S.tensor_names] + [-1], dtype=np.int64)
    subset = None
    if tensors is not None:
        subset = np.array([n in tensors for n in T.tensor_names], dtype=bool)

    with ThreadPoolExecutor(1) as pool:  # the source side and the destination's relay chains, side by side
        fut = pool.submit(_source_boxes, S, src, D, s2d, s_off, s_size, t_shape, T.tensor_names)
        primary = np.array([r[0] for r in T.class_ranks], dtype=np.int64)
        units, rep, head = _relay_units(T, options, bucket) if options.relay else ({}, None, primary[T.buf_class])
        live = (T.p_numel > 0) & (subset[T.p_tensor] if subset is not None else True)
        if rep is not None:
            live &= np.take(rep, T.p_buf) == T.p_buf  # a copy of a buffer fed elsewhere arrives by relay
        dp_rows = np.flatnonzero(live)
        rows, b_first, b_count, b_t, b_off, b_size, hs, hs_ranks = fut.result()
        # Source boxes that overlap without being replicas are an error: checked while the
        # intersections run, and reported before any error of theirs.
        check = pool.submit(_check_source_overlap, S, src, b_t, b_off, b_size, t_shape, rows, b_first, T.tensor_names)
        try:
            inter, err = _intersect(T, D, d_off, d_size, dp_rows, b_t, b_off, b_size, primary), None
        except Exception as e:  # noqa: BLE001 -- re-raised below, after the overlap check
            inter, err = None, e
        check.result()
        if err is not None:
            raise err
    g = _primary_segments(S, T, src, options, D, rows, b_first, b_count, hs, hs_ranks, *inter, head, s_off, s_strides,
                          d_off, d_strides)
    del inter, rows, b_first, b_count, b_t, b_off, b_size, hs, hs_ranks, dp_rows
    layouts_hash = hashlib.sha256()  # the digest covers both layouts' buffers: hashed now, and the
    for tbl in (S, T):               # source table's piece columns freed (the plan no longer needs them)
        tbl.hash_buffers(layouts_hash)
    del S, s_off, s_size, s_strides
    m_opts, m_bucket = _window_bucket(options, bucket, dst)
    g, m = _messages(g, name_rank, m_opts, m_bucket)
    relay_msgs: dict[bytes, tuple[dict, dict]] = {}  # relay templates' messages planned for the pace, by key
    unit_keys: dict[tuple[int, ...], bytes] = {}  # chain -> its template's key (b"": nothing to relay), from the pace
    if dst.receive_window:
        # With replicas, a bounded primary receives at the pace its relay chain forwards, so what it
        # holds until forwarded stays a few rounds' bytes (not the rank's weights)
        pace = _relay_pace(T, units, subset, D, name_rank, m_opts, m_bucket, relay_msgs, unit_keys)
        m["round"] = _windowed_rounds(g, m, name_rank, dst.receive_window, m_bucket, pace)
    m["relay"] = np.zeros(len(m["src"]), dtype=bool)
    peers = max(1, options.staging_limit // (2 * bucket))
    relaying = bool(units)
    # A primary that relays may send one relay bucket in a round where it receives: one peer less.
    m["round"] = _stagger(m, peers, max(1, peers - 1) if relaying else peers)
    arrival = _arrival_rounds(g, m) if relaying else None

    # -- relays: replicas forward what they hold, along a pipelined chain per replica group ----
    primary_of: dict[int, int] = {}
    relayed: dict[int, list[tuple[int, int]]] = defaultdict(list)  # rank -> (buffer row, head) arriving by relay
    seg_parts, msg_parts = [g], [m]
    nseg = len(g["tensor"])
    templates: dict[bytes, tuple[dict, dict, int]] = {}  # equal relay segments: planned once, stored once
    busy: dict[int, int] = {}  # rank -> the last round of the chains placed so far that it takes part in
    if options.relay:
        for ranks, (bufs, copies) in sorted(units.items()):
            for r in ranks[1:]:
                primary_of.setdefault(r, ranks[0])
                relayed[r] += [(b, ranks[0]) for b in copies.get(int(T.rank_class[r]), bufs)]
            rg, key = None, unit_keys.get(ranks)  # the pace's (bounded), else the chain's segments are made here
            if key is None:
                rg = _relay_segments(T, bufs, subset, D)
                key = _segments_key(rg) if len(rg["tensor"]) else b""
            if not key:
                continue
            hit = templates.get(key)
            if hit is not None:
                rg, rm, base = hit
            else:
                rg, rm = relay_msgs.pop(key, None) or _relay_messages(
                    rg if rg is not None else _relay_segments(T, bufs, subset, D), name_rank, m_opts, m_bucket)
                base = nseg
                templates[key] = (rg, rm, base)
                seg_parts.append(rg)
                nseg += len(rg["tensor"])
            # A relay message leaves the primary in the round after the last source round that
            # writes its buffers (relays overlap the source phase), never earlier than its place
            # among the relay messages allows; link k of the chain runs k rounds behind link 0:
            # message j leaves a replica the round after it arrived there, so every link carries
            # the data once, pipelined.
            start = _relay_start(rm, rg, arrival, ranks[0])
            start = _after_busy(start, ranks, busy)
            for k in range(len(ranks) - 1):
                lm = dict(rm)
                lm["src"] = np.full(len(rm["src"]), ranks[k], dtype=np.int64)
                lm["dst"] = np.full(len(rm["src"]), ranks[k + 1], dtype=np.int64)
                lm["round"] = start + k
                lm["lo"], lm["hi"] = rm["lo"] + base, rm["hi"] + base
                lm["relay"] = np.ones(len(rm["src"]), dtype=bool)
                msg_parts.append(lm)
    G = {k: np.concatenate([p.pop(k) for p in seg_parts]) if len(seg_parts) > 1 else seg_parts[0][k] for k in SEG_KEYS}
    del g, seg_parts
    Mm = {k: np.concatenate([p[k] for p in msg_parts]) for k in ("src", "dst", "round", "tag", "sd", "rd", "nbytes", "lo", "hi", "relay")}
    order = _order(Mm["round"], Mm["relay"], Mm["src"], Mm["dst"], Mm["tag"])
    Mm = _take_all(Mm, order)
    # Relay tags count a link's messages in this order, over every chain that uses the link (a
    # link of one chain keeps its tags; chains sharing a link get unique ones). The order holds.
    rel = np.flatnonzero(Mm["relay"])
    o = rel[_order(Mm["src"][rel], Mm["dst"][rel])]
    start = _group_starts([Mm["src"][o], Mm["dst"][o]])
    Mm["tag"][o] = np.arange(len(o)) - np.flatnonzero(start)[np.cumsum(start) - 1]
    num_rounds = int(Mm["round"].max()) + 1 if len(order) else 0
    # The digest covers the plan and the buffers of both layouts (their pieces enter through the
    # plan's segments); the layouts' full fingerprints are not needed for it.
    digest = _digest(tensors, Mm, G, T.tensor_names, buffer_names, layouts_hash.digest())
    return Plan(src.world, dst.world, num_rounds, digest, Mm, G, T.tensor_names, buffer_names, primary_of, T, subset,
                {r: sorted(b) for r, b in relayed.items()})


def _natural_key(name: str) -> tuple:
    """`model.layers.10.x` -> ('model.layers.', 10, '.x'): numbers compare as numbers."""
    parts = re.split(r"(\d+)", name)
    return tuple(int(p) if i % 2 else p for i, p in enumerate(parts))


def _after_busy(start: np.ndarray, ranks: tuple[int, ...], busy: dict[int, int]) -> np.ndarray:
    """Rounds at which a chain's messages leave its head, delayed as a block so that every rank of
    the chain takes part only after the chains placed before it are done with that rank (a rank
    in two chains relays one bucket per round, as the staging bound assumes). Updates `busy`."""
    if not len(start):
        return start
    lo, hi, n = int(start.min()), int(start.max()), len(ranks)
    # Rank k receives on link k-1 (rounds start + k - 1) and sends on link k (rounds start + k).
    need = max([busy[r] - (lo + max(k - 1, 0)) + 1 for k, r in enumerate(ranks) if r in busy] + [0])
    for k, r in enumerate(ranks):
        busy[r] = max(busy.get(r, -1), hi + need + min(k, n - 2))
    return start + need if need else start


def _tables(src: Layout, dst: Layout) -> tuple[LayoutTable, LayoutTable, list[str]]:
    """Both layouts' tables, built side by side (numpy releases the interpreter lock: the two
    cores both work), and one buffer-name numbering: the source's names, then the destination's
    new ones, each in order of first use. The source's error, if both are invalid, comes first."""
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(build_table, src, {}, "source", False)
        try:
            T = build_table(dst, {}, "destination", True)
            err = None
        except LayoutError as e:
            T, err = None, e
        S = fut.result()
    if err is not None:
        raise err
    names = list(dict.fromkeys(S.buf_str_names + T.buf_str_names))
    index = {n: i for i, n in enumerate(names)}
    T.buf_name = np.array([index[n] for n in T.buf_str_names], dtype=np.int64)[T.buf_name]
    S.buf_str_names = T.buf_str_names = names
    return S, T, names


def _relay_units(T: LayoutTable, options: PlanOptions, bucket: int):
    """Relay chains and what the source phase feeds.

    Returns (units, rep, head): units maps a chain (ranks, ascending; the first is fed by the
    source phase) to (buffer rows of the first rank's class, {class: its copies of those rows});
    rep[b] is the buffer row whose copy the source phase feeds for row b (b itself unless an
    identical buffer of another class is fed instead); head[b] the rank that receives it.

    Ranks of one class hold identical buffers: one chain per class. Identical buffers across
    classes (the same name and content) form one chain through all their holders when the
    holders share at least `shared_relay_min_bytes`."""
    nb = len(T.buf_class)
    rep = np.arange(nb, dtype=np.int64)
    primary = np.array([r[0] for r in T.class_ranks], dtype=np.int64)
    head = primary[T.buf_class]
    cross: dict[tuple[int, ...], list[list[int]]] = defaultdict(list)  # holder classes -> groups of rows
    if T.num_classes > 1 and nb:
        first = _identical_buffers(T)
        shared = np.flatnonzero(first != np.arange(nb))
        if shared.size:
            members: dict[int, list[int]] = defaultdict(list)
            for b, f in zip(shared.tolist(), first[shared].tolist()):
                members[f].append(b)
            for f, ms in members.items():
                group = [f] + ms
                cross[tuple(int(T.buf_class[b]) for b in group)].append(group)
    units: dict[tuple[int, ...], tuple[list[int], dict[int, list[int]]]] = {}
    in_cross = np.zeros(nb, dtype=bool)
    limit = options.shared_relay_min_bytes or bucket
    isz = ITEMSIZE[T.buf_dtype]
    for classes, groups in sorted(cross.items()):
        if sum(int(T.buf_numel[g[0]] * isz[g[0]]) for g in groups) < limit:
            continue
        ranks = tuple(sorted(r for c in classes for r in T.class_ranks[c]))
        copies = {c: [g[k] for g in groups] for k, c in enumerate(classes)}
        bufs = copies[classes[0]]
        for g in groups:
            rep[g] = g[0]
            in_cross[g] = True
            head[g] = ranks[0]
        units[ranks] = (bufs, copies)
    for c, ranks in enumerate(T.class_ranks):
        if len(ranks) > 1:
            bufs = np.flatnonzero((T.buf_class == c) & ~in_cross).tolist()
            if bufs:
                units[tuple(ranks)] = (bufs, {})
    return units, rep, head


def _identical_buffers(T: LayoutTable) -> np.ndarray:
    """Per buffer row: the first buffer row with the same name and content (itself if none).
    Candidates come from a 64-bit hash of each buffer's pieces; candidates are then compared
    column by column, so a collision never merges different buffers."""
    nb = len(T.buf_class)
    u64 = np.uint64
    mul = u64(0x9E3779B97F4A7C15)
    h = np.zeros(len(T.p_buf), dtype=u64)
    cols = [T.p_tensor, T.p_flat, T.p_ndim, T.p_start] + [T.p_off[:, d] for d in range(T.D)] + [T.p_size[:, d] for d in range(T.D)]
    for c in cols:
        h ^= c.astype(u64)
        h *= mul
        h ^= h >> u64(29)
    h *= (T.p_index.astype(u64) << u64(1)) | u64(1)
    counts = np.bincount(T.p_buf, minlength=nb)
    pstart = np.cumsum(counts) - counts
    hb = np.zeros(nb, dtype=u64)
    full = np.flatnonzero(counts)
    if full.size:
        hb[full] = np.add.reduceat(h, pstart[full])
    for c in [T.buf_name, T.buf_dtype, T.buf_ndim, counts] + [T.buf_shape[:, d] for d in range(T.D)]:
        hb ^= c.astype(u64)
        hb *= mul
        hb ^= hb >> u64(29)
    for b, pads in T.buf_padding.items():
        hb[b] ^= u64(zlib.crc32(repr(pads).encode()))
    o = np.lexsort((np.arange(nb), hb))
    hs = hb[o]
    start = np.append(True, hs[1:] != hs[:-1])
    first = np.empty(nb, dtype=np.int64)
    first[o] = o[np.flatnonzero(start)][np.cumsum(start) - 1]
    cand = np.flatnonzero(first != np.arange(nb))
    if not cand.size:
        return first
    f = first[cand]
    ok = (counts[cand] == counts[f]) & (T.buf_class[cand] != T.buf_class[f])
    for c in (T.buf_name, T.buf_dtype, T.buf_ndim, T.buf_shape):
        ok &= (c[cand] == c[f]) if c.ndim == 1 else (c[cand] == c[f]).all(axis=1)
    ok &= np.array([T.buf_padding.get(int(a), ()) == T.buf_padding.get(int(b), ()) for a, b in zip(cand, f)], dtype=bool) \
        if T.buf_padding else True
    n = counts[cand]
    if n.sum():
        own = np.repeat(pstart[cand], n) + (np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n))
        theirs = own + np.repeat(pstart[f] - pstart[cand], n)  # the same piece of the first buffer
        same = np.ones(len(own), dtype=bool)
        for c in (T.p_tensor, T.p_flat, T.p_ndim, T.p_start, T.p_off, T.p_size):
            same &= (c[own] == c[theirs]) if c.ndim == 1 else (c[own] == c[theirs]).all(axis=1)
        ok[np.repeat(np.arange(len(cand)), n)[~same]] = False
    first[cand[~ok]] = cand[~ok]
    return first


def _source_boxes(S, src, D, s2d, s_off, s_size, t_shape, tnames):
    """Distinct source boxes (tensor in destination numbering, box), each with the classes holding it;
    holder sets interned (one class: its ranks; several: their union)."""
    st = s2d[S.p_tensor]
    rows = np.flatnonzero((S.p_numel > 0) & (st >= 0))
    cls = S.buf_class[S.p_buf[rows]]
    keys = [cls] + [s_size[rows, d] for d in range(D - 1, -1, -1)] + [s_off[rows, d] for d in range(D - 1, -1, -1)] + [st[rows]]
    o = np.lexsort(keys)
    rows, cls = rows[o], cls[o]
    bstart = _group_starts([st[rows], s_off[rows], s_size[rows]])
    dup = ~bstart & np.append(False, cls[1:] == cls[:-1])  # a class holding one box twice: keep one
    rows, cls, bstart = rows[~dup], cls[~dup], bstart[~dup]
    b_first = np.flatnonzero(bstart)
    b_count = np.diff(np.append(b_first, len(rows)))
    b_row = rows[b_first]                       # a representative piece row per distinct box
    b_t, b_off, b_size = st[b_row], s_off[b_row], s_size[b_row]
    # Holder sets: one class -> that class's ranks; several -> their union, interned.
    nclass = S.num_classes
    hs = cls[b_first].copy()
    hs_ranks: list[np.ndarray] = [np.array(r, dtype=np.int64) for r in S.class_ranks]
    multi: dict[tuple, int] = {}
    for b in np.flatnonzero(b_count > 1).tolist():
        key = tuple(cls[b_first[b]:b_first[b] + b_count[b]].tolist())
        h = multi.get(key)
        if h is None:
            h = multi[key] = nclass + len(multi)
            hs_ranks.append(np.sort(np.concatenate([hs_ranks[c] for c in key])))
        hs[b] = h
    return rows, b_first, b_count, b_t, b_off, b_size, hs, hs_ranks


def _intersect(T, D, d_off, d_size, dp_rows, b_t, b_off, b_size, primary):
    """Every (destination piece x source box) intersection, checked to cover each piece."""
    # Candidate boxes per destination piece: each tensor's source boxes are searched along the
    # first dimension on which they are disjoint (only the boxes overlapping the piece there);
    # a tensor with no such dimension offers all of its boxes.
    ntens = len(T.tensor_names) + 1
    search_dim = np.full(ntens, -1, dtype=np.int64)
    for d in range(D - 1, -1, -1):
        o_d = np.lexsort((b_off[:, d], b_t))
        t_d, lo_d, hi_d = b_t[o_d], b_off[o_d, d], b_off[o_d, d] + b_size[o_d, d]
        clash = (t_d[1:] == t_d[:-1]) & (lo_d[1:] < hi_d[:-1])
        ok = np.ones(ntens, dtype=bool)
        ok[t_d[1:][clash]] = False
        search_dim[ok] = d  # the lowest such dimension wins (descending loop)
    M = np.int64(1) << np.int64(40)
    bd = np.maximum(search_dim[b_t], 0)
    b_lo = np.take_along_axis(b_off, bd[:, None], 1)[:, 0]
    b_hi = b_lo + np.take_along_axis(b_size, bd[:, None], 1)[:, 0]
    bo = np.lexsort((b_lo, b_t))
    b_t_s = b_t[bo]
    key_lo, key_hi = b_t_s * M + b_lo[bo], b_t_s * M + b_hi[bo]
    dt_ = T.p_tensor[dp_rows]
    dd = search_dim[dt_]
    ddc = np.maximum(dd, 0)
    a0 = d_off.reshape(-1)[dp_rows * D + ddc]
    a1 = a0 + d_size.reshape(-1)[dp_rows * D + ddc]
    t_start = np.searchsorted(b_t_s, np.arange(ntens + 1), "left")  # each tensor's run of boxes
    t_lo, t_hi = np.take(t_start, dt_), np.take(t_start, dt_ + 1)
    every = dd < 0
    lo = np.where(every, t_lo, np.searchsorted(key_hi, dt_ * M + a0, "right"))
    hi = np.where(every, t_hi, np.searchsorted(key_lo, dt_ * M + a1, "left"))
    lo = np.maximum(lo, t_lo)
    hi = np.maximum(np.minimum(hi, t_hi), lo)
    cnt = hi - lo
    pair_d = np.repeat(np.arange(len(dp_rows)), cnt)
    pair_b = np.take(bo, np.repeat(lo - (np.cumsum(cnt) - cnt), cnt) + np.arange(int(cnt.sum())))
    prow = np.take(dp_rows, pair_d)
    # (2-D gathers through np.take and compress: several times faster than fancy indexing.)
    po, bo_ = np.take(d_off, prow, axis=0), np.take(b_off, pair_b, axis=0)
    ilo = np.maximum(po, bo_)
    po += np.take(d_size, prow, axis=0)
    bo_ += np.take(b_size, pair_b, axis=0)
    ihi = np.minimum(po, bo_, out=po)
    del bo_
    hit = row_all(ihi > ilo)
    if not hit.all():
        pair_d, pair_b, prow = pair_d[hit], pair_b[hit], prow[hit]
        ilo, ihi = np.compress(hit, ilo, axis=0), np.compress(hit, ihi, axis=0)
    isize = ihi - ilo
    inumel = row_prod(isize)
    covered = np.bincount(pair_d, weights=inumel, minlength=len(dp_rows)).astype(np.int64)
    gap = np.flatnonzero(covered != T.p_numel[dp_rows])
    if gap.size:
        r = int(dp_rows[gap[0]])
        buf = T.buf_obj[T.p_buf[r]]
        p = buf.pieces[T.p_index[r]]
        raise coverage_gap(p, int(primary[T.buf_class[T.p_buf[r]]]), buf.name, int(covered[gap[0]]))
    return pair_b, prow, ilo, isize, inumel


def _primary_segments(S, T, src, options, D, rows, b_first, b_count, hs, hs_ranks, pair_b, prow, ilo, isize, inumel,
                      head, s_off, s_strides, d_off, d_strides) -> dict[str, np.ndarray]:
    """Receivers (the head of each buffer's relay chain, `head` per buffer row, or every rank
    without relays), one source replica per transfer, and the segment columns."""
    if options.relay:
        drank = np.take(head, np.take(T.p_buf, prow))  # the head of the piece's relay chain
    else:  # every rank of the class receives its own copy
        pcls = T.buf_class[T.p_buf[prow]]
        counts = np.array([len(r) for r in T.class_ranks], dtype=np.int64)[pcls]
        reps = np.repeat(np.arange(len(pcls)), counts)
        drank = np.concatenate([np.array(T.class_ranks[c], dtype=np.int64) for c in pcls.tolist()]) if len(pcls) else pcls
        pair_b, prow, ilo, isize, inumel = (_take(a, reps) for a in (pair_b, prow, ilo, isize, inumel))
    pbuf = _take(T.p_buf, prow)
    ddt = _take(T.buf_dtype, pbuf)
    nbytes = inumel * _take(ITEMSIZE, ddt)

    # -- one source replica per transfer: largest first, to the least-loaded holder ------------
    srank = _assign(nbytes, hs[pair_b], drank, hs_ranks, src.world)
    # The piece row of box b held by srank.
    srow = _holder_rows(S, rows, b_first, b_count, pair_b, srank)
    sbuf = _take(S.p_buf, srow)
    sstrides, dstrides = _take(s_strides, srow), _take(d_strides, prow)
    return {
        "tensor": _take(T.p_tensor, prow), "off": ilo, "size": isize, "ndim": _take(T.p_ndim, prow),
        "sbuf": _take(S.buf_name, sbuf), "sstart": _take(S.p_start, srow) + _dot(ilo - _take(s_off, srow), sstrides),
        "sstrides": sstrides, "dbuf": _take(T.buf_name, pbuf),
        "dstart": _take(T.p_start, prow) + _dot(ilo - _take(d_off, prow), dstrides), "dstrides": dstrides,
        "piece": _take(T.p_index, prow), "sdt": _take(S.buf_dtype, sbuf), "ddt": ddt,
        "ps": srank, "pd": drank,
    }


def _order(*cols: np.ndarray) -> np.ndarray:
    """np.lexsort(cols[::-1]) (first column most significant) for non-negative integer columns:
    one stable sort of a mixed-radix key when the key fits 63 bits."""
    if not len(cols[0]):
        return np.zeros(0, dtype=np.int64)
    radix = [int(c.max()) + 1 for c in cols]
    if math.prod(radix) >= 1 << 63:
        return np.lexsort(cols[::-1])
    key = np.zeros(len(cols[0]), dtype=np.int64)
    for c, r in zip(cols, radix):
        key *= r
        key += c
    return np.argsort(key, kind="stable")


def _take_all(cols: dict[str, np.ndarray], idx: np.ndarray) -> dict[str, np.ndarray]:
    """Every column gathered by `idx` (and removed from `cols`), the columns split over two
    threads when there are many rows (np.take releases the interpreter lock)."""
    keys = list(cols)
    if len(idx) < 200_000 or len(keys) < 2:
        return {k: _take(cols.pop(k), idx) for k in keys}  # (popped: each source column freed once gathered)
    half = keys[1::2]
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(lambda: {k: _take(cols.pop(k), idx) for k in half})
        out = {k: _take(cols.pop(k), idx) for k in keys[0::2]}
        out.update(fut.result())
    return {k: out[k] for k in keys}


def _take(a: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """a[idx] along the first axis (np.take: several times faster than fancy indexing on the
    planner's million-row columns)."""
    return np.take(a, idx, axis=0)





def _arrival_rounds(g: dict[str, np.ndarray], m: dict[str, np.ndarray]) -> dict[tuple[int, int], int]:
    """(destination rank, buffer name id) -> the last round in which source bytes land there.
    (`g` holds the segments of the messages `m`, in their order: rows lo:hi of each.)"""
    n = m["hi"] - m["lo"]
    if not n.sum():
        return {}
    rank, rnd, buf = np.repeat(m["dst"], n), np.repeat(m["round"], n), g["dbuf"][m["lo"][0]:m["hi"][-1]]
    nb = int(buf.max()) + 1
    key = rank * nb + buf
    o = np.lexsort((rnd, key))
    last = np.append(key[o][1:] != key[o][:-1], True)
    return {(int(k // nb), int(k % nb)): int(r) for k, r in zip(key[o][last].tolist(), rnd[o][last].tolist())}


def _relay_start(rm: dict[str, np.ndarray], rg: dict[str, np.ndarray], arrival: dict[tuple[int, int], int],
                 primary: int) -> np.ndarray:
    """Round in which each relay message leaves the primary: at least one after its buffers'
    last source round, and shifted as a block so messages that the template put in different
    rounds never share one (each template round fits a bucket)."""
    if not len(rm["round"]):
        return rm["round"]
    seg_ready = np.array([arrival.get((primary, int(b)), -1) + 1 for b in rg["dbuf"].tolist()], dtype=np.int64)
    ready = np.maximum.reduceat(seg_ready, rm["lo"]) if len(seg_ready) else np.zeros(0, np.int64)
    shift = np.maximum.accumulate(ready - rm["round"])
    return rm["round"] + np.maximum(shift, 0)


def _window_bucket(options: PlanOptions, bucket: int, dst: Layout) -> tuple[PlanOptions, int]:
    """The options and bucket messages are planned with: a bounded destination (a receive window,
    half its pool) gets messages of at most half its window, direct ones included, so that a
    round keeps to the window and a primary holds a message or two it has yet to relay."""
    w = dst.receive_window // 2
    if not w or (bucket <= w and options.max_message_bytes <= w):
        return options, bucket
    w = max(ALIGN, w // ALIGN * ALIGN)
    return dataclasses.replace(options, bucket_bytes=min(options.bucket_bytes, w),
                               max_message_bytes=min(options.max_message_bytes, w)), min(bucket, w)


def _segments_key(rg: dict[str, np.ndarray]) -> bytes:
    """Equal relay segments (a template planned once) have equal keys."""
    return b"".join(np.ascontiguousarray(rg[k]).tobytes() for k in SEG_KEYS)


def _relay_messages(rg: dict[str, np.ndarray], name_rank: np.ndarray, options: PlanOptions,
                    bucket: int) -> tuple[dict, dict]:
    """A relay template's segments in message order, and its messages (one pair: keys 0)."""
    rg["ps"] = np.zeros(len(rg["tensor"]), dtype=np.int64)
    rg["pd"] = np.zeros(len(rg["tensor"]), dtype=np.int64)
    return _messages(rg, name_rank, options, bucket)


def _relay_pace(T, units: dict, subset, D: int, name_rank: np.ndarray, options: PlanOptions, bucket: int,
                planned: dict[bytes, tuple[dict, dict]], keys: dict[tuple[int, ...], bytes]) -> dict[int, int]:
    """Primary rank -> the bytes a round its relay chain forwards, on average (its relay messages'
    bytes over their rounds): what a bounded primary may receive a round without falling behind.
    Each template's segments and messages go into `planned` (by key) and each chain's key into
    `keys` (b"": nothing to relay), for the relays to take as they are."""
    out: dict[int, int] = {}
    for ranks, (bufs, _) in units.items():
        rg = _relay_segments(T, bufs, subset, D)
        if not len(rg["tensor"]):
            keys[ranks] = b""
            continue
        key = keys[ranks] = _segments_key(rg)
        if key not in planned:
            planned[key] = _relay_messages(rg, name_rank, options, bucket)
        rm = planned[key][1]
        rate = max(1, int(rm["nbytes"].sum()) // (int(rm["round"].max()) + 1))
        out[ranks[0]] = min(out.get(ranks[0], rate), rate)
    return out


def _windowed_rounds(g: dict[str, np.ndarray], m: dict[str, np.ndarray], name_rank: np.ndarray, window: int,
                     bucket: int, pace: dict[int, int] | None = None) -> np.ndarray:
    """Rounds for a destination that holds at most about `window` bytes of an update at once
    (bounded staging): each destination rank's messages, from every sender, in the order of the
    buffers they write (natural buffer order, then offset), fill rounds of `window` bytes, and
    a pair keeps to one bucket a round (a larger message alone) and to its own order. So no
    sender runs ahead through later buffers while another still sends earlier ones, and each
    buffer completes within a round or two of its first bytes. A primary that relays (`pace`:
    rank -> bytes a round) fills its rounds only to what its chain forwards a round."""
    n = len(m["src"])
    if not n:
        return m["round"]
    pace = pace or {}
    first = m["lo"]
    order = np.lexsort((m["tag"], m["src"], g["dstart"][first], np.take(name_rank, g["dbuf"][first]), m["dst"]))
    out = np.empty(n, dtype=np.int64)
    win: dict[int, tuple[int, int]] = {}  # destination -> (its current round, bytes placed in it)
    pair: dict[tuple[int, int], tuple[int, int]] = {}  # (src, dst) -> (its last round, bytes in it)
    total: dict[int, int] = defaultdict(int)  # a paced destination -> bytes placed so far
    for i, s, d, b in zip(order.tolist(), m["src"][order].tolist(), m["dst"][order].tolist(), m["nbytes"][order].tolist()):
        wr, used = win.get(d, (0, 0))
        lr, fill = pair.get((s, d), (0, 0))
        r = max(wr, lr)
        if r == lr and fill and fill + b > bucket:
            r += 1
        p = min(pace[d], max(1, window // 2)) if d in pace else 0
        if p:
            # What has arrived by the end of round r stays within what the chain forwards by then, and
            # within half the window a round: a buffer leaves a round or two after its last bytes came
            total[d] += b
            r = max(r, -(-total[d] // p) - 1)
        fill = fill + b if r == lr else b
        if r > wr:
            wr, used = r, 0
        used += b
        if used >= window:
            wr, used = wr + 1, 0
        win[d], pair[(s, d)] = (wr, used), (r, fill)
        out[i] = r
    return out


def _stagger(m: dict[str, np.ndarray], peers: int, dst_peers: int | None = None) -> np.ndarray:
    """Global rounds from each pair's own rounds, so that no rank has more than `peers` pairs
    in one round (its staging stays bounded): pairs get slots, greedily, such that a slot holds
    at most `peers` pairs of any rank (`dst_peers` of a destination rank, which may also be
    relaying in the same round); round k of a pair in slot s becomes k * slots + s."""
    dst_peers = peers if dst_peers is None else dst_peers
    if not len(m["src"]):
        return m["round"]
    pairs, inv = unique_rows(m["src"], m["dst"])
    deg_s = np.bincount(pairs[:, 0])
    deg_d = np.bincount(pairs[:, 1])
    if deg_s.max() <= peers and deg_d.max() <= dst_peers:
        return m["round"]  # every rank's pairs fit one slot
    used_s: dict[tuple[int, int], int] = defaultdict(int)
    used_d: dict[tuple[int, int], int] = defaultdict(int)
    slot = np.empty(len(pairs), dtype=np.int64)
    for i, (a, b) in enumerate(pairs.tolist()):
        k = 0
        while used_s[(a, k)] >= peers or used_d[(b, k)] >= dst_peers:
            k += 1
        slot[i] = k
        used_s[(a, k)] += 1
        used_d[(b, k)] += 1
    slots = int(slot.max()) + 1
    return m["round"] * slots + slot[inv]


def _check_source_overlap(S, src, b_t, b_off, b_size, t_shape, rows, b_first, tnames) -> None:
    """Distinct source boxes of one tensor must not overlap (identical ones are replicas)."""
    if len(b_t) < 2:
        return
    shape = t_shape[b_t]
    strides = row_strides(shape, np.full(len(shape), shape.shape[1]))
    lo = _dot(b_off, strides)
    hi = lo + _dot(b_size - 1, strides) + 1
    o = np.lexsort((lo, b_t))
    t_o = b_t[o]
    bad = (t_o[1:] == t_o[:-1]) & (lo[o][1:] < hi[o][:-1])
    if not bad.any():
        return  # linear spans disjoint: boxes disjoint
    # Exact test on the tensors the spans could not clear: every pair of their boxes, compared
    # by shifting the tensor-sorted list against itself.
    flagged = np.zeros(len(tnames) + 1, dtype=bool)
    flagged[t_o[1:][bad]] = True
    idx = o[flagged[t_o]]
    t_i = b_t[idx]
    lo_i, hi_i = b_off[idx], b_off[idx] + b_size[idx]
    for shift in range(1, len(idx)):
        same = t_i[shift:] == t_i[:-shift]
        if not same.any():
            break
        inter = same & row_all(np.maximum(lo_i[shift:], lo_i[:-shift]) < np.minimum(hi_i[shift:], hi_i[:-shift]))
        if inter.any():
            k = int(np.flatnonzero(inter)[0])
            boxes = []
            for x in (int(idx[k]), int(idx[k + shift])):
                r = int(rows[b_first[x]])
                buf = S.buf_obj[S.p_buf[r]]
                boxes.append((buf.pieces[S.p_index[r]].box, S.class_ranks[S.buf_class[S.p_buf[r]]][0]))
            raise overlapping_sources(tnames[int(t_i[k])], *sorted(boxes, key=lambda x: (x[0].offset, x[0].size)))


_WATERFILL_MAX = 4_000_000
"""Largest candidate table for placing a group of equal transfers at once (else one at a time)."""


def _assign(nbytes: np.ndarray, hs: np.ndarray, drank: np.ndarray, hs_ranks: list[np.ndarray], world: int) -> np.ndarray:
    """Greedy largest-first assignment of transfers to the least-loaded rank of their holder set.

    Transfers of equal size and holder set are placed together: for n equal items the greedy
    choices are the n smallest of {load_j + k * size} over holders j (ties to the lower rank)."""
    n = len(nbytes)
    out = np.empty(n, dtype=np.int64)
    load = np.zeros(world, dtype=np.int64)
    o = np.lexsort((np.arange(n), drank, hs, -nbytes))
    gstart = np.flatnonzero(_group_starts([nbytes[o], hs[o]]))
    gend = np.append(gstart[1:], n)
    for a, b in zip(gstart.tolist(), gend.tolist()):
        idx = o[a:b]
        h = hs_ranks[int(hs[idx[0]])]
        s = int(nbytes[idx[0]])
        k, cnt = len(h), b - a
        if k == 1:
            out[idx] = h[0]
            load[h[0]] += s * cnt
            continue
        L = load[h]
        per = min(cnt, -(-cnt // k) + int((L.max() - L.min()) // max(s, 1)) + 1)
        if k * per <= _WATERFILL_MAX:
            val = L[:, None] + s * np.arange(per)[None, :]
            j = np.broadcast_to(np.arange(k)[:, None], val.shape)
            flat = np.lexsort((j.ravel(), val.ravel()))[:cnt]
            pick = j.ravel()[flat]
        else:  # a very wide group: one item at a time
            pick = np.empty(cnt, dtype=np.int64)
            heap = [(int(L[x]), x) for x in range(k)]
            heapq.heapify(heap)
            for t in range(cnt):
                v, x = heapq.heappop(heap)
                pick[t] = x
                heapq.heappush(heap, (v + s, x))
        out[idx] = h[pick]
        np.add.at(load, h[pick], s)
    return out


def _holder_rows(S, rows, b_first, b_count, pair_b, srank) -> np.ndarray:
    """For each transfer, the source piece row of its box in the chosen rank's class."""
    cls_of_rank = S.rank_class[srank]
    single = b_count[pair_b] == 1
    out = rows[b_first[pair_b]].copy()
    multi = np.flatnonzero(~single)
    if multi.size:
        # The box's rows are sorted by class: search the chosen class among them.
        box_cls = S.buf_class[S.p_buf[rows]]
        fb, cb = b_first[pair_b[multi]], b_count[pair_b[multi]]
        key = cls_of_rank[multi]
        # Vectorized search: classes of the box lie in box_cls[fb:fb+cb], ascending.
        lo, hi = fb.copy(), fb + cb
        while True:
            act = lo < hi
            if not act.any():
                break
            mid = (lo + hi) // 2
            go_right = act & (box_cls[np.minimum(mid, len(box_cls) - 1)] < key)
            lo = np.where(go_right, mid + 1, lo)
            hi = np.where(act & ~go_right, mid, hi)
        out[multi] = rows[lo]
    return out


def _relay_segments(T, bufs: list[int], subset, D: int) -> dict[str, np.ndarray]:
    """What a replica receives from the previous one in its chain, for buffer rows `bufs`: for a
    whole update, every buffer's non-padding bytes in a few contiguous runs (raw segments:
    tensor -1, piece -1); for a partial update, the pieces of the chosen tensors."""
    if subset is None:
        rb, rs, rn = [], [], []
        for b in bufs:
            shape = tuple(T.buf_shape[b, :T.buf_ndim[b]].tolist())
            for start, n in _payload_ranges(T.buf_padding.get(b, ()), shape, int(T.buf_numel[b])):
                rb.append(b)
                rs.append(start)
                rn.append(n)
        rb_a = np.array(rb, dtype=np.int64)
        n = len(rb)
        size = np.ones((n, D), dtype=np.int64)
        size[:, 0] = rn
        strides = np.zeros((n, D), dtype=np.int64)
        strides[:, 0] = 1
        start = np.array(rs, dtype=np.int64)
        return {"tensor": np.full(n, -1, dtype=np.int64), "off": np.zeros((n, D), dtype=np.int64), "size": size,
                "ndim": np.ones(n, dtype=np.int64), "sbuf": T.buf_name[rb_a], "sstart": start, "sstrides": strides,
                "dbuf": T.buf_name[rb_a], "dstart": start, "dstrides": strides, "piece": np.full(n, -1, dtype=np.int64),
                "sdt": T.buf_dtype[rb_a], "ddt": T.buf_dtype[rb_a]}
    mine = np.zeros(len(T.buf_class), dtype=bool)
    mine[bufs] = True
    rows = np.flatnonzero(mine[T.p_buf] & subset[T.p_tensor] & (T.p_numel > 0))
    off, strides = fit_width(T.p_off[rows], D, 0), fit_width(T.p_strides[rows], D, 0)
    return {"tensor": T.p_tensor[rows], "off": off, "size": fit_width(T.p_size[rows], D, 1), "ndim": T.p_ndim[rows],
            "sbuf": T.buf_name[T.p_buf[rows]], "sstart": T.p_start[rows], "sstrides": strides,
            "dbuf": T.buf_name[T.p_buf[rows]], "dstart": T.p_start[rows], "dstrides": strides,
            "piece": T.p_index[rows], "sdt": T.buf_dtype[T.p_buf[rows]], "ddt": T.buf_dtype[T.p_buf[rows]]}


def _flat_runs(box: Box, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """A box of a tensor as contiguous (start, count) runs of its flattened elements."""
    rng = box.contiguous_range(shape)
    if rng is not None or box.numel == 0:
        return [rng] if rng and rng[1] else []
    runs = []
    for r in range(box.offset[0], box.end[0]):
        runs += _flat_runs(Box((r, *box.offset[1:]), (1, *box.size[1:])), shape)
    return runs


def _payload_ranges(padding, shape: tuple[int, ...], numel: int) -> list[tuple[int, int]]:
    """A buffer's elements outside declared padding, as contiguous (start, count) runs."""
    if not padding:
        return [(0, numel)] if numel else []
    pads = sorted(run for p in padding for run in _flat_runs(p, shape))
    out, pos = [], 0
    for start, n in pads:
        if start > pos:
            out.append((pos, start - pos))
        pos = max(pos, start + n)
    if pos < numel:
        out.append((pos, numel - pos))
    return out


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


def _digest(tensors, m: dict, g: dict, tnames: list[str], bnames: list[str], layouts: bytes) -> str:
    """sha256 (the fastest digest here on numpy buffers) of the segments, computed in a second
    thread, and of everything else."""
    def segments() -> bytes:
        hg = hashlib.sha256()
        for k in sorted(g):
            hg.update(k.encode())
            hash_array(hg, g[k])
        return hg.digest()

    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(segments)
        h = _digest_rest(tensors, m, tnames, bnames, layouts)
        h.update(fut.result())
    return h.hexdigest()[:16]


def _digest_rest(tensors, m: dict, tnames: list[str], bnames: list[str], layouts: bytes):
    h = hashlib.sha256()
    h.update(layouts)
    h.update(("*" if tensors is None else ",".join(sorted(tensors))).encode())
    h.update("\0".join(tnames).encode())
    h.update("\0".join(bnames).encode())
    for k in sorted(m):
        h.update(k.encode())
        hash_array(h, m[k])
    return h
