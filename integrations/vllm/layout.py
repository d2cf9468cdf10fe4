"""One vLLM rank's layout, read from its live model: no user description.

Every parameter vLLM loads becomes one local buffer, named as vLLM names it, in the shape vLLM's
weight loaders write (before `process_weights_after_loading` repacks it: vLLM records that
shape for its layerwise reload). Its pieces say which boxes of which canonical (Hugging Face)
tensors it holds:

- `QKVParallelLinear`: this rank's query heads, then its KV heads (the KV shard
  `tp_rank // num_kv_head_replicas`: KV heads are replicated when TP exceeds them);
- `MergedColumnParallelLinear` (`gate_up_proj`, a shared expert's too): this rank's rows of
  each stacked tensor; one built with `disable_tp` (DeepSeek MLA's `fused_qkv_a_proj`: q_a_proj,
  then kv_a_proj_with_mqa) or a merged `ReplicatedLinear`, every row of each. The stacked
  tensors' names come from the model's `packed_modules_mapping`, else `names.FUSED`;
- `ColumnParallelLinear` / `RowParallelLinear`: rows / columns of rank `tp_rank` (MLA's
  `q_b_proj` and `kv_b_proj`: whole heads; `o_proj`: their columns);
- `VocabParallelEmbedding`, `ParallelLMHead`: this rank's vocabulary rows; the rows that pad
  the vocabulary to a multiple are padding;
- anything else (norms, `ReplicatedLinear`: MoE gates, Qwen2-MoE's `shared_expert_gate`): the
  whole tensor.

Which parameters are loadable is vLLM's own record (`record_metadata_for_reloading`, taken when
the model is built, before any weight): each in the shape it was recorded in. vLLM leaves two
kinds out of that record by design and loads them into the live tensor, so they are read live:
linear biases (`qkv_proj.bias` of Qwen2 models) and a MoE gate's `e_score_correction_bias`
(DeepSeek-V3's `noaux_tc` routing). A parameter that appeared after the record was derived by
vLLM from loaded weights (MLA's `W_UK_T` and `W_UV`, from `kv_b_proj`, which vLLM's reload
derives again): it is no buffer, and `RankLayout.derived` names it.

A parameter shared by two modules (tied embeddings: `lm_head` holds `embed_tokens`'s weight; a
DeepSeek gate's `e_score_correction_bias`, which its experts module holds too) is one buffer;
both modules are targets of it, since each derives its own kernel data.

Quantized models: a layer of a block-FP8 checkpoint (`quantization_config` fp8 with
`weight_block_size`, as DeepSeek-V3 and the Qwen3 FP8 models ship; float8_e4m3fn `weight`
and a float32 `weight_scale_inv` per 128 x 128 block) is read, by default (`quantize="sender"`),
as the checkpoint holds it (a fused MoE layer's stacked experts too: `w13_weight` and `w2_weight`,
float8_e4m3fn, with `w13_weight_scale_inv` and `w2_weight_scale_inv`, blocks per expert; canonically
`mlp.experts.gate_up_proj_scale_inv` (E, 2I/128, H/128) and `down_proj_scale_inv`): the weight's canonical tensors are float8_e4m3fn and each has its
`<name>_scale_inv`, whose pieces are the weight's pieces block by block. The trainer ranks
quantize (common/layout/quantized.py), FP8 values and scales cross the wire, and the backend
copies them into the layer. With `quantize="receiver"` the weight is received unquantized, in the
dtype the layer was built for (`orig_dtype`: what the trainer's weights are cast to), and the
backend quantizes each whole block on the rank when it loads (`common/quant.py`, vLLM's own
recipe), writing the values and their scales; `weight_scale_inv` is no buffer then
(`RankLayout.derived`): for a trainer whose column shards split blocks (row shards that do are
quantized on the sender, the trainer ranks exchanging partial block maxima first). Either way a rank's shard must
be made of whole blocks (vLLM refuses other splits; so does this). vLLM's
online quantization (`quantization="fp8"` over a bf16 checkpoint) records the checkpoint's
bf16 weights for its reload, so its layers read like unquantized ones and vLLM quantizes them
when it reloads. FP8 experts whose intermediate size per rank is not a multiple of 128 (vLLM
refines their scale grid) are refused, as is any other quantized format (compressed-tensors, AWQ,
GPTQ, modelopt, per-tensor FP8, ...), by name."""

from __future__ import annotations

import dataclasses

import torch

from reshard.common.layout.core import Box, LayoutError, LocalBuffer, Piece, TensorSpec
from reshard.common.layout.quantized import SCALE_SUFFIX, aligned, full_block, scale_buffer, scale_name, scale_shape
from reshard.common.quant import FP8_BLOCK
from reshard.integrations.names import FUSED, MOE_STACKED, fused_names, unfused, vllm_module_name

# Parameters vLLM's record for reloading leaves out by design (`reload.meta.SKIP_TENSORS`) that
# checkpoints hold: its loaders write them into the live tensor.
LOADED_LIVE = ("bias", "e_score_correction_bias")


@dataclasses.dataclass(frozen=True)
class Target:
    """A parameter of the live model that a buffer's contents are loaded into."""

    module: str
    param: str
    buffer: str
    quant: tuple[int, int] | None = None
    """Block FP8: the block (rows, columns) the buffer is quantized in when loaded into `param`,
    its scales into `param`_scale_inv."""


@dataclasses.dataclass
class RankLayout:
    tensors: dict[str, TensorSpec]
    buffers: list[LocalBuffer]
    targets: list[Target]
    derived: list[str] = dataclasses.field(default_factory=list)  # live parameters vLLM derives, not loads

    def modules(self) -> list[str]:
        return list(dict.fromkeys(t.module for t in self.targets))


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _loadable_params(module: torch.nn.Module) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(the module's own parameters in the shape its weight loaders write, the names of those it
    has that vLLM derived after loading). The shapes are the meta tensors vLLM recorded when it
    built the model (for its layerwise reload); a parameter it leaves out of that record by
    design (`LOADED_LIVE`) is loaded in place, so it is read live; any other that is not in the
    record was made by vLLM's processing after loading. A module vLLM recorded nothing of (not
    built by vLLM's loader): its live parameters."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    info = LAYERWISE_INFO.get(module)
    live = {n: p for n, p in module.named_parameters(recurse=False) if p is not None}
    if info is None:
        return live, []
    recorded = info.restore_metadata[0]
    out = {n: t for n, t in recorded.items() if n in live}
    derived = []
    for n, p in live.items():
        if n in recorded:
            continue
        if n in LOADED_LIVE:
            out[n] = p
        else:
            derived.append(n)
    return out, derived


def _rows(tensor: str, buf_row: int, row: int, rows: int, rest: tuple[int, ...]) -> Piece:
    z = (0,) * len(rest)
    return Piece(tensor, Box((buf_row, *z), (rows, *rest)), Box((row, *z), (rows, *rest)))


def _expert_runs(module: torch.nn.Module) -> list[tuple[int, int, int]]:
    """(local index, global index, count) runs of the experts this rank holds."""
    emap = module.expert_map
    if emap is None:
        return [(0, 0, module.local_num_experts)]
    glob = sorted((int(j), g) for g, j in enumerate(emap.tolist()) if j >= 0)
    runs: list[tuple[int, int, int]] = []
    for j, g in glob:
        if runs and runs[-1][0] + runs[-1][2] == j and runs[-1][1] + runs[-1][2] == g:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((j, g, 1))
    return runs


def _expert_pieces(cname: str, module: torch.nn.Module, pname: str, shape: tuple[int, ...], add: callable) -> list[Piece]:
    """Stacked experts (see `names.MOE_STACKED`), under TP (intermediate split) or EP (experts split)."""
    cfg = module.moe_config
    if getattr(getattr(module, "expert_map_manager", None), "num_fused_shared_experts", 0):
        raise LayoutError(f"{cname}.{pname}: shared experts fused into the routed experts' tensors (ROCm AITER) are "
                          "not supported")
    tp_rank, ip = cfg.tp_rank, module.intermediate_size_per_partition
    e, hidden, inter = module.global_num_experts, module.hidden_size, module.intermediate_size_per_partition * cfg.tp_size
    tensor = f"{cname}.{MOE_STACKED[pname]}"
    want = (module.local_num_experts, 2 * ip, hidden) if pname == "w13_weight" else (module.local_num_experts, hidden, ip)
    if shape != want:
        raise LayoutError(f"{cname}.{pname}: shape {list(shape)}, expected {list(want)} (padded intermediate sizes "
                          "are not supported)")
    pieces = []
    if pname == "w13_weight":
        add(tensor, (e, 2 * inter, hidden))
        for j, g, n in _expert_runs(module):
            for half in (0, 1):  # gate rows, then up rows
                pieces.append(Piece(tensor, Box((j, half * ip, 0), (n, ip, hidden)),
                                    Box((g, half * inter + tp_rank * ip, 0), (n, ip, hidden))))
    else:
        add(tensor, (e, hidden, inter))
        for j, g, n in _expert_runs(module):
            pieces.append(Piece(tensor, Box((j, 0, 0), (n, hidden, ip)), Box((g, 0, tp_rank * ip), (n, hidden, ip))))
    return pieces


def _parts(mname: str, fused: dict[str, tuple[str, ...]], n: int, default: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The canonical module names of a fused module of `n` parts, in the order they are stacked."""
    last = mname.rpartition(".")[2]
    parts = fused.get(last, default)
    if parts is None or len(parts) != n:
        raise LayoutError(f"{mname}: a fused module of {n} parts with no canonical names "
                          "(add it to reshard.integrations.names.FUSED)")
    if last in parts:
        raise LayoutError(f"{mname}: the model's packed_modules_mapping says the checkpoint holds it fused "
                          f"({last} -> {list(parts)}): not supported")
    return unfused(mname, {last: parts})


def _param_pieces(mname: str, module: torch.nn.Module, pname: str, shape: tuple[int, ...],
                  add: callable, fused: dict[str, tuple[str, ...]] = FUSED) -> tuple[list[Piece], list[Box]]:
    """(pieces, padding) of one parameter; `mname` is the module's canonical name; `add(name,
    shape)` declares a canonical tensor; `fused` names the parts of fused modules."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    if pname in MOE_STACKED and hasattr(module, "moe_config"):
        return _expert_pieces(mname, module, pname, shape, add), []
    tp_size, tp_rank = getattr(module, "tp_size", 1), getattr(module, "tp_rank", 0)
    rest = shape[1:]
    if isinstance(module, QKVParallelLinear):
        q, k, v = _parts(mname, fused, 3, ("q_proj", "k_proj", "v_proj"))
        d, dv = module.head_size, module.v_head_size
        nq, nkv = module.num_heads, module.num_kv_heads
        kv_shard = tp_rank // module.num_kv_head_replicas
        parts = [(q, module.total_num_heads * d, tp_rank * nq * d, nq * d),
                 (k, module.total_num_kv_heads * d, kv_shard * nkv * d, nkv * d),
                 (v, module.total_num_kv_heads * dv, kv_shard * nkv * dv, nkv * dv)]
        pieces, at = [], 0
        for name, total, row, rows in parts:
            add(f"{name}.{pname}", (total, *rest))
            pieces.append(_rows(f"{name}.{pname}", at, row, rows, rest))
            at += rows
        return pieces, []
    sizes = getattr(module, "output_sizes", None)
    replicated = isinstance(module, ReplicatedLinear)
    if isinstance(module, MergedColumnParallelLinear) or (replicated and sizes and len(sizes) > 1):
        names = _parts(mname, fused, len(sizes))
        split = 1 if replicated else tp_size  # `disable_tp` sets tp_size 1, tp_rank 0
        if split == 1:
            tp_rank = 0
        pieces, at = [], 0
        for name, total in zip(names, sizes):
            rows = total // split
            add(f"{name}.{pname}", (total, *rest))
            pieces.append(_rows(f"{name}.{pname}", at, tp_rank * rows, rows, rest))
            at += rows
        return pieces, []
    canonical = f"{mname}.{pname}"
    if isinstance(module, VocabParallelEmbedding):
        if module.num_added_embeddings:
            raise LayoutError(f"{mname}: added (LoRA) vocabulary is not supported")
        si = module.shard_indices
        rows = si.org_vocab_end_index - si.org_vocab_start_index
        add(canonical, (module.org_vocab_size, *rest))
        pad = [Box((rows, *(0,) * len(rest)), (shape[0] - rows, *rest))] if shape[0] > rows else []
        return [_rows(canonical, 0, si.org_vocab_start_index, rows, rest)] if rows else [], pad
    if isinstance(module, ColumnParallelLinear) and tp_size > 1:
        add(canonical, (shape[0] * tp_size, *rest))
        return [_rows(canonical, 0, tp_rank * shape[0], shape[0], rest)], []
    if isinstance(module, RowParallelLinear) and tp_size > 1 and len(shape) == 2:
        add(canonical, (shape[0], shape[1] * tp_size))
        return [Piece(canonical, Box((0, 0), shape), Box((0, tp_rank * shape[1]), shape))], []
    add(canonical, shape)
    return [Piece(canonical, Box.full(shape), Box.full(shape))], []


# Quantization methods whose layers read like unquantized ones (no method, or vLLM's own
# unquantized ones; online quantization records the checkpoint's weights for its reload).
PLAIN_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod", "UnquantizedFusedMoEMethod")
ONLINE = "online"


def _quant_format(module: torch.nn.Module) -> str:
    """The quantized format of a module's weights, as vLLM names it ('' when unquantized)."""
    method = getattr(module, "quant_method", None)
    if method is None or type(method).__name__ in PLAIN_METHODS:
        return ""
    if ".quantization.online." in type(method).__module__:  # vLLM's online quantization (no quant_config)
        return ONLINE
    config = getattr(method, "quant_config", None)
    name = config.get_name() if config is not None and hasattr(config, "get_name") else type(method).__name__
    return str(name)


def _block_fp8(mname: str, module: torch.nn.Module, params: dict[str, torch.Tensor]
               ) -> tuple[tuple[int, int], tuple[str, ...]] | None:
    """(the block, the FP8 parameters) of a block-FP8 layer: a linear layer's `weight`, or a fused
    MoE layer's stacked experts `w13_weight` and `w2_weight`, each with its `<param>_scale_inv`
    (None: not quantized, or quantized online); refuses every other quantized format by name."""
    fmt = _quant_format(module)
    if not fmt or fmt == ONLINE or not params:  # no weights here (an FP8 KV cache's attention layer)
        return None
    block = getattr(module, "weight_block_size", None)
    fp8 = tuple(n for n, t in params.items() if t.dtype == torch.float8_e4m3fn)
    moe = hasattr(module, "moe_config")
    want = ("w13_weight", "w2_weight") if moe else ("weight",)
    if fmt == "fp8" and block and sorted(fp8) == sorted(want) \
            and all(f"{n}_scale_inv" in params and params[n].dim() == (3 if moe else 2) for n in want):
        if tuple(block) != FP8_BLOCK:
            raise LayoutError(f"{mname}: block FP8 in blocks of {list(block)}: reshard quantizes in blocks of "
                              f"{list(FP8_BLOCK)}")
        if getattr(module.quant_method, "weight_scale_refine", None) is not None:
            raise LayoutError(f"{mname}: block-FP8 experts whose intermediate size per rank "
                              f"({module.intermediate_size_per_partition}) is not a multiple of {FP8_BLOCK[0]}: vLLM "
                              "refines their scale grid, which reshard does not make; use a tensor-parallel size "
                              f"that leaves whole {FP8_BLOCK[0]}-row blocks, or expert parallelism")
        return tuple(block), want
    kind = f"{fmt} ({type(module.quant_method).__name__})"
    raise LayoutError(f"{mname}: quantized format {kind} cannot be resharded; supported: unquantized weights, "
                      "block FP8 checkpoints (fp8 with weight_block_size 128x128, linear layers and stacked "
                      "experts) and vLLM's online quantization")


def _check_whole_blocks(bname: str, pieces: list[Piece], block: tuple[int, int], tensors: dict[str, TensorSpec]) -> None:
    for p in pieces:
        full = full_block(len(p.region.offset), block)
        if any(o % b for o, b in zip(p.region.offset, full)) or not aligned(p.box, tensors[p.tensor].shape, block):
            raise LayoutError(f"{bname}: block FP8 is quantized where its {list(block)} blocks are whole, but this "
                              f"rank holds {p.tensor} box {p.box} (at {list(p.region.offset)} of its buffer): not on "
                              "block boundaries")


def _check_scales(sbuf: LocalBuffer, want: torch.Tensor) -> None:
    end = tuple(max(e) for e in zip(*(p.region.end for p in sbuf.pieces))) or (0,) * want.dim()
    if len(end) != want.dim() or any(e > w for e, w in zip(end, want.shape)) or want.dtype != torch.float32:
        raise LayoutError(f"{sbuf.name}: {list(want.shape)} {want.dtype}, but its weight's blocks need float32 scales "
                          f"up to {list(end)}")


QUANTIZE = ("sender", "receiver")
"""Where block FP8 is quantized: on the trainer ranks (FP8 values and scales on the wire), or on this rank."""


def rank_layout(model: torch.nn.Module, quantize: str = "sender") -> RankLayout:
    """This rank's buffers, their canonical tensors, and the parameters they load into. Block-FP8
    layers (`quantize`): "sender", the layout declares the FP8 weight and its float32
    `weight_scale_inv` as the checkpoint holds them, and the trainer quantizes; "receiver", the
    weight in the layer's unquantized dtype, quantized on this rank when it loads."""
    if quantize not in QUANTIZE:
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE)}, not {quantize!r}")
    arch = type(model).__name__
    fused = fused_names(getattr(model, "packed_modules_mapping", None))
    derived: list[str] = []
    tensors: dict[str, TensorSpec] = {}
    buffers: list[LocalBuffer] = []
    targets: list[Target] = []
    owner: dict[int, str] = {}  # id of a live parameter -> its buffer (tied parameters share one)

    for mname, module in model.named_modules():
        params, made = _loadable_params(module)
        fp8 = _block_fp8(mname, module, params)
        block, qnames = fp8 if fp8 is not None else (None, ())
        scales = {n: params[f"{n}{SCALE_SUFFIX}"] for n in qnames}
        if qnames:  # the scales travel beside the weights (sender), or are made on this rank
            if quantize == "receiver":
                made = [*made, *(f"{n}{SCALE_SUFFIX}" for n in qnames)]
            params = {n: t for n, t in params.items() if n not in {f"{q}{SCALE_SUFFIX}" for q in qnames}}
        derived += [f"{mname}.{n}" for n in made]
        for pname, meta in params.items():
            live = module._parameters[pname]
            key = id(live)
            quant = block if pname in qnames and quantize == "receiver" else None
            if key in owner:
                targets.append(Target(mname, pname, owner[key], quant))
                continue
            shape = tuple(meta.shape)
            dtype = _dtype(meta) if quant is None else _dtype(torch.empty(0, dtype=module.orig_dtype))

            def add(name: str, tshape: tuple[int, ...], dtype: str = dtype) -> None:
                spec = TensorSpec(name, tuple(tshape), dtype)
                if tensors.setdefault(name, spec) != spec:
                    raise LayoutError(f"canonical tensor {name!r} read as {tensors[name]} and as {spec}")

            pieces, padding = _param_pieces(vllm_module_name(arch, mname), module, pname, shape, add, fused)
            bname = f"{mname}.{pname}"
            if pname in qnames:
                _check_whole_blocks(bname, pieces, block, tensors)
            owner[key] = bname
            buffers.append(LocalBuffer(bname, shape, dtype, tuple(pieces), tuple(padding)))
            targets.append(Target(mname, pname, bname, quant))
            if pname in qnames and quantize == "sender":
                sbuf = scale_buffer(buffers[-1], f"{bname}{SCALE_SUFFIX}", tuple(scales[pname].shape))
                _check_scales(sbuf, scales[pname])
                for p in pieces:
                    add(scale_name(p.tensor), scale_shape(tensors[p.tensor].shape), "float32")
                owner[id(module._parameters[f"{pname}{SCALE_SUFFIX}"])] = sbuf.name
                buffers.append(sbuf)
                targets.append(Target(mname, f"{pname}{SCALE_SUFFIX}", sbuf.name))
    if not buffers:
        raise LayoutError(f"{type(model).__name__}: no loadable parameters found")
    return RankLayout(tensors, buffers, targets, derived)
