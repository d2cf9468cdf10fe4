"""An abort reaches every rank's data plane at once, not at the update's deadline.

Inference rank 1 stalls its data plane after its first bucket for as long as the update's
deadline (a fault-injection setting on the real path; its control plane keeps answering, as a
rank blocked in a receive does). A trainer worker is killed during TRANSFER: the update fails at
once, every rank's transfer is aborted, and the next update (once the supervisor has restarted
the worker) commits without waiting for the stalled one's deadline."""

import os
import re
import signal
import time

import pytest
import torch

from .cluster import Cluster
from .test_faults import SLOW, start_update_in_background, wait_in_transfer

pytestmark = pytest.mark.integration

DEADLINE = 60.0
SHARDED = "model.layers.0.self_attn.q_proj.weight"  # split over every inference rank


def pid_of(status: dict, rank: int) -> int:
    return int(next(w for w in status["workers"] if w["rank"] == rank)["pid"])


@pytest.mark.slow  # a stalled transfer, a kill and a worker restart
def test_killed_trainer_worker_aborts_every_rank_at_once():
    env = dict(SLOW, RESHARD_FAULT_SLOW_SECONDS=str(DEADLINE), RESHARD_FAULT_ONCE="1")
    c = Cluster("small", inference_workers=2, update_timeout=DEADLINE, bucket_bytes=64 << 10, inference_env=env)
    try:
        victim = pid_of(c.status("trainer"), 1)
        proc = start_update_in_background(c)
        wait_in_transfer(c)  # inference rank 1 has stalled after its first bucket
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        stdout, stderr = proc.communicate(timeout=DEADLINE + 30)
        failed_after = time.monotonic() - t0
        assert proc.returncode != 0 and "died" in stderr, stdout + stderr
        assert failed_after < 10, f"the update failed after {failed_after:.1f}s"
        c.wait_for(lambda s: all(w["state"] == "READY" for w in s["workers"]) and pid_of(s, 1) != victim,
                   side="trainer", what="the killed trainer worker restarted")
        t0 = time.monotonic()
        rc, out, err = c.update(timeout=DEADLINE + 30)
        took = time.monotonic() - t0
        assert rc == 0, err + c.logs()
        assert took < 20, f"the next update took {took:.1f}s: a rank's data plane was still blocked\n{c.logs()}"
        got, _ = c.dump(SHARDED)
        assert torch.equal(got, c.expected(SHARDED, out["committed"]["step"]))
        with open(f"{c.logdir}/inference.log") as f:  # the stalled rank's own error, long before its stall ended
            assert re.search(r"inference worker 1: transfer of (\w+) failed: update \1 aborted: a trainer worker died", f.read())
    finally:
        c.close()
