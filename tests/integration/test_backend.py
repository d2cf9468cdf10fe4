"""Backend selection and the memory report through the real services (CPU: gloo)."""

import pytest

from tests.integration.cluster import Cluster

pytestmark = pytest.mark.integration  # starts real services in real processes


@pytest.mark.slow  # 3-5 s: the quick suite's margin under 5 minutes on slower machines
def test_cpu_workers_report_device_and_memory_and_run_gloo():
    c = Cluster("tiny", inference_workers=2, trainer_workers=1)
    try:
        rc, out, err = c.update()
        assert rc == 0, err + c.logs()
        tr, inf = c.status("trainer"), c.status("inference")
        assert [d["backend"] for d in tr["deployments"]] == ["gloo"]
        assert [w["device"] for w in tr["workers"]] == ["cpu"] and [w["device"] for w in inf["workers"]] == ["cpu", "cpu"]
        for w in inf["workers"]:
            mem = {k: int(v) for k, v in w["memory"].items()}
            assert mem["staging"] > 0 and mem["shadow"] > 0 and "nccl" not in mem, mem
        assert int(tr["workers"][0]["memory"]["staging"]) > 0
    finally:
        c.close()


@pytest.mark.slow  # the quick suite's time: 4-6 s
def test_a_forced_backend_that_cannot_work_fails_the_update_by_name():
    """`--backend hybrid` (NCCL between GPUs, CUDA IPC within one) on CPU workers: the update fails
    before any byte moves, saying why, and inference keeps serving what it had."""
    c = Cluster("tiny", inference_workers=1, trainer_workers=1, trainer_args=("--backend", "hybrid"))
    try:
        before = c.status("inference")["version"]
        rc, out, err = c.update()
        assert rc != 0 and out and not out["ok"], (rc, out, err)
        assert "--backend hybrid needs CUDA buffers, but trainer ranks [0] and inference ranks [0] hold CPU buffers" \
            in out["error"] and "nothing transferred" in out["error"], out
        assert c.status("inference")["version"] == before
    finally:
        c.close()
