"""Canonical tensor names: Hugging Face checkpoint names, the one vocabulary both sides agree on.

A trainer holding a Hugging Face model (plain, FSDP2, tensor parallel) names its parameters
canonically already, up to the wrapper prefixes that torch.compile, activation checkpointing
and FSDP1 insert. Serving engines fuse some of them (vLLM's `qkv_proj` holds q, k and v;
`gate_up_proj` holds gate and up; DeepSeek's MLA `fused_qkv_a_proj` holds `q_a_proj` and
`kv_a_proj_with_mqa`): `FUSED` says which, in the order they are stacked."""

from __future__ import annotations

from collections.abc import Callable, Mapping

# Fused module -> the canonical modules it stacks along its output rows, in order (what vLLM's
# `packed_modules_mapping` says for its Llama-family, Qwen-MoE and DeepSeek-V2/V3 models; a live
# vLLM model's own mapping is read too, and wins: `fused_names`).
FUSED: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),  # MLA with q_lora_rank: replicated on every TP rank
}


def fused_names(packed: Mapping[str, list[str] | tuple[str, ...]] | None) -> dict[str, tuple[str, ...]]:
    """`FUSED`, updated by a vLLM model's `packed_modules_mapping` (None: `FUSED` alone)."""
    out = dict(FUSED)
    for k, v in (packed or {}).items():
        out[k] = tuple(v)
    return out

# Stacked experts: vLLM's parameter of a fused-MoE module -> the canonical (transformers) tensor it
# holds, and how: `w13_weight` [local experts, 2 * I / tp, H] holds this rank's rows of the gate
# half then of the up half of `gate_up_proj` [E, 2 * I, H]; `w2_weight` [local experts, H, I / tp]
# holds its columns of `down_proj` [E, H, I].
MOE_STACKED: dict[str, str] = {"w13_weight": "gate_up_proj", "w2_weight": "down_proj"}

# vLLM module paths that differ from transformers' in-memory ones, by architecture.
VLLM_RENAMES: dict[str, tuple[tuple[str, str], ...]] = {
    "MixtralForCausalLM": ((".block_sparse_moe.", ".mlp."),),
}
VLLM_DROP_PARTS = ("routed_experts",)  # vLLM's inner module of a fused-MoE layer


def vllm_module_name(architecture: str, module_name: str) -> str:
    """A vLLM module's canonical (transformers) path."""
    name = ".".join(p for p in module_name.split(".") if p not in VLLM_DROP_PARTS)
    for old, new in VLLM_RENAMES.get(architecture, ()):
        name = name.replace(old, new)
    return name


# Prefixes wrappers put in front of parameter names; they are not part of the model's names.
WRAPPER_PARTS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "module")

Names = Callable[[str], str] | Mapping[str, str] | None


def strip_wrappers(name: str) -> str:
    """`model._orig_mod.layers.0._checkpoint_wrapped_module.mlp...` -> `model.layers.0.mlp...`."""
    return ".".join(p for p in name.split(".") if p not in WRAPPER_PARTS)


def canonical_name(name: str, names: Names = None) -> str:
    """The canonical name of a parameter: `names` (a function or a mapping of the names that
    differ) applied after the wrapper prefixes are stripped."""
    name = strip_wrappers(name)
    if names is None:
        return name
    if callable(names):
        return names(name)
    return names.get(name, name)


def unfused(module_name: str, fused: Mapping[str, tuple[str, ...]] | None = None) -> tuple[str, ...] | None:
    """The canonical module names a fused module stacks (`...self_attn.qkv_proj` ->
    `...self_attn.q_proj`, `...k_proj`, `...v_proj`), or None when it is not fused."""
    prefix, _, last = module_name.rpartition(".")
    parts = (fused or FUSED).get(last)
    if parts is None:
        return None
    return tuple(f"{prefix}.{p}" if prefix else p for p in parts)
