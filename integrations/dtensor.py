"""A trainer rank's layout read from a live PyTorch module: parameters that are DTensors (FSDP2's
`fully_shard`, tensor parallel through `parallelize_module`, 2-D meshes) or plain tensors
(replicated, as under DDP). FSDP2 over tensor parallelism on a 2-D mesh included (its
`_StridedShard` placements).

Each parameter is one local buffer: the rank's local shard, which the optimizer updates in place,
so the worker sends the current weights at every publish without a copy. Its box in the canonical
tensor follows from the DTensor's mesh, placements and this rank's mesh coordinate, split as
DTensor splits (`torch.chunk`: ceil-sized shards, the last short or empty). Empty shards hold
nothing and get no buffer."""

from __future__ import annotations

import torch

from reshard.common.layout.core import Box, LayoutError, LocalBuffer, Piece, TensorSpec
from reshard.common.layout.placement import Replicate, Shard, box_at
from reshard.integrations.names import Names, canonical_name


def _box(name: str, shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements, coord: tuple[int, ...]) -> Box:
    """This mesh coordinate's box. Shard and Replicate split left to right over the mesh dimensions,
    as DTensor does. A `_StridedShard(d, split_factor=f)` is what FSDP2 gives a parameter that
    tensor parallelism already shards on dimension d: the later mesh dimensions that shard d
    (whose sizes multiply to f) split it first and this one splits their shards (right to left),
    so it is expanded after them."""
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor.placement_types import _StridedShard

    plain, order, strided = [], list(range(len(mesh_shape))), []
    for i, p in enumerate(placements):
        if isinstance(p, _StridedShard):
            later = [j for j in range(i + 1, len(placements)) if isinstance(placements[j], TShard) and placements[j].dim == p.dim]
            inner = 1
            for j in later:
                inner *= mesh_shape[j]
            if not later or inner != int(p.split_factor):
                raise LayoutError(f"parameter {name!r}: placement {p} at mesh dimension {i}: the later mesh dimensions "
                                  f"shard dimension {p.dim} into {inner}, not {p.split_factor}: only FSDP2's form over "
                                  "tensor parallelism is supported")
            strided.append((i, later[-1]))
            plain.append(Shard(p.dim))
        elif type(p) is TShard:
            plain.append(Shard(p.dim))
        elif isinstance(p, TReplicate):
            plain.append(Replicate())
        else:  # Partial (a pending reduction)
            raise LayoutError(f"parameter {name!r}: placement {type(p).__name__} ({p}) is not supported "
                              "(Shard, Replicate and FSDP2's _StridedShard are)")
    for i, last in strided:  # expand the strided dimension right after the ones that split first
        order.remove(i)
        order.insert(order.index(last) + 1, i)
    return box_at(shape, tuple(mesh_shape[j] for j in order), tuple(plain[j] for j in order), tuple(coord[j] for j in order),
                  name)


def _persistent_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's persistent floating-point buffers, by name: checkpoint tensors an engine loads
    too (DeepSeek-V3's `e_score_correction_bias`); non-persistent ones (rotary `inv_freq`) are not."""
    out = []
    for mname, m in module.named_modules():
        for bname, b in m.named_buffers(recurse=False):
            if b is not None and bname not in m._non_persistent_buffers_set and b.is_floating_point():
                out.append((f"{mname}.{bname}" if mname else bname, b))
    return out


def module_layout(module: torch.nn.Module, *, names: Names = None, rank: int | None = None,
                  world: int | None = None) -> tuple[int, int, dict[str, TensorSpec], dict[str, tuple[LocalBuffer, torch.Tensor]]]:
    """(rank, world, canonical tensors, buffers) of this process's rank. `rank` and `world`
    default to torch.distributed's; parameter names become canonical through `names` (a function
    or a mapping; see `reshard.integrations.names`). Tied parameters count once. Persistent
    floating-point buffers count as tensors too (whole on every rank, or as their DTensor says)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if rank is None or world is None:
        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialized: pass rank and world")
        rank, world = dist.get_rank(), dist.get_world_size()
    tensors: dict[str, TensorSpec] = {}
    buffers: dict[str, tuple[LocalBuffer, torch.Tensor]] = {}
    for pname, p in [*module.named_parameters(), *_persistent_buffers(module)]:  # tied parameters once
        name = canonical_name(pname, names)
        if name in tensors:
            raise LayoutError(f"parameters {pname!r} and another both map to canonical name {name!r}")
        data = p if isinstance(p, DTensor) else p.data
        dtype = str(p.dtype).removeprefix("torch.")
        if isinstance(data, DTensor):
            mesh = data.device_mesh
            where = (mesh.mesh == rank).nonzero()  # this rank's coordinate in the parameter's mesh
            tensors[name] = TensorSpec(name, tuple(data.shape), dtype)
            if not len(where):  # this rank is outside the parameter's mesh
                continue
            coord = tuple(int(i) for i in where[0])
            box = _box(pname, tuple(data.shape), tuple(mesh.shape), data.placements, coord)
            local = data._local_tensor.detach()  # the storage the optimizer updates in place
        else:
            tensors[name] = TensorSpec(name, tuple(data.shape), dtype)
            box, local = Box.full(tuple(data.shape)), data.detach()
        if box.numel == 0:
            continue
        if tuple(local.shape) != box.size:
            raise LayoutError(f"parameter {pname!r}: local shard is {tuple(local.shape)}, its placements give {box.size}")
        if not local.is_contiguous():
            raise LayoutError(f"parameter {pname!r}: its local shard is not contiguous")
        buffers[name] = (LocalBuffer(name, box.size, dtype, (Piece(name, Box.full(box.size), box),)), local)
    if not tensors:
        raise LayoutError(f"{type(module).__name__} has no parameters")
    if not buffers:
        raise LayoutError(f"rank {rank} holds no part of any parameter of {type(module).__name__}")
    return rank, world, tensors, buffers


def full_state(module: torch.nn.Module, names: Names = None) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole, by canonical name (a collective: call on every rank).
    For checks and references, not for updates."""
    from torch.distributed.tensor import DTensor

    out = {}
    for pname, p in module.named_parameters():
        data = p if isinstance(p, DTensor) else p.data
        out[canonical_name(pname, names)] = (data.full_tensor() if isinstance(data, DTensor) else data).detach().clone()
    return out

