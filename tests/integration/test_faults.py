"""Faults that strike while bytes are in flight. The transfer is slowed on one
inference worker after its first bucket (a fault-injection setting on the real
path); the test waits until status shows the TRANSFER phase with progress, then
strikes, and proves the outcome with `reshard dump`."""

import os
import signal
import time

import pytest
import torch

from .cluster import CHECKED, Cluster

pytestmark = pytest.mark.integration

DEADLINE = 10.0
# Inference rank 1 pauses 5 s after its first bucket: the window in which the tests strike.
SLOW = {"RESHARD_FAULT_RANK": "1", "RESHARD_FAULT_SLOW_AFTER": "0", "RESHARD_FAULT_SLOW_SECONDS": "5"}
REPLICATED = "model.layers.2.input_layernorm.weight"  # every vLLM rank holds all of it


def start_update_in_background(c: Cluster):
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-m", "reshard.cli", "update", "--trainer", c.tr, "--wait", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_in_transfer(c: Cluster) -> None:
    c.wait_for(lambda s: s["update_in_progress"] and s["progress"]["phase"] == "TRANSFER"
               and int(s["progress"]["bytes_done"]) > 0, timeout=60, what="TRANSFER with progress")


def assert_holds(c: Cluster, step: int, rank: int | None = None) -> None:
    names = [REPLICATED] if rank is not None else CHECKED
    for name in names:
        got, _ = c.dump(name, rank=rank)
        assert torch.equal(got, c.expected(name, step)), f"{name} on rank {rank} is not step {step}"


@pytest.mark.slow  # the failure matrix's worker cells cover kills and freezes in make test
def test_frozen_inference_worker():
    c = Cluster("small", update_timeout=DEADLINE, bucket_bytes=64 << 10, inference_env=SLOW)
    try:
        rc, out, err = c.update()
        assert rc == 0, err + c.logs()
        good = out["committed"]["step"]
        pid = c.worker_pid(1)  # the worker still receiving when the test strikes
        proc = start_update_in_background(c)
        wait_in_transfer(c)
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            stdout, stderr = proc.communicate(timeout=DEADLINE + 30)
            elapsed = time.monotonic() - t0
            assert proc.returncode != 0, stdout
            assert "failed" in stderr and "stopped answering" in stderr, stderr
            # Found by its silence (--worker-timeout, 5 s), not at the update's deadline.
            assert elapsed < DEADLINE, f"the failure took {elapsed:.1f}s"
            # The other workers never stopped serving the previous version.
            for r in (0, 2, 3):
                assert_holds(c, good, rank=r)
        finally:
            os.kill(pid, signal.SIGCONT)
        # The thawed worker still holds the previous version too, and the next update succeeds.
        c.wait_for(lambda s: all(w["state"] == "READY" for w in s["workers"]), what="all workers ready")
        assert_holds(c, good)
        rc, out, err = c.update()
        assert rc == 0, err + c.logs()
        assert_holds(c, out["committed"]["step"])
        assert c.status()["serving_state"] == "SERVING"
    finally:
        c.close()


@pytest.mark.slow  # the failure matrix's worker cells cover kills and freezes in make test
def test_killed_inference_worker_rejoins():
    c = Cluster("small", update_timeout=DEADLINE, bucket_bytes=64 << 10, inference_env=SLOW)
    try:
        rc, out, err = c.update()
        assert rc == 0, err
        good = out["committed"]["step"]
        victim = c.worker_pid(1)  # the worker still receiving when the test strikes
        proc = start_update_in_background(c)
        wait_in_transfer(c)
        os.kill(victim, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=DEADLINE + 30)
        assert proc.returncode != 0 and "failed" in stderr
        for r in (0, 2, 3):
            assert_holds(c, good, rank=r)
        # The supervisor restarts the worker from its checkpoint: it is held (never serves its
        # checkpoint beside its peers' version) and the trainer repairs the deployment at once,
        # with the newest version it holds.
        st = c.wait_for(lambda s: s["serving_state"] == "SERVING" and all(w["state"] == "READY" for w in s["workers"])
                        and int(next(w for w in s["workers"] if w["rank"] == 1)["pid"]) != victim,
                        what="restarted worker repaired, deployment serving")
        assert st["last_error"]
        restarted = next(w for w in st["workers"] if w["rank"] == 1)
        assert not any(k.startswith("checkpoint") for k in restarted["requests_by_version"]), restarted
        assert_holds(c, int(st["version"]["step"]))
        rc, out, err = c.update()
        assert rc == 0, err + c.logs()
        assert_holds(c, out["committed"]["step"])
        assert c.status()["serving_state"] == "SERVING"
    finally:
        c.close()


@pytest.mark.slow  # the failure matrix's worker cells cover kills and freezes in make test
def test_inplace_update_that_fails_leaves_not_serving_until_a_full_update():
    env = dict(SLOW, RESHARD_FAULT_SLOW_SECONDS=str(DEADLINE + 2), RESHARD_FAULT_ONCE="1")
    c = Cluster("small", update_timeout=DEADLINE, bucket_bytes=64 << 10, inference_env=env, inference_staging="inplace")
    try:
        rc, out, err = c.update()
        assert rc != 0 and "deadline" in ((out or {}).get("error", "") + err)
        st = c.wait_for(lambda s: s["serving_state"] == "NOT_SERVING", what="NOT_SERVING after a failed in-place update")
        assert not st["update_in_progress"]
        time.sleep(5)  # let the slowed worker's one-shot fault run out
        rc, out, err = c.update()
        assert rc == 0, err + c.logs()
        assert_holds(c, out["committed"]["step"])
        assert c.status()["serving_state"] == "SERVING"
    finally:
        c.close()
