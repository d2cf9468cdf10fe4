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
