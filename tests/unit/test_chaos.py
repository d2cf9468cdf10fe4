"""`reshard chaos`'s own logic, without services: the faults it picks, its arguments, and the
summary it prints (tests/integration/test_chaos.py runs it)."""

import pytest

from reshard.tools.chaos import Cycle, Settings, print_table, random_faults, summarize
from reshard.cli import build_parser
from reshard.common.control.faults import ACTIONS, PHASES, ROLES


def test_faults_follow_the_seed_and_name_a_rank_only_for_workers():
    s = Settings(trainer_workers=2, inference_workers=3)
    faults = random_faults(400, 7, s)
    assert faults == random_faults(400, 7, s) and faults != random_faults(400, 8, s)
    assert {(f.role, f.phase, f.action) for f in faults} == {(r, p, a) for r in ROLES for p in PHASES for a in ACTIONS}
    for f in faults:
        if f.role == "trainer-worker":
            assert f.rank in (0, 1)
        elif f.role == "inference-worker":
            assert f.rank in (0, 1, 2)
        else:
            assert f.rank is None


def test_arguments():
    a = build_parser().parse_args(["chaos", "--cycles", "3", "--seed", "1", "--json"])
    assert (a.command, a.cycles, a.seed, a.json, a.model) == ("chaos", 3, 1, True, "tiny")
    with pytest.raises(ValueError, match="positive"):
        Settings(freeze=0)


def test_summary_counts_each_kind_of_fault_and_times_recovery(capsys):
    ok = {"struck": True, "next_ok": True, "committed": "chaos:2"}
    cycles = [Cycle("inference-worker:COMMIT:kill:1", "inference-worker kill", recovery_seconds=2.0, **ok),
              Cycle("inference-worker:VERIFY:kill:0", "inference-worker kill", recovery_seconds=4.0,
                    backwards=["served chaos:3 -> checkpoint:0"], **ok),
              Cycle("trainer:CONNECT:stop", "trainer stop", hang="late", unrecovered="trainer DEGRADED", struck=True,
                    torn=["SERVING with ranks at chaos:1, chaos:2"], weights_error="lm_head.weight differs")]
    s = summarize(cycles)
    assert list(s["kinds"]) == ["trainer stop", "inference-worker kill"]  # in the order of ROLES
    k = s["kinds"]["inference-worker kill"]
    assert (k["count"], k["backwards"], k["hangs"], k["recovery_mean_s"], k["recovery_max_s"]) == (2, 1, 0, 3.0, 4.0)
    t = s["kinds"]["trainer stop"]
    assert (t["hangs"], t["torn"], t["unrecovered"], t["next_failed"], t["wrong_weights"]) == (1, 1, 1, 1, 1)
    assert t["recovery_mean_s"] is None and s["total"]["count"] == 3 and s["total"]["struck"] == 3
    assert [c.clean for c in cycles] == [True, False, False]
    print_table(s, 30.0, 3)
    out = capsys.readouterr().out
    assert "inference-worker kill" in out and "3.0, 4.0" in out and "10.0s per cycle" in out
