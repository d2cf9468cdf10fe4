"""Bounded staging through the services (issue 29, item 1): standalone inference workers that
hold no copy of their weights receive each update through a 1 MiB pool, loading each buffer
into what they serve as it completes; checked with `Dump` against the test's own regeneration
of the weights, the pool's high-water mark from `status`, and a failed update that leaves the
deployment NOT_SERVING (what it loaded is torn) until a full update succeeds."""

import time

import pytest
import torch

from reshard.common.models.frameworks import model_spec

from .cluster import Cluster

pytestmark = pytest.mark.integration

POOL = 1536 << 10
BUCKET = 32 << 10
# Four inference ranks of the small model hold 2.7 MB each, the embedding and lm_head rows 640 KB
# each of it; the workers declare a receive window of half the pool, and the plan sends each rank's
# buffers in order within it, from both trainer ranks.


def _holds(c: Cluster, step: int) -> None:
    names = list(model_spec("small").tensors())
    for name in names[:2] + names[len(names) // 2:len(names) // 2 + 2] + names[-2:]:
        got, version = c.dump(name)
        assert version["step"] == step and torch.equal(got, c.expected(name, step)), f"{name} is not step {step}"


@pytest.mark.slow  # quick suite under 300 s on 2 cores (CI runs it with the slow ones)
def test_bounded_updates_load_through_a_fixed_pool():
    c = Cluster("small", inference_workers=4, bucket_bytes=BUCKET, inference_staging="bounded",
                inference_args=("--pool-bytes", str(POOL)))
    try:
        for _ in range(2):
            rc, out, err = c.update()
            assert rc == 0, err + c.logs()
            assert out["verified"]
            _holds(c, out["committed"]["step"])
        st = c.status()
        assert st["serving_state"] == "SERVING"
        for w in st["workers"]:
            mem = {k: int(v) for k, v in w["memory"].items()}
            assert "shadow" not in mem, mem  # no copy of the weights
            assert mem["pool"] == POOL and mem["pool_overflow"] == 0, mem
            assert 0 < mem["pool_high_water"] <= POOL, mem
        weights = sum(s.nbytes for s in model_spec("small").tensors().values()) // 4  # about a rank's share
        assert weights > 1.7 * POOL, "the pool would hold a rank: nothing bounded is tested"
        assert "bounded on ranks [0, 1, 2, 3]" in c.logs()
    finally:
        c.close()


@pytest.mark.slow  # about 25 s: a deadline waited out
def test_a_failed_bounded_update_leaves_not_serving_until_a_full_update():
    deadline = 10.0
    env = {"RESHARD_FAULT_RANK": "1", "RESHARD_FAULT_SLOW_AFTER": "0", "RESHARD_FAULT_SLOW_SECONDS": str(deadline + 2),
           "RESHARD_FAULT_ONCE": "1"}
    c = Cluster("small", inference_workers=2, update_timeout=deadline, bucket_bytes=BUCKET, inference_env=env,
                inference_staging="bounded",
                inference_args=("--pool-bytes", str(POOL)))
    try:
        rc, out, err = c.update()
        assert rc != 0 and "deadline" in ((out or {}).get("error", "") + err)
        st = c.wait_for(lambda s: s["serving_state"] == "NOT_SERVING", what="NOT_SERVING after a failed bounded update")
        assert not st["update_in_progress"]
        time.sleep(3)  # the slowed worker's one-shot fault runs out
        rc, out, err = c.update()
        assert rc == 0, err + c.logs()
        _holds(c, out["committed"]["step"])
        assert c.status()["serving_state"] == "SERVING"
    finally:
        c.close()


@pytest.mark.slow  # over 6 s: the quick suite keeps under 5 minutes on 2 cores
def test_bounded_refuses_a_partial_update_that_splits_a_buffer():
    c = Cluster("tiny", inference_workers=2, inference_staging="bounded", inference_args=("--pool-bytes", str(POOL)))
    try:
        rc, out, err = c.update("--tensors", "model.layers.0.self_attn.q_proj.weight")
        assert rc != 0
        msg = (out or {}).get("error", "") + err
        assert "loads whole buffers" in msg and "k_proj" in msg, msg
        assert c.status()["serving_state"] == "SERVING"  # refused before anything moved
        rc, out, err = c.update("--tensors", "model.layers.0.self_attn.*")  # q, k, v and o: whole buffers
        assert rc == 0, err + c.logs()
    finally:
        c.close()
