"""The `reshard` weight-transfer engine, built by vLLM in each of its worker processes.

On `init_weight_transfer_engine` it reads this rank's layout from the live model and attaches an
InferenceWorker to the reshard inference controller named in the init info. From then on the
trainer's updates land on this rank straight from the trainer ranks that hold its slices, into a
staging copy of this rank's weights, verified (checksums) and committed by the controller as
on any reshard deployment, while vLLM keeps serving.

vLLM's own calls then make the engine serve a committed version:

    llm.start_weight_update()
    llm.update_weights({"update_info": {"step": 7}})   # waits until step 7 is committed here
    llm.finish_weight_update(weight_version="run:7")
    llm.reset_prefix_cache()

(`reshard.integrations.vllm.update(llm, step)` makes those calls.) `update_weights` loads the
staged weights into the model through vLLM's layerwise reload, so what vLLM derives from weights
after loading (repacked CPU GEMM weights, MoE prepacking) is rebuilt. If it fails, every layer
gets its previous kernel weights back and vLLM keeps serving the version it served."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import warnings

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from reshard.common.control.security import Security
from reshard.inference_svc.worker import InferenceWorker
from reshard.integrations.vllm import TORN  # in the error of an update that leaves the model mixing versions
from reshard.integrations.vllm.layout import QUANTIZE, RankLayout, rank_layout

log = logging.getLogger("vllm.reshard")  # under vLLM's logger: its handlers and level apply
STAGINGS = ("bounded", "staged", "shadow")  # the init info's `staging` (and `inplace`, staged's earlier name)
STAGING_DEVICES = ("host", "device")  # where `staged` keeps its copy
_mode_warned = False


def _warn_mode() -> None:
    """The init info's `mode`, the earlier name of `staging`: said once per process, in vLLM's log too
    (where a server's operator looks; a DeprecationWarning is hidden by default)."""
    global _mode_warned
    if not _mode_warned:
        _mode_warned = True
        msg = "the reshard init info's `mode` is deprecated: give `staging` (bounded | staged | shadow)"
        warnings.warn(msg, DeprecationWarning, stacklevel=4)
        log.warning(msg)


@dataclasses.dataclass
class ReshardInitInfo(WeightTransferInitInfo):
    controller: str = ""
    """The reshard inference controller's worker listener: HOST:PORT or unix:/PATH."""
    token: str = ""
    """The worker token; empty: RESHARD_TOKEN_WORKER / RESHARD_TOKEN_FILE of the vLLM process."""
    tls_ca: str = ""
    """The CA that signs the controller's certificate (TLS); empty: RESHARD_TLS_CA."""
    connect_timeout: float = 60.0
    """Seconds to wait for the controller to accept this rank."""
    timeout: float = 600.0
    """Default seconds an `update_weights` waits for its version."""
    staging: str = ""
    """`bounded` (the default: no copy of the weights; the update is received through a pool of
    `pool_bytes` on the device while vLLM is inside `update_weights`, each module loaded as soon as
    it arrived; a failed transfer leaves the modules it loaded torn until a full update),
    `staged` (one copy of the weights, in host memory or on the device: `staging_device`, received
    while vLLM serves; only the load pauses generation; a failed transfer leaves the copy torn
    until a full update, while vLLM serves what it loaded) or `shadow` (two copies on the device:
    the staging copy always holds the last committed version). `inplace`, the earlier name of
    `staged` on the device, is still taken."""
    staging_device: str = ""
    """Staged: where the copy lives, `host` (the default: host memory, the update received through
    a pool of `pool_bytes` on the device) or `device` (the copy on vLLM's device, received straight
    into it)."""
    pool_bytes: int = 256 << 20
    """Bounded and staged in host memory: the pool on the device an update is received through, bytes."""
    run: str = ""
    """The training run whose versions this deployment takes; empty: the trainer's."""
    quantize: str = "sender"
    """Block-FP8 layers: `sender` (the trainer ranks quantize, FP8 values and their scales on the wire;
    their column shards must start and end on 128-column block boundaries; row shards that end
    inside a block have the trainer ranks exchange partial block maxima first) or `receiver` (the weights arrive in the
    layer's unquantized dtype and this rank quantizes them when it loads, whatever the trainer's shards)."""
    mode: str = ""
    """Deprecated: the earlier name of `staging` (still taken, with a warning)."""

    def __post_init__(self) -> None:
        if self.mode:
            if self.staging and self.staging != self.mode:
                raise ValueError(f"the reshard init info's staging={self.staging!r} and mode={self.mode!r} (its "
                                 "deprecated name) disagree: give staging only")
            _warn_mode()
            self.staging = self.mode
        self.staging = self.staging or "bounded"
        if self.staging == "inplace":  # the earlier name of staged on the device
            if self.staging_device not in ("", "device"):
                raise ValueError(f"the reshard init info's staging 'inplace' is staged on the device, not on "
                                 f"{self.staging_device!r}: give staging='staged', staging_device={self.staging_device!r}")
            self.staging, self.staging_device = "staged", "device"
        if self.staging not in STAGINGS:
            raise ValueError(f"the reshard init info's staging must be one of {', '.join(STAGINGS)}, not {self.staging!r}")
        if self.staging_device and self.staging != "staged":
            raise ValueError(f"the reshard init info's staging_device applies to staging='staged', not {self.staging!r}")
        self.staging_device = self.staging_device or ("host" if self.staging == "staged" else "")
        if self.staging == "staged" and self.staging_device not in STAGING_DEVICES:
            raise ValueError(f"the reshard init info's staging_device must be one of {', '.join(STAGING_DEVICES)}, "
                             f"not {self.staging_device!r}")
        if self.quantize not in QUANTIZE:
            raise ValueError(f"the reshard init info's quantize must be one of {', '.join(QUANTIZE)}, not {self.quantize!r}")
        if self.pool_bytes < 1 << 20:
            raise ValueError(f"the reshard init info's pool_bytes must be at least 1 MiB, not {self.pool_bytes}")


@dataclasses.dataclass
class ReshardUpdateInfo(WeightTransferUpdateInfo):
    step: int = -1
    """Serve this step (or a newer one, if it was committed meanwhile); -1: the newest committed."""
    run: str = ""
    timeout: float = 0.0
    """Seconds to wait for it; 0: the init info's timeout."""
    exact: bool = False
    """Serve exactly `step`: fail if a newer step was committed before it was asked for."""


class _Worker(InferenceWorker):
    """An InferenceWorker that remembers which tensors each committed update carried."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.dirty: set[str] | None = set()  # canonical tensors committed since the last load; None: all

    def _commit(self, version) -> None:
        super()._commit(version)  # what the update carried: InferenceWorker._carrying
        if self._carrying is None or self.dirty is None:
            self.dirty = None
        else:
            self.dirty |= self._carrying


def deployment_rank(pc) -> tuple[int, int]:
    """(rank, world) of this vLLM worker among every rank of the deployment: data-parallel replica
    `data_parallel_index` (vLLM's own weight-transfer engines number them so), then its rank within
    the replica (`parallel_config.rank`: pipeline stage major, tensor rank minor), over
    data_parallel_size x pipeline_parallel_size x tensor_parallel_size ranks. Each rank's layout
    says what it holds (a stage's layers, a replica's copy, the experts of its expert map): the
    inference controller merges them, and the planner relays between replicas holding the same."""
    if getattr(pc, "distributed_executor_backend", None) == "external_launcher":
        return pc.rank, pc.world_size  # one process per rank (torchrun): vLLM's world already spans the replicas
    per_replica = pc.world_size  # TP x PP
    dp_index = getattr(pc, "data_parallel_index", None)
    if dp_index is None:
        dp_index = getattr(pc, "data_parallel_rank", 0)
    dp = max(1, int(getattr(pc, "data_parallel_size", 1)))
    if not getattr(pc, "enable_elastic_ep", False):
        # `vllm serve` runs a dense model's replicas as independent engines of data_parallel_size 1
        # (reconfigure_for_independent_dp_rank); elastic_ep_max_dp_size keeps the size it was given
        dp = max(dp, int(getattr(pc, "elastic_ep_max_dp_size", None) or 1))
    if not 0 <= dp_index < dp or not 0 <= pc.rank < per_replica:
        raise RuntimeError(f"vLLM parallel config: rank {pc.rank} of {per_replica} in data-parallel replica {dp_index} "
                           f"of {dp} is outside the deployment")
    return dp_index * per_replica + pc.rank, dp * per_replica


def load_target(layer: torch.nn.Module, target, tensor: torch.Tensor) -> None:
    """Write a buffer into its parameter of a layer vLLM's reload materialized: as it is, or (block
    FP8) quantized whole block by whole block, values into the parameter and scales into its
    `_scale_inv`, as an FP8 checkpoint holds them (common/quant.py)."""
    param = getattr(layer, target.param)
    if target.quant is None:
        param.data.copy_(tensor)
        return
    from reshard.common.quant import fp8_block_quantize

    values, scales = fp8_block_quantize(tensor, target.quant)
    param.data.copy_(values)
    getattr(layer, f"{target.param}_scale_inv").data.copy_(scales)


# On CPU: after each this many bytes of modules loaded, the C heap's freed pages go back to the OS
TRIM_EVERY = 4 << 20
_TRIM: list = []


def release_freed_heap() -> None:
    """Return the C heap's free pages to the OS (glibc's `malloc_trim`; nothing elsewhere). vLLM's
    CPU processing of each reloaded module allocates a new copy of its weights and frees the old,
    and glibc keeps most such freed memory resident: over one update the rank's resident memory
    grew by about half its weights (llama-0.5g, TP 2). This changes no allocator setting; it only
    releases what is already free."""
    if not _TRIM:
        import ctypes

        try:
            _TRIM.append(ctypes.CDLL(None).malloc_trim)
        except (OSError, AttributeError):
            _TRIM.append(None)
    if _TRIM[0] is not None:
        _TRIM[0](0)


def _torn_kernel(*_a, **_k):
    raise RuntimeError(f"reshard: {TORN}: this layer's CPU kernel was released for a reload that did not finish; "
                       "generate nothing from this model until a full update commits")


# vLLM's methods whose CPU processing always makes the layer's kernel anew (`cpu_linear`, through
# dispatch_cpu_unquantized_gemm), for a 2-D weight
_CPU_KERNEL_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")


def release_cpu_kernel(layer: torch.nn.Module, weights: list[torch.Tensor]) -> bool:
    """Bounded, on CPU: drop a layer's packed CPU kernel (vLLM's `cpu_linear`, which holds a packed
    copy of the weight) before vLLM's processing makes the new one, so that the two never exist at
    once: for the largest module (an LM head) that was a transient of its whole size on top of the
    pool. Only for the methods that always make it anew; until they do, the layer raises (a torn
    rank serves nothing). Returns whether it did."""
    method = getattr(layer, "quant_method", None)
    if (type(method).__name__ not in _CPU_KERNEL_METHODS or not hasattr(layer, "cpu_linear")
            or any(w.dim() != 2 for w in weights)):
        return False
    layer.cpu_linear = _torn_kernel
    return True


def alias_param(layer: torch.nn.Module, target, tensor: torch.Tensor) -> bool:
    """Bounded: make a parameter vLLM's reload has not materialized yet a view of its buffer in the
    pool, in place of a fresh tensor and a copy (vLLM's processing reads it, and copies what it
    makes into the kernel's own storage before the pool space is reused). Only for a buffer loaded
    as it is into this one parameter, in the parameter's own shape, dtype, strides and device.
    Returns whether it did."""
    meta = getattr(layer, target.param, None)
    if (target.quant is not None or meta is None or not meta.is_meta
            or tuple(meta.shape) != tuple(tensor.shape) or meta.dtype != tensor.dtype
            or tuple(meta.stride()) != tuple(tensor.stride())):
        return False
    view = tensor.detach().view(tensor.shape)
    view.__class__ = meta.__class__
    view.__dict__ = meta.__dict__.copy()
    setattr(layer, target.param, view)
    return True


class ReshardEngine(WeightTransferEngine[ReshardInitInfo, ReshardUpdateInfo]):
    init_info_cls = ReshardInitInfo
    update_info_cls = ReshardUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.rank, self.world = deployment_rank(vllm_config.parallel_config)
        self.worker: _Worker | None = None
        self.layout: RankLayout | None = None
        self.known: set[str] = set()  # buffers whose staging copy holds the weights vLLM serves
        self.loaded: tuple[str, int] | None = None  # (run, step) loaded into the model
        self.info: ReshardInitInfo | None = None
        self.host: dict[str, torch.Tensor] | None = None  # staged in host memory: the copy vLLM loads from
        self._loaded_now = 0  # bounded: modules loaded by the update in flight (a failure leaves them torn)
        self._loading_s = 0.0  # bounded: seconds those loads took (inside the transfer)
        self._freed = 0  # bytes of modules loaded since the C heap's freed pages last went back (CPU)
        self._targets_of: tuple | None = None  # (layout, module -> its targets, tied buffers): see _targets

    # -- vLLM's calls ------------------------------------------------------------------
    def init_transfer_engine(self, info: ReshardInitInfo) -> None:
        if not info.controller:
            raise ValueError("the reshard backend's init info needs `controller`: the inference controller's "
                             "worker listener (HOST:PORT or unix:/PATH)")
        if self.worker is not None:
            self.shutdown()
        self.info = info
        self.layout = layout = rank_layout(self.model, info.quantize)
        # Bounded, and staged in host memory: the worker's buffers are meta tensors (no copy on the
        # device); vLLM's own parameters, or the host copy, hold the weights.
        pooled = info.staging == "bounded" or info.staging_device == "host"
        self.host = {b.name: self._initial(b, "cpu") for b in layout.buffers} if info.staging_device == "host" else None
        live = {}
        for b in layout.buffers:
            live[b.name] = torch.empty(b.shape, dtype=getattr(torch, b.dtype), device="meta") if pooled else self._initial(b)
        security = Security.from_env(**({"ca": info.tls_ca} if info.tls_ca else {}))
        if info.token:
            security = dataclasses.replace(security, tokens=(("worker", info.token),))
        extra, staging = {}, {"staged": "staged" if pooled else "inplace"}.get(info.staging, info.staging)
        if pooled:
            extra = dict(pool_bytes=info.pool_bytes, device=str(torch.device(self.device)))
        if info.staging == "bounded":
            extra.update(load=self._load_group, load_groups=self._module_groups(), pause=self._await_update_call,
                         resume=self._end_reload)
        elif pooled:  # staged in host memory: each buffer copied there as it lands, while vLLM serves
            extra.update(load=self._to_host)
        self._update_called = threading.Event()  # bounded: vLLM is inside update_weights (generation paused)
        self._reloading = False
        self.worker = _Worker(info.controller, self.rank, self.world, layout.tensors,
                              {b.name: (b, live[b.name]) for b in layout.buffers}, staging=staging,
                              model=type(self.model).__name__, security=security, **extra).start()
        if not self.worker.wait_connected(info.connect_timeout):
            err, refused = self.worker.last_error, self.worker.refused
            self.worker.stop()
            self.worker = None
            if refused:  # said at once: waiting would not change it
                raise RuntimeError(f"vLLM rank {self.rank} of {self.world}: {err}")
            raise RuntimeError(f"vLLM rank {self.rank}: the reshard inference controller at {info.controller} did not "
                               f"accept this rank within {info.connect_timeout:.0f}s" + (f": {err}" if err else ""))
        weights = sum(b.nbytes for b in layout.buffers)
        on_device = {"bounded": info.pool_bytes, "shadow": 2 * weights,
                     "staged": info.pool_bytes if pooled else weights}[info.staging]
        in_host = weights if self.host is not None else 0
        log.info("vLLM rank %d/%d attached to %s: %d buffers, %.1f MB; %s staging%s holds %.1f MB more on %s (%.0f%% "
                 "of its weights)%s", self.rank, self.world, info.controller, len(layout.buffers), weights / 1e6,
                 info.staging, f" ({info.staging_device})" if info.staging_device else "", on_device / 1e6,
                 torch.device(self.device).type, 100 * on_device / max(1, weights),
                 f" and {in_host / 1e6:.1f} MB in host memory" if in_host else "")

    def start_weight_update(self) -> None:
        self._need_worker()

    def receive_weights(self, info: ReshardUpdateInfo) -> None:
        w = self._need_worker()
        timeout = info.timeout or self.info.timeout
        run = info.run or self.info.run or None
        t_wait = time.perf_counter()
        self._loaded_now, self._loading_s = 0, 0.0
        self._update_called.set()  # bounded: the transfer may load into the model from now on
        try:
            version = w.wait_for_version(max(info.step, 0), run, timeout)
        finally:
            self._update_called.clear()
        t_wait = time.perf_counter() - t_wait
        failed = w.failure(max(info.step, 0), run) if version is None else None
        if failed is not None:
            raise RuntimeError(f"vLLM rank {self.rank}: the update carrying step {info.step} failed on the reshard "
                               f"deployment: {failed}; {self._after_failure()}")
        if version is None:
            held = w.version
            raise TimeoutError(
                f"vLLM rank {self.rank}: step {info.step}{f' of run {run}' if run else ''} was not committed here "
                f"within {timeout:.0f}s (this rank holds {f'{held.run}:{held.step}' if held else 'no version'}"
                f"{'' if w.serving_ok else ', torn by a failed in-place transfer'}"
                f"{f'; last error: {w.last_error}' if w.last_error else ''}); {self._after_failure()}")
        with w.serving() as v:  # a commit of a newer version waits until the copy is done
            if v is None:
                raise RuntimeError(f"vLLM rank {self.rank}: the reshard deployment holds this rank (not serving)"
                                   + (f"; {TORN}: a failed bounded update left modules of the model at another version "
                                      "than the rest until a full update commits" if self.info.staging == "bounded" else ""))
            if info.exact and v.step != info.step:
                raise RuntimeError(f"vLLM rank {self.rank}: step {info.step} was superseded by step {v.step} before "
                                   f"vLLM asked for it; ask for step {v.step} (or -1: the newest)")
            t0 = time.perf_counter()
            # bounded: each module was loaded as it arrived; staged: from the copy (host or device)
            n = self._load(w.dirty) if w.holds_copy or self.host is not None else 0
            w.dirty = set()
            self.loaded = (v.run, v.step)
        self.last_load_seconds = time.perf_counter() - t0
        if n or not self._loaded_now:
            log.info("vLLM rank %d: loaded %s:%d into the model (%d modules, %.3f s; waited %.3f s for the commit)",
                     self.rank, v.run, v.step, n, self.last_load_seconds, t_wait)
        else:  # bounded: loaded module by module as the transfer went
            log.info("vLLM rank %d: loaded %s:%d into the model (%d modules as they arrived, %.3f s of loading within "
                     "the %.3f s from the update call to the commit)", self.rank, v.run, v.step, self._loaded_now,
                     self._loading_s, t_wait)

    def finish_weight_update(self) -> None:
        pass

    def _after_failure(self) -> str:
        """What a failed update leaves vLLM serving, said in its error."""
        n = self._loaded_now
        if self.info.staging == "bounded" and n:
            return (f"{TORN}: {n} module(s) of this rank were loaded at the new version before it failed and the rest "
                    "hold the old one; generate nothing from this model until a full update commits")
        return "vLLM keeps serving what it served"

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.stop()
            self.worker = None

    # -- helpers -------------------------------------------------------------------------
    def _need_worker(self) -> _Worker:
        if self.worker is None:
            raise RuntimeError("the reshard weight-transfer engine is not initialized: call "
                               "init_weight_transfer_engine({'init_info': {'controller': ...}}) first")
        return self.worker

    def _initial(self, b, device=None) -> torch.Tensor:
        """A staging buffer on `device` (default vLLM's), holding the model's current weights where
        they can be read (a CPU linear layer's weight is repacked after loading and cannot). In host
        memory beside a GPU it is pinned (copies to and from the device run at full speed)."""
        device = torch.device(device or self.device)
        pin = device.type == "cpu" and torch.device(self.device).type == "cuda"
        t = torch.zeros(b.shape, dtype=getattr(torch, b.dtype), device=device, pin_memory=pin)
        target = next(x for x in self.layout.targets if x.buffer == b.name)
        live = getattr(self.model.get_submodule(target.module), target.param)
        if tuple(live.shape) == b.shape and live.dtype == t.dtype:
            t.copy_(live.detach())
            self.known.add(b.name)
        return t

    @torch.no_grad()
    def _to_host(self, tensors: dict[str, torch.Tensor]) -> None:
        """Staged in host memory: a buffer that landed in the pool, copied into the host copy (before
        its pool space is reused: the copy is synchronous). vLLM loads that copy when asked."""
        for name, t in tensors.items():
            self.host[name].copy_(t)
            self.known.add(name)

    # -- bounded staging: modules loaded as they arrive, inside update_weights -----------------
    def _module_groups(self) -> dict[str, str]:
        """Buffer -> its load group: the modules that share buffers (tied weights) load together."""
        parent: dict[str, str] = {}

        def find(x: str) -> str:
            while parent.setdefault(x, x) != x:
                x = parent[x]
            return x

        for t in self.layout.targets:
            parent[find("b:" + t.buffer)] = find("m:" + t.module)
        return {b.name: find("b:" + b.name) for b in self.layout.buffers}

    def _await_update_call(self) -> None:
        """Bounded: the transfer writes into vLLM's model, so it waits until vLLM is inside
        `update_weights` (generation paused), within the update's deadline."""
        w = self.worker
        left = w.transfer_deadline - time.monotonic() if w is not None else 0.0
        if not self._update_called.wait(max(0.0, left)):
            raise RuntimeError(f"vLLM rank {self.rank} stages bounded: vLLM did not call update_weights before the "
                               "update's deadline (a bounded transfer loads into the model, so it waits for that call)")
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        with torch.no_grad():
            initialize_layerwise_reload(self.model)
        self._reloading = True
        self._touched_moe = []

    @torch.no_grad()
    def _load_group(self, tensors: dict[str, torch.Tensor]) -> None:
        """Bounded: load a complete group of buffers (the modules that hold them) into the model."""
        t0 = time.perf_counter()
        mods = list(dict.fromkeys(t.module for t in self.layout.targets if t.buffer in tensors))
        self._touched_moe += self._load_modules(mods, tensors, scratch=True)
        self._loaded_now += len(mods)
        self._loading_s += time.perf_counter() - t0

    def _end_reload(self) -> None:
        """Bounded, at commit or abort: vLLM's reload is finished (modules not loaded get their
        kernel weights back); generation may resume."""
        if not self._reloading:
            return
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        self._reloading = False
        with torch.no_grad():
            finalize_layerwise_reload(self.model, self.model_config)
            self._prepack(self._touched_moe)

    def _load_modules(self, modules: list[str], staged, scratch: bool = False) -> list:
        """Load each module's buffers from `staged` (buffer -> tensor) through vLLM's layerwise reload
        (begun by the caller): materialize, copy, process. Returns the MoE layers loaded."""
        from vllm.model_executor.model_loader.reload.layerwise import _layerwise_process, get_layerwise_info
        from vllm.model_executor.model_loader.reload.meta import materialize_layer

        by_module, shared = self._targets()
        host_heap = torch.device(self.device).type == "cpu"
        moe = []
        for m in modules:
            layer = self.model.get_submodule(m)
            info = get_layerwise_info(layer)
            aliased = {t.param for t in by_module[m]
                       if scratch and t.buffer not in shared and alias_param(layer, t, staged[t.buffer])}
            materialize_layer(layer, info)
            for t in by_module[m]:
                if t.param not in aliased:
                    load_target(layer, t, staged[t.buffer])
                self.known.add(t.buffer)
            released = host_heap and scratch and release_cpu_kernel(layer, [staged[t.buffer] for t in by_module[m]])
            _layerwise_process(layer, info)
            if released and getattr(layer, "cpu_linear", None) is _torn_kernel:
                raise RuntimeError(f"vLLM rank {self.rank}: vLLM's processing of {m} made no CPU kernel ({TORN})")
            if getattr(getattr(layer, "quant_method", None), "moe_kernel", None) is not None:
                moe.append(layer)
            if host_heap:  # counted across calls: bounded loads a group at a time
                self._freed += sum(staged[t.buffer].nbytes for t in by_module[m])
                if self._freed >= TRIM_EVERY:
                    release_freed_heap()
                    self._freed = 0
        return moe

    def _targets(self) -> tuple[dict[str, list], set[str]]:
        """(module -> its targets, the buffers several targets load: tied weights, each module
        processing its own copy), made once per layout."""
        layout = self.layout
        if self._targets_of is None or self._targets_of[0] is not layout:
            by_module: dict[str, list] = {}
            uses: dict[str, int] = {}
            for t in layout.targets:
                by_module.setdefault(t.module, []).append(t)
                uses[t.buffer] = uses.get(t.buffer, 0) + 1
            self._targets_of = (layout, by_module, {b for b, n in uses.items() if n > 1})
        return self._targets_of[1], self._targets_of[2]

    def _prepack(self, moe_layers: list) -> None:
        for layer in moe_layers if torch.device(self.device).type == "cpu" else ():
            # vLLM's CPU MoE skips its prepack on a reload (0.32): redo it for the layers loaded
            layer.quant_method.moe_kernel.fused_experts.process_weights_after_loading(layer)

    @torch.no_grad()
    def _load(self, dirty: set[str] | None) -> int:
        """Load the staged weights of every module holding a tensor in `dirty` (None: all)
        through vLLM's layerwise reload; on failure every module gets its kernel weights back."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        layout, staged = self.layout, self.host if self.host is not None else self.worker.live
        bufs = {b.name: b for b in layout.buffers}
        by_module = self._targets()[0]
        todo = [m for m, ts in by_module.items()
                if dirty is None or any(p.tensor in dirty for t in ts for p in bufs[t.buffer].pieces)]
        def fresh(buf: str) -> bool:
            return dirty is None or any(p.tensor in dirty for p in bufs[buf].pieces)

        unknown = sorted({t.buffer for m in todo for t in by_module[m] if t.buffer not in self.known and not fresh(t.buffer)})
        if unknown:
            raise RuntimeError(f"vLLM rank {self.rank}: a partial update reached module(s) whose other weights "
                               f"reshard never received, e.g. {unknown[0]!r}: send a full update first")
        initialize_layerwise_reload(self.model)
        touched_moe = []
        try:
            touched_moe = self._load_modules(todo, staged)
        finally:
            finalize_layerwise_reload(self.model, self.model_config)
        self._prepack(touched_moe)
        return len(todo)
