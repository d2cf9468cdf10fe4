"""Object-form twins of the framework builders, for tests only.

`reshard.common.models.frameworks` emits routed experts as numpy columns. Here the same
layouts are built piece by piece as Python objects, written from the frameworks' own
conventions (Megatron: `local_experts.k.linear_fc1` = [gate; up] rows of this expert-TP rank,
`linear_fc2` its columns of down; vLLM FusedMoE: `w13_weight` [E, 2*I/etp, H] gate rows then up
rows per expert, `w2_weight` [E, H, I/etp], each expert's slab a flat piece). The dense
buffers come from the builders' per-rank functions, which the columns path uses as they are."""

from __future__ import annotations

from reshard.common.layout.core import Box, Layout, LocalBuffer, Piece
from reshard.common.models import frameworks as fw


def _div(n: int, k: int) -> int:
    assert n % k == 0, (n, k)
    return n // k


def _rows_of(tensor: str, buf_row: int, row: int, rows: int, cols: int) -> Piece:
    return Piece(tensor, Box((buf_row, 0), (rows, cols)), Box((row, 0), (rows, cols)))


def megatron_experts(m, layers, etp: int, etr: int, ep: int, er: int) -> list[LocalBuffer]:
    h, per = m.hidden, m.experts // ep
    pe = _div(m.moe_intermediate, etp)
    out = []
    for i in layers:
        if not m.is_moe(i):
            continue
        for k in range(per):
            e = er * per + k
            x, y = f"model.layers.{i}.mlp.experts.{e}.", f"decoder.layers.{i}.mlp.experts.local_experts.{k}."
            out.append(LocalBuffer(y + "linear_fc1.weight", (2 * pe, h), m.dtype, (
                _rows_of(x + "gate_proj.weight", 0, etr * pe, pe, h), _rows_of(x + "up_proj.weight", pe, etr * pe, pe, h))))
            out.append(LocalBuffer(y + "linear_fc2.weight", (h, pe), m.dtype, (
                Piece(x + "down_proj.weight", Box((0, 0), (h, pe)), Box((0, etr * pe), (h, pe))),)))
    return out


def vllm_experts(m, experts: range, etp: int, er: int) -> list[LocalBuffer]:
    h = m.hidden
    pe = _div(m.moe_intermediate, etp)
    n = len(experts)
    out = []
    for i in range(m.layers):
        if not m.is_moe(i):
            continue
        p = f"model.layers.{i}.mlp.experts."
        w13, w2 = [], []
        for k, e in enumerate(experts):
            x = f"{p}{e}."
            for half, w in enumerate(("gate", "up")):  # slab k: rows [2k*pe + half*pe, ...) of [n*2pe, h]
                w13.append(Piece(x + f"{w}_proj.weight", Box((((2 * k + half) * pe) * h,), (pe * h,)),
                                 Box((er * pe, 0), (pe, h)), flat=True))
            w2.append(Piece(x + "down_proj.weight", Box((k * h * pe,), (h * pe,)), Box((0, er * pe), (h, pe)), flat=True))
        out.append(LocalBuffer(p + "w13_weight", (n, 2 * pe, h), m.dtype, tuple(w13)))
        out.append(LocalBuffer(p + "w2_weight", (n, h, pe), m.dtype, tuple(w2)))
    return out


def megatron_objects(m, tp: int = 1, pp: int = 1, cp: int = 1, dp: int = 1, ep: int = 1, etp: int = 0, vpp: int = 1,
                     pad_multiple: int = 128) -> Layout:
    etp = etp or tp
    inner = tp * cp * dp
    t = fw._tensors(m)
    stages = fw._stage_layers(m.layers, pp, vpp)
    cache: dict[tuple, tuple] = {}
    ranks = []
    for rank in range(inner * pp):
        tr, s, i = rank % tp, rank // inner, rank % inner
        er = (i // etp) % ep
        key = (tr, s, i % etp, er)
        if key not in cache:
            dense = fw._megatron_rank(m, t, tp, tr, stages[s], s == 0, s == pp - 1, pad_multiple * tp)
            cache[key] = tuple(dense) + tuple(megatron_experts(m, stages[s], etp, i % etp, ep, er))
        ranks.append(cache[key])
    return Layout(t, tuple(ranks))


def vllm_objects(m, tp: int = 1, dp: int = 1, ep: int = 0, pad_multiple: int = 64) -> Layout:
    t = fw._tensors(m)
    moe_ep = bool(ep and m.experts)
    dense = [tuple(fw._vllm_rank(m, t, tp, r, pad_multiple)) for r in range(tp)]
    if not moe_ep:
        replica = [dense[r] + tuple(vllm_experts(m, range(m.experts), tp, r)) for r in range(tp)]
        return Layout(t, tuple(replica[r] for _ in range(dp) for r in range(tp)))
    per = _div(m.experts, tp * dp)
    return Layout(t, tuple(dense[r] + tuple(vllm_experts(m, range((d * tp + r) * per, (d * tp + r + 1) * per), 1, 0))
                           for d in range(dp) for r in range(tp)))


OBJECT_BUILDERS = {"megatron": megatron_objects, "vllm": vllm_objects}
