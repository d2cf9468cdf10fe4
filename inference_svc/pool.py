"""Bounded staging: an update received through a pool of fixed size, loaded group by group.

A rank staging `bounded` holds no copy of its weights. Its buffers exist only while an update
carries them: a buffer takes its space from the pool when the data plane first asks for it
(zeroed, so regions the update does not write, padding, read as zeros), and once every round
that writes it or relays from it has landed, its pieces are summed (what VERIFY compares with
the senders' sums), and its group (the buffers one engine module loads together, e.g. a
layer's weight and bias) is handed to `load` as soon as every buffer of the group is
complete; then its space is reused. The plan sends each pair's segments in buffer order, so
buffers complete one after another and what is held at once stays near a bucket per sender.

The pool is a bound, not a wall: a buffer that does not fit (larger than the pool, or too many
incomplete at once) gets space of its own, counted in `overflow_bytes` and warned about once
per update, rather than deadlocking a transfer that its peers already sent. `high_water`
is the most bytes held at once (pool and overflow), per update.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping

import torch

from reshard.common.dataplane.checksum import box_checksums
from reshard.common.layout.core import LocalBuffer, dtype_of
from reshard.common.plan.planner import Plan

log = logging.getLogger("reshard.inference")

ALIGN = 256  # bytes: every buffer starts on this boundary of the pool
DEFAULT_POOL_BYTES = 256 << 20

LoadFn = Callable[[dict[str, torch.Tensor]], None]
"""Takes a complete group's buffers (name -> tensor in the buffer's shape and dtype) and loads them
into the engine; the tensors are valid only during the call."""


class _Space:
    """First-fit allocation of aligned byte ranges of one pool."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.free: list[tuple[int, int]] = [(0, size)] if size else []  # (start, length), sorted, coalesced

    def take(self, n: int) -> int | None:
        n = -(-n // ALIGN) * ALIGN
        for i, (start, length) in enumerate(self.free):
            if length >= n:
                self.free[i:i + 1] = [(start + n, length - n)] if length > n else []
                return start
        return None

    def give(self, start: int, n: int) -> None:
        n = -(-n // ALIGN) * ALIGN
        self.free.append((start, n))
        self.free.sort()
        merged: list[tuple[int, int]] = []
        for s, length in self.free:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((s, length))
        self.free = merged


class BoundedStaging(Mapping[str, torch.Tensor]):
    """The buffers of one rank for a bounded update: a mapping the data plane reads and writes
    (`Engine(buffers=...)`), backed by a pool of `pool_bytes`, completing groups through `load`."""

    def __init__(self, descs: Mapping[str, LocalBuffer], shapes: Mapping[str, tuple[int, ...]], device: str | torch.device,
                 pool_bytes: int = DEFAULT_POOL_BYTES, groups: Mapping[str, str] | None = None) -> None:
        """`shapes`: the canonical tensors' shapes (a piece's checksum is positioned in its tensor);
        `groups`: buffer -> the group it loads with (default: each buffer alone)."""
        if pool_bytes < 0:
            raise ValueError(f"pool_bytes must be >= 0, not {pool_bytes}")
        self.descs, self.shapes, self.device = dict(descs), dict(shapes), torch.device(device)
        self.groups = {n: (groups or {}).get(n, n) for n in self.descs}  # buffer -> its group (default: itself)
        self.members: dict[str, list[str]] = defaultdict(list)
        for n, g in self.groups.items():
            self.members[g].append(n)
        self.pool_bytes = pool_bytes
        self._pool: torch.Tensor | None = None  # allocated at the first update, kept
        self._space = _Space(pool_bytes)
        self._held: dict[str, tuple[torch.Tensor, int | None]] = {}  # buffer -> (tensor, pool offset or None: overflow)
        self._reset_update()

    def _reset_update(self) -> None:
        self.plan: Plan | None = None
        self.rank = -1
        self.load: LoadFn | None = None
        self._last_round: dict[str, int] = {}
        self._by_round: dict[int, list[str]] = defaultdict(list)
        self._pending: dict[str, set[str]] = {}  # group -> buffers of it this update carries, not complete yet
        self._verify: dict[str, list[tuple[str, int]]] = defaultdict(list)  # buffer -> (buffer, piece) VERIFY checks
        self.sums: dict[tuple[int, str, int], int] = {}
        self.loaded: list[str] = []  # groups loaded this update, in order
        self.touched: list[str] = []  # groups whose load began (a failure from here leaves them torn)
        self.overflow_bytes = 0
        self.high_water = 0
        self._warned = False

    # -- an update ------------------------------------------------------------------------
    def begin(self, plan: Plan, rank: int, load: LoadFn) -> None:
        """Prepare for `plan`'s receives on `rank`: which round completes each buffer it carries."""
        self.release()
        self._reset_update()
        self.plan, self.rank, self.load = plan, rank, load
        for m in plan.recvs.get(rank, []):
            for seg in m.segments:
                b = seg.dst.buffer
                self._last_round[b] = max(self._last_round.get(b, -1), m.round)
        for m in plan.relay_sends.get(rank, []):  # a relay reads what this rank received: keep it until sent
            for seg in m.segments:
                b = seg.src.buffer
                self._last_round[b] = max(self._last_round.get(b, -1), m.round)
        unknown = sorted(set(self._last_round) - set(self.descs))
        if unknown:
            raise KeyError(f"the plan writes buffer {unknown[0]!r}, which rank {rank} does not have")
        # The data plane's hook counts this rank's own rounds (0, 1, ...), not the plan's.
        own = {r: i for i, r in enumerate(sorted({m.round for m in plan.recvs.get(rank, []) + plan.relay_sends.get(rank, [])}))}
        for b, r in self._last_round.items():
            self._by_round[own[r]].append(b)
            self._pending.setdefault(self.groups[b], set()).add(b)
        keys, _ = plan.verify_pieces(rank)
        for bname, i in keys:
            self._verify[bname].append((bname, i))
        if self._pool is None and self.pool_bytes:
            self._pool = torch.empty(self.pool_bytes, dtype=torch.uint8, device=self.device)

    def carried(self) -> set[str]:
        """The buffers this update writes."""
        return set(self._last_round)

    def touched_buffers(self) -> set[str]:
        """The buffers of every group whose load began this update: what a failure leaves torn."""
        return {n for g in list(self.touched) for n in self.members[g] if n in self._last_round}

    def round_done(self, rnd: int) -> list[str]:
        """Every round of this rank's up to its `rnd`-th (the Engine's hook) has landed: sum the buffers it completed, load each group whose
        buffers are all complete, free their space. Returns the groups loaded now."""
        done = [b for r in sorted(k for k in self._by_round if k <= rnd) for b in self._by_round.pop(r)]
        if not done:
            return []
        if self.device.type == "cuda":  # what the data plane queued into them has run
            torch.cuda.current_stream(self.device).synchronize()
        self._sum(done)
        loaded = []
        for b in done:
            g = self.groups[b]
            pending = self._pending.get(g)
            if pending is None:
                continue
            pending.discard(b)
            if not pending:
                del self._pending[g]
                names = [n for n in self.members[g] if n in self._last_round]
                self.touched.append(g)
                self.load({n: self[n] for n in names})
                for n in names:
                    self._free(n)
                loaded.append(g)
        self.loaded += loaded
        return loaded

    def finish(self) -> dict[tuple[int, str, int], int]:
        """After the last round: every group is loaded (or the plan was wrong); the sums VERIFY checks."""
        if self._by_round or self._pending:
            left = sorted(self._pending) or sorted(b for bs in self._by_round.values() for b in bs)
            raise RuntimeError(f"bounded staging: {len(left)} group(s) never completed, e.g. {left[0]!r}")
        return dict(self.sums)

    def release(self) -> None:
        """Drop whatever an update left (an aborted one): the pool is free again."""
        for n in list(self._held):
            self._free(n)

    def _sum(self, names: list[str]) -> None:
        keys = [k for n in names for k in self._verify.get(n, ())]
        if not keys:
            return
        layout_pieces = {(n, i): p for n in names for i, p in enumerate(self.descs[n].pieces)}
        boxes = [(layout_pieces[k].view(self[k[0]]), layout_pieces[k].box.offset, self.shapes[layout_pieces[k].tensor])
                 for k in keys]
        for (bname, i), c in zip(keys, box_checksums(boxes)):
            self.sums[(self.rank, bname, i)] = c

    # -- the mapping the data plane uses ------------------------------------------------------
    def __getitem__(self, name: str) -> torch.Tensor:
        held = self._held.get(name)
        if held is not None:
            return held[0]
        desc = self.descs[name]  # KeyError for a buffer this rank does not have
        if name not in self._last_round:
            raise KeyError(f"buffer {name!r} is not carried by this bounded update")
        dtype = dtype_of(desc.dtype)
        nbytes = desc.numel * dtype.itemsize
        start = self._space.take(nbytes) if self._pool is not None else None
        if start is None:
            t = torch.zeros(desc.shape, dtype=dtype, device=self.device)
            self.overflow_bytes += nbytes
            if not self._warned:
                self._warned = True
                log.warning("bounded staging: buffer %r (%.2f MiB) does not fit the %.2f MiB pool beside what is held: "
                            "it takes space of its own (raise the pool size to avoid this)", name, nbytes / 2**20,
                            self.pool_bytes / 2**20)
        else:
            t = self._pool[start:start + nbytes].view(dtype).view(desc.shape)
            t.zero_()
        self._held[name] = (t, start)
        self.high_water = max(self.high_water, self.held_bytes)
        return t

    @property
    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t, _ in self._held.values())

    def _free(self, name: str) -> None:
        t, start = self._held.pop(name)
        if start is not None:
            self._space.give(start, t.numel() * t.element_size())

    def __iter__(self) -> Iterator[str]:
        return iter(self.descs)

    def __len__(self) -> int:
        return len(self.descs)

    def __contains__(self, name: object) -> bool:
        return name in self.descs
