"""The fault hook (common/control/faults.py): its instructions, and who it strikes, once. A process that
strikes itself is a small Python child here, never the test's own process."""

import json
import os
import signal
import subprocess
import sys

import pytest

from reshard.common.control.faults import Fault


def test_instructions_parse_and_print_back():
    for text in ("trainer:VERIFY:stop", "inference-worker:COMMIT:kill:1", "trainer-worker:NEGOTIATE:kill:0"):
        assert str(Fault.parse(text)) == text
    assert Fault.parse(" inference:CONNECT:kill\n") == Fault("inference", "CONNECT", "kill", None)


@pytest.mark.parametrize("text", ["trainer:VERIFY", "trainer:VERIFY:pause", "trainer:verify:kill", "engine:VERIFY:kill",
                                  "trainer:VERIFY:kill:1", "inference-worker:COMMIT:kill:one", "inference-worker:COMMIT:kill:1:2"])
def test_bad_instructions_say_what_is_expected(text):
    with pytest.raises(ValueError, match="expected ROLE:PHASE:ACTION"):
        Fault.parse(text)


def hook(env: dict, calls: str) -> subprocess.CompletedProcess:
    """Run `calls` (at_phase calls, one per line) in a child with the hook's environment."""
    code = "from reshard.common.control.faults import at_phase\n" + calls + "\nprint('survived')"
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=60, check=False)


def test_unset_hook_strikes_nothing():
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESHARD_FAULT")}
    code = "from reshard.common.control import faults\nfaults.at_phase('trainer', 'VERIFY')\nassert not faults._SPEC and not faults._FIXED"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr


def test_control_file_strikes_the_process_it_names_once(tmp_path):
    ctl = tmp_path / "fault"
    ctl.write_text("trainer:VERIFY:kill")
    env = {"RESHARD_FAULT_AT": f"@{ctl}"}
    r = hook(env, "at_phase('trainer', 'CONNECT')\nat_phase('inference', 'VERIFY')\nat_phase('trainer-worker', 'VERIFY', 0)")
    assert r.returncode == 0 and "survived" in r.stdout, r.stderr  # another phase, another role: not struck
    assert ctl.exists()
    r = hook(env, "at_phase('trainer', 'VERIFY')")
    assert r.returncode == -signal.SIGKILL, r.stdout + r.stderr
    fired = json.loads((tmp_path / "fault.fired").read_text())
    assert fired["fault"] == "trainer:VERIFY:kill" and fired["pid"] == fired["by"] and fired["phase"] == "VERIFY"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fault.fired"]  # claimed: it strikes no one else
    assert hook(env, "at_phase('trainer', 'VERIFY')").returncode == 0
    ctl.write_text("not a fault")
    r = hook(env, "at_phase('trainer', 'VERIFY')\nat_phase('trainer', 'COMMIT')")
    assert r.returncode == 0 and r.stderr.count("fault control file") == 1, r.stderr  # said once, then ignored


def test_direct_instruction_strikes_its_rank_once_for_good_with_a_marker(tmp_path):
    marker = tmp_path / "struck"
    env = {"RESHARD_FAULT_AT": "inference-worker:COMMIT:kill:1", "RESHARD_FAULT_MARKER": str(marker)}
    assert hook(env, "at_phase('inference-worker', 'COMMIT', 0)").returncode == 0
    assert hook(env, "at_phase('inference-worker', 'COMMIT', 1)").returncode == -signal.SIGKILL
    assert json.loads(marker.read_text())["rank"] == 1
    assert hook(env, "at_phase('inference-worker', 'COMMIT', 1)").returncode == 0  # restarted: not again


def test_a_bad_direct_instruction_fails_at_start():
    """A service refuses to start with it, naming the variable (the module itself loads: a CLI
    that imports it must still be able to say what is wrong)."""
    import os

    env = dict(os.environ, RESHARD_FAULT_AT="trainer:VERIFY:explode")
    r = subprocess.run([sys.executable, "-m", "reshard.cli", "trainer", "--listen", "127.0.0.1:0"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "RESHARD_FAULT_AT" in r.stderr and "expected ROLE:PHASE:ACTION" in r.stderr, r.stderr


def test_a_controller_strikes_its_idle_worker(tmp_path):
    """A worker cell of BY_CONTROLLER: the controller signals the worker's pid from its hub."""
    ctl = tmp_path / "fault"
    ctl.write_text("trainer-worker:VERIFY:stop:1")
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        hub = ("class W:\n    def __init__(self, rank, pid): self.rank, self.pid = rank, pid\n"
               f"class Hub:\n    def alive(self): return [W(0, 1), W(1, {worker.pid})]\n")
        env = {"RESHARD_FAULT_AT": f"@{ctl}"}
        r = hook(env, hub + "at_phase('trainer-worker', 'VERIFY', 1)\nat_phase('trainer', 'VERIFY', workers=Hub())")
        assert r.returncode == 0, r.stderr  # the worker's own call does not strike: its controller does
        fired = json.loads((tmp_path / "fault.fired").read_text())
        assert fired["pid"] == worker.pid and fired["rank"] == 1 and fired["by"] != worker.pid
        _, status = os.waitpid(worker.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status)
    finally:
        worker.kill()
        worker.wait()
