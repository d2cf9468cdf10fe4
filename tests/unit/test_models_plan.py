"""Framework layouts planned and executed in memory, checked by slicing written here."""

import pytest
import torch

from reshard.common.dataplane.engine import execute_in_memory
from reshard.common.layout.core import Layout, LayoutError
from reshard.common.layout.wire import layout_bytes, layout_fingerprint, layout_from_bytes
from reshard.common.models.presets import megatron_layout, model_config, vllm_layout
from reshard.common.plan.planner import PlanOptions, make_plan
from reshard.tools.synth import tensor_value

SEED, STEP = 7, 2


def canonical(cfg):
    return {n: tensor_value(SEED, n, STEP, t.shape, torch.bfloat16) for n, t in cfg.tensors().items()}


def megatron_buffers(cfg, tp, full):
    """Megatron TP shards built by hand from the canonical tensors."""
    h, hd = cfg.hidden, cfg.head_dim
    qpg, groups, ffn = cfg.heads // cfg.kv_heads, cfg.kv_heads // tp, cfg.intermediate // tp
    vp = -(-cfg.vocab // (128 * tp)) * 128 * tp
    out = []
    for r in range(tp):
        b = {}
        for mg, hf in (("embedding.word_embeddings.weight", "model.embed_tokens.weight"), ("output_layer.weight", "lm_head.weight")):
            padded = torch.zeros(vp, h, dtype=torch.bfloat16)
            padded[: cfg.vocab] = full[hf]
            b[mg] = padded.chunk(tp)[r].clone()
        for i in range(cfg.layers):
            p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
            q = full[p + "self_attn.q_proj.weight"].view(cfg.kv_heads, qpg * hd, h)
            k = full[p + "self_attn.k_proj.weight"].view(cfg.kv_heads, hd, h)
            v = full[p + "self_attn.v_proj.weight"].view(cfg.kv_heads, hd, h)
            b[m + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1)[r * groups:(r + 1) * groups].reshape(-1, h).clone()
            b[m + "self_attention.linear_qkv.layer_norm_weight"] = full[p + "input_layernorm.weight"].clone()
            b[m + "self_attention.linear_proj.weight"] = full[p + "self_attn.o_proj.weight"].chunk(tp, 1)[r].clone()
            b[m + "mlp.linear_fc1.layer_norm_weight"] = full[p + "post_attention_layernorm.weight"].clone()
            b[m + "mlp.linear_fc1.weight"] = torch.cat([full[p + "mlp.gate_proj.weight"][r * ffn:(r + 1) * ffn], full[p + "mlp.up_proj.weight"][r * ffn:(r + 1) * ffn]]).clone()
            b[m + "mlp.linear_fc2.weight"] = full[p + "mlp.down_proj.weight"].chunk(tp, 1)[r].clone()
        b["decoder.final_layernorm.weight"] = full["model.norm.weight"].clone()
        out.append(b)
    return out


def expected_vllm(cfg, tp, full, r):
    hd = cfg.head_dim
    reps = max(1, tp // cfg.kv_heads)
    kvn = max(1, cfg.kv_heads // tp)
    kv0 = (r // reps) * kvn
    p = "model.layers.0."
    q = full[p + "self_attn.q_proj.weight"].chunk(tp)[r]
    k = full[p + "self_attn.k_proj.weight"][kv0 * hd:(kv0 + kvn) * hd]
    v = full[p + "self_attn.v_proj.weight"][kv0 * hd:(kv0 + kvn) * hd]
    return torch.cat([q, k, v])


@pytest.mark.parametrize("model,src_tp,dst_tp", [("tiny", 2, 4), ("tiny", 1, 2), ("tiny", 2, 1), ("small", 2, 4)])
def test_megatron_to_vllm_exact(model, src_tp, dst_tp):
    cfg = model_config(model)
    full = canonical(cfg)
    src, dst = megatron_layout(cfg, src_tp), vllm_layout(cfg, dst_tp)
    plan = make_plan(src, dst, PlanOptions(bucket_bytes=8192, direct_min_bytes=4096, max_message_bytes=16384))
    sbufs = megatron_buffers(cfg, src_tp, full)
    dbufs = [{b.name: torch.full(b.shape, float("nan"), dtype=torch.bfloat16) for b in bufs} for bufs in dst.ranks]
    execute_in_memory(plan, sbufs, dbufs)
    ffn = cfg.intermediate // dst_tp
    for r in range(dst_tp):
        d = dbufs[r]
        assert torch.equal(d["model.layers.0.self_attn.qkv_proj.weight"], expected_vllm(cfg, dst_tp, full, r))
        gu = torch.cat([full["model.layers.1.mlp.gate_proj.weight"][r * ffn:(r + 1) * ffn], full["model.layers.1.mlp.up_proj.weight"][r * ffn:(r + 1) * ffn]])
        assert torch.equal(d["model.layers.1.mlp.gate_up_proj.weight"], gu)
        assert torch.equal(d["model.layers.1.mlp.down_proj.weight"], full["model.layers.1.mlp.down_proj.weight"].chunk(dst_tp, 1)[r])
        assert torch.equal(d["model.norm.weight"], full["model.norm.weight"])
        per = d["lm_head.weight"].shape[0]
        rows = full["lm_head.weight"][r * per:(r + 1) * per]
        assert torch.equal(d["lm_head.weight"][: rows.shape[0]], rows)
        assert torch.isnan(d["lm_head.weight"][rows.shape[0]:].float()).all()  # padding untouched


def test_digest_is_deterministic_and_balanced():
    cfg = model_config("small")
    a = make_plan(megatron_layout(cfg, 2), vllm_layout(cfg, 4))
    b = make_plan(megatron_layout(cfg, 2), vllm_layout(cfg, 4))
    assert a.digest == b.digest
    s0, s1 = a.send_bytes(0), a.send_bytes(1)
    assert abs(s0 - s1) <= 0.05 * max(s0, s1)  # replicated norms shared between the two senders
    assert a.total_bytes == sum(b.nbytes for bufs in vllm_layout(cfg, 4).ranks for b in bufs) - sum(
        p.numel * 2 for bufs in vllm_layout(cfg, 4).ranks for b in bufs for p in b.padding)


def test_incompatible_models_name_first_mismatch():
    with pytest.raises(LayoutError, match="shape mismatch"):
        make_plan(megatron_layout(model_config("tiny"), 2), vllm_layout(model_config("small"), 4))


def test_layout_wire_form_shares_replicas_and_keeps_fingerprint():
    from reshard.common.models.frameworks import build

    lay = build("tiny", "framework=vllm,tp=2,dp=3")
    back = layout_from_bytes(layout_bytes(lay))
    assert back.ranks[0] is back.ranks[2] and back.ranks[1] is back.ranks[5]
    assert back == lay and layout_fingerprint(back) == layout_fingerprint(lay)
    # Equal ranks built as separate objects are still one replica group to the planner.
    unshared = Layout(lay.tensors, tuple(tuple(b for b in bufs) for bufs in lay.ranks))
    assert unshared.ranks[0] is not unshared.ranks[2]
    assert layout_fingerprint(unshared) == layout_fingerprint(lay)
    plan = make_plan(build("tiny", "framework=megatron,tp=2"), unshared)
    assert plan.primary_of == {2: 0, 3: 1, 4: 0, 5: 1}


def test_message_table_matches_messages():
    from reshard.common.models.frameworks import build

    plan = make_plan(build("tiny", "framework=megatron,tp=2"), build("tiny", "framework=vllm,tp=2,dp=2"),
                     PlanOptions(bucket_bytes=4096, direct_min_bytes=1024, max_message_bytes=8192))
    t = plan.message_table()
    msgs = plan.messages
    assert [(m.src, m.dst, m.round, m.tag, m.nbytes, m.relay, len(m.segments)) for m in msgs] == list(
        zip(t["src"].tolist(), t["dst"].tolist(), t["round"].tolist(), t["tag"].tolist(), t["nbytes"].tolist(),
            t["relay"].tolist(), t["segments"].tolist()))
    assert t["relay"].any() and not t["src"].flags.writeable
    assert plan.link_bytes() == {k: v for k, v in _links(msgs).items()}


def _links(msgs):
    out = {}
    for m in msgs:
        out[(m.relay, m.src, m.dst)] = out.get((m.relay, m.src, m.dst), 0) + m.nbytes
    return out


def test_fingerprint_memo_follows_content():
    import dataclasses

    from reshard.common.layout.tables import build_table
    from reshard.common.models.frameworks import build

    a, b = build("tiny", "framework=megatron,tp=2"), build("tiny", "framework=vllm,tp=2")
    make_plan(a, b)  # the planner leaves the fingerprints it computed on both layouts
    for x in (a, b):
        assert layout_fingerprint(x) == build_table(x, {}, require_full_buffers=False, check=False).fingerprint()[:16]
    c = dataclasses.replace(a, allow_casts=True)  # a new layout starts with no memo
    assert layout_fingerprint(c) != layout_fingerprint(a) and c == dataclasses.replace(a, allow_casts=True)


def test_plans_in_threads_agree_and_restore_numpy_settings():
    """Plans made at once in several threads give one digest, and the process-wide settings the
    planner changes while it runs (numpy's huge-page advice) are restored after the last one."""
    import threading

    import numpy as np

    from reshard.common.models.frameworks import build

    hp = getattr(np._core.multiarray, "_set_madvise_hugepage", None)
    before = hp(True) if hp else None
    src, dst = build("small", "framework=megatron,tp=2,pp=2"), build("small", "framework=vllm,tp=2,dp=2")
    digests: list[str] = []
    threads = [threading.Thread(target=lambda: digests.append(make_plan(src, dst).digest)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(digests) == 4 and len(set(digests)) == 1
    if hp:
        assert hp(before) is True  # back to what it was before the plans
