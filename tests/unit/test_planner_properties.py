"""Property-based tests of the planner on random layouts, plus focused validation tests.

Every expectation here is built from how the test itself constructed the layouts
(slicing the canonical tensors by the boxes it chose), never from plan segments;
the plan is only read to check its structural properties (exactly-once writes,
matched rounds, balance, determinism). Two regression tests pin defects found
by these properties: an unaligned bucket_bytes must still bound staged bytes, and a
half-direct message (staged send, direct receive) posts the same size on both ends.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter, defaultdict

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from reshard.common.dataplane.engine import Engine, StagingPool, execute_in_memory
from reshard.common.layout.core import Box, Layout, LayoutError, LocalBuffer, Piece, TensorSpec, dtype_of, itemsize
from reshard.common.layout.wire import layout_bytes, layout_from_bytes
from reshard.common.plan.planner import ALIGN, PlanOptions, make_plan

from .loopback import Loopback

FLOAT_DTYPES = ("float32", "bfloat16")
SRC_GARBAGE = -4096.0  # fills undeclared gap rows of source buffers (never a canonical value)


# --------------------------------------------------------------------------------------------
# Scenario construction (hypothesis strategies)
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class BufDesc:
    """How the test itself laid out one local buffer: pieces stacked on dim 0."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    items: list[tuple[str, Box, int]]  # (tensor, canonical box, first row in the buffer)
    pad_rows: int = 0  # declared padding rows at the end (destination only)

    @property
    def data_rows(self) -> int:
        return self.shape[0] - self.pad_rows


@dataclasses.dataclass
class Scenario:
    specs: dict[str, TensorSpec]
    src: Layout
    dst: Layout
    src_desc: list[list[BufDesc]]
    dst_desc: list[list[BufDesc]]
    seed: int


@st.composite
def tensor_specs(draw, max_tensors: int = 3) -> dict[str, TensorSpec]:
    n = draw(st.integers(1, max_tensors))
    specs = {}
    for i in range(n):
        ndim = draw(st.integers(1, 3))
        # Trailing dims from a small set so that pieces of different tensors can share them (fusion).
        trail = tuple(draw(st.sampled_from([1, 2, 3, 5, 8, 24])) for _ in range(ndim - 1))
        rows = draw(st.one_of(st.integers(1, 12), st.integers(32, 96), st.integers(500, 3000)))
        shape = (min(rows, max(1, 20000 // math.prod(trail))), *trail)  # at most ~80 KB
        specs[f"t{i}"] = TensorSpec(f"t{i}", shape, draw(st.sampled_from(FLOAT_DTYPES)))
    return specs


def draw_split(draw, shape: tuple[int, ...], max_cuts: int = 4) -> list[Box]:
    """Split `shape` on a random axis into random, uneven, contiguous chunks."""
    axis = draw(st.integers(0, len(shape) - 1))
    extent = shape[axis]
    cuts = sorted(draw(st.sets(st.integers(1, extent - 1), max_size=min(max_cuts, extent - 1)))) if extent > 1 else []
    bounds = [0, *cuts, extent]
    boxes = []
    for lo, hi in zip(bounds, bounds[1:]):
        off = tuple(lo if d == axis else 0 for d in range(len(shape)))
        size = tuple(hi - lo if d == axis else s for d, s in enumerate(shape))
        boxes.append(Box(off, size))
    return boxes


def draw_holders(draw, world: int) -> list[int]:
    """A non-empty set of ranks holding one box (replication when more than one)."""
    return sorted(draw(st.sets(st.integers(0, world - 1), min_size=1, max_size=world)))


def draw_buffers(draw, items: list[tuple[str, Box]], specs: dict[str, TensorSpec], side: str) -> list[BufDesc]:
    """Group one rank's pieces into buffers, fusing along dim 0 when dtype and trailing dims match.

    Source buffers may have undeclared gap rows before a piece (sources need not be
    full); destination buffers may end in declared padding rows."""
    if not items:
        return []
    order = draw(st.permutations(list(range(len(items)))))
    items = [items[i] for i in order]
    groups: list[list[tuple[str, Box]]] = []
    for t, box in items:
        if groups:
            pt, pbox = groups[-1][-1]
            same = specs[pt].dtype == specs[t].dtype and pbox.size[1:] == box.size[1:] and pbox.ndim == box.ndim
            if same and draw(st.booleans()):
                groups[-1].append((t, box))
                continue
        groups.append([(t, box)])
    out = []
    for gi, group in enumerate(groups):
        row, placed = 0, []
        for t, box in group:
            if side == "src":
                row += draw(st.integers(0, 2))  # undeclared gap rows (garbage)
            placed.append((t, box, row))
            row += box.size[0]
        pad = draw(st.integers(0, 3)) if side == "dst" else draw(st.integers(0, 1))
        trail = group[0][1].size[1:]
        out.append(BufDesc(f"{side}buf{gi}", (row + pad, *trail), specs[group[0][0]].dtype, placed,
                           pad if side == "dst" else 0))
    return out


def to_layout(specs: dict[str, TensorSpec], desc: list[list[BufDesc]]) -> Layout:
    ranks = []
    for bufs in desc:
        lbs = []
        for b in bufs:
            pieces = tuple(
                Piece(t, Box((row, *(0 for _ in box.size[1:])), box.size), box) for t, box, row in b.items
            )
            padding = ()
            if b.pad_rows:
                padding = (Box((b.data_rows, *(0 for _ in b.shape[1:])), (b.pad_rows, *b.shape[1:])),)
            lbs.append(LocalBuffer(b.name, b.shape, b.dtype, pieces, padding))
        ranks.append(tuple(lbs))
    return Layout(dict(specs), tuple(ranks))


def draw_side(draw, specs: dict[str, TensorSpec], world: int, side: str) -> list[list[BufDesc]]:
    per_rank: list[list[tuple[str, Box]]] = [[] for _ in range(world)]
    for name, spec in specs.items():
        for box in draw_split(draw, spec.shape):
            for r in draw_holders(draw, world):
                per_rank[r].append((name, box))
    return [draw_buffers(draw, items, specs, side) for items in per_rank]


@st.composite
def plan_options(draw) -> PlanOptions:
    bucket = draw(st.one_of(st.integers(64, 160).map(lambda k: 64 * k), st.integers(4096, 10240)))
    direct = draw(st.one_of(st.just(1 << 30), st.sampled_from([1, 64, 4096]), st.integers(1, 65536)))
    max_msg = bucket + draw(st.integers(0, 3 * bucket))
    staging = draw(st.one_of(st.just(0), st.sampled_from([4, 5, 8]).map(lambda k: k * bucket)))
    shared = draw(st.sampled_from([0, 1]))  # 1: relay every buffer that ranks of different classes share
    return PlanOptions(bucket_bytes=bucket, direct_min_bytes=direct, max_message_bytes=max_msg, staging_bytes=staging,
                       shared_relay_min_bytes=shared)


def check_staging(plan, opts: PlanOptions) -> None:
    """A rank's staged bytes in one round fit half its staging limit (the engine double-buffers)."""
    for (side, rank), ms in _endpoints(plan).items():
        per_round: dict[int, int] = defaultdict(int)
        for m in ms:
            sending = side == "s" or (m.relay and m.src == rank)
            if not (m.send_direct if sending else m.recv_direct):
                per_round[m.round] += m.staged_bytes
        if opts.bucket_bytes % ALIGN == 0:
            assert max(per_round.values(), default=0) <= opts.staging_limit // 2, (side, rank, dict(per_round))


@st.composite
def scenarios(draw) -> Scenario:
    specs = draw(tensor_specs())
    src_world = draw(st.integers(1, 4))
    dst_world = draw(st.integers(1, 4))
    src_desc = draw_side(draw, specs, src_world, "src")
    dst_desc = draw_side(draw, specs, dst_world, "dst")
    seed = draw(st.integers(0, 2**31 - 1))
    return Scenario(specs, to_layout(specs, src_desc), to_layout(specs, dst_desc), src_desc, dst_desc, seed)


# --------------------------------------------------------------------------------------------
# Buffers and expectations, by slicing
# --------------------------------------------------------------------------------------------


def canonical_tensors(specs: dict[str, TensorSpec], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s.shape, generator=g).to(dtype_of(s.dtype)) for n, s in specs.items()}


def source_buffers(sc: Scenario, full: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    out = []
    for bufs in sc.src_desc:
        d = {}
        for b in bufs:
            t = torch.full(b.shape, SRC_GARBAGE, dtype=dtype_of(b.dtype))
            for name, box, row in b.items:
                t[row : row + box.size[0]] = full[name][box.slices()]
            d[b.name] = t
        out.append(d)
    return out


def nan_buffers(desc: list[list[BufDesc]]) -> list[dict[str, torch.Tensor]]:
    return [{b.name: torch.full(b.shape, float("nan"), dtype=dtype_of(b.dtype)) for b in bufs} for bufs in desc]


def expected_data(b: BufDesc, full: dict[str, torch.Tensor]) -> torch.Tensor:
    """The non-padding rows of a destination buffer, by concatenating canonical slices."""
    return torch.cat([full[name][box.slices()] for name, box, _ in b.items], dim=0)


# --------------------------------------------------------------------------------------------
# Plan property checks (shared)
# --------------------------------------------------------------------------------------------


def check_exactly_once(plan, sc: Scenario) -> None:
    counts = {(r, b.name): torch.zeros(b.shape, dtype=torch.int32) for r, bufs in enumerate(sc.dst_desc) for b in bufs}
    for m in plan.messages:
        for s in m.segments:
            s.dst.view(counts[(m.dst, s.dst_buffer)], s.box.size).add_(1)
    for r, bufs in enumerate(sc.dst_desc):
        for b in bufs:
            c = counts[(r, b.name)]
            assert bool((c[: b.data_rows] == 1).all()), f"dst rank {r} buffer {b.name}: counts {c[: b.data_rows]}"
            assert bool((c[b.data_rows :] == 0).all()), f"dst rank {r} buffer {b.name}: padding written"


def _key(m):
    return (m.relay, m.src, m.dst, m.tag)


def _endpoints(plan):
    """Every rank's operations, by session endpoint: a source rank sends; a destination rank
    receives and forwards relays to its replicas."""
    ops = {("s", r): list(plan.sends.get(r, [])) for r in range(plan.src_world)}
    for r in range(plan.dst_world):
        ops[("d", r)] = list(plan.recvs.get(r, [])) + list(plan.relay_sends.get(r, []))
    return ops


def check_rounds(plan) -> None:
    keys = [_key(m) for m in plan.messages]
    assert len(set(keys)) == len(keys), "duplicate (relay, src, dst, tag)"
    sent = [m for ms in plan.sends.values() for m in ms] + [m for ms in plan.relay_sends.values() for m in ms]
    recv = [m for ms in plan.recvs.values() for m in ms]
    assert sorted(map(_key, sent)) == sorted(keys) == sorted(map(_key, recv))
    for m in plan.messages:
        assert m in (plan.relay_sends if m.relay else plan.sends)[m.src] and m in plan.recvs[m.dst]
    for side in (plan.sends, plan.recvs, plan.relay_sends):
        for rank, ms in side.items():
            rounds = [m.round for m in ms]
            assert rounds == sorted(rounds), f"rank {rank}: rounds out of order {rounds}"
            assert all((m.src if side is not plan.recvs else m.dst) == rank for m in ms)
    check_relays_forward_what_arrived(plan)
    assert plan.num_rounds == max((m.round + 1 for m in plan.messages), default=0)
    simulate_rounds(plan)


def check_relays_forward_what_arrived(plan) -> None:
    """Every element a relay sends in round t landed on the relaying rank in a round before t."""
    if not plan.relay_sends:
        return
    arrived: dict = {}

    def stamp(rank, seg):
        n = seg.dst.start + 1 + sum((d - 1) * st for d, st in zip(seg.box.size, seg.dst.strides))
        t = arrived.setdefault((rank, seg.dst.buffer), torch.full((max(n, 1),), 1 << 30, dtype=torch.int64))
        if t.numel() < n:
            t = torch.cat([t, torch.full((n - t.numel(),), 1 << 30, dtype=torch.int64)])
            arrived[(rank, seg.dst.buffer)] = t
        return t

    for m in sorted(plan.messages, key=lambda m: m.round):
        for seg in m.segments:
            stamp(m.dst, seg)
            seg.dst.view(arrived[(m.dst, seg.dst.buffer)], seg.box.size).fill_(m.round)
    for r, ms in plan.relay_sends.items():
        for m in ms:
            for seg in m.segments:
                got = seg.src.view(arrived[(r, seg.src.buffer)], seg.box.size)
                assert bool((got < m.round).all()), f"rank {r} relays in round {m.round} bytes that arrive later"


def simulate_rounds(plan) -> None:
    """Run the engine's protocol abstractly: a rank posts every op of its current round and
    moves on only when all of them completed; an op completes when both ends posted it."""
    ops = _endpoints(plan)
    rounds = {key: sorted({m.round for m in ms}) for key, ms in ops.items()}
    pos = {key: 0 for key in rounds}
    done: set = set()

    def current(key):
        rs = rounds[key]
        return rs[pos[key]] if pos[key] < len(rs) else None

    progress = True
    while progress:
        progress = False
        for m in plan.messages:
            k = _key(m)
            sender = ("d" if m.relay else "s", m.src)
            if k not in done and current(sender) == m.round and current(("d", m.dst)) == m.round:
                done.add(k)
                progress = True
        for key, ms in ops.items():
            cur = current(key)
            if cur is not None and all(_key(m) in done for m in ms if m.round == cur):
                pos[key] += 1
                progress = True
    assert len(done) == len(plan.messages), "the round schedule deadlocks"


def check_sizes(plan, opts: PlanOptions) -> None:
    pairs: dict[tuple[bool, int, int, int], list] = defaultdict(list)
    for m in plan.messages:
        pairs[(m.relay, m.src, m.dst, m.round)].append(m)  # a relay pair is two inference ranks
        assert m.nbytes == sum(s.nbytes for s in m.segments)
        assert m.nbytes <= opts.max_message_bytes
        if m.send_direct or m.recv_direct:
            assert len(m.segments) == 1
        if not (m.send_direct and m.recv_direct):
            assert m.nbytes <= opts.bucket_bytes
            if opts.bucket_bytes % ALIGN == 0:  # see test_staged_bytes_bound_with_unaligned_bucket
                assert m.staged_bytes <= opts.bucket_bytes
    for ms in pairs.values():
        if len(ms) > 1:
            staged = sum(m.staged_bytes for m in ms if not (m.send_direct and m.recv_direct))
            if opts.bucket_bytes % ALIGN == 0:
                assert staged <= opts.bucket_bytes
            assert sum(m.nbytes for m in ms) <= opts.max_message_bytes


# --------------------------------------------------------------------------------------------
# 1-3. Random layouts: exact values, exactly-once, matched rounds
# --------------------------------------------------------------------------------------------


@given(sc=scenarios(), opts=plan_options())
def test_random_layouts_exact(sc: Scenario, opts: PlanOptions):
    plan = make_plan(sc.src, sc.dst, opts)
    full = canonical_tensors(sc.specs, sc.seed)
    sbufs = source_buffers(sc, full)
    dbufs = nan_buffers(sc.dst_desc)
    execute_in_memory(plan, sbufs, dbufs)
    for r, bufs in enumerate(sc.dst_desc):
        for b in bufs:
            got = dbufs[r][b.name]
            assert torch.equal(got[: b.data_rows], expected_data(b, full)), f"dst rank {r} buffer {b.name}"
            assert bool(torch.isnan(got[b.data_rows :].float()).all()), f"dst rank {r} {b.name}: padding touched"
    # Sources are read-only.
    assert all(torch.equal(a[k], b[k]) for a, b in zip(sbufs, source_buffers(sc, full)) for k in a)
    payload = sum(b.data_rows * math.prod(b.shape[1:]) * itemsize(b.dtype) for bufs in sc.dst_desc for b in bufs)
    assert plan.total_bytes == payload


@given(sc=scenarios(), opts=plan_options())
def test_random_layouts_exactly_once_and_rounds(sc: Scenario, opts: PlanOptions):
    plan = make_plan(sc.src, sc.dst, opts)
    check_exactly_once(plan, sc)
    check_rounds(plan)
    check_sizes(plan, opts)
    check_staging(plan, opts)


@given(sc=scenarios(), opts=plan_options(), data=st.data())
def test_tensor_subset_moves_only_those(sc: Scenario, opts: PlanOptions, data):
    chosen = set(data.draw(st.sets(st.sampled_from(sorted(sc.specs)), min_size=1)))
    plan = make_plan(sc.src, sc.dst, opts, tensors=chosen)
    assert {s.tensor for m in plan.messages for s in m.segments} <= chosen
    full = canonical_tensors(sc.specs, sc.seed)
    dbufs = nan_buffers(sc.dst_desc)
    execute_in_memory(plan, source_buffers(sc, full), dbufs)
    for r, bufs in enumerate(sc.dst_desc):
        for b in bufs:
            got = dbufs[r][b.name]
            for name, box, row in b.items:
                part = got[row : row + box.size[0]]
                if name in chosen:
                    assert torch.equal(part, full[name][box.slices()])
                else:
                    assert bool(torch.isnan(part.float()).all())


# --------------------------------------------------------------------------------------------
# 4. Balance over replicated sources
# --------------------------------------------------------------------------------------------


@st.composite
def replicated_scenarios(draw) -> tuple[Scenario, int]:
    specs = draw(tensor_specs(max_tensors=2))
    k = draw(st.integers(2, 4))
    dst_world = draw(st.integers(1, 4))
    # Every source rank holds every tensor in full (possibly fused with others).
    src_desc = [draw_buffers(draw, [(n, Box.full(s.shape)) for n, s in specs.items()], specs, "src") for _ in range(k)]
    per_rank: list[list[tuple[str, Box]]] = [[] for _ in range(dst_world)]
    largest = 0
    for name, spec in specs.items():
        for box in draw_split(draw, spec.shape, max_cuts=10):
            largest = max(largest, box.numel * itemsize(spec.dtype))
            for r in draw_holders(draw, dst_world):
                per_rank[r].append((name, box))
    dst_desc = [draw_buffers(draw, items, specs, "dst") for items in per_rank]
    sc = Scenario(specs, to_layout(specs, src_desc), to_layout(specs, dst_desc), src_desc, dst_desc, 0)
    return sc, largest


@given(case=replicated_scenarios())
def test_replicated_sources_are_balanced(case):
    sc, largest = case
    plan = make_plan(sc.src, sc.dst)  # default buckets: every destination piece is one segment
    # (relays between identical destination ranks carry whole buffers: not source segments)
    assert max(s.nbytes for m in plan.messages if not m.relay for s in m.segments) == largest
    sent = [plan.send_bytes(r) for r in range(sc.src.world)]
    assert max(sent) - min(sent) <= largest, sent
    check_exactly_once(plan, sc)


# --------------------------------------------------------------------------------------------
# 5. Determinism
# --------------------------------------------------------------------------------------------


@given(sc=scenarios(), opts=plan_options())
def test_digest_deterministic(sc: Scenario, opts: PlanOptions):
    a = make_plan(sc.src, sc.dst, opts)
    b = make_plan(layout_from_bytes(layout_bytes(sc.src)), layout_from_bytes(layout_bytes(sc.dst)), opts)
    assert a.digest == b.digest
    assert a.messages == b.messages
    # A different destination layout: one more padding row at the end of one buffer.
    r = next(i for i, bufs in enumerate(sc.dst_desc) if bufs)
    desc = [list(bufs) for bufs in sc.dst_desc]
    b0 = desc[r][0]
    desc[r][0] = dataclasses.replace(b0, shape=(b0.shape[0] + 1, *b0.shape[1:]), pad_rows=b0.pad_rows + 1)
    other = make_plan(sc.src, to_layout(sc.specs, desc), opts)
    assert other.digest != a.digest


# --------------------------------------------------------------------------------------------
# Staged-bytes bound (documented on PlanOptions.bucket_bytes)
# --------------------------------------------------------------------------------------------


def _one(name: str, shape, dtype: str = "float32", box: Box | None = None, region_shape=None) -> LocalBuffer:
    box = box or Box.full(shape)
    bshape = tuple(region_shape or box.size)
    return LocalBuffer(name, bshape, dtype, (Piece(name, Box.full(box.size), box),))


def test_staged_bytes_bound_with_unaligned_bucket():
    specs = {"w": TensorSpec("w", (2000,), "float32")}
    lay = Layout(specs, ((_one("w", (2000,)),),))
    opts = PlanOptions(bucket_bytes=4100, direct_min_bytes=1 << 30, max_message_bytes=8200)
    plan = make_plan(lay, lay, opts)
    # PlanOptions.bucket_bytes: "Upper bound on the staged bytes of one message".
    assert max(m.staged_bytes for m in plan.messages) <= opts.bucket_bytes




def test_engine_half_direct_message_sizes_match():
    specs = {"w": TensorSpec("w", (3, 7), "float32")}
    # The source holds w in the first 7 of 8 columns (non-contiguous); the destination holds it whole.
    src = Layout(specs, ((LocalBuffer("s", (3, 8), "float32", (Piece("w", Box((0, 0), (3, 7)), Box.full((3, 7))),)),),))
    dst = Layout(specs, ((_one("w", (3, 7)),),))
    plan = make_plan(src, dst, PlanOptions(direct_min_bytes=64))
    [m] = plan.messages
    assert (m.send_direct, m.recv_direct, m.nbytes, m.staged_bytes) == (False, True, 84, 128)
    full = torch.arange(21, dtype=torch.float32).view(3, 7)
    sbuf = torch.full((3, 8), SRC_GARBAGE)
    sbuf[:, :7] = full
    dbuf = torch.full((3, 7), float("nan"))
    wire: dict = {}
    deadline = time.monotonic() + 30
    Engine(Loopback(0, wire), plan, "src", 0, {"s": sbuf}, {"w": (3, 7)}, StagingPool(), deadline).run()
    Engine(Loopback(1, wire), plan, "dst", 0, {"w": dbuf}, {"w": (3, 7)}, StagingPool(), deadline).run()
    assert torch.equal(dbuf, full)


# --------------------------------------------------------------------------------------------
# 6. Validation errors
# --------------------------------------------------------------------------------------------


def _lay(specs: dict[str, TensorSpec], *ranks: tuple[LocalBuffer, ...]) -> Layout:
    return Layout(specs, tuple(tuple(r) for r in ranks))


W = {"w": TensorSpec("w", (8, 4), "float32")}
FULL_W = _lay(W, (_one("w", (8, 4)),))


def test_error_source_coverage_gap():
    src = _lay(W, (_one("w", (8, 4), box=Box((0, 0), (4, 4))),))
    with pytest.raises(LayoutError, match=r"tensor 'w'.*covers only 16 of its 32 elements \(coverage gap\)"):
        make_plan(src, FULL_W)


def test_error_overlapping_pieces_in_one_buffer():
    two = {"a": TensorSpec("a", (4, 4), "float32"), "b": TensorSpec("b", (4, 4), "float32")}
    src = _lay(two, (_one("a", (4, 4)), _one("b", (4, 4))))
    fused = LocalBuffer("fused", (6, 4), "float32", (
        Piece("a", Box((0, 0), (4, 4)), Box((0, 0), (4, 4))),
        Piece("b", Box((2, 0), (4, 4)), Box((0, 0), (4, 4))),
    ))
    with pytest.raises(LayoutError, match=r"buffer 'fused': piece of 'b' at \[2:6, 0:4\] overlaps piece of 'a'"):
        make_plan(src, _lay(two, (fused,)))


def test_error_padding_overlaps_piece():
    buf = LocalBuffer("w", (9, 4), "float32", (Piece("w", Box((0, 0), (8, 4)), Box((0, 0), (8, 4))),),
                      (Box((7, 0), (2, 4)),))
    with pytest.raises(LayoutError, match=r"buffer 'w': (padding .* overlaps piece of 'w'|piece of 'w' .* overlaps padding)"):
        make_plan(FULL_W, _lay(W, (buf,)))


def test_error_destination_buffer_gap():
    # Rows 8..9 are neither a piece nor padding (only row 9 is declared padding).
    buf = LocalBuffer("w", (10, 4), "float32", (Piece("w", Box((0, 0), (8, 4)), Box((0, 0), (8, 4))),),
                      (Box((9, 0), (1, 4)),))
    with pytest.raises(LayoutError, match=r"destination rank 0 buffer 'w': 4 of 40 elements are neither a piece "
                                          r"nor declared padding \(coverage gap\)"):
        make_plan(FULL_W, _lay(W, (buf,)))


def test_error_shape_mismatch():
    w2 = {"w": TensorSpec("w", (8, 5), "float32")}
    with pytest.raises(LayoutError, match=r"tensor 'w': shape mismatch, source \[8, 4\] vs destination \[8, 5\]"):
        make_plan(FULL_W, _lay(w2, (_one("w", (8, 5)),)))


def test_error_dtype_mismatch_between_layouts():
    wi = {"w": TensorSpec("w", (8, 4), "int8")}
    with pytest.raises(LayoutError, match=r"tensor 'w': dtype mismatch, source float32 vs destination int8: a float "
                                          r"\(float32\) into an integer \(int8\) loses its range"):
        make_plan(FULL_W, _lay(wi, (_one("w", (8, 4), "int8"),)))


def test_error_dtype_mismatch_buffer_without_cast():
    with pytest.raises(LayoutError, match=r"tensor 'w': destination rank 0 buffer 'w' holds it as bfloat16 .*dtype mismatch"):
        make_plan(FULL_W, _lay(W, (_one("w", (8, 4), "bfloat16"),)))


def test_error_unknown_tensor_name():
    both = {**W, "x": TensorSpec("x", (2, 4), "float32")}
    with pytest.raises(LayoutError, match=r"tensor 'x': the destination needs it but the source layout has no such "
                                          r"tensor \(unknown name\)"):
        make_plan(FULL_W, _lay(both, (_one("w", (8, 4)), _one("x", (2, 4)))))


def test_error_piece_names_tensor_missing_from_its_layout():
    """The validator names the undeclared tensor however the layout reached it: written by hand,
    decoded from the wire, or merged from rank layouts (the columns keep undeclared names)."""
    from reshard.common.layout.core import merge_ranks

    bad = LocalBuffer("y", (2, 4), "float32", (Piece("y", Box((0, 0), (2, 4)), Box((0, 0), (2, 4))),))
    lay = _lay(W, (_one("w", (8, 4)), bad))
    back = layout_from_bytes(layout_bytes(lay))
    merged = merge_ranks([_lay(W, (_one("w", (8, 4)),)), back], [0, 0, 1])
    assert back.ranks[0][1] == bad and merged.ranks[2][1] == bad
    for layout in (lay, back, merged):
        with pytest.raises(LayoutError, match=r"piece names unknown tensor 'y'"):
            make_plan(FULL_W, layout)


@pytest.mark.parametrize("side", ["src", "dst"])
def test_error_box_outside_tensor(side):
    outside = _lay(W, (_one("w", (8, 4), box=Box((4, 0), (6, 4))),))
    src, dst = (outside, FULL_W) if side == "src" else (FULL_W, outside)
    where = "source" if side == "src" else "destination"
    with pytest.raises(LayoutError, match=rf"tensor 'w': {where} rank 0 buffer 'w' names box \[4:10, 0:4\] outside "
                                          r"the tensor shape \[8, 4\]"):
        make_plan(src, dst)


def test_error_source_boxes_partially_overlap():
    src = _lay(W, (_one("w", (8, 4), box=Box((0, 0), (5, 4))),), (_one("w", (8, 4), box=Box((3, 0), (5, 4))),))
    with pytest.raises(LayoutError, match=r"tensor 'w': source boxes .* overlap without being identical replicas"):
        make_plan(src, FULL_W)


def test_error_region_and_box_differ():
    buf = LocalBuffer("w", (8, 4), "float32", (Piece("w", Box((0, 0), (8, 4)), Box((0, 0), (4, 4))),))
    with pytest.raises(LayoutError, match=r"piece of 'w' region \[0:8, 0:4\] and box \[0:4, 0:4\] differ in shape"):
        make_plan(FULL_W, _lay(W, (buf,)))


def test_tiny_bucket_rejected():
    with pytest.raises(ValueError, match="bucket_bytes=4095 is too small"):
        PlanOptions(bucket_bytes=4095)


def test_generator_covers_fusion_padding_gaps_replication():
    """The generator does produce fused buffers, replication, padding and gaps (a guard on the tests)."""
    seen = Counter()

    @given(sc=scenarios())
    def probe(sc):
        for bufs in sc.dst_desc:
            for b in bufs:
                seen["fused"] += len(b.items) > 1
                seen["padding"] += b.pad_rows > 0
        for bufs in sc.src_desc:
            for b in bufs:
                seen["gap"] += b.items[0][2] > 0 or b.shape[0] > sum(x[1].size[0] for x in b.items)
        boxes = Counter((t, box) for bufs in sc.src_desc for b in bufs for t, box, _ in b.items)
        seen["replicated"] += any(c > 1 for c in boxes.values())

    probe()
    assert all(seen[k] > 0 for k in ("fused", "padding", "gap", "replicated")), seen


@pytest.mark.parametrize("replicas", [2, 3, 5])
def test_relay_chain_with_many_replicas(replicas):
    """Replicas of one shard: the source sends each byte once, every replica's link carries it
    at most once, relays only forward what already arrived, and every replica ends exact."""
    specs = {"a": TensorSpec("a", (64, 33), "float32"), "b": TensorSpec("b", (40,), "float32")}
    src = Layout(specs, (tuple(_one(n, s.shape) for n, s in specs.items()),))
    rank = (
        LocalBuffer("fused", (64 + 8, 33), "float32", (Piece("a", Box((0, 0), (64, 33)), Box.full((64, 33))),),
                    (Box((64, 0), (8, 33)),)),
        _one("b", (40,)),
    )
    dst = Layout(specs, tuple(rank for _ in range(replicas)))
    plan = make_plan(src, dst, PlanOptions(bucket_bytes=4096, direct_min_bytes=512, max_message_bytes=4096))
    check_rounds(plan)
    payload = sum(s.nbytes for s in specs.values())
    assert plan.source_bytes == payload
    assert sorted(plan.primary_of) == list(range(1, replicas))
    for r in range(replicas):
        assert sum(m.nbytes for m in plan.relay_sends.get(r, [])) <= payload
    full = {n: torch.randn(s.shape) for n, s in specs.items()}
    got = [{"fused": torch.full((72, 33), float("nan")), "b": torch.full((40,), float("nan"))} for _ in range(replicas)]
    execute_in_memory(plan, [{n: t.clone() for n, t in full.items()}], got)
    for g in got:
        assert torch.equal(g["fused"][:64], full["a"]) and torch.isnan(g["fused"][64:]).all()
        assert torch.equal(g["b"], full["b"])


@given(data=st.data())
def test_next_fit_paths_agree(data):
    """The planner's bin packing has a per-item path and a per-bin vectorized one: same bins."""
    import numpy as np

    from reshard.common.plan.planner import _next_fit

    n = data.draw(st.integers(1, 300))
    group = np.sort(np.array(data.draw(st.lists(st.integers(0, 6), min_size=n, max_size=n)), dtype=np.int64))
    w1 = np.array(data.draw(st.lists(st.integers(0, 100), min_size=n, max_size=n)), dtype=np.int64)
    w2 = np.array(data.draw(st.lists(st.integers(1, 100), min_size=n, max_size=n)), dtype=np.int64)
    weights = [(w1, 150), (w2, 120)]
    a = _next_fit(group, weights, vectorized=False)
    b = _next_fit(group, weights, vectorized=True)
    assert a.tolist() == b.tolist()
    # Independent check: bins restart per group, stay within caps unless an item is alone.
    for gv in set(group.tolist()):
        idx = np.flatnonzero(group == gv)
        assert a[idx[0]] == 0 and (np.diff(a[idx]) >= 0).all() and (np.diff(a[idx]) <= 1).all()
        for bnum in set(a[idx].tolist()):
            members = idx[a[idx] == bnum]
            if len(members) > 1:
                assert w1[members].sum() <= 150 and w2[members].sum() <= 120


@given(data=st.data())
def test_replica_assignment_paths_agree(data):
    """Equal transfers are placed by a candidate table, or one at a time when the table would be
    huge: both are the greedy least-loaded choice, and it matches a plain greedy loop."""
    import numpy as np

    import reshard.common.plan.planner as planner

    world = data.draw(st.integers(2, 6))
    sets = [np.array(sorted(data.draw(st.sets(st.integers(0, world - 1), min_size=1, max_size=world))), dtype=np.int64)
            for _ in range(data.draw(st.integers(1, 3)))]
    n = data.draw(st.integers(1, 60))
    nbytes = np.array(data.draw(st.lists(st.sampled_from([64, 128, 4096]), min_size=n, max_size=n)), dtype=np.int64)
    hs = np.array(data.draw(st.lists(st.integers(0, len(sets) - 1), min_size=n, max_size=n)), dtype=np.int64)
    drank = np.array(data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)), dtype=np.int64)
    a = planner._assign(nbytes, hs, drank, sets, world)
    old = planner._WATERFILL_MAX
    planner._WATERFILL_MAX = 0
    try:
        b = planner._assign(nbytes, hs, drank, sets, world)
    finally:
        planner._WATERFILL_MAX = old
    assert a.tolist() == b.tolist()
    # Plain greedy, in the same order (largest first, then holder set, destination, index).
    load = [0] * world
    want = [0] * n
    for i in sorted(range(n), key=lambda i: (-nbytes[i], hs[i], drank[i], i)):
        h = sets[hs[i]].tolist()
        r = min(h, key=lambda x: (load[x], h.index(x)))
        want[i] = r
        load[r] += int(nbytes[i])
    assert a.tolist() == want


def test_rounds_staggered_to_bound_staging():
    """Eight sources of one destination, staging for two peers per round: the destination
    receives from at most two per round, the result is exact and the schedule cannot deadlock."""
    spec = {"w": TensorSpec("w", (8, 1024), "float32")}
    src = Layout(spec, tuple((LocalBuffer("w", (1, 1024), "float32", (Piece("w", Box((0, 0), (1, 1024)), Box((r, 0), (1, 1024))),)),)
                             for r in range(8)))
    dst = Layout(spec, ((LocalBuffer("w", (8, 1024), "float32", (Piece("w", Box((0, 0), (8, 1024)), Box((0, 0), (8, 1024))),)),),))
    opts = PlanOptions(bucket_bytes=4096, direct_min_bytes=1 << 30, max_message_bytes=4096, staging_bytes=4 * 4096)
    plan = make_plan(src, dst, opts)
    per_round = defaultdict(set)
    for m in plan.messages:
        per_round[m.round].add(m.src)
    assert max(len(v) for v in per_round.values()) == 2 and len(per_round) == 4
    check_rounds(plan)
    check_staging(plan, opts)
    full = torch.arange(8 * 1024, dtype=torch.float32).reshape(8, 1024)
    out = {"w": torch.zeros(8, 1024)}
    execute_in_memory(plan, [{"w": full[r:r + 1].clone()} for r in range(8)], [out])
    assert torch.equal(out["w"], full)
    with pytest.raises(ValueError, match="staging_bytes=8192 must be at least 4 \\* bucket_bytes"):
        PlanOptions(bucket_bytes=4096, staging_bytes=8192)
