"""The demo's synthetic Llama-shaped models and their two framework layouts.

A thin layer over `frameworks`: `megatron_layout(cfg, tp)` is Megatron-core with
tensor parallelism (fused, per-query-group interleaved `linear_qkv`; `linear_fc1` =
this rank's gate slice then its up slice; vocabulary padded to a multiple of
128 x TP), `vllm_layout(cfg, tp)` is vLLM (`qkv_proj` = this rank's q, k, v rows,
KV heads replicated when TP exceeds their count; `gate_up_proj` = gate then up;
vocabulary padded to a multiple of 64). Canonical names are Hugging Face's.
"""

from __future__ import annotations

from reshard.common.layout.core import Layout
from reshard.common.models.frameworks import MODEL_SPECS, ModelSpec, megatron, model_spec, vllm

MODELS = MODEL_SPECS
model_config = model_spec


def megatron_layout(cfg: ModelSpec, tp: int) -> Layout:
    return megatron(cfg, tp=tp)


def vllm_layout(cfg: ModelSpec, tp: int) -> Layout:
    return vllm(cfg, tp=tp)
