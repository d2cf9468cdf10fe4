"""Which data-plane backend a session uses: NCCL when every worker's buffers are on CUDA,
gloo when every worker's are on CPU, or the one a flag forces. A session that mixes CPU
and CUDA workers is refused before any byte moves, naming the ranks on each side."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

BACKENDS = ("auto", "gloo", "nccl")


class BackendError(ValueError):
    """The workers' devices and the requested backend do not fit together."""


def buffers_device(tensors: Iterable[torch.Tensor]) -> str:
    """The one device a worker's buffers live on, as a string ('cpu', 'cuda:0'); 'cpu' when it has none."""
    devices = sorted({str(_normalize(t.device)) for t in tensors})
    if len(devices) > 1:
        raise ValueError(f"a worker's buffers must all be on one device; they are on {', '.join(devices)}")
    return devices[0] if devices else "cpu"


def _normalize(d: torch.device) -> torch.device:
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return d


def worker_device(spec: str, rank: int) -> torch.device:
    """Where a standalone worker keeps its weights: 'cpu'; 'cuda' (local GPU rank % count, the
    usual one-process-per-GPU placement); or an explicit 'cuda:N'. Clear errors when CUDA is
    missing or the index is out of range."""
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


def device_kind(device: str) -> str:
    """'cuda:3' -> 'cuda'; '' (a worker that does not report its device) -> 'cpu'."""
    return (device or "cpu").split(":")[0]


def _ranks(devices: Mapping[int, str], kind: str) -> list[int]:
    return sorted(r for r, d in devices.items() if device_kind(d) == kind)


def select_backend(requested: str, trainer: Mapping[int, str], inference: Mapping[int, str]) -> str:
    """The backend for a session between trainer ranks and inference ranks (rank -> device)."""
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
    if requested == "auto":
        return "nccl" if gpu else "gloo"
    if requested == "nccl" and not gpu:
        raise BackendError(f"--backend nccl needs CUDA buffers, but {where('cpu')} hold CPU buffers; use --backend gloo or auto")
    if requested == "gloo" and gpu:
        raise BackendError(f"--backend gloo moves CPU buffers, but every worker's buffers are on CUDA ({where('cuda')}); "
                           "use --backend nccl or auto")
    return requested
