"""The control plane at DeepSeek-V3 scale: Megatron tp=1,pp=4,dp=32,ep=16 (128 ranks) -> vLLM
tp=8,dp=16 (128 ranks), through both real controllers, with 256 workers that speak the real
worker protocol but skip the data plane (reshard/tools/dry_workers.py), run by `reshard
control-scale`. Two updates commit; no control message is over 16 MiB; the controllers' memory
stays bounded; the report says each update's phases and control bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration  # starts real services in real processes

LIMIT = 16 << 20


@pytest.mark.slow  # about 100 s
@pytest.mark.timeout(900)
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads peak memory from /proc")
def test_deepseek_v3_128_to_128_two_updates_under_16_mib_per_message():
    r = subprocess.run([sys.executable, "-m", "reshard.cli", "control-scale", "--updates", "2", "--json"],
                       capture_output=True, text=True, timeout=880)
    assert r.returncode == 0, r.stderr[-6000:]
    out = json.loads(r.stdout)
    assert (out["model"], out["src_ranks"], out["dst_ranks"]) == ("deepseek-v3", 128, 128)
    assert [u["step"] for u in out["updates"]] == [1, 2], out["updates"]
    for u in out["updates"]:
        for side in ("trainer", "inference"):
            x = u[side]
            assert 0 < x["max_control_message_bytes"] < LIMIT, (side, x["max_control_message"], x["max_control_message_bytes"])
            assert x["seconds"] > 0 and x["control_bytes"] > 0
        assert {"negotiate", "connect", "transfer", "verify", "commit"} <= set(u["trainer"]["phase_seconds"]), u
    # The second update sends no layout (fingerprints alone): far less than the first.
    steady = [u["inference"]["control_bytes"] for u in out["updates"]]
    assert steady[1] < steady[0] / 4, steady
    for name, peak in out["controller_peak_rss_bytes"].items():
        assert peak and peak < 3 << 30, f"{name} controller peaked at {peak / 2**30:.2f} GiB"
