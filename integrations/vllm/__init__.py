"""reshard as a vLLM weight-transfer backend.

Installed with reshard (the `vllm.general_plugins` entry point calls `register` in every vLLM
process), selected with `--weight-transfer-config '{"backend": "reshard"}'` (or
`LLM(..., weight_transfer_config={"backend": "reshard"})`), initialized once with the reshard
inference controller's worker listener:

    llm.init_weight_transfer_engine({"init_info": {"controller": "unix:/run/reshard/workers.sock"}})

and driven by vLLM's own calls after each trainer step (`update` below makes them)."""

from __future__ import annotations

from typing import Any

BACKEND = "reshard"
TORN = "reshard: torn"
"""In the error of an `update_weights` that leaves a rank's model mixing versions (bounded staging:
modules loaded before the update failed). `update`, `update_server` and the trainer engine then label
vLLM's weight version TORN_VERSION (a server also stays paused) until an update succeeds."""
TORN_VERSION = "torn"


def register() -> None:
    """The `vllm.general_plugins` entry point: make `reshard` a weight-transfer backend (the worker
    side, and the trainer side of vLLM's trainer API). vLLM runs
    plugins more than once in a process tree, and its registry refuses a name twice."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "reshard.integrations.vllm.engine", "ReshardEngine")
    try:  # the trainer side (vLLM's trainer API: WeightTransferTrainerFactory.trainer_init), where vLLM has it
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    except ImportError:
        return
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, "reshard.integrations.vllm.trainer", "ReshardTrainerEngine")


def update(llm: Any, step: int, *, run: str = "", timeout: float = 0.0) -> str:
    """Make an offline `vllm.LLM` serve trainer step `step` as soon as every rank has it: vLLM's
    start / update / finish calls, then a prefix-cache reset (cached KV blocks were computed with
    the old weights). The weight version vLLM then reports (`get_weight_version()`, and each
    output's `weight_versions`) is `run:step`, or `step` when `run` is left empty: vLLM takes the
    version from this caller, and its API gives no way to read back the run the ranks loaded
    (pass the trainer's `--run`, which also makes the ranks refuse another run's step). Raises (and vLLM keeps
    serving what it served) if the step is not committed within the timeout, or was superseded
    by a newer one before vLLM asked for it. A failed bounded update that loaded some modules
    leaves the model torn (the error says `reshard: torn`): the weight version is then `torn`, so
    every output generated until a full update commits says so."""
    if step < 0:
        raise ValueError(f"step must be >= 0, not {step}")
    llm.start_weight_update()
    try:
        llm.update_weights({"update_info": {"step": step, "run": run, "timeout": timeout, "exact": True}})
    except BaseException as e:
        _end_failed(llm.finish_weight_update)
        if TORN in str(e):
            llm.update_weight_version(TORN_VERSION)
        raise
    version = f"{run}:{step}" if run else str(step)
    llm.finish_weight_update(weight_version=version)
    llm.reset_prefix_cache()
    return version


def _end_failed(finish) -> None:
    """vLLM's finish after a failed update_weights: older vLLMs keep the update open until it; 0.32
    closes it itself and refuses the call (which must not hide the update's own error)."""
    try:
        finish()
    except Exception:  # noqa: BLE001 - the update's error is the one raised
        pass


def update_server(base_url: str, step: int, *, run: str = "", timeout: float = 0.0, api_key: str = "",
                  http_timeout: float = 900.0) -> str:
    """The same for a vLLM server (`vllm serve ... --weight-transfer-config '{"backend": "reshard"}'`,
    started with VLLM_SERVER_DEV_MODE=1, which serves vLLM's weight-transfer routes): pause
    generation (in-flight requests finish with the weights they started with, and the caches are
    cleared), start / update / finish, resume. Returns the weight version now served: `run:step`,
    or `step` when `run` is left empty (as for `update`). A failed bounded update that left the
    model torn keeps the server paused, its weight version `torn`, until an update succeeds."""
    import json
    import urllib.error
    import urllib.request

    if step < 0:
        raise ValueError(f"step must be >= 0, not {step}")

    def post(path: str, body: dict | None = None) -> None:
        req = urllib.request.Request(base_url.rstrip("/") + path, data=json.dumps(body or {}).encode(), method="POST",
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {api_key}"} if api_key else {})})
        try:
            with urllib.request.urlopen(req, timeout=http_timeout) as r:
                r.read()
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"vLLM server {path}: HTTP {e.code}: {e.read().decode(errors='replace')[:2000]}") from None

    version = f"{run}:{step}" if run else str(step)
    post("/pause?mode=wait")
    held = False
    try:
        post("/start_weight_update")
        try:
            post("/update_weights", {"update_info": {"step": step, "run": run, "timeout": timeout, "exact": True}})
        except BaseException as e:
            _end_failed(lambda: post("/finish_weight_update", {}))
            if TORN in str(e):
                post("/update_weight_version", {"new_version": TORN_VERSION})
                held = True
                raise RuntimeError(f"{e}\nThe server stays paused (its weight version `{TORN_VERSION}`) until an update "
                                   "succeeds: call update_server again (it resumes then)") from None
            raise
        post("/finish_weight_update", {"weight_version": version})
    finally:
        if not held:
            post("/resume")
    return version
