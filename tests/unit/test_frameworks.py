"""Framework layout builders: valid, plannable, and laid out as the frameworks lay them out
(checked with slicing written here for the parts that differ between frameworks)."""

import json
import subprocess
import sys

import pytest
import torch

from reshard.common.dataplane.engine import execute_in_memory
from reshard.common.layout.core import LayoutError, dtype_of
from reshard.common.layout.wire import layout_bytes, layout_fingerprint, layout_from_bytes
from reshard.common.models.frameworks import build, model_spec, parse_spec, world_of
from reshard.common.plan.planner import PlanOptions, make_plan

SPECS = [
    "framework=megatron,tp=2", "framework=megatron,tp=2,pp=2,dp=2", "framework=megatron,tp=1,pp=3,dp=2,vpp=1",
    "framework=megatron,tp=2,pp=2,vpp=1,dp=2,ep=2", "framework=megatron,tp=2,dp=2,ep=2,etp=1",
    "framework=vllm,tp=2", "framework=vllm,tp=4,dp=2", "framework=vllm,tp=2,dp=2,ep=1",
    "framework=fsdp,dp=3", "framework=fsdp,dp=4,flat=0",
]


def canonical(m):
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(t.shape, generator=g).to(dtype_of(t.dtype)) for n, t in m.tensors().items()}


def fill_from(layout, full):
    out = []
    for bufs in layout.ranks:
        d = {}
        for b in bufs:
            t = torch.full(b.shape, float("nan"), dtype=dtype_of(b.dtype))
            for p in b.pieces:
                p.view(t).copy_(full[p.tensor][p.box.slices()])
            d[b.name] = t
        out.append(d)
    return out


@pytest.mark.parametrize("model", ["tiny-moe", "tiny-mla"])
@pytest.mark.parametrize("src,dst", [(SPECS[i], SPECS[j]) for i, j in [(1, 6), (3, 7), (4, 5), (8, 6), (9, 2), (7, 9), (0, 8)]])
def test_builders_plan_and_execute(model, src, dst):
    m = model_spec(model)
    a, b = build(m, src), build(m, dst)
    assert a.world == world_of(src) and b.world == world_of(dst)
    full = canonical(m)
    plan = make_plan(a, b, PlanOptions(bucket_bytes=8192, direct_min_bytes=1024, max_message_bytes=65536))
    got = [{n: torch.full_like(t, float("nan")) for n, t in bufs.items()} for bufs in fill_from(b, full)]
    execute_in_memory(plan, fill_from(a, full), got)
    want = fill_from(b, full)
    for r, bufs in enumerate(want):
        for n, t in bufs.items():
            assert torch.equal(got[r][n].nan_to_num(7.0), t.nan_to_num(7.0)), (r, n)


def test_vllm_stacked_experts_and_megatron_local_experts():
    m = model_spec("tiny-moe")
    full = canonical(m)
    inter, tp = m.moe_intermediate, 2
    v = fill_from(build(m, "framework=vllm,tp=2"), full)
    per = inter // tp
    for r in range(tp):
        w13, w2 = v[r]["model.layers.1.mlp.experts.w13_weight"], v[r]["model.layers.1.mlp.experts.w2_weight"]
        assert w13.shape == (m.experts, 2 * per, m.hidden) and w2.shape == (m.experts, m.hidden, per)
        for e in (0, 5):
            x = f"model.layers.1.mlp.experts.{e}."
            assert torch.equal(w13[e], torch.cat([full[x + "gate_proj.weight"][r * per:(r + 1) * per], full[x + "up_proj.weight"][r * per:(r + 1) * per]]))
            assert torch.equal(w2[e], full[x + "down_proj.weight"][:, r * per:(r + 1) * per])
    # Expert parallel in vLLM: whole experts, E / (tp * dp) per rank, in rank order.
    ve = fill_from(build(m, "framework=vllm,tp=2,dp=2,ep=1"), full)
    assert ve[3]["model.layers.1.mlp.experts.w13_weight"].shape[0] == 2
    assert torch.equal(ve[3]["model.layers.1.mlp.experts.w2_weight"][1], full["model.layers.1.mlp.experts.7.down_proj.weight"])
    # Megatron ep=2 over dp=2 ranks (tp=1): rank 1 holds experts 4..7 as local experts 0..3.
    mg = fill_from(build(m, "framework=megatron,dp=2,ep=2"), full)
    fc1 = mg[1]["decoder.layers.2.mlp.experts.local_experts.0.linear_fc1.weight"]
    x = "model.layers.2.mlp.experts.4."
    assert torch.equal(fc1, torch.cat([full[x + "gate_proj.weight"], full[x + "up_proj.weight"]]))
    assert "decoder.layers.0.mlp.linear_fc1.weight" in mg[0]  # first_dense layer: a dense MLP


def test_pipeline_stages_uneven_and_virtual():
    m = model_spec("small")  # 4 layers
    lay = build(m, "framework=megatron,pp=3")
    layers = [sorted({int(b.name.split(".")[2]) for b in r if b.name.startswith("decoder.layers.")}) for r in lay.ranks]
    assert layers == [[0, 1], [2], [3]]
    lay = build(m, "framework=megatron,pp=2,vpp=2")
    layers = [sorted({int(b.name.split(".")[2]) for b in r if b.name.startswith("decoder.layers.")}) for r in lay.ranks]
    assert layers == [[0, 2], [1, 3]]  # chunk v*pp + s
    assert any(b.name == "embedding.word_embeddings.weight" for b in lay.ranks[0])
    assert any(b.name == "output_layer.weight" for b in lay.ranks[1])


def test_tied_embeddings_are_one_tensor_named_twice():
    m = model_spec("tiny-moe")
    assert "lm_head.weight" not in m.tensors()
    lay = build(m, "framework=vllm,tp=1")
    names = [p.tensor for b in lay.ranks[0] if b.name in ("model.embed_tokens.weight", "lm_head.weight") for p in b.pieces]
    assert names == ["model.embed_tokens.weight", "model.embed_tokens.weight"]


def test_spec_errors():
    with pytest.raises(ValueError, match="framework must be one of"):
        parse_spec("framework=jax,tp=2")
    with pytest.raises(ValueError, match="takes tp, dp, ep"):
        parse_spec("framework=vllm,pp=2")
    with pytest.raises(ValueError, match="non-negative integer"):
        parse_spec("framework=vllm,tp=two")
    with pytest.raises(LayoutError, match="etp\\*ep"):
        build("tiny-moe", "framework=megatron,tp=2,dp=1,ep=2")
    with pytest.raises(LayoutError, match="not divisible"):
        build("tiny", "framework=megatron,tp=4")


@pytest.mark.slow  # 2-3 s (a CLI process): the quick suite keeps under 5 minutes on 2 cores
def test_plan_command_json():
    r = subprocess.run([sys.executable, "-m", "reshard.cli", "plan", "--model", "tiny-moe", "--src",
                        "framework=megatron,tp=2,pp=2", "--dst", "framework=vllm,tp=2,dp=2", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("plan_seconds", "num_ranks_src", "num_ranks_dst", "num_tensors", "num_transfers", "bytes_total",
                "max_rank_send_bytes", "mean_rank_send_bytes", "max_rank_recv_bytes", "max_link_bytes", "peak_memory_bytes"):
        assert key in out, key
    m = model_spec("tiny-moe")
    dst = build(m, "framework=vllm,tp=2,dp=2")
    payload = sum(p.box.numel * 2 for bufs in dst.ranks for b in bufs for p in b.pieces)
    assert out["bytes_total"] == payload and out["num_ranks_src"] == 4 and out["num_ranks_dst"] == 4
    assert out["max_rank_send_bytes"] >= out["mean_rank_send_bytes"] > 0
    r = subprocess.run([sys.executable, "-m", "reshard.cli", "plan", "--model", "tiny", "--src", "framework=megatron,tp=4",
                        "--dst", "framework=vllm,tp=2"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "not divisible" in r.stderr


# -- columnar builders ------------------------------------------------------------------

COLUMN_CASES = [
    ("tiny-moe", "framework=megatron,tp=2,dp=2,ep=2"), ("tiny-moe", "framework=megatron,tp=2,pp=2,dp=2,ep=4,etp=1"),
    ("tiny-mla", "framework=megatron,tp=1,pp=2,dp=4,ep=4"), ("tiny-mla", "framework=megatron,tp=2,pp=3,dp=2,ep=2"),
    ("tiny-moe", "framework=megatron,tp=2,pp=2,vpp=1,dp=2,ep=2"), ("tiny", "framework=megatron,tp=2,pp=2"),
    ("tiny-moe", "framework=vllm,tp=2,dp=2"), ("tiny-moe", "framework=vllm,tp=2,dp=2,ep=1"),
    ("tiny-mla", "framework=vllm,tp=4,dp=2"), ("tiny-mla", "framework=vllm,tp=1,dp=8,ep=1"), ("tiny", "framework=vllm,tp=2,dp=3"),
]


@pytest.mark.parametrize("model,spec", COLUMN_CASES)
def test_columnar_builders_match_object_builders(model, spec):
    """The builders emit routed experts as columns; rank by rank the buffers equal those the
    object twins of tests/unit/reference_layouts.py make piece by piece (buffer order may
    differ), replicas still share one tuple, and the columns survive the wire: same fingerprint
    and plan digest after decoding."""
    from reshard.common.layout.columns import ColumnRanks
    from reshard.common.models.frameworks import BUILDERS
    from tests.unit.reference_layouts import OBJECT_BUILDERS

    m = model_spec(model)
    fw, kw = parse_spec(spec)
    cols, objs = BUILDERS[fw](m, **kw), OBJECT_BUILDERS[fw](m, **kw)
    assert isinstance(cols.ranks, ColumnRanks) and isinstance(objs.ranks, ColumnRanks)  # objects are read into columns
    assert [{b.name: b for b in bufs} for bufs in cols.ranks] == [{b.name: b for b in bufs} for bufs in objs.ranks]
    assert [len({id(cols.ranks[r]) for r in range(cols.world)})] == [len({id(b) for b in objs.ranks})]
    back = layout_from_bytes(layout_bytes(cols))
    assert back == cols and layout_fingerprint(back) == layout_fingerprint(cols)
    dst = build(m, "framework=vllm,tp=2,dp=2")
    opts = PlanOptions(bucket_bytes=8192, direct_min_bytes=1024)
    assert make_plan(cols, dst, opts).digest == make_plan(back, dst, opts).digest
    assert make_plan(dst, cols, opts).digest == make_plan(dst, back, opts).digest


def test_expert_parallel_replicas_relay_their_shared_buffers():
    """vLLM ep=1: DP ranks hold different experts but the same attention and dense weights. Each
    shared byte leaves the trainer once and reaches the other holders by relay; experts go
    straight to their one holder; every rank ends exact, and verification extends a head's
    checksums only to the buffers its chain relays."""
    m = model_spec("tiny-moe")
    src, dst = build(m, "framework=megatron,tp=2,dp=2,ep=2"), build(m, "framework=vllm,tp=2,dp=2,ep=1")
    full = canonical(m)
    piece_bytes = {(b.name, p): p.box.numel * dtype_of(b.dtype).itemsize for bufs in dst.ranks for b in bufs for p in b.pieces}

    def bytes_of(bufs_by_rank):
        return sum(piece_bytes[(b.name, p)] for bufs in bufs_by_rank for b in bufs for p in b.pieces)

    distinct = {}  # independent: every buffer content once, wherever it is held
    for bufs in dst.ranks:
        for b in bufs:
            distinct.setdefault((b.name, b), b)
    opts = dict(bucket_bytes=8192, direct_min_bytes=1024)
    shared = make_plan(src, dst, PlanOptions(shared_relay_min_bytes=1, **opts))
    apart = make_plan(src, dst, PlanOptions(shared_relay_min_bytes=1 << 40, **opts))
    egress = {k: int(p.rank_bytes()["send"].sum()) for k, p in (("shared", shared), ("apart", apart))}
    assert egress["apart"] == bytes_of(dst.ranks)                  # no class has two ranks: no relay at all
    assert egress["shared"] == bytes_of([list(distinct.values())])  # each distinct buffer once
    assert egress["shared"] < egress["apart"]
    assert sorted(shared.primary_of) == [1, 2, 3] and not apart.primary_of  # norms: one chain through all four
    for plan in (shared, apart):
        got = [{n: torch.full_like(t, float("nan")) for n, t in bufs.items()} for bufs in fill_from(dst, full)]
        execute_in_memory(plan, fill_from(src, full), got)
        for r, bufs in enumerate(fill_from(dst, full)):
            for n, t in bufs.items():
                assert torch.equal(got[r][n].nan_to_num(7.0), t.nan_to_num(7.0)), (r, n)
    # Verification: every piece of every rank is expected; relayed ones carry the head's value,
    # the rest (the experts of rank 2) keep their own.
    sent = {}
    for r in range(dst.world):
        for msg in shared.recvs.get(r, ()):
            if not msg.relay:
                for s in msg.segments:
                    sent[(r, s.dst_buffer, s.dst_piece)] = hash((r, s.dst_buffer, s.dst_piece))
    ext = shared.expected_checksums(sent)
    for r, bufs in enumerate(dst.ranks):
        for b in bufs:
            for i in range(len(b.pieces)):
                assert (r, b.name, i) in ext, (r, b.name, i)
                assert (b.name, i) in shared.expected_pieces(r)
    w13 = "model.layers.1.mlp.experts.w13_weight"
    assert ext[(2, w13, 0)] == sent[(2, w13, 0)] != sent[(0, w13, 0)]
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    assert (2, qkv, 0) not in sent and ext[(2, qkv, 0)] == sent[(0, qkv, 0)]


def test_wire_form_is_columns_and_reads_the_json_form():
    """Layouts cross the control plane as columns: small, decoded without per-piece work into a
    columnar layout equal to the original; the JSON form still reads; damaged bytes raise
    LayoutError instead of yielding a layout."""
    from reshard.common.layout.columns import WIRE_MAGIC, ColumnRanks, unwire, wire

    for lay in (build("tiny-moe", "framework=vllm,tp=2,dp=2,ep=1"), build("tiny", "framework=fsdp,dp=3"),
                build("tiny-mla", "framework=megatron,tp=2,pp=2,dp=2,ep=2", )):
        data = layout_bytes(lay)
        assert data.startswith(WIRE_MAGIC) and layout_bytes(lay) is data  # made once
        back = layout_from_bytes(data)
        assert isinstance(back.ranks, ColumnRanks) and back == lay and layout_fingerprint(back) == layout_fingerprint(lay)
    with pytest.raises(LayoutError, match="not a layout's wire form"):
        layout_from_bytes(b'{"tensors": [], "classes": [], "rank_class": []}')  # no JSON form
    raw = unwire(data)
    n = int.from_bytes(raw[:8], "little")
    head = json.loads(raw[8:8 + n])
    bad_heads = []
    for key, value in (("buffers", [1] + head["buffers"][1:]), ("rank_class", [99] + head["rank_class"][1:]),
                       ("buffer_names", head["buffer_names"][:1]), ("tensors", head["tensors"][:2])):
        h = dict(head, **{key: value})
        hb = json.dumps(h).encode()
        bad_heads.append(wire(len(hb).to_bytes(8, "little") + hb + raw[8 + n:]))
    lying = data[:len(WIRE_MAGIC)] + (len(raw) - 16).to_bytes(8, "little") + data[len(WIRE_MAGIC) + 8:]
    for bad in [data[:len(data) // 2], wire(raw[:-16]), lying, *bad_heads]:
        with pytest.raises(LayoutError, match="malformed layout"):
            layout_from_bytes(bad)


@pytest.mark.parametrize("model,spec", [("tiny-moe", "framework=vllm,tp=2,dp=2,ep=1"), ("tiny-mla", "framework=megatron,tp=2,pp=2,dp=2"),
                                        ("tiny", "framework=fsdp,dp=3")])
def test_rank_layouts_merge_in_columns_into_the_built_layout(model, spec):
    """A controller assembles its side's layout from its workers' hellos without making Python
    pieces: the result equals the layout the builder made (content, fingerprint, plan digest)."""
    from reshard.common.control.worker import rank_layout_bytes
    from reshard.common.layout.columns import ColumnRanks
    from reshard.common.layout.core import merge_ranks

    lay = build(model, spec)
    hellos = [rank_layout_bytes(lay.tensors, list(lay.ranks[r])) for r in range(lay.world)]
    parts, index = [], {}
    rank_part = [index.setdefault(h, len(index)) for h in hellos]
    parts = [layout_from_bytes(h) for h in index]
    merged = merge_ranks(parts, rank_part)
    assert isinstance(merged.ranks, ColumnRanks) and len(merged.ranks.classes) == len(parts) <= lay.world
    assert layout_fingerprint(merged) == layout_fingerprint(lay)
    assert tuple(merged.ranks) == tuple(lay.ranks) and merged.tensors == lay.tensors
    other = build(model, "framework=fsdp,dp=2")
    assert make_plan(merged, other).digest == make_plan(lay, other).digest


def test_rank_layouts_that_disagree_on_a_tensor_are_refused():
    from reshard.common.control.worker import rank_layout_bytes
    from reshard.common.layout.core import TensorSpec, merge_ranks

    lay = build("tiny", "framework=megatron,tp=2")
    name = lay.ranks[1][0].pieces[0].tensor
    bad = dict(lay.tensors)
    bad[name] = TensorSpec(name, tuple(s + 1 for s in bad[name].shape), bad[name].dtype)
    parts = [layout_from_bytes(rank_layout_bytes(lay.tensors, list(lay.ranks[0]))),
             layout_from_bytes(rank_layout_bytes(bad, list(lay.ranks[1])))]
    with pytest.raises(LayoutError, match=f"tensor '{name}': rank 1 declares"):
        merge_ranks(parts, [0, 1])


def test_a_layout_header_nested_thousands_deep_is_malformed_not_a_crash():
    """Issue 28's probe: a RecursionError in the decoder came back as UNKNOWN with a traceback."""
    import zlib

    import pytest

    from reshard.common.layout.columns import WIRE_MAGIC
    from reshard.common.layout.core import LayoutError
    from reshard.common.layout.wire import layout_from_bytes

    header = b"[" * 100_000 + b"]" * 100_000
    raw = len(header).to_bytes(8, "little") + header
    data = WIRE_MAGIC + len(raw).to_bytes(8, "little") + zlib.compress(raw)
    with pytest.raises(LayoutError, match="malformed layout"):
        layout_from_bytes(data)
