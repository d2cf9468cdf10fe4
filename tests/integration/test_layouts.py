"""Real updates between framework layouts other than the demo's, over gloo, checked
with `reshard dump` against the test's own regeneration of the weights."""

import pytest
import torch

from reshard.common.models.frameworks import model_spec

from .cluster import Cluster

pytestmark = pytest.mark.integration

CASES = [
    # Megatron TP x PP (uneven stages: 3 layers over 2 stages) with tied embeddings -> vLLM TP with 2 replicas.
    ("tiny-moe", "framework=megatron,tp=2,pp=2", "framework=vllm,tp=2,dp=2"),
    # FSDP1 flat shards (ranges crossing tensor boundaries) -> vLLM TP.
    ("tiny", "framework=fsdp,dp=3", "framework=vllm,tp=4"),
    # A small MoE (MLA attention, shared expert) with EP on the trainer and TP on inference.
    ("tiny-mla", "framework=megatron,tp=1,pp=1,dp=4,ep=4", "framework=vllm,tp=2", 0),
    # Experts over EP on inference, from FSDP2 per-parameter shards; with small buckets the DP
    # ranks' shared attention and dense weights (more than a bucket) leave the trainer once and
    # are relayed between them.
    ("tiny-moe", "framework=fsdp,dp=2,flat=0", "framework=vllm,tp=2,dp=2,ep=1", 8192),
]


# Over 12 s each: with the slow tests (the planner's property tests cover these layouts in make test).
@pytest.mark.slow
@pytest.mark.parametrize("model,src,dst,bucket", [c if len(c) == 4 else (*c, 0) for c in CASES])
def test_layout_pair_end_to_end(model, src, dst, bucket):
    c = Cluster(model, trainer_layout=src, inference_layout=dst, bucket_bytes=bucket)
    try:
        rc, out, err = c.update()
        assert rc == 0, err + c.logs()
        assert out["verified"]
        step = out["committed"]["step"]
        names = list(model_spec(model).tensors())
        picked = names[:3] + names[len(names) // 2 : len(names) // 2 + 3] + names[-3:]
        picked += [n for n in names if ".experts.5." in n or "shared_experts" in n or "kv_b_proj" in n][:4]
        for name in picked:
            got, version = c.dump(name)
            assert version["step"] == step
            assert torch.equal(got, c.expected(name, step)), f"{name} differs"
    finally:
        c.close()


@pytest.mark.slow  # over 15 s; tests/unit/test_flat_and_casts.py covers casts in make test
def test_fp32_master_weights_cast_on_the_sender():
    """A declared cast end to end: the trainer holds float32 masters (its own optimizer
    trajectory), inference receives bfloat16 = the masters rounded, verified by checksums."""
    from reshard.tools.synth import tensor_value

    c = Cluster("small", trainer_args=("--master-dtype", "float32"))
    try:
        for _ in range(2):
            rc, out, err = c.update()
            assert rc == 0, err + c.logs()
            assert out["verified"]
        step = out["committed"]["step"]
        spec = model_spec("small").tensors()
        for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.2.mlp.up_proj.weight", "lm_head.weight"):
            got, _ = c.dump(name)
            want = tensor_value(c.seed, name, step, spec[name].shape, torch.float32).to(torch.bfloat16)
            assert got.dtype == torch.bfloat16 and torch.equal(got, want), name
            # Not the bf16-trained trajectory: the masters really were float32.
            assert not torch.equal(got, c.expected(name, step))
        c.restart_trainer("--transfer-method", "serialized")  # the baseline casts during its gather
        rc, out, err = c.update()
        assert rc == 0, err
        got, _ = c.dump("lm_head.weight")
        want = tensor_value(c.seed, "lm_head.weight", out["committed"]["step"], spec["lm_head.weight"].shape, torch.float32)
        assert torch.equal(got, want.to(torch.bfloat16))
    finally:
        c.close()


@pytest.mark.slow  # about 15 s; tests/unit/test_precision.py covers it in make test
def test_fsdp2_fp32_masters_negotiated_into_bf16():
    """No declaration: the trainer's layout says float32 (what FSDP2 under a bf16 mixed-precision
    policy holds), inference's says bfloat16 (what it serves); the sender casts, bf16 crosses."""
    from reshard.tools.synth import tensor_value

    c = Cluster("small", inference_workers=2, trainer_layout="framework=fsdp,dp=2,flat=0,dtype=float32",
                inference_layout="framework=vllm,tp=2")
    try:
        rc, out, err = c.update()
        assert rc == 0, err + c.logs()
        assert out["verified"]
        spec = model_spec("small").tensors()
        bf16_bytes = sum(s.numel * 2 for s in spec.values())
        # Each inference rank's pieces, 2 bytes an element: the replicated norms twice, nothing in fp32.
        assert bf16_bytes <= int(out["bytes"]) < 1.1 * bf16_bytes, out
        step = out["committed"]["step"]
        for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.2.mlp.up_proj.weight", "lm_head.weight"):
            got, _ = c.dump(name)
            want = tensor_value(c.seed, name, step, spec[name].shape, torch.float32).to(torch.bfloat16)
            assert got.dtype == torch.bfloat16 and torch.equal(got, want), name
        assert "cast on the sender" in c.logs()
    finally:
        c.close()
