"""`reshard doctor`: what the data plane can use on this machine (works without a GPU)."""

from __future__ import annotations

import json
import os
import platform
import sys

ENV_SHOWN = ("RESHARD_NCCL_LIBRARY", "CUDA_VISIBLE_DEVICES", "NCCL_SOCKET_IFNAME", "NCCL_DEBUG", "NCCL_P2P_DISABLE",
             "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE", "NCCL_CUMEM_ENABLE")


def collect() -> dict:
    import torch
    import torch.distributed as dist

    from reshard.common.dataplane.nccl import NcclUnavailable, current_choice, load_library

    info: dict = {
        "python": platform.python_version(),
        "torch_version": torch.__version__,
        "torch_cuda": torch.version.cuda,  # None: a CPU build of torch
        "cuda_available": torch.cuda.is_available(),
        "cuda_devices": [],
        "gloo_available": dist.is_available() and dist.is_gloo_available(),
        "torch_nccl_available": dist.is_available() and dist.is_nccl_available(),
        "nccl_library": None,
        "nccl_source": None,
        "nccl_reason": None,
        "nccl_version": None,
        "nccl_error": None,
        "env": {k: os.environ[k] for k in ENV_SHOWN if k in os.environ},
    }
    if info["cuda_available"]:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info["cuda_devices"].append({"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                                         "total_memory": p.total_memory})
    try:
        choice = current_choice()
        info.update(nccl_library=choice.path, nccl_source=choice.source, nccl_reason=choice.reason)
        lib = load_library(choice)
        info["nccl_version"] = lib.version
    except NcclUnavailable as e:
        info["nccl_error"] = str(e)
    gpu = info["cuda_available"] and info["nccl_version"] is not None
    info["backend_auto"] = "nccl for CUDA buffers, gloo for CPU buffers" if gpu else "gloo (no usable CUDA + NCCL here)"
    return info


def render(info: dict) -> str:
    lines = [f"python {info['python']}, torch {info['torch_version']} "
             + (f"(CUDA {info['torch_cuda']} build)" if info["torch_cuda"] else "(CPU build)")]
    if info["cuda_available"]:
        for d in info["cuda_devices"]:
            lines.append(f"cuda:{d['index']} {d['name']} (sm {d['capability']}, {d['total_memory'] / 2**30:.0f} GiB)")
    else:
        lines.append("CUDA: not available")
    if info["nccl_version"]:
        lines.append(f"NCCL {info['nccl_version']}: {info['nccl_library']} ({info['nccl_reason']})")
    else:
        lines.append(f"NCCL: none usable: {info['nccl_error']}")
    lines.append(f"gloo: {'available' if info['gloo_available'] else 'NOT available'}")
    lines.append(f"backend auto: {info['backend_auto']}")
    for k, v in info["env"].items():
        lines.append(f"{k}={v}")
    return "\n".join(lines)


def main(as_json: bool) -> int:
    info = collect()
    print(json.dumps(info, indent=2) if as_json else render(info))
    return 0


if __name__ == "__main__":
    sys.exit(main("--json" in sys.argv))
