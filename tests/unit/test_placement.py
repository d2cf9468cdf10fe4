"""Compact placements (mesh + Shard/Replicate), checked against torch.chunk."""

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from reshard.common.dataplane.engine import execute_in_memory
from reshard.common.layout.core import LayoutError, TensorSpec
from reshard.common.layout.placement import Replicate, Shard, box_at, chunk_sizes, expand, placement_layout
from reshard.common.plan.planner import PlanOptions, make_plan


def chunk_slice(t: torch.Tensor, mesh, placements, coord) -> torch.Tensor:
    """What DTensor's rank at `coord` holds, computed with torch.chunk directly."""
    for mdim, p in enumerate(placements):
        if isinstance(p, Shard):
            parts = torch.chunk(t, mesh[mdim], dim=p.dim) if p.sizes is None else torch.split(t, list(p.sizes), dim=p.dim)
            parts = list(parts) + [t.narrow(p.dim, 0, 0)] * (mesh[mdim] - len(parts))
            t = parts[coord[mdim]]
    return t


@st.composite
def placed(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 9)) for _ in range(ndim))
    mesh = tuple(draw(st.integers(1, 3)) for _ in range(draw(st.integers(1, 2))))
    pl = tuple(draw(st.one_of(st.just(Replicate()), st.builds(Shard, st.integers(0, ndim - 1)))) for _ in mesh)
    return shape, mesh, pl


@given(placed())
def test_expand_matches_torch_chunk(case):
    shape, mesh, pl = case
    t = torch.arange(int(torch.tensor(shape).prod())).view(shape)
    boxes = expand(shape, mesh, pl)
    for coord in itertools.product(*(range(m) for m in mesh)):
        assert torch.equal(t[boxes[coord].slices()], chunk_slice(t, mesh, pl, coord))
        assert torch.equal(t[box_at(shape, mesh, pl, coord).slices()], chunk_slice(t, mesh, pl, coord))  # one coordinate alone


@given(placed(), placed(), st.integers(4096, 20000))
def test_reshard_between_placements(a, b, bucket):
    shape = a[0]
    b = (shape, b[1], tuple(p if isinstance(p, Replicate) or p.dim < len(shape) else Shard(0) for p in b[2]))
    specs = {"w": TensorSpec("w", shape, "float32"), "v": TensorSpec("v", (5,), "float32")}
    full = {"w": torch.randn(shape), "v": torch.randn(5)}
    src = placement_layout(specs, a[1], {"w": a[2], "*": [Replicate()] * len(a[1])})
    v_pl = [Shard(0)] + [Replicate()] * (len(b[1]) - 1)
    dst = placement_layout(specs, b[1], {"w": b[2], "v": v_pl})
    plan = make_plan(src, dst, PlanOptions(bucket_bytes=bucket, direct_min_bytes=64))
    src_bufs = []
    for r, coord in enumerate(itertools.product(*(range(m) for m in a[1]))):
        bufs = {"v": full["v"].clone()}
        w = chunk_slice(full["w"], a[1], a[2], coord)
        if w.numel():
            bufs["w"] = w.contiguous().clone()
        src_bufs.append(bufs)
    dst_bufs = [{buf.name: torch.full(buf.shape, float("nan")) for buf in bufs} for bufs in dst.ranks]
    execute_in_memory(plan, src_bufs, dst_bufs)
    for r, coord in enumerate(itertools.product(*(range(m) for m in b[1]))):
        w = chunk_slice(full["w"], b[1], b[2], coord)
        if w.numel():
            assert torch.equal(dst_bufs[r]["w"], w)
        v = chunk_slice(full["v"], b[1], v_pl, coord)
        if v.numel():
            assert torch.equal(dst_bufs[r]["v"], v)


def test_uneven_sizes_and_errors():
    assert chunk_sizes(10, 4) == [3, 3, 3, 1]
    assert chunk_sizes(5, 4) == [2, 2, 1, 0]
    boxes = expand((8, 4), (2,), (Shard(0, sizes=(5, 3)),))
    assert boxes[(0,)].size == (5, 4) and boxes[(1,)].offset == (5, 0)
    with pytest.raises(LayoutError, match="sizes"):
        expand((8, 4), (2,), (Shard(0, sizes=(5, 2)),))
    with pytest.raises(LayoutError, match="placements for a mesh"):
        expand((8, 4), (2, 2), (Shard(0),))
    with pytest.raises(LayoutError, match="Shard\\(2\\)"):
        expand((8, 4), (2,), (Shard(2),))
    with pytest.raises(LayoutError, match="no placement given"):
        placement_layout({"x": TensorSpec("x", (4,), "float32")}, (2,), {"y": (Shard(0),)})
