"""Synthetic Llama-shaped models and the layouts real frameworks give them.

`megatron_layout` lays a model out as Megatron-core does with tensor parallelism
(fused, per-query-group interleaved `linear_qkv`; `linear_fc1` = this rank's gate
slice then its up slice; vocabulary padded to a multiple of 128 x TP).
`vllm_layout` lays it out as vLLM does (`qkv_proj` = this rank's q, k, v rows,
KV heads replicated when TP exceeds their count; `gate_up_proj` = gate then up;
vocabulary padded to a multiple of 64). Canonical names are Hugging Face's.
"""

from __future__ import annotations

import dataclasses

from .layout import Box, Layout, LayoutError, LocalBuffer, Piece, TensorSpec


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LlamaConfig:
    hidden: int
    """Model width."""
    heads: int
    """Query heads."""
    kv_heads: int
    """Key/value heads (GQA groups)."""
    intermediate: int
    """MLP width."""
    layers: int
    """Decoder layers."""
    vocab: int
    """Vocabulary size (unpadded)."""
    dtype: str = "bfloat16"
    """Dtype of every tensor."""

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} is not a multiple of heads={self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def tensors(self) -> dict[str, TensorSpec]:
        h, hd, dt = self.hidden, self.head_dim, self.dtype
        out = [TensorSpec("model.embed_tokens.weight", (self.vocab, h), dt)]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out += [
                TensorSpec(p + "input_layernorm.weight", (h,), dt),
                TensorSpec(p + "self_attn.q_proj.weight", (self.heads * hd, h), dt),
                TensorSpec(p + "self_attn.k_proj.weight", (self.kv_heads * hd, h), dt),
                TensorSpec(p + "self_attn.v_proj.weight", (self.kv_heads * hd, h), dt),
                TensorSpec(p + "self_attn.o_proj.weight", (h, self.heads * hd), dt),
                TensorSpec(p + "post_attention_layernorm.weight", (h,), dt),
                TensorSpec(p + "mlp.gate_proj.weight", (self.intermediate, h), dt),
                TensorSpec(p + "mlp.up_proj.weight", (self.intermediate, h), dt),
                TensorSpec(p + "mlp.down_proj.weight", (h, self.intermediate), dt),
            ]
        out += [TensorSpec("model.norm.weight", (h,), dt), TensorSpec("lm_head.weight", (self.vocab, h), dt)]
        return {t.name: t for t in out}

    @property
    def payload_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors().values())


MODELS: dict[str, LlamaConfig] = {
    # Small enough for unit tests: KV heads (2) fewer than inference TP (4).
    "tiny": LlamaConfig(hidden=64, heads=4, kv_heads=2, intermediate=128, layers=2, vocab=1030),
    # Integration tests and CI: a few MB.
    "small": LlamaConfig(hidden=256, heads=8, kv_heads=2, intermediate=704, layers=4, vocab=5003),
    # About 100 MB of bf16.
    "medium": LlamaConfig(hidden=1024, heads=16, kv_heads=4, intermediate=2816, layers=4, vocab=16003),
    # The demo default: about 1.1 GB (1.06 GiB) of bf16, replicated KV heads on vLLM TP=4.
    "llama-1g": LlamaConfig(hidden=2048, heads=16, kv_heads=2, intermediate=5632, layers=10, vocab=32003),
    # Llama-3-8B's shape: 16 GB of bf16, for machines that have the memory.
    "llama3-8b": LlamaConfig(hidden=4096, heads=32, kv_heads=8, intermediate=14336, layers=32, vocab=128256),
}


def model_config(name: str) -> LlamaConfig:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; valid models: {', '.join(MODELS)}") from None


def _pad(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def _rows(tensor: str, buf_row: int, row: int, rows: int, cols: int) -> Piece:
    return Piece(tensor, Box((buf_row, 0), (rows, cols)), Box((row, 0), (rows, cols)))


def _vocab_buffer(name: str, tensor: str, cfg: LlamaConfig, tp: int, rank: int, multiple: int) -> LocalBuffer:
    vp = _pad(cfg.vocab, multiple)
    per = vp // tp
    lo, hi = rank * per, (rank + 1) * per
    real = max(0, min(hi, cfg.vocab) - lo)
    pieces = (_rows(tensor, 0, lo, real, cfg.hidden),) if real else ()
    padding = (Box((real, 0), (per - real, cfg.hidden)),) if real < per else ()
    return LocalBuffer(name, (per, cfg.hidden), cfg.dtype, pieces, padding)


def _replicated(name: str, tensor: str, n: int, dtype: str) -> LocalBuffer:
    return LocalBuffer(name, (n,), dtype, (Piece(tensor, Box((0,), (n,)), Box((0,), (n,))),))


def _cols(name: str, tensor: str, rows: int, cols_total: int, tp: int, rank: int, dtype: str) -> LocalBuffer:
    per = cols_total // tp
    return LocalBuffer(name, (rows, per), dtype, (Piece(tensor, Box((0, 0), (rows, per)), Box((0, rank * per), (rows, per))),))


def _check_tp(cfg: LlamaConfig, tp: int, what: str) -> None:
    if tp < 1:
        raise LayoutError(f"{what}: tp={tp} must be at least 1")
    for field, n in (("heads", cfg.heads), ("intermediate", cfg.intermediate)):
        if n % tp:
            raise LayoutError(f"{what}: {field}={n} is not divisible by tp={tp}")


def megatron_layout(cfg: LlamaConfig, tp: int, *, pad_multiple: int = 128) -> Layout:
    """Megatron-core GPT layout with tensor parallelism `tp` (TE names, fused norms)."""
    _check_tp(cfg, tp, "megatron")
    if cfg.kv_heads % tp:
        raise LayoutError(f"megatron: kv_heads={cfg.kv_heads} (query groups) is not divisible by tp={tp}")
    h, hd = cfg.hidden, cfg.head_dim
    q_per_group = cfg.heads // cfg.kv_heads
    groups = cfg.kv_heads // tp
    ffn = cfg.intermediate // tp
    ranks = []
    for r in range(tp):
        bufs = [_vocab_buffer("embedding.word_embeddings.weight", "model.embed_tokens.weight", cfg, tp, r, pad_multiple * tp)]
        for i in range(cfg.layers):
            hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
            pieces, row = [], 0
            for g in range(r * groups, (r + 1) * groups):
                pieces.append(_rows(hf + "self_attn.q_proj.weight", row, g * q_per_group * hd, q_per_group * hd, h))
                row += q_per_group * hd
                pieces.append(_rows(hf + "self_attn.k_proj.weight", row, g * hd, hd, h))
                row += hd
                pieces.append(_rows(hf + "self_attn.v_proj.weight", row, g * hd, hd, h))
                row += hd
            bufs += [
                _replicated(mg + "self_attention.linear_qkv.layer_norm_weight", hf + "input_layernorm.weight", h, cfg.dtype),
                LocalBuffer(mg + "self_attention.linear_qkv.weight", (row, h), cfg.dtype, tuple(pieces)),
                _cols(mg + "self_attention.linear_proj.weight", hf + "self_attn.o_proj.weight", h, cfg.heads * hd, tp, r, cfg.dtype),
                _replicated(mg + "mlp.linear_fc1.layer_norm_weight", hf + "post_attention_layernorm.weight", h, cfg.dtype),
                LocalBuffer(mg + "mlp.linear_fc1.weight", (2 * ffn, h), cfg.dtype, (
                    _rows(hf + "mlp.gate_proj.weight", 0, r * ffn, ffn, h),
                    _rows(hf + "mlp.up_proj.weight", ffn, r * ffn, ffn, h),
                )),
                _cols(mg + "mlp.linear_fc2.weight", hf + "mlp.down_proj.weight", h, cfg.intermediate, tp, r, cfg.dtype),
            ]
        bufs += [
            _replicated("decoder.final_layernorm.weight", "model.norm.weight", h, cfg.dtype),
            _vocab_buffer("output_layer.weight", "lm_head.weight", cfg, tp, r, pad_multiple * tp),
        ]
        ranks.append(tuple(bufs))
    return Layout(cfg.tensors(), tuple(ranks))


def vllm_layout(cfg: LlamaConfig, tp: int, *, pad_multiple: int = 64) -> Layout:
    """vLLM Llama layout with tensor parallelism `tp` (fused qkv_proj and gate_up_proj)."""
    _check_tp(cfg, tp, "vllm")
    if cfg.kv_heads % tp and tp % cfg.kv_heads:
        raise LayoutError(f"vllm: kv_heads={cfg.kv_heads} and tp={tp} must divide one another")
    h, hd = cfg.hidden, cfg.head_dim
    q_heads = cfg.heads // tp
    kv_per_rank = max(1, cfg.kv_heads // tp)
    replicas = max(1, tp // cfg.kv_heads)
    ffn = cfg.intermediate // tp
    ranks = []
    for r in range(tp):
        kv0 = (r // replicas) * kv_per_rank
        bufs = [_vocab_buffer("model.embed_tokens.weight", "model.embed_tokens.weight", cfg, tp, r, pad_multiple)]
        for i in range(cfg.layers):
            p = f"model.layers.{i}."
            qrows, kvrows = q_heads * hd, kv_per_rank * hd
            bufs += [
                _replicated(p + "input_layernorm.weight", p + "input_layernorm.weight", h, cfg.dtype),
                LocalBuffer(p + "self_attn.qkv_proj.weight", (qrows + 2 * kvrows, h), cfg.dtype, (
                    _rows(p + "self_attn.q_proj.weight", 0, r * qrows, qrows, h),
                    _rows(p + "self_attn.k_proj.weight", qrows, kv0 * hd, kvrows, h),
                    _rows(p + "self_attn.v_proj.weight", qrows + kvrows, kv0 * hd, kvrows, h),
                )),
                _cols(p + "self_attn.o_proj.weight", p + "self_attn.o_proj.weight", h, cfg.heads * hd, tp, r, cfg.dtype),
                _replicated(p + "post_attention_layernorm.weight", p + "post_attention_layernorm.weight", h, cfg.dtype),
                LocalBuffer(p + "mlp.gate_up_proj.weight", (2 * ffn, h), cfg.dtype, (
                    _rows(p + "mlp.gate_proj.weight", 0, r * ffn, ffn, h),
                    _rows(p + "mlp.up_proj.weight", ffn, r * ffn, ffn, h),
                )),
                _cols(p + "mlp.down_proj.weight", p + "mlp.down_proj.weight", h, cfg.intermediate, tp, r, cfg.dtype),
            ]
        bufs += [
            _replicated("model.norm.weight", "model.norm.weight", h, cfg.dtype),
            _vocab_buffer("lm_head.weight", "lm_head.weight", cfg, tp, r, pad_multiple),
        ]
        ranks.append(tuple(bufs))
    return Layout(cfg.tensors(), tuple(ranks))


LAYOUTS = {"megatron": megatron_layout, "vllm": vllm_layout}


def build_layout(framework: str, model: str, tp: int) -> Layout:
    try:
        fn = LAYOUTS[framework]
    except KeyError:
        raise ValueError(f"unknown framework {framework!r}; valid frameworks: {', '.join(LAYOUTS)}") from None
    return fn(model_config(model), tp)
