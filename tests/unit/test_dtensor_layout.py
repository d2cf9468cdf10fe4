"""Trainer layouts read from live DTensor parameters: every rank of 1-D and 2-D meshes, uneven
and empty shards, against torch's own split (the local shard torch.distributed.tensor gives each
rank, and the global offset it computes), on a fake process group (no communication)."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.testing._internal.distributed.fake_pg import FakeStore

from reshard.common.layout.core import LayoutError
from reshard.integrations.dtensor import module_layout
from reshard.integrations.names import canonical_name, unfused

CASES = [  # mesh, {parameter: (shape, placements)}
    ((4,), {"w": ((10, 3), (Shard(0),)), "e": ((6, 2), (Shard(0),)), "n": ((5,), (Replicate(),))}),
    ((2, 2), {"w": ((10, 6), (Shard(0), Shard(1))), "v": ((7, 4), (Replicate(), Shard(0))),
              "x": ((3, 5), (Shard(1), Shard(1)))}),
]


class Holder(torch.nn.Module):
    def __init__(self, params: dict) -> None:
        super().__init__()
        for n, p in params.items():
            self.register_parameter(n, torch.nn.Parameter(p))


@pytest.fixture
def fake_world():
    def init(rank: int, world: int) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("mesh_shape,params", CASES)
def test_every_rank_matches_torchs_split(fake_world, mesh_shape, params):
    world = 1
    for m in mesh_shape:
        world *= m
    covered = {n: torch.zeros(s, dtype=torch.int32) for n, (s, _) in params.items()}
    for rank in range(world):
        fake_world(rank, world)
        mesh = dist.device_mesh.init_device_mesh("cpu", mesh_shape)
        full = {n: torch.arange(torch.Size(s).numel(), dtype=torch.float32).reshape(s) for n, (s, _) in params.items()}
        model = Holder({n: distribute_tensor(full[n], mesh, pl) for n, (_, pl) in params.items()})
        r, w, tensors, buffers = module_layout(model)
        assert (r, w) == (rank, world)
        assert {n: t.shape for n, t in tensors.items()} == {n: tuple(s) for n, (s, _) in params.items()}
        for n, (shape, pl) in params.items():
            local_shape, offset = compute_local_shape_and_global_offset(torch.Size(shape), mesh, pl)
            local = model.get_parameter(n).data._local_tensor
            assert tuple(local.shape) == tuple(local_shape)
            if local.numel() == 0:
                assert n not in buffers, f"rank {rank}: an empty shard of {n} got a buffer"
                continue
            desc, t = buffers[n]
            (piece,) = desc.pieces
            assert piece.box.offset == tuple(offset) and piece.box.size == tuple(local_shape)
            assert t.data_ptr() == local.data_ptr(), "the buffer must be the parameter's own storage"
            covered[n][piece.box.slices()] += 1
    for n, (_, pl) in params.items():
        replicas = 1
        for m, p in zip(mesh_shape, pl):
            replicas *= m if isinstance(p, Replicate) else 1
        assert bool((covered[n] == replicas).all()), f"{n}: boxes do not tile the tensor"


def test_plain_parameters_are_replicated_and_partial_is_refused(fake_world):
    from torch.distributed.tensor import Partial

    fake_world(1, 2)
    mesh = dist.device_mesh.init_device_mesh("cpu", (2,))
    model = torch.nn.Linear(4, 3)
    _, _, tensors, buffers = module_layout(model)
    assert set(buffers) == {"weight", "bias"} and buffers["weight"][0].pieces[0].box.size == (3, 4)
    bad = Holder({"p": DTensor.from_local(torch.zeros(2, 2), mesh, (Partial(),), run_check=False)})
    with pytest.raises(LayoutError, match="Partial"):
        module_layout(bad)


def test_names():
    assert canonical_name("model._orig_mod.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight") == \
        "model.layers.0.mlp.up_proj.weight"
    assert canonical_name("layers.0.wq.weight", {"layers.0.wq.weight": "model.layers.0.self_attn.q_proj.weight"}) == \
        "model.layers.0.self_attn.q_proj.weight"
    assert unfused("model.layers.3.self_attn.qkv_proj") == ("model.layers.3.self_attn.q_proj",
                                                            "model.layers.3.self_attn.k_proj", "model.layers.3.self_attn.v_proj")
    assert unfused("model.layers.3.mlp.down_proj") is None


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(6, 7, bias=False)  # colwise: 7 rows over TP 2 (4, 3), then over DP 2 (2, 2 and 2, 1)
        self.down = torch.nn.Linear(7, 6, bias=False)  # rowwise: columns over TP, rows over DP
        self.norm = torch.nn.Parameter(torch.zeros(3))  # replicated over TP, 3 rows over DP 2


@pytest.mark.parametrize("dp,tp", [(2, 2), (2, 3)])
def test_fsdp2_over_tensor_parallel_2d_mesh(fake_world, dp, tp):
    """FSDP2 (`fully_shard`) over tensor-parallel parameters on a (dp, tp) mesh gives the
    colwise weight `_StridedShard` placements: each rank holds its DP chunk of its TP chunk.
    Each rank's box must select, from the full tensor, exactly the values its local shard holds
    (the modules are split locally, src_data_rank=None, so the fake group moves no data)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.distributed.tensor.placement_types import _StridedShard

    torch.manual_seed(0)
    ref = Mlp()
    full = {n: p.detach().clone() for n, p in ref.named_parameters()}
    for n, t in full.items():
        t.copy_(torch.arange(t.numel(), dtype=t.dtype).reshape(t.shape) + 1)
    covered = {n: torch.zeros(t.shape, dtype=torch.int32) for n, t in full.items()}
    strided = 0
    for rank in range(dp * tp):
        fake_world(rank, dp * tp)
        mesh = dist.device_mesh.init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        model = Mlp()
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(full[n])
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()}, src_data_rank=None)
        fully_shard(model, mesh=mesh["dp"])
        strided += any(isinstance(p, _StridedShard) for p in model.up.weight.placements)
        _, _, tensors, buffers = module_layout(model)
        assert {n: t.shape for n, t in tensors.items()} == {n: tuple(t.shape) for n, t in full.items()}
        for n, p in model.named_parameters():
            local = p._local_tensor
            if local.numel() == 0:
                assert n not in buffers
                continue
            (piece,) = buffers[n][0].pieces
            assert torch.equal(full[n][piece.box.slices()], local), f"rank {rank}: {n} box {piece.box} holds other values"
            covered[n][piece.box.slices()] += 1
    assert strided == dp * tp, "FSDP2 no longer gives _StridedShard here: this test does not test it"
    for n, c in covered.items():
        replicas = 1 if n != "norm" else tp
        assert bool((c == replicas).all()), f"{n}: boxes do not tile the tensor"


def test_strided_shard_other_than_fsdp2s_form_is_refused(fake_world):
    from torch.distributed.tensor.placement_types import _StridedShard

    fake_world(0, 4)
    mesh = dist.device_mesh.init_device_mesh("cpu", (2, 2))
    bad = Holder({"p": DTensor.from_local(torch.zeros(2, 2), mesh, (_StridedShard(0, split_factor=3), Shard(0)), run_check=False)})
    with pytest.raises(LayoutError, match="only FSDP2's form"):
        module_layout(bad)


def test_persistent_buffers_are_tensors_and_non_persistent_ones_are_not():
    """DeepSeek-V3's gate keeps `e_score_correction_bias` as a persistent buffer, a checkpoint
    tensor vLLM loads: a trainer that offered parameters only could not update such a model."""
    m = torch.nn.Module()
    m.gate = torch.nn.Linear(4, 3, bias=False)
    m.gate.register_buffer("e_score_correction_bias", torch.arange(3, dtype=torch.float32))
    m.gate.register_buffer("inv_freq", torch.ones(2), persistent=False)
    m.gate.register_buffer("counts", torch.zeros(3, dtype=torch.int64))  # bookkeeping, not weights
    _, _, tensors, buffers = module_layout(m, rank=0, world=1)
    assert set(tensors) == {"gate.weight", "gate.e_score_correction_bias"}
    desc, t = buffers["gate.e_score_correction_bias"]
    assert t.data_ptr() == m.gate.e_score_correction_bias.data_ptr() and desc.shape == (3,)
