"""Model shapes and the layouts frameworks give them, from a model config and a
parallel config in the frameworks' own terms.

Models: dense Llama-style (GQA), MoE with GQA (Qwen3-MoE), MoE with multi-head
latent attention (DeepSeek-V3, Kimi-K2). Shapes only: no weights are needed to plan.

Frameworks:
- megatron: tp, pp, cp, dp (world = tp*pp*cp*dp), ep and etp folded into the
  data-parallel ranks as Megatron folds them, vpp (virtual pipeline chunks).
- vllm: tp, dp (replicas), ep (expert parallel on or off).
- fsdp: dp with flat=1 (FSDP1: one flat parameter, evenly split, padded) or flat=0
  (FSDP2: per-parameter Shard(0), padded to equal local shapes).

Canonical names are Hugging Face's. Spec strings read `framework=megatron,tp=2,pp=2`.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools

import numpy as np

from reshard.common.layout.columns import DTYPE_IDS, ClassCols, ColumnRanks, concat, fit_width
from reshard.common.layout.core import DTYPES, Box, Layout, LayoutError, LocalBuffer, Piece, TensorSpec, flat_pieces
from reshard.common.layout.placement import chunk_sizes


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    hidden: int
    """Model width."""
    layers: int
    """Decoder layers."""
    vocab: int
    """Vocabulary size (unpadded)."""
    heads: int
    """Query heads."""
    kv_heads: int = 0
    """KV heads (GQA groups); unused with MLA."""
    head_size: int = 0
    """Head size (GQA); 0: hidden // heads."""
    intermediate: int = 0
    """Dense MLP width."""
    attention: str = "gqa"
    """gqa | mla (multi-head latent attention)."""
    qk_norm: bool = False
    """Per-head q/k RMSNorm (Qwen3)."""
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    experts: int = 0
    """Routed experts per MoE layer (0: dense)."""
    moe_intermediate: int = 0
    """Width of one routed expert."""
    shared_experts: int = 0
    """Shared experts (fused into one MLP of shared_experts * moe_intermediate)."""
    first_dense: int = 0
    """Leading layers with a dense MLP in an MoE model."""
    tie_embeddings: bool = False
    """lm_head shares model.embed_tokens.weight."""
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.attention not in ("gqa", "mla"):
            raise ValueError(f"attention must be 'gqa' or 'mla', not {self.attention!r}")
        if self.attention == "gqa" and (not self.kv_heads or self.heads % self.kv_heads):
            raise ValueError(f"heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    def is_moe(self, layer: int) -> bool:
        return self.experts > 0 and layer >= self.first_dense

    def layer_tensors(self, i: int) -> list[TensorSpec]:
        h, dt, p = self.hidden, self.dtype, f"model.layers.{i}."
        out = [TensorSpec(p + "input_layernorm.weight", (h,), dt), TensorSpec(p + "post_attention_layernorm.weight", (h,), dt)]
        if self.attention == "gqa":
            hd = self.head_dim
            out += [TensorSpec(p + "self_attn.q_proj.weight", (self.heads * hd, h), dt),
                    TensorSpec(p + "self_attn.k_proj.weight", (self.kv_heads * hd, h), dt),
                    TensorSpec(p + "self_attn.v_proj.weight", (self.kv_heads * hd, h), dt),
                    TensorSpec(p + "self_attn.o_proj.weight", (h, self.heads * hd), dt)]
            if self.qk_norm:
                out += [TensorSpec(p + "self_attn.q_norm.weight", (hd,), dt), TensorSpec(p + "self_attn.k_norm.weight", (hd,), dt)]
        else:
            qk = self.qk_nope_dim + self.qk_rope_dim
            out += [TensorSpec(p + "self_attn.q_a_proj.weight", (self.q_lora_rank, h), dt),
                    TensorSpec(p + "self_attn.q_a_layernorm.weight", (self.q_lora_rank,), dt),
                    TensorSpec(p + "self_attn.q_b_proj.weight", (self.heads * qk, self.q_lora_rank), dt),
                    TensorSpec(p + "self_attn.kv_a_proj_with_mqa.weight", (self.kv_lora_rank + self.qk_rope_dim, h), dt),
                    TensorSpec(p + "self_attn.kv_a_layernorm.weight", (self.kv_lora_rank,), dt),
                    TensorSpec(p + "self_attn.kv_b_proj.weight", (self.heads * (self.qk_nope_dim + self.v_head_dim), self.kv_lora_rank), dt),
                    TensorSpec(p + "self_attn.o_proj.weight", (h, self.heads * self.v_head_dim), dt)]
        if not self.is_moe(i):
            out += _mlp(p + "mlp.", h, self.intermediate, dt)
        else:
            out.append(TensorSpec(p + "mlp.gate.weight", (self.experts, h), dt))
            for e in range(self.experts):
                out += _mlp(f"{p}mlp.experts.{e}.", h, self.moe_intermediate, dt)
            if self.shared_experts:
                out += _mlp(p + "mlp.shared_experts.", h, self.shared_experts * self.moe_intermediate, dt)
        return out

    def tensors(self) -> dict[str, TensorSpec]:
        dt = self.dtype
        out = [TensorSpec("model.embed_tokens.weight", (self.vocab, self.hidden), dt)]
        for i in range(self.layers):
            out += self.layer_tensors(i)
        out.append(TensorSpec("model.norm.weight", (self.hidden,), dt))
        if not self.tie_embeddings:
            out.append(TensorSpec("lm_head.weight", (self.vocab, self.hidden), dt))
        return {t.name: t for t in out}

    @property
    def payload_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors().values())


def _mlp(prefix: str, h: int, inter: int, dt: str) -> list[TensorSpec]:
    return [TensorSpec(prefix + "gate_proj.weight", (inter, h), dt), TensorSpec(prefix + "up_proj.weight", (inter, h), dt),
            TensorSpec(prefix + "down_proj.weight", (h, inter), dt)]


MODEL_SPECS: dict[str, ModelSpec] = {
    "tiny": ModelSpec(hidden=64, heads=4, kv_heads=2, intermediate=128, layers=2, vocab=1030),
    "small": ModelSpec(hidden=256, heads=8, kv_heads=2, intermediate=704, layers=4, vocab=5003),
    "tiny-moe": ModelSpec(hidden=64, heads=4, kv_heads=2, intermediate=128, layers=3, vocab=1030, qk_norm=True,
                          experts=8, moe_intermediate=32, first_dense=1, tie_embeddings=True),
    "tiny-mla": ModelSpec(hidden=64, heads=4, layers=2, vocab=1030, attention="mla", q_lora_rank=32, kv_lora_rank=16,
                          qk_nope_dim=16, qk_rope_dim=8, v_head_dim=16, intermediate=128, experts=8, moe_intermediate=32,
                          shared_experts=1, first_dense=1),
    # About 100 MB of bf16.
    "medium": ModelSpec(hidden=1024, heads=16, kv_heads=4, intermediate=2816, layers=4, vocab=16003),
    # The demo default: about 1.1 GB (1.06 GiB) of bf16, replicated KV heads on vLLM TP=4.
    "llama-1g": ModelSpec(hidden=2048, heads=16, kv_heads=2, intermediate=5632, layers=10, vocab=32003),
    "llama3-8b": ModelSpec(hidden=4096, heads=32, kv_heads=8, intermediate=14336, layers=32, vocab=128256),
    "llama3-70b": ModelSpec(hidden=8192, heads=64, kv_heads=8, intermediate=28672, layers=80, vocab=128256),
    "qwen3-235b-a22b": ModelSpec(hidden=4096, heads=64, kv_heads=4, head_size=128, layers=94, vocab=151936, qk_norm=True,
                                 experts=128, moe_intermediate=1536),
    "deepseek-v3": ModelSpec(hidden=7168, heads=128, layers=61, vocab=129280, attention="mla", q_lora_rank=1536,
                             kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128, intermediate=18432,
                             experts=256, moe_intermediate=2048, shared_experts=1, first_dense=3),
    "kimi-k2": ModelSpec(hidden=7168, heads=64, layers=61, vocab=163840, attention="mla", q_lora_rank=1536,
                         kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128, intermediate=18432,
                         experts=384, moe_intermediate=2048, shared_experts=1, first_dense=1),
}


@functools.lru_cache(maxsize=4)
def _tensors(m: ModelSpec) -> dict[str, TensorSpec]:
    """The model's tensors, one dict shared by the layouts built for it (the planner reads a
    shared dict's columns once). Never modified: layouts only read it."""
    return m.tensors()


def model_spec(name: str) -> ModelSpec:
    try:
        return MODEL_SPECS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; valid models: {', '.join(MODEL_SPECS)}") from None


# -- building blocks -------------------------------------------------------------------

def _pad(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _div(n: int, k: int, what: str) -> int:
    if n % k:
        raise LayoutError(f"{what}: {n} is not divisible by {k}")
    return n // k


def _rows(tensor: str, buf_row: int, row: int, rows: int, cols: int) -> Piece:
    return Piece(tensor, Box((buf_row, 0), (rows, cols)), Box((row, 0), (rows, cols)))


def _whole(name: str, spec: TensorSpec) -> LocalBuffer:
    return LocalBuffer(name, spec.shape, spec.dtype, (Piece(spec.name, Box.full(spec.shape), Box.full(spec.shape)),))


def _row_split(name: str, spec: TensorSpec, tp: int, r: int) -> LocalBuffer:
    per = _div(spec.shape[0], tp, f"{spec.name} rows")
    return LocalBuffer(name, (per, *spec.shape[1:]), spec.dtype, (_rows(spec.name, 0, r * per, per, spec.shape[1]),))


def _col_split(name: str, spec: TensorSpec, tp: int, r: int) -> LocalBuffer:
    rows, cols = spec.shape
    per = _div(cols, tp, f"{spec.name} columns")
    return LocalBuffer(name, (rows, per), spec.dtype, (Piece(spec.name, Box((0, 0), (rows, per)), Box((0, r * per), (rows, per))),))


def _fused_rows(name: str, specs: list[TensorSpec], tp: int, r: int) -> LocalBuffer:
    """This rank's row slice of each tensor, one after another (gate then up, q then k then v)."""
    pieces, row = [], 0
    for s in specs:
        per = _div(s.shape[0], tp, f"{s.name} rows")
        pieces.append(_rows(s.name, row, r * per, per, s.shape[1]))
        row += per
    return LocalBuffer(name, (row, specs[0].shape[1]), specs[0].dtype, tuple(pieces))


def _vocab(name: str, spec: TensorSpec, tp: int, r: int, multiple: int) -> LocalBuffer:
    vocab, h = spec.shape
    per = _pad(vocab, multiple) // tp
    lo = r * per
    real = max(0, min(lo + per, vocab) - lo)
    pieces = (_rows(spec.name, 0, lo, real, h),) if real else ()
    padding = (Box((real, 0), (per - real, h)),) if real < per else ()
    return LocalBuffer(name, (per, h), spec.dtype, pieces, padding)


# -- vLLM ----------------------------------------------------------------------------

def vllm(m: ModelSpec, tp: int = 1, dp: int = 1, ep: int = 0, pad_multiple: int = 64) -> Layout:
    """vLLM's layout: TP ranks per replica, `dp` identical replicas; ep=1 puts whole experts
    on ranks (expert parallel over tp*dp), ep=0 splits every expert over TP. Dense buffers are
    built as objects per TP rank, routed experts as columns (`reshard.common.layout.columns`)."""
    tensors = _tensors(m)
    moe_ep = bool(ep and m.experts)
    if moe_ep:
        per = _div(m.experts, tp * dp, "experts over expert-parallel ranks")
    ctx = _Columns(m, tensors)
    dense = [ctx.block(_vllm_rank(m, tensors, tp, r, pad_multiple)) for r in range(tp)]
    if not moe_ep:
        classes = [concat([dense[r], _vllm_experts(ctx, np.arange(m.experts), tp, r)]) if m.experts else dense[r]
                   for r in range(tp)]
        return Layout(tensors, ctx.ranks(classes, [r for _ in range(dp) for r in range(tp)]))
    classes = [concat([dense[r], _vllm_experts(ctx, np.arange((d * tp + r) * per, (d * tp + r + 1) * per), 1, 0)])
               for d in range(dp) for r in range(tp)]
    return Layout(tensors, ctx.ranks(classes, range(tp * dp)))


def _vllm_rank(m: ModelSpec, t: dict[str, TensorSpec], tp: int, r: int, mult: int) -> tuple[LocalBuffer, ...]:
    """TP rank r's buffers but the routed experts (`_vllm_experts` builds those)."""
    bufs = [_vocab("model.embed_tokens.weight", t["model.embed_tokens.weight"], tp, r, mult)]
    for i in range(m.layers):
        p = f"model.layers.{i}."
        bufs += [_whole(p + "input_layernorm.weight", t[p + "input_layernorm.weight"]),
                 _whole(p + "post_attention_layernorm.weight", t[p + "post_attention_layernorm.weight"])]
        if m.attention == "gqa":
            hd, h = m.head_dim, m.hidden
            qrows = _div(m.heads, tp, "heads") * hd
            kvn = max(1, m.kv_heads // tp)
            if m.kv_heads % tp and tp % m.kv_heads:
                raise LayoutError(f"vllm: kv_heads={m.kv_heads} and tp={tp} must divide one another")
            kv0 = (r // max(1, tp // m.kv_heads)) * kvn
            bufs.append(LocalBuffer(p + "self_attn.qkv_proj.weight", (qrows + 2 * kvn * hd, h), m.dtype, (
                _rows(p + "self_attn.q_proj.weight", 0, r * qrows, qrows, h),
                _rows(p + "self_attn.k_proj.weight", qrows, kv0 * hd, kvn * hd, h),
                _rows(p + "self_attn.v_proj.weight", qrows + kvn * hd, kv0 * hd, kvn * hd, h))))
            bufs.append(_col_split(p + "self_attn.o_proj.weight", t[p + "self_attn.o_proj.weight"], tp, r))
            if m.qk_norm:
                bufs += [_whole(p + "self_attn.q_norm.weight", t[p + "self_attn.q_norm.weight"]),
                         _whole(p + "self_attn.k_norm.weight", t[p + "self_attn.k_norm.weight"])]
        else:
            a = p + "self_attn."
            bufs.append(_fused_rows(a + "fused_qkv_a_proj.weight", [t[a + "q_a_proj.weight"], t[a + "kv_a_proj_with_mqa.weight"]], 1, 0))
            bufs += [_whole(a + "q_a_layernorm.weight", t[a + "q_a_layernorm.weight"]),
                     _whole(a + "kv_a_layernorm.weight", t[a + "kv_a_layernorm.weight"]),
                     _row_split(a + "q_b_proj.weight", t[a + "q_b_proj.weight"], tp, r),
                     _row_split(a + "kv_b_proj.weight", t[a + "kv_b_proj.weight"], tp, r),
                     _col_split(a + "o_proj.weight", t[a + "o_proj.weight"], tp, r)]
        if not m.is_moe(i):
            bufs.append(_fused_rows(p + "mlp.gate_up_proj.weight", [t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"]], tp, r))
            bufs.append(_col_split(p + "mlp.down_proj.weight", t[p + "mlp.down_proj.weight"], tp, r))
            continue
        bufs.append(_whole(p + "mlp.gate.weight", t[p + "mlp.gate.weight"]))
        if m.shared_experts:
            s = p + "mlp.shared_experts."
            bufs.append(_fused_rows(s + "gate_up_proj.weight", [t[s + "gate_proj.weight"], t[s + "up_proj.weight"]], tp, r))
            bufs.append(_col_split(s + "down_proj.weight", t[s + "down_proj.weight"], tp, r))
    bufs.append(_whole("model.norm.weight", t["model.norm.weight"]))
    head = "model.embed_tokens.weight" if m.tie_embeddings else "lm_head.weight"
    bufs.append(_vocab("lm_head.weight", t[head], tp, r, mult))
    return tuple(bufs)


# -- columns -------------------------------------------------------------------------

class _Columns:
    """Id tables of one columnar layout: tensor ids (sorted names) and buffer names."""

    def __init__(self, m: ModelSpec, tensors: dict[str, TensorSpec]):
        self.m = m
        self.tnames = sorted(tensors)
        self.tid = {n: i for i, n in enumerate(self.tnames)}
        self.bid: dict[str, int] = {}
        self._names: dict[tuple, np.ndarray] = {}

    def block(self, bufs) -> ClassCols:
        return ClassCols.from_buffers(bufs, self.tid, self.bid)

    def names(self, key: tuple, make) -> np.ndarray:
        """Buffer-name ids of `make()` (a list of names), cached under `key`."""
        got = self._names.get(key)
        if got is None:
            got = self._names[key] = np.array([self.bid.setdefault(n, len(self.bid)) for n in make()], dtype=np.int64)
        return got

    @functools.cached_property
    def expert_tids(self) -> np.ndarray:
        """(layers, experts, 3): tensor ids of each routed expert's gate, up and down projections."""
        m = self.m
        out = np.full((m.layers, m.experts, 3), -1, dtype=np.int64)
        for i in range(m.layers):
            if m.is_moe(i):
                out[i] = [[self.tid[f"model.layers.{i}.mlp.experts.{e}.{w}_proj.weight"] for w in ("gate", "up", "down")]
                          for e in range(m.experts)]
        return out

    def ranks(self, classes: list[ClassCols], rank_class) -> ColumnRanks:
        return ColumnRanks(self.tnames, sorted(self.bid, key=self.bid.__getitem__), classes, list(rank_class))


def _block(m: ModelSpec, buf_name, buf_shape, p_tensor, p_buf, r_off, r_size, off, size, flat: bool) -> ClassCols:
    """A block of buffers of the model's dtype from column arrays (pieces ordered by buffer)."""
    buf_shape, r_off, r_size, off, size = (np.asarray(a, dtype=np.int64) for a in (buf_shape, r_off, r_size, off, size))
    w = buf_shape.shape[1]
    r_off, r_size, off, size = (fit_width(a, w, f) for a, f in ((r_off, 0), (r_size, 1), (off, 0), (size, 1)))
    n = len(p_tensor)
    return ClassCols(buf_name=np.asarray(buf_name, dtype=np.int64), buf_dtype=np.full(len(buf_name), DTYPE_IDS[m.dtype], np.int64),
                     buf_shape=buf_shape, buf_ndim=np.full(len(buf_name), w, np.int64), buf_padding={},
                     p_tensor=np.asarray(p_tensor, dtype=np.int64), p_buf=np.asarray(p_buf, dtype=np.int64),
                     p_flat=np.full(n, flat), r_off=r_off, r_size=r_size, r_ndim=np.full(n, 1 if flat else w, np.int64),
                     off=off, size=size, ndim=np.full(n, 2, np.int64))


def _megatron_experts(ctx: _Columns, layers: list[int], etp: int, etr: int, ep: int, er: int) -> ClassCols:
    """The routed experts of one expert rank, as columns: per layer and local expert k, buffers
    local_experts.k.linear_fc1 ([gate; up] rows of this etp rank) and linear_fc2 (its columns of down)."""
    m = ctx.m
    moe = [i for i in layers if m.is_moe(i)]
    per = m.experts // ep
    h = m.hidden
    pe = _div(m.moe_intermediate, etp, "moe_intermediate over expert TP")
    q = len(moe) * per
    names = ctx.names(("megatron", tuple(moe), per), lambda: [
        f"decoder.layers.{i}.mlp.experts.local_experts.{k}.{w}.weight"
        for i in moe for k in range(per) for w in ("linear_fc1", "linear_fc2")])
    tids = ctx.expert_tids[moe][:, er * per:(er + 1) * per, :] if q else np.zeros((0, 0, 3), np.int64)
    shapes = np.tile([[2 * pe, h], [h, pe]], (q, 1))
    sizes = np.tile([[pe, h], [pe, h], [h, pe]], (q, 1))
    return _block(m, names, shapes, tids.reshape(-1), (2 * np.arange(q)[:, None] + [0, 0, 1]).reshape(-1),
                  np.tile([[0, 0], [pe, 0], [0, 0]], (q, 1)), sizes,
                  np.tile([[etr * pe, 0], [etr * pe, 0], [0, etr * pe]], (q, 1)), sizes, flat=False)


def _vllm_experts(ctx: _Columns, experts: np.ndarray, etp: int, er: int) -> ClassCols:
    """vLLM FusedMoE stacks of every MoE layer as columns: w13_weight [E, 2*I/etp, H] (gate rows
    then up rows of each expert), w2_weight [E, H, I/etp]; each expert's slab is a flat piece."""
    m = ctx.m
    moe = [i for i in range(m.layers) if m.is_moe(i)]
    h, n, nl = m.hidden, len(experts), len(moe)
    pe = _div(m.moe_intermediate, etp, "moe_intermediate over expert TP")
    names = ctx.names(("vllm", tuple(moe)), lambda: [
        f"model.layers.{i}.mlp.experts.{w}_weight" for i in moe for w in ("w13", "w2")])
    tids = ctx.expert_tids[moe][:, experts, :]                                      # (nl, n, 3)
    p_tensor = np.concatenate([tids[:, :, :2].reshape(nl, 2 * n), tids[:, :, 2]], axis=1).reshape(-1)
    p_buf = np.repeat(2 * np.arange(nl), 3 * n) + np.tile(np.repeat([0, 1], [2 * n, n]), nl)
    k = np.arange(n)
    start = np.concatenate([((2 * k[:, None] * pe + [0, pe]) * h).reshape(-1), k * h * pe])  # one layer
    r_off = np.tile(start, nl)[:, None]
    r_size = np.full((3 * n * nl, 1), pe * h)
    one = np.concatenate([np.tile([[er * pe, 0]], (2 * n, 1)), np.tile([[0, er * pe]], (n, 1))])
    one_size = np.concatenate([np.tile([[pe, h]], (2 * n, 1)), np.tile([[h, pe]], (n, 1))])
    return _block(m, names, np.tile([[n, 2 * pe, h], [n, h, pe]], (nl, 1)), p_tensor, p_buf, r_off, r_size,
                  np.tile(one, (nl, 1)), np.tile(one_size, (nl, 1)), flat=True)


# -- Megatron ------------------------------------------------------------------------

def _stage_layers(layers: int, pp: int, vpp: int) -> list[list[int]]:
    """Layers of each pipeline rank: virtual chunk v of rank s is model chunk v*pp + s; when the
    layers do not divide evenly the earlier chunks take one more (uneven stages)."""
    chunks = pp * vpp
    sizes = [layers // chunks + (1 if c < layers % chunks else 0) for c in range(chunks)]
    starts = [sum(sizes[:c]) for c in range(chunks)]
    out = []
    for s in range(pp):
        mine = []
        for v in range(vpp):
            c = v * pp + s
            mine += list(range(starts[c], starts[c] + sizes[c]))
        out.append(mine)
    return out


def megatron(m: ModelSpec, tp: int = 1, pp: int = 1, cp: int = 1, dp: int = 1, ep: int = 1, etp: int = 0, vpp: int = 1,
             pad_multiple: int = 128) -> Layout:
    """Megatron-core's layout (TE names). Rank order tp, cp, dp, pp (tp fastest); expert ranks fold
    the tp*cp*dp ranks of a stage as etp (fastest), ep, expert-dp. Dense buffers are built as
    objects per (TP rank, stage), routed experts as columns."""
    etp = etp or tp
    inner = tp * cp * dp
    if inner % (etp * ep):
        raise LayoutError(f"megatron: tp*cp*dp={inner} must be a multiple of etp*ep={etp * ep}")
    if m.experts and m.experts % ep:
        raise LayoutError(f"megatron: experts={m.experts} not divisible by ep={ep}")
    if m.attention == "gqa" and m.kv_heads % tp:
        raise LayoutError(f"megatron: kv_heads={m.kv_heads} (query groups) not divisible by tp={tp}")
    t = _tensors(m)
    stages = _stage_layers(m.layers, pp, vpp)
    ctx = _Columns(m, t)
    cache: dict[tuple, int] = {}
    classes: list = []
    dense: dict[tuple, ClassCols] = {}
    routed: dict[tuple, ClassCols] = {}
    rank_class = []
    for rank in range(inner * pp):
        tr, s, i = rank % tp, rank // inner, rank % inner
        er = (i // etp) % ep
        key = (tr, s, i % etp, er)
        if key not in cache:
            cache[key] = len(classes)
            if (tr, s) not in dense:
                dense[tr, s] = ctx.block(_megatron_rank(m, t, tp, tr, stages[s], s == 0, s == pp - 1, pad_multiple * tp))
            if (s, i % etp, er) not in routed:
                routed[s, i % etp, er] = _megatron_experts(ctx, stages[s], etp, i % etp, ep, er)
            classes.append(concat([dense[tr, s], routed[s, i % etp, er]]))
        rank_class.append(cache[key])
    return Layout(t, ctx.ranks(classes, rank_class))


def _megatron_rank(m, t, tp, r, layers, first, last, mult) -> tuple[LocalBuffer, ...]:
    """TP rank r's buffers on a stage of `layers`, but the routed experts (`_megatron_experts`)."""
    bufs = []
    emb = t["model.embed_tokens.weight"]
    if first:
        bufs.append(_vocab("embedding.word_embeddings.weight", emb, tp, r, mult))
    for i in layers:
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        h = m.hidden
        if m.attention == "gqa":
            hd, qpg, groups = m.head_dim, m.heads // m.kv_heads, m.kv_heads // tp
            pieces, row = [], 0
            for g in range(r * groups, (r + 1) * groups):
                pieces.append(_rows(hf + "self_attn.q_proj.weight", row, g * qpg * hd, qpg * hd, h))
                row += qpg * hd
                pieces.append(_rows(hf + "self_attn.k_proj.weight", row, g * hd, hd, h))
                row += hd
                pieces.append(_rows(hf + "self_attn.v_proj.weight", row, g * hd, hd, h))
                row += hd
            bufs.append(LocalBuffer(mg + "self_attention.linear_qkv.weight", (row, h), m.dtype, tuple(pieces)))
            if m.qk_norm:
                bufs += [_whole(mg + "self_attention.q_layernorm.weight", t[hf + "self_attn.q_norm.weight"]),
                         _whole(mg + "self_attention.k_layernorm.weight", t[hf + "self_attn.k_norm.weight"])]
        else:
            a = hf + "self_attn."
            bufs += [_whole(mg + "self_attention.linear_q_down_proj.weight", t[a + "q_a_proj.weight"]),
                     _whole(mg + "self_attention.linear_q_up_proj.layer_norm_weight", t[a + "q_a_layernorm.weight"]),
                     _row_split(mg + "self_attention.linear_q_up_proj.weight", t[a + "q_b_proj.weight"], tp, r),
                     _whole(mg + "self_attention.linear_kv_down_proj.weight", t[a + "kv_a_proj_with_mqa.weight"]),
                     _whole(mg + "self_attention.linear_kv_up_proj.layer_norm_weight", t[a + "kv_a_layernorm.weight"]),
                     _row_split(mg + "self_attention.linear_kv_up_proj.weight", t[a + "kv_b_proj.weight"], tp, r)]
        bufs.append(_whole(mg + "self_attention.linear_qkv.layer_norm_weight" if m.attention == "gqa" else mg + "input_layernorm.weight",
                           t[hf + "input_layernorm.weight"]))
        bufs.append(_col_split(mg + "self_attention.linear_proj.weight", t[hf + "self_attn.o_proj.weight"], tp, r))
        if not m.is_moe(i):
            bufs.append(_whole(mg + "mlp.linear_fc1.layer_norm_weight", t[hf + "post_attention_layernorm.weight"]))
            bufs.append(_fused_rows(mg + "mlp.linear_fc1.weight", [t[hf + "mlp.gate_proj.weight"], t[hf + "mlp.up_proj.weight"]], tp, r))
            bufs.append(_col_split(mg + "mlp.linear_fc2.weight", t[hf + "mlp.down_proj.weight"], tp, r))
            continue
        bufs.append(_whole(mg + "pre_mlp_layernorm.weight", t[hf + "post_attention_layernorm.weight"]))
        bufs.append(_whole(mg + "mlp.router.weight", t[hf + "mlp.gate.weight"]))
        if m.shared_experts:
            x, y = hf + "mlp.shared_experts.", mg + "mlp.shared_experts."
            bufs.append(_fused_rows(y + "linear_fc1.weight", [t[x + "gate_proj.weight"], t[x + "up_proj.weight"]], tp, r))
            bufs.append(_col_split(y + "linear_fc2.weight", t[x + "down_proj.weight"], tp, r))
    if last:
        bufs.append(_whole("decoder.final_layernorm.weight", t["model.norm.weight"]))
        head = emb if m.tie_embeddings else t["lm_head.weight"]
        bufs.append(_vocab("output_layer.weight", head, tp, r, mult))
    return tuple(bufs)


# -- FSDP ----------------------------------------------------------------------------

def fsdp(m: ModelSpec, dp: int = 1, flat: int = 1) -> Layout:
    """FSDP1 (flat=1): every parameter flattened and concatenated in order, padded to a multiple of
    dp, each rank one equal 1-D range. FSDP2 (flat=0): each parameter Shard(0) over dp (torch.chunk),
    local shards padded to equal shapes."""
    t = m.tensors()
    ranks = []
    if flat:
        specs = list(t.values())
        starts = list(itertools.accumulate((s.numel for s in specs), initial=0))
        total = starts[-1]
        per = _pad(total, dp) // dp
        for r in range(dp):
            lo, hi = r * per, min((r + 1) * per, total)
            pieces = []
            # Only the tensors whose ranges meet [lo, hi): found by bisection, not by a scan.
            for i in range(max(0, bisect.bisect_right(starts, lo) - 1), bisect.bisect_left(starts, hi)):
                s, pos = specs[i], starts[i]
                a, b = max(lo, pos), min(hi, pos + s.numel)
                if a < b:
                    pieces += flat_pieces(s.name, s.shape, a - pos, b - pos, a - lo)
            real = max(0, hi - lo)
            padding = (Box((real,), (per - real,)),) if real < per else ()
            ranks.append((LocalBuffer("flat_param", (per,), m.dtype, tuple(pieces), padding),))
        return Layout(t, tuple(ranks))
    for r in range(dp):
        bufs = []
        for s in t.values():
            sizes = chunk_sizes(s.shape[0], dp)
            rows, lo = sizes[r], sum(sizes[:r])
            local = (sizes[0], *s.shape[1:])
            pieces = (Piece(s.name, Box.full((rows, *s.shape[1:])), Box((lo, *(0 for _ in s.shape[1:])), (rows, *s.shape[1:]))),) if rows else ()
            pad = (Box((rows, *(0 for _ in s.shape[1:])), (local[0] - rows, *s.shape[1:])),) if rows < local[0] else ()
            bufs.append(LocalBuffer(s.name, local, s.dtype, pieces, pad))
        ranks.append(tuple(bufs))
    return Layout(t, tuple(ranks))


BUILDERS = {"megatron": megatron, "vllm": vllm, "fsdp": fsdp}
_INT_KEYS = {"megatron": ("tp", "pp", "cp", "dp", "ep", "etp", "vpp"), "vllm": ("tp", "dp", "ep"), "fsdp": ("dp", "flat")}


def parse_spec(spec: str) -> tuple[str, dict[str, int | str]]:
    """'framework=megatron,tp=2,pp=4' -> ('megatron', {'tp': 2, 'pp': 4}), with errors naming the fix.
    Every framework also takes dtype=NAME: the dtype its buffers hold (default: the model's); vllm
    takes quant=fp8 too (a block-FP8 checkpoint: `quantized.fp8_destination`)."""
    fields = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        k, sep, v = part.partition("=")
        if not sep:
            raise ValueError(f"layout spec {spec!r}: {part!r} is not key=value")
        fields[k.strip()] = v.strip()
    fw = fields.pop("framework", None)
    if fw not in BUILDERS:
        raise ValueError(f"layout spec {spec!r}: framework must be one of {', '.join(BUILDERS)}")
    out: dict[str, int | str] = {}
    for k, v in fields.items():
        if k == "dtype":
            if v not in DTYPES:
                raise ValueError(f"layout spec {spec!r}: dtype={v!r} must be one of {', '.join(DTYPES)}")
            out[k] = v
            continue
        if k == "quant" and fw == "vllm":
            if v != "fp8":
                raise ValueError(f"layout spec {spec!r}: quant={v!r}: the one quantized format is fp8 (block FP8)")
            out[k] = v
            continue
        if k not in _INT_KEYS[fw]:
            extra = ("dtype", "quant") if fw == "vllm" else ("dtype",)
            raise ValueError(f"layout spec {spec!r}: {fw} takes {', '.join(_INT_KEYS[fw] + extra)}, not {k!r}")
        if not v.isdigit():
            raise ValueError(f"layout spec {spec!r}: {k}={v!r} must be a non-negative integer")
        out[k] = int(v)
    return fw, out


def build(model: str | ModelSpec, spec: str) -> Layout:
    m = model_spec(model) if isinstance(model, str) else model
    fw, kw = parse_spec(spec)
    if "dtype" in kw:
        m = dataclasses.replace(m, dtype=str(kw.pop("dtype")))
    if kw.pop("quant", None):  # a block-FP8 checkpoint served: its linear weights and their scales
        from reshard.common.layout.quantized import fp8_destination

        return fp8_destination(BUILDERS[fw](m, **kw))
    return BUILDERS[fw](m, **kw)


def world_of(spec: str) -> int:
    fw, kw = parse_spec(spec)
    if fw == "megatron":
        return kw.get("tp", 1) * kw.get("pp", 1) * kw.get("cp", 1) * kw.get("dp", 1)
    if fw == "vllm":
        return kw.get("tp", 1) * kw.get("dp", 1)
    return kw.get("dp", 1)
