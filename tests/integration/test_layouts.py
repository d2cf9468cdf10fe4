"""Real updates between framework layouts other than the demo's, over gloo, checked
with `reshard dump` against the test's own regeneration of the weights."""

import pytest
import torch

from reshard.common.frameworks import model_spec

from .cluster import Cluster

pytestmark = pytest.mark.integration

CASES = [
    # Megatron TP x PP (uneven stages: 3 layers over 2 stages) with tied embeddings -> vLLM TP with 2 replicas.
    ("tiny-moe", "framework=megatron,tp=2,pp=2", "framework=vllm,tp=2,dp=2"),
    # FSDP1 flat shards (ranges crossing tensor boundaries) -> vLLM TP.
    ("tiny", "framework=fsdp,dp=3", "framework=vllm,tp=4"),
    # A small MoE (MLA attention, shared expert) with EP on the trainer and TP on inference.
    ("tiny-mla", "framework=megatron,tp=1,pp=1,dp=4,ep=4", "framework=vllm,tp=2"),
    # Experts over EP on inference, from FSDP2 per-parameter shards.
    ("tiny-moe", "framework=fsdp,dp=2,flat=0", "framework=vllm,tp=2,dp=2,ep=1"),
]


@pytest.mark.parametrize("model,src,dst", CASES)
def test_layout_pair_end_to_end(model, src, dst):
    c = Cluster(model, trainer_layout=src, inference_layout=dst)
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
