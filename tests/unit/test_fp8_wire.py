"""Block FP8 on the wire (issue 29, item 3): the trainer ranks quantize, FP8 values and their
scales cross the wire, and each inference rank receives exactly what a quantizer of the whole
tensor makes. The expectation is the test's own: the masters it wrote, gathered by the test,
quantized by the block-by-block loop of test_fp8_recipe (not reshard's recipe), sliced as the
engine holds them."""

from __future__ import annotations

import time

import pytest
import torch

from reshard.common.dataplane.engine import Engine, StagingPool
from reshard.common.layout.core import Box, Layout, LayoutError, LocalBuffer, Piece, TensorSpec, check_compatible
from reshard.common.layout.quantized import fp8_tensors, quantized_source, with_scales
from reshard.common.layout.values import cast_refusal
from reshard.common.plan.planner import PlanOptions, make_plan
from reshard.common.quant import QuantizedBuffers

from .loopback import Loopback
from .test_fp8_recipe import loop_quantize

# up: [384, 200] (3 block rows, the last column block partial); down: [200, 384]; norm: [200]
SHAPES = {"up.weight": (384, 200), "down.weight": (200, 384), "norm": (200,)}


def masters() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    out = {n: torch.randn(s, generator=g) * 0.05 for n, s in SHAPES.items()}
    out["up.weight"][300, 7] = 9.0  # an outlier: one block's scale
    return out


def trainer(split_up: int = 256) -> tuple[Layout, list[dict[str, torch.Tensor]]]:
    """Megatron-like fp32 masters over 2 ranks: up by rows at `split_up`, down by columns at 256 (a
    block boundary), norm replicated. Rank 0 holds its two weights in one buffer (fused, as a
    framework may): each piece is quantized on its own."""
    m = masters()
    up, down = m["up.weight"], m["down.weight"]
    specs = {n: TensorSpec(n, s, "float32") for n, s in SHAPES.items()}
    r0 = (LocalBuffer("w", (split_up * 200 + 200 * 256,), "float32", (
        Piece("up.weight", Box((0,), (split_up * 200,)), Box((0, 0), (split_up, 200)), flat=True),
        Piece("down.weight", Box((split_up * 200,), (200 * 256,)), Box((0, 0), (200, 256)), flat=True))),
        LocalBuffer("norm", (200,), "float32", (Piece("norm", Box((0,), (200,)), Box((0,), (200,))),)))
    rest = 384 - split_up
    r1 = (LocalBuffer("up", (rest, 200), "float32", (Piece("up.weight", Box((0, 0), (rest, 200)), Box((split_up, 0), (rest, 200))),)),
          LocalBuffer("down", (200, 128), "float32", (Piece("down.weight", Box((0, 0), (200, 128)), Box((0, 256), (200, 128))),)),
          LocalBuffer("norm", (200,), "float32", (Piece("norm", Box((0,), (200,)), Box((0,), (200,))),)))
    bufs = [{"w": torch.cat([up[:split_up].reshape(-1), down[:, :256].reshape(-1)]), "norm": m["norm"].clone()},
            {"up": up[split_up:].clone(), "down": down[:, 256:].clone(), "norm": m["norm"].clone()}]
    return Layout(specs, (r0, r1)), bufs


def engine_fp8() -> Layout:
    """vLLM-like TP 2 of a block-FP8 checkpoint: up by rows (blocks 0 and 1-2), down by columns
    (block 0-1 and 2), each with its float32 weight_scale_inv; norm bf16, replicated."""
    specs = {"up.weight": TensorSpec("up.weight", (384, 200), "float8_e4m3fn"),
             "up.weight_scale_inv": TensorSpec("up.weight_scale_inv", (3, 2), "float32"),
             "down.weight": TensorSpec("down.weight", (200, 384), "float8_e4m3fn"),
             "down.weight_scale_inv": TensorSpec("down.weight_scale_inv", (2, 3), "float32"),
             "norm": TensorSpec("norm", (200,), "bfloat16")}
    ranks = []
    for r, (u0, ur, d0, dc) in enumerate(((0, 128, 0, 256), (128, 256, 256, 128))):
        su, sd = (u0 // 128, -(-ur // 128)), (d0 // 128, -(-dc // 128))
        ranks.append((
            LocalBuffer("up", (ur, 200), "float8_e4m3fn", (Piece("up.weight", Box((0, 0), (ur, 200)), Box((u0, 0), (ur, 200))),)),
            LocalBuffer("up_s", (su[1], 2), "float32",
                        (Piece("up.weight_scale_inv", Box((0, 0), (su[1], 2)), Box((su[0], 0), (su[1], 2))),)),
            LocalBuffer("down", (200, dc), "float8_e4m3fn", (Piece("down.weight", Box((0, 0), (200, dc)), Box((0, d0), (200, dc))),)),
            LocalBuffer("down_s", (2, sd[1]), "float32",
                        (Piece("down.weight_scale_inv", Box((0, 0), (2, sd[1])), Box((0, sd[0]), (2, sd[1]))),)),
            LocalBuffer("norm", (200,), "bfloat16", (Piece("norm", Box((0,), (200,)), Box((0,), (200,))),)),
        ))
    return Layout(specs, tuple(ranks))


def holds_what_the_loop_makes(dbufs: list[dict[str, torch.Tensor]], m: dict[str, torch.Tensor], when: str = ""):
    """Each rank of `engine_fp8` holds what the block-by-block loop makes of the masters `m`, byte
    for byte, and norm as their bf16 cast; returns up's (values, scales)."""
    (uq, us), (dq, ds) = loop_quantize(m["up.weight"]), loop_quantize(m["down.weight"])
    u8 = torch.uint8
    for d, (u0, ur, d0, dc) in enumerate(((0, 128, 0, 256), (128, 256, 256, 128))):
        got, at = dbufs[d], f"{when}rank {d}"
        assert torch.equal(got["up"].view(u8), uq[u0:u0 + ur].view(u8)), f"{at} up"
        assert torch.equal(got["up_s"], us[u0 // 128:-(-(u0 + ur) // 128)]), f"{at} up scales"
        assert torch.equal(got["down"].view(u8), dq[:, d0:d0 + dc].view(u8)), f"{at} down"
        assert torch.equal(got["down_s"], ds[:, d0 // 128:-(-(d0 + dc) // 128)]), f"{at} down scales"
        assert torch.equal(got["norm"], m["norm"].to(torch.bfloat16)), f"{at} norm"
    return uq, us


class Counting(Loopback):
    def __init__(self, rank: int, wire: dict, counter: list[int]) -> None:
        super().__init__(rank, wire)
        self.counter = counter

    def send(self, buf, peer, tag):
        self.counter[0] += buf.numel() * buf.element_size()
        return super().send(buf, peer, tag)


@pytest.mark.parametrize("relay", [False, True])
def test_trainer_quantizes_fp8_values_and_scales_cross_the_wire(relay):
    src, sbufs = trainer()
    dst = engine_fp8()
    assert fp8_tensors(src, dst) == {"up.weight": "up.weight_scale_inv", "down.weight": "down.weight_scale_inv"}
    with pytest.raises(LayoutError, match="float8_e4m3fn values need their block scales"):
        check_compatible(src, dst)  # unquantized, the pair does not plan: the sender must quantize
    q = quantized_source(src, dst)
    check_compatible(q, dst)
    assert {n: t.dtype for n, t in q.tensors.items() if n.endswith("weight")} == {"up.weight": "float8_e4m3fn",
                                                                                 "down.weight": "float8_e4m3fn"}
    # rank 0's fused buffer gave both its pieces away (dropped); rank 1 keeps only its norm's buffer
    assert sorted(b.name for b in q.ranks[0]) == ["norm", "w#fp8:0", "w#fp8:1", "w#scale:0", "w#scale:1"]
    assert sorted(b.name for b in q.ranks[1]) == ["down#fp8:0", "down#scale:0", "norm", "up#fp8:0", "up#scale:0"]
    plan = make_plan(q, dst, PlanOptions(relay=relay, direct_min_bytes=1))
    shapes = {n: s.shape for n, s in q.tensors.items()}
    wire, sent, deadline = {}, [0], time.monotonic() + 60
    for r in range(2):
        bufs = QuantizedBuffers(q.ranks[r], {b.name: b for b in src.ranks[r]}, sbufs[r])  # as the worker: lazily
        Engine(Counting(r, wire, sent), plan, "src", r, bufs, shapes, StagingPool(), deadline).run()
    trainer_bytes = sent[0]
    dbufs = [{b.name: torch.zeros(b.shape, dtype=getattr(torch, b.dtype)) for b in dst.ranks[d]} for d in range(2)]
    for d in range(2):
        Engine(Counting(2 + d, wire, sent), plan, "dst", d, dbufs[d], shapes, StagingPool(), deadline).run()
    assert not wire
    m = masters()
    uq, us = holds_what_the_loop_makes(dbufs, m)
    assert us[2, 0] == 9.0 / 448.0 and torch.count_nonzero(uq.float()) > 0.9 * uq.numel()  # the outlier's block
    # FP8 on the wire: one byte per weight element and four per block scale (bf16 would be two per
    # element, the fp32 masters four), every destination element once (a relay forwards a copy
    # between inference ranks), packing alignment aside.
    fp8_bytes = 384 * 200 + 200 * 384 + 4 * (3 * 2 + 2 * 3)
    assert plan.total_bytes == fp8_bytes + 2 * 2 * 200
    from_trainer = sum(m.wire_bytes for m in plan.messages if not m.relay)
    assert trainer_bytes == from_trainer and trainer_bytes < 1.1 * (fp8_bytes + 2 * 2 * 200) * (1 if not relay else 2)
    assert trainer_bytes < 0.3 * 4 * (384 * 200 + 200 * 384), "the fp32 masters would be four bytes an element"


def test_a_trainer_shard_whose_columns_split_blocks_is_refused_by_name():
    src, _ = trainer()
    r1 = list(src.ranks[1])
    down = r1[1]  # columns 256-383 -> 192-383: its first column block is split with rank 0's
    r1[1] = LocalBuffer("down", (200, 192), "float32", (Piece("down.weight", Box((0, 0), (200, 192)), Box((0, 192), (200, 192))),))
    assert down.name == "down"
    bad = Layout(src.tensors, (src.ranks[0], tuple(r1)))
    with pytest.raises(LayoutError, match=r"tensor 'down.weight': the destination serves it as block FP8 \(128 x 128\), "
                                          r"and trainer rank 1 holds its box \[0:200, 192:384\], whose columns split "
                                          r"blocks.*quantize='receiver'"):
        quantized_source(bad, engine_fp8())


# FSDP2-like: each weight's rows cut where the ranks' shares end, not on block boundaries. Rank 1's
# share of up lies inside one row of blocks (it sends no scale); rank 3 holds its rows of up in two
# buffers, the cut between them inside a row of blocks too.
ROW_CUTS = {"up.weight": ((0, 100), (100, 120), (120, 250), (250, 300), (300, 384)),
            "down.weight": ((0, 67), (67, 134), (134, 200))}
HOLDER = {"up.weight": (0, 1, 2, 3, 3), "down.weight": (0, 1, 2)}


def fsdp_trainer() -> tuple[Layout, list[dict[str, torch.Tensor]]]:
    m = masters()
    specs = {n: TensorSpec(n, s, "float32") for n, s in SHAPES.items()}
    ranks, bufs = [[] for _ in range(4)], [{} for _ in range(4)]
    for t, cuts in ROW_CUTS.items():
        cols = SHAPES[t][1]
        for j, ((a, b), r) in enumerate(zip(cuts, HOLDER[t])):
            name = f"{t.split('.')[0]}{j}"
            ranks[r].append(LocalBuffer(name, (b - a, cols), "float32",
                                        (Piece(t, Box((0, 0), (b - a, cols)), Box((a, 0), (b - a, cols))),)))
            bufs[r][name] = m[t][a:b].clone()
    for r in range(4):
        ranks[r].append(LocalBuffer("norm", (200,), "float32", (Piece("norm", Box((0,), (200,)), Box((0,), (200,))),)))
        bufs[r]["norm"] = m["norm"].clone()
    return Layout(specs, tuple(tuple(x) for x in ranks)), bufs


class Waiting(Loopback):
    """Loopback whose receive waits for its message (the ranks' exchange runs in threads)."""

    def recv(self, buf, peer, tag):
        until = time.monotonic() + 10
        while (peer, self.rank, tag) not in self.wire:
            assert time.monotonic() < until, f"rank {self.rank}: nothing from rank {peer} (tag {tag})"
            time.sleep(0.001)
        return super().recv(buf, peer, tag)


def _fsdp_transfer(exchange: bool) -> tuple[list[dict[str, torch.Tensor]], Layout, object]:
    import threading

    from reshard.common.layout.quantized import amax_exchange

    src, sbufs = fsdp_trainer()
    dst = engine_fp8()
    q = quantized_source(src, dst)
    plan = make_plan(q, dst, PlanOptions(direct_min_bytes=1))
    shapes = {n: s.shape for n, s in q.tensors.items()}
    wire, deadline = {}, time.monotonic() + 60
    held = []
    for r in range(4):
        split = amax_exchange(q, r, plan.moved_tensors())
        if not exchange and split:
            split = (split[0], {})  # each rank's own part of every split row only: the negative control
        held.append(QuantizedBuffers(q.ranks[r], {b.name: b for b in src.ranks[r]}, sbufs[r], split))
    threads = [threading.Thread(target=held[r].exchange, args=(Waiting(r, wire), deadline)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for r in range(4):
        Engine(Loopback(r, wire), plan, "src", r, held[r], shapes, StagingPool(), deadline).run()
    dbufs = [{b.name: torch.zeros(b.shape, dtype=getattr(torch, b.dtype)) for b in dst.ranks[d]} for d in range(2)]
    for d in range(2):
        Engine(Loopback(4 + d, wire), plan, "dst", d, dbufs[d], shapes, StagingPool(), deadline).run()
    assert not wire
    return dbufs, q, plan


def test_fp8_blocks_split_by_trainer_shards_come_out_as_if_quantized_whole():
    from reshard.common.layout.quantized import amax_exchange, split_rows

    dbufs, q, plan = _fsdp_transfer(exchange=True)
    # up: rows of blocks 0 (cut at 100 and 120) and 1 (250); 2 (300: rank 3's own two buffers);
    # down: 0 (67), 1 (134)
    assert [(r.tensor, r.row, r.classes) for r in split_rows(q)] == [
        ("down.weight", 0, (0, 1)), ("down.weight", 1, (1, 2)),
        ("up.weight", 0, (0, 1, 2)), ("up.weight", 1, (2, 3)), ("up.weight", 2, (3,))]
    rows, peers = amax_exchange(q, 3, plan.moved_tensors())
    assert [(r.tensor, r.row) for r in rows] == [("up.weight", 1), ("up.weight", 2)] and list(peers) == [2]
    assert not any(b.name == "up1#scale:0" for b in q.ranks[1]), "a share inside one row of blocks sends no scale"
    m = masters()
    holds_what_the_loop_makes(dbufs, m)
    # Each element and each block's scale crosses the wire once, FP8: what whole blocks would cost
    assert plan.total_bytes == 384 * 200 + 200 * 384 + 4 * (3 * 2 + 2 * 3) + 2 * 2 * 200


def test_fp8_split_blocks_without_the_exchange_come_out_wrong():
    """Negative control: each rank scaling its part of a split row of blocks by its own part's max."""
    dbufs, _, _ = _fsdp_transfer(exchange=False)
    m = masters()
    u8 = torch.uint8
    for t, buf in (("up.weight", "up"), ("down.weight", "down")):
        q = loop_quantize(m[t])[0]
        got = torch.cat([dbufs[0][buf], dbufs[1][buf]], dim=0 if t == "up.weight" else 1)
        assert not torch.equal(got.view(u8), q.view(u8)), f"{t}: right without the exchange"


def test_fp8_without_its_scales_is_refused():
    src, _ = trainer()
    dst = engine_fp8()
    no_scales = Layout({n: t for n, t in dst.tensors.items() if n != "up.weight_scale_inv"},
                       tuple(tuple(b for b in r if b.name != "up_s") for r in dst.ranks))
    with pytest.raises(LayoutError, match=r"tensor 'up.weight': the destination serves it as float8_e4m3fn but "
                                          r"declares no float32 'up.weight_scale_inv' of shape \[3, 2\]"):
        quantized_source(src, no_scales)
    assert cast_refusal("float32", "float8_e4m3fn") and cast_refusal("float8_e4m3fn", "bfloat16")


def test_a_partial_update_of_an_fp8_tensor_carries_its_scales():
    dst = engine_fp8()
    assert with_scales({"up.weight", "norm"}, dst) == {"up.weight", "up.weight_scale_inv", "norm"}
    assert with_scales(None, dst) is None
    src, _ = trainer()
    plan = make_plan(quantized_source(src, dst), dst, tensors=with_scales({"up.weight"}, dst))
    assert plan.total_bytes == 384 * 200 + 4 * 3 * 2
