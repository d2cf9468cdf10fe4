"""The path RL frameworks take today, as a vLLM weight-transfer backend for `reshard demo
--engine vllm` to measure against: trainer rank 0 gathers every full tensor and broadcasts
them, packed in buckets, to every vLLM worker, which hands them to `model.load_weights` (vLLM's
loaders slice and fuse them) inside vLLM's layerwise reload. It does what vLLM's own `nccl`
backend does (packed buckets, two in flight, the same reload lifecycle), over gloo on CPU.

Registered as `reshard-gather-load` (a subclass of the `reshard` engine: one engine serves both
paths, so one vLLM instance measures both side by side). Not part of the product."""

from __future__ import annotations

import dataclasses
import datetime
import time

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer import WeightTransferEngineFactory

from reshard.integrations.vllm.engine import ReshardEngine, ReshardUpdateInfo
from reshard.tools.vllm_scene import BACKEND, buckets

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def register() -> None:
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "GatherLoadEngine")


@dataclasses.dataclass
class GatherLoadUpdateInfo(ReshardUpdateInfo):
    gather_load: dict | None = None
    """{"store": HOST:PORT, "names", "shapes", "dtype", "bucket_bytes", "version"}: receive the
    full tensors broadcast by trainer rank 0 (the store's host) instead of a reshard version."""


class GatherLoadEngine(ReshardEngine):
    update_info_cls = GatherLoadUpdateInfo

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self._group: tuple[str, dist.ProcessGroup] | None = None

    def _pg(self, store: str) -> dist.ProcessGroup:
        if self._group is None or self._group[0] != store:
            host, port = store.rsplit(":", 1)
            s = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=120))
            pg = dist.ProcessGroupGloo(dist.PrefixStore("gather-load", s), 1 + self.rank, 1 + self.world,
                                       datetime.timedelta(seconds=600))
            self._group = (store, pg)
        return self._group[1]

    @torch.no_grad()
    def receive_weights(self, info: GatherLoadUpdateInfo) -> None:
        g = info.gather_load
        if not g:
            return super().receive_weights(info)
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        t0 = time.perf_counter()
        pg = self._pg(g["store"])
        dtype = DTYPES[g["dtype"]]
        plan = buckets([list(s) for s in g["shapes"]], dtype.itemsize, g["bucket_bytes"])

        def post(i: int):
            flat = torch.empty(plan[i][1], dtype=torch.uint8)
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            return flat, pg.broadcast([flat], opts)

        initialize_layerwise_reload(self.model)
        try:
            pending = post(0) if plan else None
            for i, (members, _) in enumerate(plan):
                flat, work = pending
                work.wait()
                pending = post(i + 1) if i + 1 < len(plan) else None  # the next bucket flies while this one loads
                tensors, at = [], 0
                for k in members:
                    n = torch.Size(g["shapes"][k]).numel() * dtype.itemsize
                    tensors.append((g["names"][k], flat[at:at + n].view(dtype).view(g["shapes"][k])))
                    at += n
                self.model.load_weights(tensors)
        finally:
            finalize_layerwise_reload(self.model, self.model_config)
        if torch.device(self.device).type == "cpu":  # vLLM 0.32's CPU MoE skips its prepack on a reload
            for _, m in self.model.named_modules():
                if getattr(getattr(m, "quant_method", None), "moe_kernel", None) is not None and hasattr(m, "w13_weight"):
                    m.quant_method.moe_kernel.fused_experts.process_weights_after_loading(m)
        self.loaded = ("gather-load", int(g["version"]))
        self.baseline_seconds = time.perf_counter() - t0
