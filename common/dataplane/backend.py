"""Which data-plane backend a session uses, matching GPUs by device UUID (CUDA_VISIBLE_DEVICES
may number one GPU differently in each process):

- `ipc` when every worker's buffers are on one GPU (CUDA IPC, common/dataplane/cuda_ipc.py);
- `hybrid` when some workers share a GPU and others are elsewhere, at most one trainer rank
  per GPU (the colocated setup on several GPUs: NCCL between GPUs, CUDA IPC within one,
  common/dataplane/hybrid.py);
- `nccl` when each worker is on a GPU of its own;
- `gloo` when every worker's buffers are on CPU;
- or the one a flag forces, when it can work.

A session that mixes CPU and CUDA workers is refused before any byte moves, naming the
ranks on each side, and so is one with two trainer ranks on a GPU beside other GPUs."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a device is read: a controller plans without it
    import torch

BACKENDS = ("auto", "gloo", "nccl", "ipc", "hybrid")


class BackendError(ValueError):
    """The workers' devices and the requested backend do not fit together."""


def buffers_device(tensors: Iterable[torch.Tensor]) -> str:
    """The one device a worker's buffers live on, as a string ('cpu', 'cuda:0'); 'cpu' when it has none."""
    devices = sorted({str(_normalize(t.device)) for t in tensors})
    if len(devices) > 1:
        raise ValueError(f"a worker's buffers must all be on one device; they are on {', '.join(devices)}")
    return devices[0] if devices else "cpu"


def _normalize(d: torch.device) -> torch.device:
    import torch

    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return d


def worker_device(spec: str, rank: int) -> torch.device:
    """Where a standalone worker keeps its weights: 'cpu'; 'cuda' (local GPU rank % count, the
    usual one-process-per-GPU placement); or an explicit 'cuda:N'. Clear errors when CUDA is
    missing or the index is out of range."""
    import torch

    spec = (spec or "cpu").strip()
    if spec == "cpu":
        return torch.device("cpu")
    if spec != "cuda" and not spec.startswith("cuda:"):
        raise ValueError(f"device must be cpu, cuda or cuda:N, not {spec!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"device {spec!r} asked for, but torch {torch.__version__} sees no CUDA device here "
                         "(CPU build, or no GPU); use --device cpu")
    n = torch.cuda.device_count()
    index = rank % n if spec == "cuda" else int(spec.split(":", 1)[1])
    if not 0 <= index < n:
        raise ValueError(f"device {spec!r}: this machine has {n} CUDA device(s)")
    return torch.device("cuda", index)


def device_uuid(device: str) -> str:
    """The UUID of the GPU a 'cuda:N' device names ('' for cpu): the same GPU has the same UUID in
    every process, whatever its CUDA_VISIBLE_DEVICES."""
    if device_kind(device) != "cuda":
        return ""
    import torch

    return str(torch.cuda.get_device_properties(torch.device(device)).uuid)


def plan_options(bucket_bytes: int, backend: str):
    """The plan options of a session: every process plans alike from the same two values. CUDA IPC and
    hybrid sessions plan without relays (a destination rank's pieces are read from, or written by, the
    rank on its GPU)."""
    from reshard.common.plan.planner import PlanOptions

    opts = PlanOptions(bucket_bytes=bucket_bytes) if bucket_bytes else PlanOptions()
    return dataclasses.replace(opts, relay=False) if backend in ("ipc", "hybrid") else opts


def device_kind(device: str) -> str:
    """'cuda:3' -> 'cuda'; '' (a worker that does not report its device) -> 'cpu'."""
    return (device or "cpu").split(":")[0]


def _ranks(devices: Mapping[int, str], kind: str) -> list[int]:
    return sorted(r for r, d in devices.items() if device_kind(d) == kind)


def select_backend(requested: str, trainer: Mapping[int, str], inference: Mapping[int, str],
                   trainer_gpus: Mapping[int, str] | None = None, inference_gpus: Mapping[int, str] | None = None) -> str:
    """The backend for a session between trainer ranks and inference ranks (rank -> device; rank ->
    GPU UUID, where known: without them GPUs are taken as distinct)."""
    if requested not in BACKENDS:
        raise BackendError(f"unknown backend {requested!r}; valid backends: {', '.join(BACKENDS)}")
    kinds = {device_kind(d) for d in (*trainer.values(), *inference.values())}
    unknown = kinds - {"cpu", "cuda"}
    if unknown:
        raise BackendError(f"workers report devices of kind {', '.join(sorted(unknown))}: only cpu (gloo) and cuda (nccl) "
                           "buffers are supported")

    def where(kind: str) -> str:
        parts = [f"{side} ranks {rs}" for side, rs in (("trainer", _ranks(trainer, kind)), ("inference", _ranks(inference, kind))) if rs]
        return " and ".join(parts)

    if kinds == {"cpu", "cuda"}:
        raise BackendError(f"mixed CPU/GPU session refused: {where('cpu')} hold CPU buffers while {where('cuda')} hold "
                           "CUDA buffers; put every worker's buffers on CUDA (nccl) or every one on CPU (gloo)")
    gpu = kinds == {"cuda"}
    sharing = _sharing(trainer_gpus or {}, inference_gpus or {}, len(trainer), len(inference)) if gpu else "none"
    if requested == "auto":
        return {"one": "ipc", "some": "hybrid"}.get(sharing, "nccl") if gpu else "gloo"
    if requested == "ipc" and sharing != "one":
        raise BackendError("--backend ipc needs every trainer and inference worker's buffers on one GPU (the same device "
                           "UUID); " + ("they are not" if gpu else f"{where('cpu')} hold CPU buffers") + "; use --backend auto")
    if requested == "nccl" and sharing in ("one", "some"):
        raise BackendError("--backend nccl cannot run here: " + ("every worker is on one GPU" if sharing == "one" else
                           "some workers share a GPU") + ", and NCCL cannot hold two ranks of one GPU in a communicator; "
                           "use --backend auto (" + ("CUDA IPC" if sharing == "one" else "hybrid: NCCL between GPUs, CUDA IPC within one") + ")")
    if requested == "nccl" and not gpu:
        raise BackendError(f"--backend nccl needs CUDA buffers, but {where('cpu')} hold CPU buffers; use --backend gloo or auto")
    if requested == "hybrid" and not gpu:
        raise BackendError(f"--backend hybrid needs CUDA buffers, but {where('cpu')} hold CPU buffers; use --backend gloo or auto")
    if requested == "hybrid" and sharing == "unknown":
        raise BackendError("--backend hybrid needs every worker's GPU UUID, and some workers do not report one (an older "
                           "reshard); use --backend auto")
    if requested == "hybrid":
        _one_trainer_per_gpu(trainer_gpus or {})
    if requested == "gloo" and gpu:
        raise BackendError(f"--backend gloo moves CPU buffers, but every worker's buffers are on CUDA ({where('cuda')}); "
                           "use --backend nccl or auto")
    return requested


def _sharing(trainer_gpus: Mapping[int, str], inference_gpus: Mapping[int, str], n_trainer: int, n_inference: int) -> str:
    """How the workers share GPUs: 'one' (every worker on one GPU: CUDA IPC), 'some' (some share a
    GPU, others are elsewhere: hybrid), 'none' (each on its own GPU: NCCL), or 'unknown' (a worker
    that does not say, an older one: GPUs taken as distinct). Two trainer ranks on one GPU beside
    workers on other GPUs are refused by name (`_one_trainer_per_gpu`)."""
    known = [u for u in (*trainer_gpus.values(), *inference_gpus.values()) if u]
    if len(known) < n_trainer + n_inference:
        return "unknown"
    if len(set(known)) == 1:
        return "one"
    if len(set(known)) == len(known):
        return "none"
    _one_trainer_per_gpu(trainer_gpus)
    return "some"


def _one_trainer_per_gpu(trainer_gpus: Mapping[int, str]) -> None:
    on: dict[str, list[int]] = {}
    for r, u in sorted(trainer_gpus.items()):
        on.setdefault(u, []).append(r)
    for u, ranks in on.items():
        if len(ranks) > 1:
            raise BackendError(f"trainer ranks {ranks} share GPU {u}: a session across GPUs (hybrid: NCCL between GPUs, "
                               "CUDA IPC within one) takes at most one trainer rank per GPU; put every worker on one GPU "
                               "(ipc), or each trainer rank on its own")
