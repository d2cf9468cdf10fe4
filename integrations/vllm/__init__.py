"""reshard as a vLLM weight-transfer backend.

Installed with reshard (the `vllm.general_plugins` entry point calls `register` in every vLLM
process), selected with `--weight-transfer-config '{"backend": "reshard"}'` (or
`LLM(..., weight_transfer_config={"backend": "reshard"})`), initialized once with the reshard
inference controller's worker listener:

    llm.init_weight_transfer_engine({"init_info": {"controller": "unix:/run/reshard/workers.sock"}})

and driven by vLLM's own calls after each trainer step (`update` below makes them)."""

from __future__ import annotations

import logging
from typing import Any

BACKEND = "reshard"
log = logging.getLogger("reshard.vllm")


def register() -> None:
    """The `vllm.general_plugins` entry point: make `reshard` a weight-transfer backend. vLLM runs
    plugins more than once in a process tree, and its registry refuses a name twice."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "reshard.integrations.vllm.engine", "ReshardEngine")


def update(llm: Any, step: int, *, run: str = "", timeout: float = 0.0) -> str:
    """Make an offline `vllm.LLM` serve trainer step `step` as soon as every rank has it: vLLM's
    start / update / finish calls, then a prefix-cache reset (cached KV blocks were computed with
    the old weights). The weight version vLLM then reports (`get_weight_version()`, and each
    output's `weight_versions`) is `run:step`, or `step` without a run. Raises (and vLLM keeps
    serving what it served) if the step is not committed within the timeout, or was superseded
    by a newer one before vLLM asked for it."""
    if step < 0:
        raise ValueError(f"step must be >= 0, not {step}")
    llm.start_weight_update()
    try:
        llm.update_weights({"update_info": {"step": step, "run": run, "timeout": timeout, "exact": True}})
    except BaseException:
        llm.finish_weight_update()  # ends the update; every rank kept (or got back) what it served
        raise
    version = f"{run}:{step}" if run else str(step)
    llm.finish_weight_update(weight_version=version)
    llm.reset_prefix_cache()
    return version
