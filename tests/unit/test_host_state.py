"""The library runs inside trainers and engines: planning and building layouts leave the host
process's allocator, garbage collector, numpy and signal settings alone. Only `reshard plan`,
in the process it owns, opts in to tuning.

Each probe runs in a fresh interpreter, so this test process is never changed."""

import json
import subprocess
import sys

import pytest

PROBE = r'''
import asyncio, ctypes, gc, json, resource, signal, sys

calls = []  # glibc allocator functions looked up through ctypes, and setrlimit calls


class RecordingCDLL(ctypes.CDLL):
    def __getattr__(self, name):
        if name.startswith(("mallopt", "malloc_trim")):
            calls.append(name)
        return super().__getattr__(name)

    def __getitem__(self, name):
        if isinstance(name, str) and name.startswith(("mallopt", "malloc_trim")):
            calls.append(name)
        return super().__getitem__(name)


ctypes.CDLL = RecordingCDLL
ctypes.cdll = ctypes.LibraryLoader(RecordingCDLL)
_setrlimit = resource.setrlimit
resource.setrlimit = lambda *a: (calls.append("setrlimit"), _setrlimit(*a))[1]

import numpy as np

multiarray = (getattr(np, "_core", None) or np.core).multiarray


def state():
    return {"gc_enabled": gc.isenabled(), "gc_threshold": list(gc.get_threshold()), "gc_frozen": gc.get_freeze_count(),
            "hugepage": multiarray._get_madvise_hugepage(), "np_err": np.geterr(),
            "signals": [str(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM)],
            "loop_policy": type(asyncio.get_event_loop_policy()).__name__}


seen = []  # every distinct state met at a Python call while the library runs


def sample(frame, event, arg):
    # At every call into the library's own functions (between any two of them, state the library
    # changed would show).
    if event == "call" and frame.f_globals.get("__name__", "").startswith("reshard."):
        s = state()
        if s not in seen:
            seen.append(s)


before = state()
if sys.argv[1] == "plan-cli":
    from reshard.plan_cmd import tune_process_for_planning

    tune_process_for_planning()
from reshard.common.models.frameworks import build
from reshard.common.plan.planner import make_plan

sys.setprofile(sample)
src = build("tiny-moe", "framework=megatron,tp=2,pp=2,ep=2,dp=2")
dst = build("tiny-moe", "framework=vllm,tp=2,dp=2")
plan = make_plan(src, dst)
sys.setprofile(None)
print(json.dumps({"before": before, "during": seen, "after": state(), "calls": calls, "segments": plan.num_segments}))
'''


def probe(mode: str) -> dict:
    r = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_planning_leaves_host_process_state_alone():
    out = probe("library")
    assert out["segments"] > 0
    assert out["calls"] == []  # no mallopt, malloc_trim or setrlimit: glibc's dynamic thresholds stay on
    assert out["during"] == [out["before"]]  # not even for the duration of a call
    assert out["after"] == out["before"]


@pytest.mark.slow  # 2 s (a CLI process): the quick suite keeps under 5 minutes on 2 cores
def test_plan_command_tunes_its_own_process():
    """The probe above sees tuning when there is some: `reshard plan`'s opt-in is detected."""
    out = probe("plan-cli")
    assert "mallopt" in out["calls"]
    assert not out["after"]["gc_enabled"] and not out["after"]["hugepage"]
    assert out["before"]["gc_enabled"]
