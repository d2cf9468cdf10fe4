"""`reshard chaos` end to end: a short run on real services."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.slow  # the failure matrix's cells cover the same cycle in make test
def test_chaos_strikes_heals_and_reports_each_kind_of_fault():
    # Seed 0 picks inference-worker:VERIFY:kill:1, inference-worker:VERIFY:stop:1, trainer-worker:COMMIT:kill:0.
    r = subprocess.run([sys.executable, "-m", "reshard.cli", "chaos", "--cycles", "3", "--seed", "0", "--json"],
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    out = json.loads(r.stdout)
    assert out["clean"] and len(out["cycles"]) == 3
    assert [c["fault"] for c in out["cycles"]] == ["inference-worker:VERIFY:kill:1", "inference-worker:VERIFY:stop:1",
                                                  "trainer-worker:COMMIT:kill:0"]
    for c in out["cycles"]:
        assert c["struck"] and c["next_ok"] and not c["weights_error"] and c["recovery_seconds"] > 0, c
    assert {k: v["count"] for k, v in out["kinds"].items()} == {"trainer-worker kill": 1, "inference-worker kill": 1,
                                                               "inference-worker stop": 1}
    total = out["total"]
    assert (total["count"], total["hangs"], total["backwards"], total["torn"], total["unrecovered"]) == (3, 0, 0, 0, 0)
    assert "cycle 3/3 trainer-worker:COMMIT:kill:0: ok" in r.stderr
