"""CUDA IPC: the same-host fast path for processes that share a GPU or a node.

A process exports CUDA IPC handles of its buffers (torch's own CUDA tensor reduction, the
one torch.multiprocessing uses); the handles travel as `reshard.worker.v1.CudaIpcHandle`
protobuf messages, so any gRPC message can carry them; the peer maps the buffers into its
own address space and copies what the plan says straight from them, with no staging and
no network: each segment is one device copy (`run_plan_from_peers`).

Rules of the road: the exporting process must keep the buffers alive and unchanged until
the importer is done reading (the trainer's publish handle is released after the update);
the importer drops its views (`del`) before the exporter frees them; both processes must
see the same device (same CUDA_VISIBLE_DEVICES mapping, or device UUIDs compared by the
caller). Handles of the caching allocator are per allocation: exporting a slice of a
larger block maps the whole block once (torch caches opened handles).

Status: exercised only by `make gpu-check` (two processes on one GPU, weights verified);
not yet a session backend that the update lifecycle picks on its own.
"""

from __future__ import annotations

import dataclasses

import torch

from reshard.common.plan.planner import Plan


@dataclasses.dataclass(frozen=True, slots=True)
class IpcHandle:
    """One buffer's CUDA IPC handle: torch's CUDA tensor reduction, field by field (the
    `reshard.worker.v1.CudaIpcHandle` message has the same fields)."""

    name: str
    device: int
    handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def to_proto(self):
        from reshard.proto import worker_pb2 as wpb

        return wpb.CudaIpcHandle(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    @classmethod
    def from_proto(cls, m) -> "IpcHandle":
        kw = {f.name: getattr(m, f.name) for f in dataclasses.fields(cls)}
        return cls(**dict(kw, shape=tuple(m.shape), stride=tuple(m.stride)))


def export_tensor(t: torch.Tensor, name: str = "") -> IpcHandle:
    """An IPC handle of CUDA tensor `t` (a view of its allocation)."""
    from torch.multiprocessing.reductions import reduce_tensor

    if t.device.type != "cuda":
        raise ValueError(f"CUDA IPC exports CUDA tensors; {name or 'this tensor'} is on {t.device}")
    torch.cuda.current_stream(t.device).synchronize()  # what the importer reads must be written
    _, args = reduce_tensor(t)
    (_cls, size, stride, offset, _scls, dtype, device, handle, storage_bytes, storage_offset, _grad,
     ref_handle, ref_offset, event_handle, event_sync) = args
    return IpcHandle(name=name, device=int(device), handle=handle, storage_bytes=storage_bytes,
                     storage_offset=storage_offset, ref_counter_handle=ref_handle or b"", ref_counter_offset=ref_offset or 0,
                     event_handle=event_handle or b"", event_sync_required=bool(event_sync),
                     dtype=str(dtype).removeprefix("torch."), shape=tuple(size), stride=tuple(stride), offset=offset)


def import_tensor(h: IpcHandle) -> torch.Tensor:
    """The exporter's tensor, mapped into this process (a view of its memory, not a copy)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(torch.Tensor, torch.Size(h.shape), tuple(h.stride), h.offset, torch.UntypedStorage,
                               getattr(torch, h.dtype), h.device, h.handle, h.storage_bytes, h.storage_offset, False,
                               h.ref_counter_handle or None, h.ref_counter_offset, h.event_handle or None,
                               h.event_sync_required)


def export_buffers(buffers: dict[str, torch.Tensor]) -> bytes:
    """Every buffer's handle, as one serialized `CudaIpcHandles` message (fits any gRPC message)."""
    from reshard.proto import worker_pb2 as wpb

    return wpb.CudaIpcHandles(handles=[export_tensor(t, n).to_proto() for n, t in buffers.items()]).SerializeToString()


def import_buffers(data: bytes) -> dict[str, torch.Tensor]:
    from reshard.proto import worker_pb2 as wpb

    return {h.name: import_tensor(IpcHandle.from_proto(h)) for h in wpb.CudaIpcHandles.FromString(data).handles}


def run_plan_from_peers(plan: Plan, rank: int, src_buffers: dict[int, dict[str, torch.Tensor]],
                        dst_buffers: dict[str, torch.Tensor]) -> int:
    """Destination `rank`'s share of `plan`, read straight from the source ranks' mapped buffers
    (`src_buffers[src rank]`): one device copy per segment (casting where the plan declares it).
    Returns the bytes written. Every source is mapped, so plan without relays
    (`PlanOptions(relay=False)`): a relay would read another destination rank."""
    nbytes = 0
    stream = torch.cuda.current_stream()
    for m in sorted(plan.recvs.get(rank, []), key=lambda m: m.round):
        if m.relay:
            raise ValueError("CUDA IPC reads every source directly: make the plan with PlanOptions(relay=False)")
        bufs = src_buffers[m.src]
        for seg in m.segments:
            seg.dst.view(dst_buffers[seg.dst.buffer], seg.box.size).copy_(seg.src.view(bufs[seg.src.buffer], seg.box.size),
                                                                          non_blocking=True)
            nbytes += seg.nbytes
    stream.synchronize()
    return nbytes
