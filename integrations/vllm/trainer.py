"""The trainer side of the `reshard` backend, for vLLM's trainer API:

    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.m2n_source import DTensorModuleSource
    from reshard.integrations.vllm.trainer import ReshardTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        ReshardTrainerInitInfo(rank=rank, trainer="unix:/run/reshard/trainer.sock",
                               controller="unix:/run/reshard/inference.sock", run="grpo"),
        client=HTTPVLLMWeightSyncClient(url), source=DTensorModuleSource(model, world))
    ...
    engine.send_weights()          # on every trainer rank, after each optimizer step

Every rank attaches a TrainerWorker (its layout read from the live module: FSDP2 / DTensor shards
or plain parameters, never gathered) to the reshard trainer controller. `send_weights` publishes
the next step on every rank; the reshard services move each rank's slices straight to the vLLM
ranks that serve them, verify and commit them on every rank or none. Rank 0 (the sender) drives
vLLM through the client as vLLM's other backends do: start / update (which waits until the step
is committed on every vLLM rank and loaded) / finish with the weight version `run:step`, then a
reset of the prefix cache (its KV blocks were computed with the old weights). A vLLM server is
paused around it (`/pause`, `/resume`), as for `update_server`.

A failed update (a rank gone on either side, a deadline, a refused layout) raises on every trainer
rank, with the reason, and vLLM keeps serving the version it served. A failure inside vLLM after
the update committed (its own load) raises on the sender only: the other ranks learnt the commit."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from reshard.common.control.security import Security
from reshard.integrations.vllm import TORN, TORN_VERSION
from reshard.trainer_svc.worker import TrainerWorker

log = logging.getLogger("reshard.vllm.trainer")
_warned: set[str] = set()


@dataclasses.dataclass
class ReshardTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = "reshard"

    trainer: str = ""
    """The reshard trainer controller's worker listener (HOST:PORT or unix:/PATH): every trainer
    rank attaches there."""
    controller: str = ""
    """The reshard inference controller's worker listener, which the vLLM ranks attach to: sent to
    vLLM in its init info (as `controller`)."""
    world: int = 0
    """Trainer ranks; 0: torch.distributed's world size (1 without a process group)."""
    run: str = ""
    """The training run the versions belong to; empty: the trainer controller's `--run`."""
    names: dict[str, str] | None = None
    """Parameter name -> canonical (Hugging Face) name, where they differ."""
    token: str = ""
    """This rank's worker token for the trainer controller; empty: RESHARD_TOKEN_WORKER / RESHARD_TOKEN_FILE."""
    tls_ca: str = ""
    """The CA of the trainer controller's certificate; empty: RESHARD_TLS_CA."""
    connect_timeout: float = 60.0
    """Seconds to wait for the trainer controller to accept this rank."""
    timeout: float = 600.0
    """Seconds a `send_weights` waits for its update."""
    engine: dict[str, Any] = dataclasses.field(default_factory=dict)
    """More of vLLM's init info for its `reshard` engine (staging, staging_device, pool_bytes,
    quantize, token, tls_ca, timeout: see ReshardInitInfo)."""
    step: int = 0
    """The step the first `send_weights` publishes is this + 1 (a resumed run starts past its last)."""

    def __post_init__(self) -> None:
        if not self.trainer or not self.controller:
            raise ValueError("ReshardTrainerInitInfo needs `trainer` (the reshard trainer controller's worker listener) "
                             "and `controller` (the reshard inference controller's worker listener)")
        if "controller" in self.engine:
            raise ValueError("ReshardTrainerInitInfo.engine: give the inference controller as `controller`, not in `engine`")
        if self.timeout <= 0 or self.connect_timeout <= 0:
            raise ValueError("ReshardTrainerInitInfo: timeout and connect_timeout are seconds, more than 0")
        if self.step < 0:
            raise ValueError(f"ReshardTrainerInitInfo.step must be >= 0, not {self.step}")

    def vllm_init_info(self) -> dict[str, Any]:
        """What the sender passes to vLLM's `init_weight_transfer_engine`."""
        return {"controller": self.controller, **({"run": self.run} if self.run else {}), **self.engine}


def _module_of(source):
    """The module a weight source reads (vLLM's ModuleSource and DTensorModuleSource), or a module."""
    import torch

    if isinstance(source, torch.nn.Module):
        return source
    module = getattr(source, "_module", None) or getattr(source, "module", None)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"the reshard backend sends each rank's own shards of a live module: give source=ModuleSource(model) "
                        f"or DTensorModuleSource(model, world) (or the module), not a {type(source).__name__}, which "
                        "yields whole tensors")
    return module


class ReshardTrainerEngine(TrainerWeightTransferEngine[ReshardTrainerInitInfo]):
    init_info_cls = ReshardTrainerInitInfo

    def __init__(self, *, client, source, is_sender: bool, info: ReshardTrainerInitInfo, worker: TrainerWorker) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info, self.worker = info, worker
        self.step = info.step
        self.version = ""  # the weight version vLLM serves after the last send_weights
        self.last_seconds = 0.0

    @classmethod
    def trainer_init(cls, init_info: ReshardTrainerInitInfo, *, client, source=None) -> "ReshardTrainerEngine":
        if source is None:
            raise ValueError("the reshard backend sends from the trainer's live weights: pass source=ModuleSource(model) "
                             "or DTensorModuleSource(model, world)")
        module = _module_of(source)
        security = Security.from_env(**({"ca": init_info.tls_ca} if init_info.tls_ca else {}))
        if init_info.token:
            security = dataclasses.replace(security, tokens=(("worker", init_info.token),))
        world = init_info.world
        if not world:
            import torch.distributed as dist

            world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        worker = TrainerWorker.from_module(init_info.trainer, module, names=init_info.names, rank=init_info.rank,
                                           world=world, run=init_info.run, security=security).start()
        if not worker.wait_connected(init_info.connect_timeout):
            err = worker.last_error
            worker.stop()
            raise RuntimeError(f"trainer rank {init_info.rank}: the reshard trainer controller at {init_info.trainer} did "
                               f"not accept this rank within {init_info.connect_timeout:.0f}s" + (f": {err}" if err else ""))
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, info=init_info, worker=worker)
        if engine.is_sender:
            try:
                client.init_weight_transfer_engine(init_info.vllm_init_info())  # every vLLM rank attaches
            except BaseException:
                worker.stop()
                raise
        return engine

    def send_weights(self, step: int | None = None) -> None:
        """Publish the next step (or `step`) from every rank; the sender makes vLLM serve it. Raises on
        every rank if the update did not commit (vLLM then serves what it served)."""
        step = self.step + 1 if step is None else step
        if step <= self.step:
            raise ValueError(f"step {step} does not advance the last one sent ({self.step})")
        t0 = time.perf_counter()
        handle = self.worker.publish(step)
        self.step = step
        error = ""
        if self.is_sender:
            error = self._drive_vllm(step, handle)
        if handle.wait_outcome(self.info.timeout) is None:
            raise TimeoutError(f"trainer rank {self.info.rank}: step {step} had no outcome within {self.info.timeout:.0f}s")
        if not handle.ok or error:
            raise RuntimeError(f"trainer rank {self.info.rank}: step {step} did not reach vLLM: {handle.error or error}")
        d = handle.delivered
        self.version = f"{d.run}:{d.step}" if d.run else str(d.step)
        self.last_seconds = time.perf_counter() - t0

    def _drive_vllm(self, step: int, handle) -> str:
        """start / update (until committed and loaded on every vLLM rank) / finish / prefix-cache reset;
        the error that stopped it ('' if none)."""
        c = self.client
        paused = _pause(c)
        try:
            c.start_weight_update()
            try:
                c.update_weights({"step": step, "run": self.info.run, "timeout": self.info.timeout, "exact": True})
            except Exception as e:  # noqa: BLE001 - vLLM ended the update
                handle.wait_outcome(min(30.0, self.info.timeout))  # the reshard side's reason, when it has one
                why = handle.error or f"vLLM's update_weights failed: {e}"
                if TORN not in str(e):
                    return why + "; vLLM serves what it served"
                _set_version(c, TORN_VERSION)  # every output says so until a full update commits
                paused = False  # a server stays paused: generation held until an update succeeds
                return (f"{why}; {TORN}: a bounded vLLM rank loaded some modules before the update failed: its "
                        f"weight version is `{TORN_VERSION}`{', and the server stays paused' if _http(c) else ''} "
                        "until an update succeeds")
            if handle.wait_outcome(self.info.timeout) and handle.delivered.run:
                version = f"{handle.delivered.run}:{handle.delivered.step}"
            else:
                version = f"{self.info.run}:{step}" if self.info.run else str(step)
            c.finish_weight_update(weight_version=version)
            reset_prefix_cache(c)
            return ""
        finally:
            if paused:
                _resume(c)

    def shutdown(self) -> None:
        self.worker.stop()


# -- what the client protocol leaves out ---------------------------------------------------------

def _http(client):
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    return client if isinstance(client, HTTPVLLMWeightSyncClient) else None


def _pause(client) -> bool:
    """A vLLM server: pause generation (requests in flight finish with the weights they began with)."""
    if (h := _http(client)) is None:
        return False
    h._post("pause?mode=wait")
    return True


def _resume(client) -> None:
    _http(client)._post("resume")


def _set_version(client, version: str) -> None:
    """Label the weights vLLM serves (what each output reports) without an update."""
    if (h := _http(client)) is not None:
        h._post("update_weight_version", {"new_version": version})
    elif type(client).__name__ == "RayVLLMWeightSyncClient":
        import ray

        ray.get([a.update_weight_version.remote(version) for a in client.handles])
    elif callable(fn := getattr(client, "update_weight_version", None)):
        fn(version)


def reset_prefix_cache(client) -> bool:
    """Reset the prefix cache of the engines behind `client`: a client's own `reset_prefix_cache`, a
    vLLM server's route (VLLM_SERVER_DEV_MODE), or every Ray actor's. Warns once when it cannot."""
    fn = getattr(client, "reset_prefix_cache", None)
    if callable(fn):
        fn()
        return True
    if (h := _http(client)) is not None:
        h._post("reset_prefix_cache")
        return True
    handles = getattr(client, "handles", None)
    if handles and type(client).__name__ == "RayVLLMWeightSyncClient":
        import ray

        ray.get([a.reset_prefix_cache.remote() for a in handles])
        return True
    name = type(client).__name__
    if name not in _warned:
        _warned.add(name)
        log.warning("%s has no way to reset vLLM's prefix cache: give it a reset_prefix_cache() method, or cached KV "
                    "blocks computed with the old weights may be reused", name)
    return False


class LLMClient:
    """vLLM's client protocol over an offline `vllm.LLM` in this process (vLLM offers clients for a
    server and for Ray actors), with `reset_prefix_cache`."""

    def __init__(self, llm) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version=weight_version)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def update_weight_version(self, version: str) -> None:
        self.llm.update_weight_version(version)

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()
