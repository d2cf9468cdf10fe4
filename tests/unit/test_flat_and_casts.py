"""Flat (FSDP1-style) pieces and declared dtype casts.

As in test_planner_properties, every expectation is built from how the test
itself laid the buffers out: flat buffers are filled and checked by the test's
own flattening (torch.cat of the flattened canonical tensors, then a slice of
the range), boxed buffers by slicing the canonical tensors with the boxes the
test chose. Plans are read only for structural properties (exactly-once
writes, no direct send of a cast segment, non-contiguous destination sides).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter, defaultdict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.common.dataplane.checksum import P
from reshard.common.dataplane.engine import Engine, StagingPool, execute_in_memory, receiver_checksums
from reshard.common.layout.core import (
    Box,
    Layout,
    LayoutError,
    LocalBuffer,
    Piece,
    TensorSpec,
    dtype_of,
    flat_pieces,
    flat_range_to_boxes,
    itemsize,
)
from reshard.common.layout.wire import layout_bytes, layout_fingerprint, layout_from_bytes
from reshard.common.plan import verify
from reshard.common.plan.planner import PlanOptions, make_plan

from .loopback import Loopback

FLOAT_DTYPES = ("float32", "bfloat16")
GARBAGE = -4096.0  # undeclared gaps of source buffers (never a canonical value)
DIRECTIONS = ("flat->boxed", "boxed->flat", "flat->flat")


# --------------------------------------------------------------------------------------------
# 1. flat_range_to_boxes (pure)
# --------------------------------------------------------------------------------------------


@st.composite
def shapes_and_ranges(draw):
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.integers(1, 5)) for _ in range(ndim))
    n = math.prod(shape)
    a, b = draw(st.integers(0, n)), draw(st.integers(0, n))
    return shape, min(a, b), max(a, b)


def check_flat_boxes(shape: tuple[int, ...], start: int, end: int) -> list[Box]:
    boxes = flat_range_to_boxes(start, end, shape)
    idx = torch.arange(math.prod(shape)).view(shape)
    seen = torch.zeros(math.prod(shape), dtype=torch.int32)
    pos = start
    for b in boxes:
        assert b.ndim == len(shape) and b.within(shape) and b.numel > 0, (shape, start, end, b)
        run = idx[b.slices()].reshape(-1)
        # Contiguous in the tensor, and it continues exactly where the previous box ended (row-major order).
        assert torch.equal(run, torch.arange(pos, pos + b.numel)), (shape, start, end, [str(x) for x in boxes])
        assert b.contiguous_range(shape) == (pos, b.numel)
        seen[run] += 1
        pos += b.numel
    assert pos == end, (shape, start, end, [str(x) for x in boxes])
    # Disjoint and together exactly range(start, end).
    want = torch.zeros_like(seen)
    want[start:end] = 1
    assert torch.equal(seen, want)
    assert len(boxes) <= max(1, 2 * len(shape) - 1)
    return boxes


@given(case=shapes_and_ranges())
def test_flat_range_to_boxes_random(case):
    check_flat_boxes(*case)


@pytest.mark.parametrize(
    "shape, start, end, count",
    [
        ((3, 3, 3), 4, 23, 5),  # worst case for 3 dims: partial, rows, full slab, rows, partial
        ((3, 3, 4, 5), 1, 179, 7),  # worst case for 4 dims
        ((5, 7), 10, 30, 3),
        ((5, 7), 7, 28, 1),  # whole rows: one box
        ((5, 7), 0, 35, 1),
        ((5, 7), 8, 12, 1),  # inside one row
        ((5, 7), 3, 3, 0),
        ((9,), 2, 7, 1),
    ],
)
def test_flat_range_to_boxes_examples(shape, start, end, count):
    assert len(check_flat_boxes(shape, start, end)) == count


# --------------------------------------------------------------------------------------------
# Scenario construction: flat sides (FSDP1) and boxed sides
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class FlatSide:
    """One flat parameter space: tensors concatenated in `order`, `pad` elements at the end,
    rank r holding the range bounds[r % len(bounds)] in one 1-D buffer named 'flat' (more than
    len(bounds) ranks: HSDP, identical replica groups; sources only)."""

    order: list[str]
    offsets: dict[str, int]
    numel: int  # without padding
    pad: int
    bounds: list[tuple[int, int]]
    dtype: str
    declare_padding: bool
    replicas: int = 1

    kind = "flat"

    @property
    def world(self) -> int:
        return len(self.rank_bounds)

    @property
    def rank_bounds(self) -> list[tuple[int, int]]:
        return self.bounds * self.replicas

    def buffers(self, specs: dict[str, TensorSpec]) -> list[tuple[LocalBuffer, ...]]:
        ranks = []
        for lo, hi in self.rank_bounds:
            pieces: list[Piece] = []
            for t in self.order:
                o, n = self.offsets[t], specs[t].numel
                a, b = max(lo, o), min(hi, o + n)
                if a < b:
                    pieces += flat_pieces(t, specs[t].shape, a - o, b - o, a - lo)
            padding = ()
            a = max(lo, self.numel)
            if self.declare_padding and a < hi:
                padding = (Box((a - lo,), (hi - a,)),)
            ranks.append((LocalBuffer("flat", (hi - lo,), self.dtype, tuple(pieces), padding),))
        return ranks

    def _cat(self, values: dict[str, torch.Tensor], pad_value: float) -> torch.Tensor:
        dtype = dtype_of(self.dtype)
        parts = [values[t].reshape(-1).to(dtype) for t in self.order]
        return torch.cat(parts + [torch.full((self.pad,), pad_value, dtype=dtype)])

    def fill(self, values: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        flat = self._cat(values, GARBAGE)
        return [{"flat": flat[lo:hi].clone()} for lo, hi in self.rank_bounds]

    def expected(self, values: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        flat = self._cat(values, float("nan"))
        return [{"flat": flat[lo:hi].clone()} for lo, hi in self.rank_bounds]

    def data_masks(self) -> list[dict[str, torch.Tensor]]:
        out = []
        for lo, hi in self.rank_bounds:
            m = torch.zeros(hi - lo, dtype=torch.int32)
            m[: max(0, min(hi, self.numel) - lo)] = 1
            out.append({"flat": m})
        return out


@dataclasses.dataclass
class BoxedBuf:
    name: str
    shape: tuple[int, ...]
    items: list[tuple[str, Box, int]]  # (tensor, canonical box, first row)
    pad_rows: int  # declared padding rows at the end (destination)


@dataclasses.dataclass
class BoxedSide:
    ranks: list[list[BoxedBuf]]
    dtype: str

    kind = "boxed"

    @property
    def world(self) -> int:
        return len(self.ranks)

    def buffers(self, specs: dict[str, TensorSpec]) -> list[tuple[LocalBuffer, ...]]:
        out = []
        for bufs in self.ranks:
            lbs = []
            for b in bufs:
                pieces = tuple(Piece(t, Box((row, *(0 for _ in box.size[1:])), box.size), box) for t, box, row in b.items)
                padding = ()
                if b.pad_rows:
                    data = b.shape[0] - b.pad_rows
                    padding = (Box((data, *(0 for _ in b.shape[1:])), (b.pad_rows, *b.shape[1:])),)
                lbs.append(LocalBuffer(b.name, b.shape, self.dtype, pieces, padding))
            out.append(tuple(lbs))
        return out

    def _build(self, values: dict[str, torch.Tensor], background: float) -> list[dict[str, torch.Tensor]]:
        dtype = dtype_of(self.dtype)
        out = []
        for bufs in self.ranks:
            d = {}
            for b in bufs:
                t = torch.full(b.shape, background, dtype=dtype)
                for name, box, row in b.items:
                    t[row : row + box.size[0]] = values[name][box.slices()].to(dtype)
                d[b.name] = t
            out.append(d)
        return out

    def fill(self, values):
        return self._build(values, GARBAGE)

    def expected(self, values):
        return self._build(values, float("nan"))

    def data_masks(self) -> list[dict[str, torch.Tensor]]:
        out = []
        for bufs in self.ranks:
            d = {}
            for b in bufs:
                m = torch.zeros(b.shape, dtype=torch.int32)
                for _, box, row in b.items:
                    m[row : row + box.size[0]] = 1
                d[b.name] = m
            out.append(d)
        return out


@dataclasses.dataclass
class Scenario:
    specs: dict[str, TensorSpec]
    src_side: FlatSide | BoxedSide
    dst_side: FlatSide | BoxedSide
    src: Layout
    dst: Layout
    values: dict[str, torch.Tensor]  # canonical values, in the source buffers' dtype

    def expected_dst(self):
        return self.dst_side.expected(self.values)


@st.composite
def tensor_specs(draw, dtype: str) -> dict[str, TensorSpec]:
    n = draw(st.integers(1, 4))
    specs = {}
    for i in range(n):
        ndim = draw(st.integers(1, 3))
        trail = tuple(draw(st.sampled_from([1, 2, 3, 5, 8])) for _ in range(ndim - 1))
        rows = draw(st.one_of(st.integers(1, 6), st.integers(7, 40), st.integers(200, 1500)))
        shape = (min(rows, max(1, 2500 // math.prod(trail))), *trail)  # at most 2500 elements
        specs[f"t{i}"] = TensorSpec(f"t{i}", shape, dtype)
    return specs


@st.composite
def flat_sides(draw, specs: dict[str, TensorSpec], dtype: str, role: str) -> FlatSide:
    order = list(draw(st.permutations(sorted(specs))))
    offsets, pos = {}, 0
    for t in order:
        offsets[t] = pos
        pos += specs[t].numel
    n = pos
    world = draw(st.integers(1, 4))
    if draw(st.booleans()):  # FSDP1: pad to a multiple of the world, equal ranges
        per = -(-n // world)
        pad = per * world - n
        bounds = [(r * per, (r + 1) * per) for r in range(world)]
    else:  # uneven ranges, possibly empty
        pad = draw(st.integers(0, 5))
        # Any point, or a tensor boundary / an end (cuts then repeat: empty ranges).
        points = st.one_of(st.integers(0, n + pad), st.sampled_from(sorted({0, n, n + pad, *offsets.values()})))
        cuts = sorted(draw(st.lists(points, min_size=world - 1, max_size=world - 1)))
        edges = [0, *cuts, n + pad]
        bounds = list(zip(edges, edges[1:]))
    declare = True if role == "dst" else draw(st.booleans())
    replicas = 1 if role == "dst" or world > 2 else draw(st.integers(1, 2))
    return FlatSide(order, offsets, n, pad, bounds, dtype, declare, replicas)


@st.composite
def boxed_sides(draw, specs: dict[str, TensorSpec], dtype: str, role: str) -> BoxedSide:
    """Every tensor split into 1-3 chunks (mostly by rows, sometimes on another axis), each held
    by 1-2 ranks; a rank's pieces are one buffer each or fused along dim 0 (same trailing dims).
    Sources may have undeclared gap rows, destinations declared padding rows at the end."""
    world = draw(st.integers(1, 3))
    per_rank: list[list[tuple[str, Box]]] = [[] for _ in range(world)]
    for name, spec in specs.items():
        nd = len(spec.shape)
        axis = draw(st.one_of(st.just(0), st.integers(1, nd - 1))) if nd > 1 else 0
        extent = spec.shape[axis]
        k = draw(st.integers(1, min(3, extent)))
        cuts = sorted(draw(st.sets(st.integers(1, extent - 1), min_size=k - 1, max_size=k - 1))) if k > 1 else []
        edges = [0, *cuts, extent]
        for lo, hi in zip(edges, edges[1:]):
            box = Box(tuple(lo if d == axis else 0 for d in range(nd)),
                      tuple(hi - lo if d == axis else x for d, x in enumerate(spec.shape)))
            for r in sorted(draw(st.sets(st.integers(0, world - 1), min_size=1, max_size=min(2, world)))):
                per_rank[r].append((name, box))
    ranks = []
    for items in per_rank:
        items = [items[i] for i in draw(st.permutations(list(range(len(items)))))]
        groups: list[list[tuple[str, Box]]] = []
        for t, box in items:
            if groups:
                pbox = groups[-1][-1][1]
                if pbox.ndim == box.ndim and pbox.size[1:] == box.size[1:] and draw(st.booleans()):
                    groups[-1].append((t, box))
                    continue
            groups.append([(t, box)])
        bufs = []
        for gi, group in enumerate(groups):
            row, placed = 0, []
            for t, box in group:
                if role == "src":
                    row += draw(st.integers(0, 2))
                placed.append((t, box, row))
                row += box.size[0]
            pad = draw(st.integers(0, 2))
            bufs.append(BoxedBuf(f"{role}buf{gi}", (row + pad, *group[0][1].size[1:]), placed, pad if role == "dst" else 0))
        ranks.append(bufs)
    return BoxedSide(ranks, dtype)


def draw_side(draw, kind: str, specs, dtype: str, role: str):
    return draw(flat_sides(specs, dtype, role) if kind == "flat" else boxed_sides(specs, dtype, role))


@st.composite
def scenarios(draw, cast: str | None = None, directions=DIRECTIONS) -> Scenario:
    """cast=None: every buffer in the tensors' dtype. cast='src': bfloat16 tensors held as float32
    master weights on the source (allow_casts). cast='dst': the destination holds them as float32."""
    dtype = draw(st.sampled_from(FLOAT_DTYPES)) if cast is None else "bfloat16"
    specs = draw(tensor_specs(dtype))
    src_kind, dst_kind = draw(st.sampled_from(directions)).split("->")
    src_side = draw_side(draw, src_kind, specs, "float32" if cast == "src" else dtype, "src")
    dst_side = draw_side(draw, dst_kind, specs, "float32" if cast == "dst" else dtype, "dst")
    src = Layout(dict(specs), tuple(src_side.buffers(specs)), allow_casts=cast == "src")
    dst = Layout(dict(specs), tuple(dst_side.buffers(specs)), allow_casts=cast == "dst")
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    # float32 draws: on a float32 source they are not bfloat16-representable, so a cast really rounds.
    values = {n: torch.randn(s.shape, generator=g).to(dtype_of(src_side.dtype)) for n, s in specs.items()}
    return Scenario(specs, src_side, dst_side, src, dst, values)


@st.composite
def plan_options(draw) -> PlanOptions:
    bucket = draw(st.one_of(st.integers(64, 160).map(lambda k: 64 * k), st.integers(4096, 10240)))
    direct = draw(st.sampled_from([1, 64, 512, 4096, 1 << 30]))
    return PlanOptions(bucket_bytes=bucket, direct_min_bytes=direct, max_message_bytes=bucket + draw(st.integers(0, 3 * bucket)))


# --------------------------------------------------------------------------------------------
# Shared checks
# --------------------------------------------------------------------------------------------


def nan_buffers(layout: Layout) -> list[dict[str, torch.Tensor]]:
    return [{b.name: torch.full(b.shape, float("nan"), dtype=dtype_of(b.dtype)) for b in bufs} for bufs in layout.ranks]


def assert_dst_equal(got: list[dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]]) -> None:
    """Exact equality; NaN (untouched padding) must stay NaN."""
    assert len(got) == len(want)
    for r, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys()
        for name in g:
            assert g[name].dtype == w[name].dtype
            torch.testing.assert_close(g[name], w[name], rtol=0, atol=0, equal_nan=True,
                                       msg=lambda m, r=r, name=name: f"dst rank {r} buffer {name!r}: {m}")


def check_exactly_once(plan, sc: Scenario) -> None:
    counts = {(r, b.name): torch.zeros(b.shape, dtype=torch.int32) for r, bufs in enumerate(sc.dst.ranks) for b in bufs}
    for m in plan.messages:
        for seg in m.segments:
            seg.dst.view(counts[(m.dst, seg.dst.buffer)], seg.box.size).add_(1)
    for r, masks in enumerate(sc.dst_side.data_masks()):
        for name, mask in masks.items():
            c = counts[(r, name)]
            assert torch.equal(c, mask), f"dst rank {r} buffer {name!r}: write counts {c.tolist()} (want {mask.tolist()})"


def payload_bytes(sc: Scenario) -> int:
    return sum(int(m.sum()) * itemsize(b.dtype) for r, masks in enumerate(sc.dst_side.data_masks())
               for name, m in masks.items() for b in sc.dst.ranks[r] if b.name == name)


def run_and_check(sc: Scenario, opts: PlanOptions):
    plan = make_plan(sc.src, sc.dst, opts)
    sbufs = sc.src_side.fill(sc.values)
    dbufs = nan_buffers(sc.dst)
    execute_in_memory(plan, sbufs, dbufs)
    assert_dst_equal(dbufs, sc.expected_dst())
    check_exactly_once(plan, sc)
    # Sources are read-only.
    for a, b in zip(sbufs, sc.src_side.fill(sc.values)):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert plan.total_bytes == payload_bytes(sc)
    return plan


# --------------------------------------------------------------------------------------------
# 2. FSDP1 flat sources and destinations
# --------------------------------------------------------------------------------------------


@given(sc=scenarios(), opts=plan_options())
def test_flat_layouts_exact_and_exactly_once(sc: Scenario, opts: PlanOptions):
    run_and_check(sc, opts)




def run_engines(plan, src: Layout, dst: Layout, sbufs, dbufs, shapes) -> None:
    """Every rank's Engine over a loopback; sender checksums must match the receivers'."""
    wire: dict = {}
    deadline = time.monotonic() + 60
    sent: dict = defaultdict(int)
    reports = []
    for r in range(src.world):
        sums = Engine(Loopback(r, wire), plan, "src", r, sbufs[r], shapes, StagingPool(), deadline).run()
        reports.append(verify.sender_report(plan, sums))
        for k, c in sums.items():
            sent[k] = (sent[k] + c) % P
    sent = plan.expected_checksums(sent)  # replicas fed by relays mirror their primary
    values = verify.merge_reports(plan, reports)  # the control plane's compact form of the same sums
    for d in range(dst.world):
        landed = Engine(Loopback(src.world + d, wire), plan, "dst", d, dbufs[d], shapes, StagingPool(), deadline,
                        receiver_sums=True).run()
        pieces = dst.rank_pieces(d)
        got = receiver_checksums(plan, d, dbufs[d], dst, shapes)
        assert got == {k: v for k, v in sent.items() if k[0] == d}, f"dst rank {d}: checksums differ"
        assert {k: v for k, v in got.items() if k in landed} == landed, f"dst rank {d}: sums taken as bytes landed differ"
        verify.check_rank(plan, d, verify.rank_expected(plan, d, values), dbufs[d], pieces, shapes)
        verify.check_rank(plan, d, verify.rank_expected(plan, d, values), dbufs[d], pieces, shapes, landed=landed)
        keys, _ = plan.verify_pieces(d)
        assert {(d, b, i) for b, i in keys} >= set(got), f"dst rank {d}: verifies fewer pieces than it receives"
    assert not wire, "messages sent but never received"


@given(sc=scenarios(), opts=plan_options())
def test_flat_layouts_engine_loopback_and_checksums(sc: Scenario, opts: PlanOptions):
    plan = make_plan(sc.src, sc.dst, opts)
    dbufs = nan_buffers(sc.dst)
    run_engines(plan, sc.src, sc.dst, sc.src_side.fill(sc.values), dbufs, {n: s.shape for n, s in sc.specs.items()})
    assert_dst_equal(dbufs, sc.expected_dst())


@pytest.mark.slow  # 3-5 s: the quick suite's margin under 5 minutes on slower machines
def test_flat_generator_covers_the_interesting_cases():
    """A guard on the tests: the scenarios do produce empty ranges, ranges crossing tensor
    boundaries, ranges cutting rows, declared padding and direct messages."""
    seen = Counter()

    @settings(max_examples=300, derandomize=True)  # plan only: cheap; fixed examples, so it cannot flake
    @given(sc=scenarios(), opts=plan_options())
    def probe(sc, opts):
        for side in (sc.src_side, sc.dst_side):
            if side.kind != "flat":
                continue
            starts = set(side.offsets.values())
            for lo, hi in side.bounds:
                seen["empty range"] += lo == hi
                seen["crosses tensors"] += any(lo < o < hi for o in starts)
                seen["padding"] += hi > side.numel and lo < hi
            seen["replicas"] += side.replicas > 1
        for bufs in sc.src.ranks + sc.dst.ranks:
            for b in bufs:
                seen["cut row"] += any(p.flat and p.box.ndim > 1 and p.box.size[-1] != sc.specs[p.tensor].shape[-1]
                                       for p in b.pieces)
        plan = make_plan(sc.src, sc.dst, opts)
        seen["send direct"] += any(m.send_direct for m in plan.messages)
        seen["recv direct"] += any(m.recv_direct for m in plan.messages)
        seen["strided side"] += any(not (s.src.contiguous(s.box.size) and s.dst.contiguous(s.box.size))
                                    for m in plan.messages for s in m.segments)
        seen["split"] += len(plan.messages) > sum(len(b.pieces) for bufs in sc.dst.ranks for b in bufs)

    probe()
    want = ("empty range", "crosses tensors", "padding", "cut row", "send direct", "recv direct", "split", "strided side", "replicas")
    assert all(seen[k] > 0 for k in want), seen


# --------------------------------------------------------------------------------------------
# 3. Declared casts
# --------------------------------------------------------------------------------------------


@given(sc=scenarios(cast="src", directions=DIRECTIONS + ("boxed->boxed",)), opts=plan_options())
def test_cast_master_weights_to_bf16(sc: Scenario, opts: PlanOptions):
    assert sc.src_side.dtype == "float32" and sc.dst_side.dtype == "bfloat16"
    plan = run_and_check(sc, opts)  # expected: the float32 masters .to(torch.bfloat16), sliced
    assert not any(m.send_direct for m in plan.messages if not m.relay), "a cast segment must be packed on the sender"
    for m in plan.messages:
        # Relays forward what a replica already holds: bf16 to bf16.
        want = ("bfloat16", "bfloat16") if m.relay else ("float32", "bfloat16")
        assert all((s.src_dtype, s.dst_dtype) == want for s in m.segments)
    with pytest.raises(LayoutError, match="declare a cast"):
        make_plan(dataclasses.replace(sc.src, allow_casts=False), sc.dst, opts)


@given(sc=scenarios(cast="dst", directions=DIRECTIONS + ("boxed->boxed",)), opts=plan_options())
def test_cast_bf16_to_float32_destination(sc: Scenario, opts: PlanOptions):
    plan = run_and_check(sc, opts)
    assert not any(m.send_direct for m in plan.messages if not m.relay)
    with pytest.raises(LayoutError, match="declare a cast"):
        make_plan(sc.src, dataclasses.replace(sc.dst, allow_casts=False), opts)


@given(sc=st.sampled_from(["src", "dst"]).flatmap(lambda c: scenarios(cast=c)), opts=plan_options())
def test_cast_engine_loopback_and_checksums(sc: Scenario, opts: PlanOptions):
    plan = make_plan(sc.src, sc.dst, opts)
    dbufs = nan_buffers(sc.dst)
    run_engines(plan, sc.src, sc.dst, sc.src_side.fill(sc.values), dbufs, {n: s.shape for n, s in sc.specs.items()})
    assert_dst_equal(dbufs, sc.expected_dst())


def test_cast_fixed_example():
    specs = {"w": TensorSpec("w", (4, 6), "bfloat16")}
    master = (torch.arange(24, dtype=torch.float32).view(4, 6) + 1) / 3  # not representable in bf16
    src = Layout(specs, ((LocalBuffer("m", (4, 6), "float32", (Piece("w", Box.full((4, 6)), Box.full((4, 6))),)),),),
                 allow_casts=True)
    dst = Layout(specs, ((LocalBuffer("flat", (24,), "bfloat16", tuple(flat_pieces("w", (4, 6), 0, 24, 0))),),))
    plan = make_plan(src, dst, PlanOptions(direct_min_bytes=1))
    assert plan.messages and not any(m.send_direct for m in plan.messages)
    assert any(m.recv_direct for m in plan.messages)  # the receiving side may still be direct
    out = torch.full((24,), float("nan"), dtype=torch.bfloat16)
    execute_in_memory(plan, [{"m": master.clone()}], [{"flat": out}])
    assert torch.equal(out, master.to(torch.bfloat16).reshape(-1))
    assert not torch.equal(out.float(), master.reshape(-1))  # the cast did round
    with pytest.raises(LayoutError, match=r"holds it as float32 but the tensor is bfloat16 .*declare a cast"):
        make_plan(dataclasses.replace(src, allow_casts=False), dst)


# --------------------------------------------------------------------------------------------
# 4. Flat destination from row- / column-sharded sources: ranges cut rows in the middle
# --------------------------------------------------------------------------------------------

SHARD_SPECS = {"a": TensorSpec("a", (5, 7), "float32"), "b": TensorSpec("b", (3, 4, 5), "float32")}
SHARD_ORDER = ("a", "b")  # flat space: a (35 elements) then b (60), 95 in all


def sharded_source(mode: str) -> tuple[Layout, list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """Two source ranks; each tensor split on dim 0 ('rows') or dim 1 ('cols'), one buffer per shard."""
    full = {n: torch.arange(s.numel, dtype=torch.float32).view(s.shape) + 1000 * i
            for i, (n, s) in enumerate(SHARD_SPECS.items())}
    dim = 0 if mode == "rows" else 1
    ranks: list[list[LocalBuffer]] = [[], []]
    bufs: list[dict[str, torch.Tensor]] = [{}, {}]
    for n, s in SHARD_SPECS.items():
        cut = {"a": (2, 3), "b": (1, 1)}[n][dim]
        for r, (lo, hi) in enumerate([(0, cut), (cut, s.shape[dim])]):
            box = Box(tuple(lo if d == dim else 0 for d in range(len(s.shape))),
                      tuple(hi - lo if d == dim else x for d, x in enumerate(s.shape)))
            ranks[r].append(LocalBuffer(n, box.size, "float32", (Piece(n, Box.full(box.size), box),)))
            bufs[r][n] = full[n][box.slices()].clone()
    return Layout(dict(SHARD_SPECS), tuple(tuple(r) for r in ranks)), bufs, full


def flat_destination(bounds: list[tuple[int, int]], total: int) -> Layout:
    offsets = {"a": 0, "b": 35}
    ranks = []
    for lo, hi in bounds:
        pieces = []
        for n in SHARD_ORDER:
            o, k = offsets[n], SHARD_SPECS[n].numel
            a, b = max(lo, o), min(hi, o + k)
            if a < b:
                pieces += flat_pieces(n, SHARD_SPECS[n].shape, a - o, b - o, a - lo)
        pad = (Box((max(lo, 95) - lo,), (hi - max(lo, 95),)),) if hi > 95 else ()
        ranks.append((LocalBuffer("flat", (hi - lo,), "float32", tuple(pieces), pad),))
    assert bounds[-1][1] == total
    return Layout(dict(SHARD_SPECS), tuple(ranks))


@pytest.mark.parametrize("mode", ["rows", "cols"])
@pytest.mark.parametrize("bounds", [
    [(0, 10), (10, 47), (47, 95)],  # 10: row 1 of a at column 3; 47: inside b[0, 2]
    [(0, 32), (32, 64), (64, 96)],  # FSDP1: 3 equal ranges, one padding element
    [(0, 3), (3, 3), (3, 58), (58, 96)],  # an empty rank
])
@pytest.mark.parametrize("direct_min", [1, 1 << 30])
def test_flat_destination_from_sharded_source(mode, bounds, direct_min):
    src, sbufs, full = sharded_source(mode)
    total = bounds[-1][1]
    dst = flat_destination(bounds, total)
    # The ranges do cut rows in the middle: some destination box is narrower than its tensor's rows.
    assert any(p.box.size[-1] < SHARD_SPECS[p.tensor].shape[-1] for bufs in dst.ranks for b in bufs for p in b.pieces)
    opts = PlanOptions(bucket_bytes=4096, direct_min_bytes=direct_min)
    plan = make_plan(src, dst, opts)
    flat = torch.cat([full[n].reshape(-1) for n in SHARD_ORDER] + [torch.full((total - 95,), float("nan"))])
    want = [{"flat": flat[lo:hi]} for lo, hi in bounds]
    dbufs = nan_buffers(dst)
    execute_in_memory(plan, sbufs, dbufs)
    assert_dst_equal(dbufs, want)
    # Exactly once.
    counts = [torch.zeros(hi - lo, dtype=torch.int32) for lo, hi in bounds]
    for m in plan.messages:
        for s in m.segments:
            s.dst.view(counts[m.dst], s.box.size).add_(1)
    for (lo, hi), c in zip(bounds, counts):
        assert c.tolist() == [1 if lo + i < 95 else 0 for i in range(hi - lo)]
    noncontig = [s for m in plan.messages for s in m.segments if not s.dst.contiguous(s.box.size)]
    if mode == "cols":
        assert noncontig, "column shards should give strided sub-views of the flat ranges"
    if direct_min == 1:
        assert any(m.recv_direct for m in plan.messages)
    # The same plan through the engines (direct receives land in flat storage) with checksums.
    dbufs = nan_buffers(dst)
    run_engines(plan, src, dst, sbufs, dbufs, {n: s.shape for n, s in SHARD_SPECS.items()})
    assert_dst_equal(dbufs, want)


@pytest.mark.parametrize("direct_min", [1, 1 << 30])
def test_flat_space_with_a_scalar_tensor(direct_min):
    """A 0-d tensor inside the flat space (FSDP1 flattens scalars too), alone on one rank."""
    specs = {"s": TensorSpec("s", (), "float32"), "w": TensorSpec("w", (3, 4), "float32")}
    side = FlatSide(["s", "w"], {"s": 0, "w": 1}, 13, 2, [(0, 1), (1, 6), (6, 15)], "float32", True)
    flat = Layout(specs, tuple(side.buffers(specs)))
    boxed = Layout(specs, ((LocalBuffer("s", (), "float32", (Piece("s", Box((), ()), Box((), ())),)),
                            LocalBuffer("w", (3, 4), "float32", (Piece("w", Box.full((3, 4)), Box.full((3, 4))),))),))
    values = {"s": torch.tensor(7.0), "w": torch.arange(12.0).view(3, 4)}
    shapes = {n: sp.shape for n, sp in specs.items()}
    opts = PlanOptions(direct_min_bytes=direct_min)
    for src, dst, sbufs, want in [
        (flat, boxed, side.fill(values), [{n: v.clone() for n, v in values.items()}]),
        (boxed, flat, [values], side.expected(values)),
    ]:
        plan = make_plan(src, dst, opts)
        for run in ("memory", "engines"):
            dbufs = nan_buffers(dst)
            if run == "memory":
                execute_in_memory(plan, sbufs, dbufs)
            else:
                run_engines(plan, src, dst, sbufs, dbufs, shapes)
            assert_dst_equal(dbufs, want)
    assert layout_from_bytes(layout_bytes(flat)) == flat


# --------------------------------------------------------------------------------------------
# 5. Validation of flat pieces
# --------------------------------------------------------------------------------------------

W = {"w": TensorSpec("w", (4, 4), "float32")}
FULL_W = Layout(W, ((LocalBuffer("w", (4, 4), "float32", (Piece("w", Box.full((4, 4)), Box.full((4, 4))),)),),))


def _dst(buf: LocalBuffer) -> Layout:
    return Layout(W, ((buf,),))


def test_error_flat_range_length_differs_from_box():
    buf = LocalBuffer("f", (16,), "float32", (Piece("w", Box((0,), (5,)), Box((0, 0), (1, 4)), flat=True),
                                              Piece("w", Box((5,), (11,)), Box((1, 0), (3, 4)), flat=True)))
    with pytest.raises(LayoutError, match=r"buffer 'f': flat piece of 'w' range \[0:5\] must be 1-D and hold the 4 "):
        make_plan(FULL_W, _dst(buf))
    with pytest.raises(LayoutError, match=r"source rank 0 buffer 'f': flat piece of 'w'"):
        make_plan(_dst(buf), FULL_W)  # sources are validated too


def test_error_flat_range_not_1d():
    buf = LocalBuffer("f", (4, 4), "float32", (Piece("w", Box((0, 0), (4, 4)), Box.full((4, 4)), flat=True),))
    with pytest.raises(LayoutError, match=r"must be 1-D"):
        make_plan(FULL_W, _dst(buf))


def test_error_flat_range_past_buffer_end():
    buf = LocalBuffer("f", (16,), "float32", (Piece("w", Box((0,), (12,)), Box((0, 0), (3, 4)), flat=True),
                                              Piece("w", Box((14,), (4,)), Box((3, 0), (1, 4)), flat=True)))
    with pytest.raises(LayoutError, match=r"flat piece of 'w' range \[14:18\] lies outside the buffer's 16 elements"):
        make_plan(FULL_W, _dst(buf))
    with pytest.raises(LayoutError, match=r"lies outside"):
        make_plan(Layout(W, ((buf,),)), FULL_W)  # sources are validated too


def test_error_flat_piece_overlaps_boxed_piece():
    two = {"a": TensorSpec("a", (2, 4), "float32"), "b": TensorSpec("b", (2, 4), "float32")}
    src = Layout(two, ((LocalBuffer("a", (2, 4), "float32", (Piece("a", Box.full((2, 4)), Box.full((2, 4))),)),
                        LocalBuffer("b", (2, 4), "float32", (Piece("b", Box.full((2, 4)), Box.full((2, 4))),))),))
    # Rows 0-1 hold a (boxed); the flat range [6, 14) holding b spills into row 1.
    bad = LocalBuffer("mix", (4, 4), "float32", (
        Piece("a", Box((0, 0), (2, 4)), Box.full((2, 4))),
        *flat_pieces("b", (2, 4), 0, 8, 6),
    ), (Box((3, 2), (1, 2)),))
    with pytest.raises(LayoutError, match=r"buffer 'mix': .*overlaps"):
        make_plan(src, Layout(two, ((bad,),)))
    # The same buffer with the flat range right after the boxed rows is valid and transfers exactly.
    good = LocalBuffer("mix", (4, 4), "float32", (
        Piece("a", Box((0, 0), (2, 4)), Box.full((2, 4))),
        *flat_pieces("b", (2, 4), 0, 8, 8),
    ))
    plan = make_plan(src, Layout(two, ((good,),)), PlanOptions(direct_min_bytes=1))
    a, b = torch.arange(8.0).view(2, 4), torch.arange(8.0).view(2, 4) + 100
    out = torch.full((4, 4), float("nan"))
    execute_in_memory(plan, [{"a": a, "b": b}], [{"mix": out}])
    assert torch.equal(out, torch.cat([a, b]))


def test_error_flat_pieces_overlap_each_other():
    buf = LocalBuffer("f", (16,), "float32", (*flat_pieces("w", (4, 4), 0, 8, 0), *flat_pieces("w", (4, 4), 8, 16, 6)))
    with pytest.raises(LayoutError, match=r"buffer 'f': .*overlaps"):
        make_plan(FULL_W, _dst(buf))


def test_error_flat_destination_gap():
    buf = LocalBuffer("f", (18,), "float32", tuple(flat_pieces("w", (4, 4), 0, 16, 1)), (Box((17,), (1,)),))
    with pytest.raises(LayoutError, match=r"1 of 18 elements are neither a piece nor declared padding"):
        make_plan(FULL_W, _dst(buf))


# --------------------------------------------------------------------------------------------
# 6. Serialization of flat pieces
# --------------------------------------------------------------------------------------------


@given(sc=scenarios(cast="src"))
def test_flat_layout_bytes_round_trip(sc: Scenario):
    for lay in (sc.src, sc.dst):
        back = layout_from_bytes(layout_bytes(lay))
        assert back == lay
        assert back.allow_casts == lay.allow_casts
        assert layout_fingerprint(back) == layout_fingerprint(lay)
        assert [p.flat for bufs in back.ranks for b in bufs for p in b.pieces] == \
               [p.flat for bufs in lay.ranks for b in bufs for p in b.pieces]
    assert make_plan(layout_from_bytes(layout_bytes(sc.src)), layout_from_bytes(layout_bytes(sc.dst))).digest == \
        make_plan(sc.src, sc.dst).digest


def test_flat_flag_changes_fingerprint():
    flat = Layout(W, ((LocalBuffer("f", (16,), "float32", tuple(flat_pieces("w", (4, 4), 0, 16, 0))),),))
    [p] = flat.ranks[0][0].pieces
    assert p.flat and p.region == Box((0,), (16,)) and p.box == Box.full((4, 4))
    back = layout_from_bytes(layout_bytes(flat))
    assert back.ranks[0][0].pieces[0].flat is True
    assert layout_fingerprint(back) == layout_fingerprint(flat)
    boxed = Layout(W, ((LocalBuffer("f", (4, 4), "float32", (Piece("w", Box.full((4, 4)), Box.full((4, 4))),)),),))
    assert layout_fingerprint(boxed) != layout_fingerprint(flat)


def test_table_padding_of_mixed_ranks():
    """Boxes of several ranks land in one table, right-filled (offset 0, size 1)."""
    from reshard.common.layout.columns import pad_rows as _pad

    rows = [(3,), (1, 2), (), (4, 5, 6), (7,)]
    assert _pad(rows, 3, 1).tolist() == [[3, 1, 1], [1, 2, 1], [1, 1, 1], [4, 5, 6], [7, 1, 1]]
    assert _pad([(1, 2), (3, 4)], 2, 0).tolist() == [[1, 2], [3, 4]]


def test_unique_rows_matches_numpy():
    import numpy as np

    from reshard.common.layout.tables import unique_rows

    rng = np.random.default_rng(0)
    for cols in ([rng.integers(0, 5, 300), rng.integers(0, 300, 300)],
                 [rng.integers(0, 2, 50), rng.integers(0, 7, 50), rng.integers(0, 3, 50)],
                 [np.array([0, 1 << 40, 3]), np.array([1 << 30, 0, 5])]):  # wide: the fallback
        want_u, want_i = np.unique(np.stack(cols, 1), axis=0, return_inverse=True)
        u, i = unique_rows(*cols)
        assert u.tolist() == want_u.tolist() and i.tolist() == want_i.reshape(-1).tolist()
