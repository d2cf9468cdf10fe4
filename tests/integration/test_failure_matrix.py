"""The failure matrix (issue 11): each process role x each phase of an update x {SIGKILL, SIGSTOP
then SIGCONT}, struck at that phase through the fault hook (common/control/faults.py, whose table says
where each cell strikes), on real services in real processes.

In every cell: the faulted update's outcome comes within its deadlines (no hang); the process
struck is resumed, or restarted as an operator would (a controller re-run with its command line,
standalone workers by their controller) and the deployment is whole again; the next update
commits; the weights served equal an independent regeneration bit for bit. All along, no served
or committed version goes backwards, and the deployment never reports SERVING while its serving
ranks hold different versions (a monitor polls both controllers).

One deployment serves the forty cells in turn (reshard.tools.chaos.Deployment and run_cycle, the harness
`reshard chaos` runs); the weights are also checked here, by the test's own means."""

import time

import pytest
import torch

from reshard.tools.chaos import Deployment, Monitor, Settings, run_cycle
from reshard.common.control.faults import PHASES, Fault
from reshard.common.models.presets import model_config
from reshard.tools.synth import tensor_value

from .cluster import dump_rpc, live_members

pytestmark = pytest.mark.integration

SETTINGS = Settings(model="tiny", update_timeout=8.0, rpc_timeout=3.0, worker_timeout=2.0, freeze=3.0)
CHECKED = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
           "model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.down_proj.weight", "model.embed_tokens.weight",
           "lm_head.weight", "model.norm.weight"]
VICTIM_RANK = 1  # the worker struck in worker cells

def cell(role: str, phase: str, action: str):
    """`make test` keeps two cells where a process is killed at COMMIT (the phase whose failures leave
    the most behind): an inference worker, and the trainer controller. The other 38 run with the slow
    tests (the quick suite's time on 2 cores)."""
    quick = phase == "COMMIT" and action == "kill" and role in ("inference-worker", "trainer")
    return pytest.param(role, phase, action, id=f"{role}-{phase}-{action}", marks=[] if quick else [pytest.mark.slow])


CELLS = [cell(role, phase, action) for role in ("trainer-worker", "inference-worker", "trainer", "inference")
         for phase in PHASES for action in ("kill", "stop")]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    dep = Deployment(SETTINGS, str(tmp_path_factory.mktemp("matrix")))
    monitor = None
    try:
        dep.start()
        why = dep.wait_whole(120)
        assert not why, f"the deployment did not come up: {why}\n{dep.logs()}"
        first = dep.update()
        assert first.ok, f"the first update failed: {first.error}\n{dep.logs()}"
        monitor = Monitor(dep).start()
        yield dep, monitor
    finally:
        if monitor is not None:
            monitor.stop()
        dep.close()


def orphans(dep, role: str, pgid: int) -> list[int]:
    """Processes of a killed controller's group (its workers) that its successor did not adopt
    and that still run."""
    st = dep.status(role)
    adopted = {w.pid for w in st.workers} if st is not None else set()
    end = time.monotonic() + 10
    while (left := [p for p in live_members(pgid) if p not in adopted]) and time.monotonic() < end:
        time.sleep(0.1)
    return left


@pytest.mark.parametrize(("role", "phase", "action"), CELLS)
def test_fault(deployment, role, phase, action):
    dep, monitor = deployment
    fault = Fault(role, phase, action, VICTIM_RANK if role.endswith("-worker") else None)
    struck = []
    c = run_cycle(dep, monitor, fault, on_struck=struck.append)
    problems = [p for p in (c.hang, c.unrecovered and f"not whole again: {c.unrecovered}",
                            c.weights_error and f"weights: {c.weights_error}") if p]
    problems += [f"{b}" for b in c.backwards] + [f"torn: {t}" for t in c.torn]
    if not c.struck:
        problems.append("the fault was never struck: the phase was not reached")
    if not c.next_ok:
        problems.append(f"the next update failed: {c.next_error}")
    if c.struck and action == "kill" and role in ("trainer", "inference") and (left := orphans(dep, role, struck[0]["pid"])):
        problems.append(f"the killed {role} controller's workers {left} outlived it, not adopted by its successor")
    if c.next_ok:  # the test's own check: canonical tensors reassembled from every rank, regenerated here
        run, step = c.committed.split(":")
        specs = model_config(SETTINGS.model).tensors()
        for name in CHECKED:
            got, version = dump_rpc(dep.inf, name)
            assert version == {"run": run, "step": int(step)}, (name, version, c)
            want = tensor_value(SETTINGS.seed, name, int(step), specs[name].shape, torch.bfloat16)
            assert torch.equal(got, want), f"{name} at {c.committed} is not the regenerated step\n{c}"
    assert not problems, f"{fault}: " + "; ".join(problems) + f"\n{c}\n{dep.logs()}"
