"""A trainer rank's layout read from a live Megatron-core GPT model: its `sharded_state_dict()`
metadata (each ShardedTensor's global shape, offset and the layer axis Megatron prepends; the
SwiGLU factory of `linear_fc1`, built into its gate and up halves), mapped once to canonical
(Hugging Face Llama) names, interleaved QKV per query group included.

The buffers are the model's own parameters, sent in place at each publish. Megatron's names
(keys of the sharded state dict, the same for the local and the Transformer Engine layer specs)
map to canonical ones as `KEYS` says; `linear_qkv` holds, per query group, the group's query
heads then its key head then its value head; `linear_fc1` holds gate rows then up rows.

    from reshard.integrations.megatron import module_layout
    rank, world, tensors, buffers = module_layout(gpt_model)
    worker = TrainerWorker(CONTROLLER, rank, world, tensors, buffers).start()
"""

from __future__ import annotations

import torch

from reshard.common.layout.core import Box, LayoutError, LocalBuffer, Piece, TensorSpec

LAYER = "model.layers.{}."
KEYS: dict[str, str] = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "output_layer.weight": "lm_head.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "decoder.layers.self_attention.linear_qkv.layer_norm_weight": LAYER + "input_layernorm.weight",
    "decoder.layers.input_layernorm.weight": LAYER + "input_layernorm.weight",
    "decoder.layers.mlp.linear_fc1.layer_norm_weight": LAYER + "post_attention_layernorm.weight",
    "decoder.layers.pre_mlp_layernorm.weight": LAYER + "post_attention_layernorm.weight",
    "decoder.layers.self_attention.linear_proj.weight": LAYER + "self_attn.o_proj.weight",
    "decoder.layers.mlp.linear_fc2.weight": LAYER + "mlp.down_proj.weight",
    "decoder.layers.self_attention.linear_qkv.weight": LAYER + "self_attn.{}_proj.weight",  # q, k, v
    "decoder.layers.mlp.linear_fc1.weight": LAYER + "mlp.{}_proj.weight",  # gate, up
}
SKIPPED = ("_extra_state",)  # Transformer Engine's FP8 metadata: not weights


def _sharded_tensors(model: torch.nn.Module) -> list:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = []
    for key, v in model.sharded_state_dict().items():
        if key.endswith(SKIPPED):
            continue
        if isinstance(v, ShardedTensorFactory):
            built = v.build()
            out += list(built.values()) if isinstance(built, dict) else list(built)
        elif isinstance(v, ShardedTensor):
            out.append(v)
        else:
            raise LayoutError(f"{key}: {type(v).__name__} in the sharded state dict is not supported")
    return out


def _owner(params: list[tuple[str, torch.Tensor]], t: torch.Tensor) -> tuple[str, torch.Tensor, tuple[int, ...]]:
    """The parameter whose storage holds view `t`, and where `t` starts in it (coordinates)."""
    isz = t.element_size()
    for name, p in params:
        start = (t.data_ptr() - p.data_ptr()) // isz
        if 0 <= start < p.numel() and t.untyped_storage().data_ptr() == p.untyped_storage().data_ptr():
            coords, rem = [], start
            for stride in p.stride():
                coords.append(rem // stride)
                rem %= stride
            return name, p, tuple(coords)
    raise LayoutError("a sharded tensor's data is not a view of any parameter")


def module_layout(model: torch.nn.Module, *, rank: int | None = None, world: int | None = None,
                  vocab_size: int | None = None) -> tuple[int, int, dict[str, TensorSpec], dict[str, tuple[LocalBuffer, torch.Tensor]]]:
    """(rank, world, canonical tensors, buffers) of this rank of a Megatron-core GPT model.
    `vocab_size`: the canonical vocabulary when Megatron padded its own (rows past it are padding)."""
    import torch.distributed as dist

    if rank is None or world is None:
        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialized: pass rank and world")
        rank, world = dist.get_rank(), dist.get_world_size()
    cfg = model.config
    heads, groups = cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads
    d = cfg.kv_channels or cfg.hidden_size // heads
    hpg = heads // groups
    params = [(n, p.data) for n, p in model.named_parameters()]
    tensors: dict[str, TensorSpec] = {}
    pieces: dict[str, list[Piece]] = {}
    padding: dict[str, list[Box]] = {}

    def add(name: str, shape: tuple[int, ...], dtype: str) -> None:
        spec = TensorSpec(name, tuple(shape), dtype)
        if tensors.setdefault(name, spec) != spec:
            raise LayoutError(f"canonical tensor {name!r} read as {tensors[name]} and as {spec}")

    for st in _sharded_tensors(model):
        if st.flattened_range is not None:
            raise LayoutError(f"{st.key}: flattened (distributed optimizer) shards are not supported here")
        template = KEYS.get(st.key)
        if template is None:
            raise LayoutError(f"{st.key}: no canonical name (add it to reshard.integrations.megatron.KEYS)")
        k = st.prepend_axis_num
        layer = st.global_offset[0] if k else None
        gshape, off, size = st.global_shape[k:], st.global_offset[k:], tuple(st.local_shape)
        pname, p, at = _owner(params, st.data)
        dtype = str(p.dtype).removeprefix("torch.")
        rest = tuple(size[1:])
        z = (0,) * len(rest)
        out = pieces.setdefault(pname, [])
        base = at[0] if p.dim() == len(size) else 0  # the row of the parameter where this shard's data starts
        if st.key.endswith("linear_qkv.weight"):
            per = (hpg + 2) * d
            if off[0] % per or size[0] % per:
                raise LayoutError(f"{st.key}: shard rows {off[0]}:{off[0] + size[0]} do not hold whole query groups")
            names = {s: template.format(layer, s) for s in "qkv"}
            add(names["q"], (heads * d, *rest), dtype)
            add(names["k"], (groups * d, *rest), dtype)
            add(names["v"], (groups * d, *rest), dtype)
            for i, g in enumerate(range(off[0] // per, (off[0] + size[0]) // per)):
                row = base + i * per
                out.append(Piece(names["q"], Box((row, *z), (hpg * d, *rest)), Box((g * hpg * d, *z), (hpg * d, *rest))))
                out.append(Piece(names["k"], Box((row + hpg * d, *z), (d, *rest)), Box((g * d, *z), (d, *rest))))
                out.append(Piece(names["v"], Box((row + (hpg + 1) * d, *z), (d, *rest)), Box((g * d, *z), (d, *rest))))
        elif st.key.endswith("linear_fc1.weight"):
            inter = gshape[0] // 2
            half, row = ("gate", off[0]) if off[0] < inter else ("up", off[0] - inter)
            if row + size[0] > inter:
                raise LayoutError(f"{st.key}: a shard straddles the gate and up halves")
            name = template.format(layer, half)
            add(name, (inter, *rest), dtype)
            out.append(Piece(name, Box((base, *z), size), Box((row, *z), size)))
        else:
            name = template.format(layer) if layer is not None else template
            canon = tuple(gshape)
            if vocab_size and st.key in ("embedding.word_embeddings.weight", "output_layer.weight"):
                canon = (vocab_size, *rest)
                keep = max(0, min(size[0], vocab_size - off[0]))
                if keep < size[0]:
                    padding.setdefault(pname, []).append(Box((base + keep, *z), (size[0] - keep, *rest)))
                size = (keep, *rest)
            add(name, canon, dtype)
            if all(size):  # a shard of padding rows only holds no piece
                region = Box((base, *(0,) * (len(size) - 1)), size) if p.dim() == len(size) else Box.full(size)
                out.append(Piece(name, region, Box(tuple(off), size)))
    buffers = {}
    for pname, p in params:
        if pname in pieces:
            if not p.is_contiguous():
                raise LayoutError(f"parameter {pname!r} is not contiguous")
            buffers[pname] = (LocalBuffer(pname, tuple(p.shape), str(p.dtype).removeprefix("torch."), tuple(pieces[pname]),
                                          tuple(padding.get(pname, ()))), p)
    return rank, world, tensors, buffers


def full_state(model: torch.nn.Module, vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    """Every weight gathered whole under its canonical name (a collective over the tensor-parallel
    group: call on each of its ranks). For checks and references, not for updates."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    tp = dist.get_world_size(group)
    _, _, tensors, buffers = module_layout(model, rank=0, world=1, vocab_size=vocab_size)
    out = {n: torch.zeros(t.shape, dtype=getattr(torch, t.dtype)) for n, t in tensors.items()}
    held = {n: torch.zeros(t.shape, dtype=torch.uint8) for n, t in tensors.items()}  # gloo gathers no bools
    for desc, t in buffers.values():
        for p in desc.pieces:
            out[p.tensor][p.box.slices()] = p.view(t)
            held[p.tensor][p.box.slices()] = 1
    for name, t in out.items():  # each element from the first rank that holds it
        parts, masks = [torch.empty_like(t) for _ in range(tp)], [torch.empty_like(held[name]) for _ in range(tp)]
        dist.all_gather(parts, t, group=group)
        dist.all_gather(masks, held[name], group=group)
        whole, done = parts[0].clone(), masks[0].bool()
        for x, m in zip(parts[1:], masks[1:]):
            m = m.bool()
            take = m & ~done
            whole[take] = x[take]
            done |= m
        if not bool(done.all()):
            raise LayoutError(f"{name}: no tensor-parallel rank holds part of it")
        out[name] = whole
    return out
