"""`reshard chaos`: random faults at every phase of real updates, and what they did.

Starts a deployment on 127.0.0.1 as real processes: an inference controller and a trainer
controller, each with standalone workers. Each cycle arms one random fault (role, phase, kill
or freeze) through the fault hook (common/control/faults.py: every process reads a control file at each
phase, so nothing is restarted to arm it) and triggers an update. A frozen process is resumed
after `--freeze` seconds; a killed controller is re-run with its command line, as an operator
would (killed workers are restarted by their controller). Once the deployment is whole again
the next update is triggered and must commit, and the weights served are read back (the Dump
RPC) and compared bit for bit with an independent regeneration of the synthetic weights at the
version served (tools/synth.py).

A monitor polls both controllers all along and records a served or committed version that goes
backwards, and a torn version: the deployment reporting SERVING while its serving ranks hold
different versions. Per kind of fault (role and action) it prints how many struck, hangs (an
outcome later than the deadlines allow), versions backwards, torn versions served, unrecovered
states (not whole again within `--recover-timeout`), failed next updates, wrong weights, and the
time from the fault to the next committed update (mean, max).

The matrix test (tests/integration/test_failure_matrix.py) drives the same Deployment and
run_cycle over every role, phase and action."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

if TYPE_CHECKING:  # annotations only: importing this module does not import torch
    import torch

from reshard.common.control.faults import ACTIONS, PHASES, ROLES, Fault
from reshard.common.control.supervisor import module_command
from reshard.common.layout.core import dtype_of
from reshard.common.models.presets import model_config
from reshard.proto import reshard_pb2 as pb
from reshard.proto import reshard_pb2_grpc as rgrpc

CONTROLLERS = ("trainer", "inference")
# The trainer reaches a restarted inference controller within its channel's longest reconnect
# backoff (common/control/rpc.py), gRPC's jitter of 20% included; until then its calls there fail at once.
CHECKPOINT_RUN = "checkpoint"  # what standalone inference workers load at start (synthetic step 0)
RUN = "chaos"


def add_parser(sub) -> None:
    p = sub.add_parser("chaos", help="random faults at every phase of real updates: hangs, versions, recovery",
                       description="\n\n".join(__doc__.split("\n\n")[:3]), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="model of the standalone workers (default tiny)")
    p.add_argument("--cycles", type=int, default=20, help="faulted updates (default 20)")
    p.add_argument("--seed", type=int, default=0, help="picks the faults, and seeds the synthetic weights")
    p.add_argument("--trainer-workers", type=int, default=2)
    p.add_argument("--inference-workers", type=int, default=2)
    p.add_argument("--freeze", type=float, default=3.0,
                   help="seconds a stopped process stays frozen before SIGCONT (default 3: longer than --worker-timeout)")
    p.add_argument("--update-timeout", type=float, default=8.0, help="the services' update deadline, seconds")
    p.add_argument("--rpc-timeout", type=float, default=3.0, help="the services' control-plane deadline, seconds")
    p.add_argument("--worker-timeout", type=float, default=2.0, help="a worker silent this long fails the update, seconds")
    p.add_argument("--recover-timeout", type=float, default=60.0,
                   help="seconds the deployment has to be whole again after a fault before it counts as unrecovered")
    p.add_argument("--json", action="store_true")
    p.set_defaults(_main=main)


@dataclasses.dataclass(kw_only=True, slots=True)
class Settings:
    model: str = "tiny"
    """Model of the standalone workers."""
    seed: int = 0
    """Seed of the synthetic weights."""
    trainer_workers: int = 2
    inference_workers: int = 2
    update_timeout: float = 8.0
    """The services' --update-timeout."""
    rpc_timeout: float = 3.0
    """The services' --rpc-timeout."""
    worker_timeout: float = 2.0
    """The services' --worker-timeout: a frozen worker is noticed after this long."""
    freeze: float = 3.0
    """Seconds a stopped process stays frozen before SIGCONT."""
    recover_timeout: float = 60.0
    """Seconds the deployment has to be whole again after a fault."""
    bucket_bytes: int = 64 << 10
    """Staging buckets small enough that a transfer takes several rounds (a fault lands mid-transfer)."""

    def __post_init__(self) -> None:
        if min(self.update_timeout, self.rpc_timeout, self.worker_timeout, self.freeze, self.recover_timeout) <= 0:
            raise ValueError("chaos: deadlines, --freeze and --recover-timeout must be positive seconds")
        if self.trainer_workers < 1 or self.inference_workers < 1:
            raise ValueError("chaos: each side needs at least one worker")
        model_config(self.model)  # an unknown name says which are known

    @property
    def update_bound(self) -> float:
        """The latest an update's outcome may come, from its trigger: the deadline (a step, then
        the update), a freeze on top, and slack for a loaded machine."""
        return self.update_timeout + self.freeze + 5.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _order(run: str, step: int) -> tuple[int, int]:
    """Versions in the order they may be served: the checkpoint first, then the run's steps."""
    return (0 if run == CHECKPOINT_RUN else 1, step)


def _v(v) -> str:
    return f"{v[0]}:{v[1]}"


@dataclasses.dataclass(slots=True)
class Outcome:
    """One update as its caller saw it."""

    started: float
    """Wall-clock time of the trigger."""
    ended: float = 0.0
    ok: bool = False
    committed: tuple[str, int] | None = None
    error: str = ""

    @property
    def seconds(self) -> float:
        return self.ended - self.started


class Weights:
    """The synthetic weights at any step, regenerated here, independently of the services
    (tools/synth.py): each tensor is kept at the last step asked for and advanced from there."""

    def __init__(self, model: str, seed: int) -> None:
        self.specs, self.seed = model_config(model).tensors(), seed
        self._held: dict[str, tuple[int, torch.Tensor]] = {}

    def at(self, name: str, step: int) -> torch.Tensor:
        import torch  # here, not at the top: every command's parser imports this module

        from reshard.tools.synth import advance_box, init_box

        spec = self.specs[name]
        zero = (0,) * len(spec.shape)
        held = self._held.get(name)
        if held is None or held[0] > step:
            t = torch.empty(spec.shape, dtype=dtype_of(spec.dtype))
            init_box(t, self.seed, name, zero, spec.shape)
            held = (0, t)
        s, t = held
        while s < step:
            s += 1
            advance_box(t, self.seed, name, s, zero, spec.shape)
        self._held[name] = (s, t)
        return t


class Deployment:
    """A trainer controller and an inference controller with standalone workers, as real
    processes on 127.0.0.1, armed through one fault control file, restarted as an operator would."""

    def __init__(self, settings: Settings, workdir: str) -> None:
        s = self.settings = settings
        self.workdir = workdir
        self.control = os.path.join(workdir, "fault")
        self.inf, self.tr = f"127.0.0.1:{_free_port()}", f"127.0.0.1:{_free_port()}"
        self.weights = Weights(s.model, s.seed)
        deadlines = ["--update-timeout", str(s.update_timeout), "--rpc-timeout", str(s.rpc_timeout),
                     "--worker-timeout", str(s.worker_timeout)]
        cli = module_command("reshard.cli")
        self.commands = {
            "inference": [*cli, "inference", "--listen", self.inf, "--workers", str(s.inference_workers),
                          "--model", s.model, "--seed", str(s.seed), *deadlines],
            "trainer": [*cli, "trainer", "--listen", self.tr, "--workers", str(s.trainer_workers), "--model", s.model,
                        "--seed", str(s.seed), "--inference", self.inf, "--run", RUN, "--bucket-bytes", str(s.bucket_bytes),
                        *deadlines],
        }
        self.env = dict(os.environ, RESHARD_FAULT_AT="@" + self.control,
                        RESHARD_LOG_LEVEL=os.environ.get("RESHARD_LOG_LEVEL", "INFO"))
        self.procs: dict[str, subprocess.Popen] = {}
        self.groups: list[int] = []  # every process group started: a killed controller's workers are in its own
        self._channels: dict[str, grpc.Channel] = {}

    # -- processes -----------------------------------------------------------------------
    def start(self, role: str | None = None) -> None:
        """Start a controller (both when `role` is None); its workers start with it."""
        for r in (role,) if role else CONTROLLERS[::-1]:
            with open(os.path.join(self.workdir, f"{r}.log"), "a") as log:
                p = subprocess.Popen(self.commands[r], env=self.env, stdout=subprocess.DEVNULL, stderr=log,
                                     start_new_session=True)
            self.procs[r], self.groups = p, [*self.groups, p.pid]

    def restart(self, role: str) -> None:
        """Re-run a controller that died, with its command line."""
        self.procs[role].wait(10)
        self.start(role)

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                pass
        for g in self.groups:  # anything left behind, frozen ones included
            try:
                os.killpg(g, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.procs.values():
            p.wait()
        for ch in self._channels.values():
            ch.close()

    def logs(self, tail: int = 4000) -> str:
        out = []
        for r in CONTROLLERS:
            with open(os.path.join(self.workdir, f"{r}.log"), errors="replace") as f:
                out.append(f"--- {r} ---\n" + f.read()[-tail:])
        return "\n".join(out)

    # -- calls -----------------------------------------------------------------------------
    def stub(self, role: str):
        ch = self._channels.get(role)
        if ch is None:  # reconnects at once to a restarted controller (gRPC's default backoff grows to 2 min)
            ch = self._channels[role] = grpc.insecure_channel(
                self.tr if role == "trainer" else self.inf,
                options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.initial_reconnect_backoff_ms", 100),
                         ("grpc.max_reconnect_backoff_ms", 500)])
        return rgrpc.TrainerServiceStub(ch) if role == "trainer" else rgrpc.InferenceServiceStub(ch)

    def status(self, role: str, timeout: float = 2.0) -> pb.Status | None:
        """The controller's GetStatus, or None when it does not answer."""
        try:
            return self.stub(role).GetStatus(pb.StatusRequest(), timeout=timeout)
        except grpc.RpcError:
            return None

    def missing(self, killed: int = 0) -> str:
        """'' when the deployment is whole: both controllers answer, every worker is attached and
        serves (none of them the process `killed`, even if its death is not noticed yet), nothing
        is held, no update is running; otherwise what is not."""
        inf, tr = self.status("inference"), self.status("trainer")
        if inf is None or tr is None:
            return f"{'inference' if inf is None else 'trainer'} controller does not answer"
        # No wait for the trainer to reach a restarted inference controller: an update asked for
        # meanwhile waits for the connection within its own deadline.
        for role, st in (("inference", inf), ("trainer", tr)):
            if killed and any(w.pid == killed for w in st.workers):
                return f"{role} worker pid {killed} (killed) not replaced yet"
            bad = [f"{w.rank} {w.state}" for w in st.workers if w.state != "READY"]
            if st.serving_state != "SERVING" or bad:
                return f"{role} {st.serving_state}" + (f" (workers {', '.join(bad)})" if bad else "")
        if inf.needs_repair:
            return "inference has ranks to repair"
        # An update the trainer still drives, or one inference is finishing, ends first; one that a
        # dead trainer left behind is superseded by the next.
        if tr.update_in_progress:
            return f"trainer still updating ({tr.progress.phase})"
        if inf.update_in_progress and inf.progress.phase in ("VERIFY", "COMMIT"):
            return f"inference still finishing an update ({inf.progress.phase})"
        return ""

    def wait_whole(self, timeout: float, killed: int = 0) -> str:
        """Wait until the deployment is whole; returns what is still missing at the timeout ('' when whole)."""
        end = time.monotonic() + timeout
        while (why := self.missing(killed)) and time.monotonic() < end:
            time.sleep(0.1)
        return why

    def update(self) -> Outcome:
        """Trigger an update (the trainer's workers take a step) and wait for its outcome."""
        o = Outcome(started=time.time())
        wait = 3 * self.settings.update_bound
        stub = self.stub("trainer")
        try:
            rep = stub.TriggerUpdate(pb.TriggerUpdateRequest(), timeout=wait)
            out = stub.WaitForVersion(pb.WaitForVersionRequest(version=rep.version, timeout_s=wait), timeout=wait + 5)
            o.ok, o.error = out.ok, out.error
            if out.ok:
                o.committed = (out.committed.run, out.committed.step)
        except grpc.RpcError as e:
            o.error = f"{e.code().name}: {e.details()}"
        o.ended = time.time()
        return o

    def dump(self, name: str) -> tuple[torch.Tensor, tuple[str, int]]:
        """A canonical tensor read back through the Dump RPC, with the version it holds."""
        data, first = bytearray(), None
        for chunk in self.stub("inference").Dump(pb.DumpRequest(tensor=name), timeout=30):
            first = first or chunk
            data += chunk.data
        import torch

        t = torch.frombuffer(data, dtype=dtype_of(first.dtype)).view(list(first.shape)).clone()
        return t, (first.version.run, first.version.step)

    def check_weights(self, version: tuple[str, int] | None = None) -> str:
        """'' when every tensor served equals the regeneration at the version served (and that
        version is `version`, when given); otherwise what differs."""
        for name in self.weights.specs:
            try:
                got, held = self.dump(name)
            except grpc.RpcError as e:
                return f"dump {name}: {e.code().name}: {e.details()}"
            if version is not None and held != version:
                return f"{name} holds {_v(held)}, not {_v(version)}"
            step = 0 if held[0] == CHECKPOINT_RUN else held[1]
            if not got.equal(self.weights.at(name, step)):
                return f"{name} at {_v(held)} differs from its regeneration"
        return ""

    # -- faults --------------------------------------------------------------------------
    def arm(self, fault: Fault) -> None:
        for leftover in (self.control, self.control + ".fired"):
            if os.path.exists(leftover):
                os.unlink(leftover)
        tmp = self.control + ".tmp"
        with open(tmp, "w") as f:  # the processes see the control file whole: written, then renamed
            f.write(str(fault))
        os.replace(tmp, self.control)

    def struck(self, wait: float = 0.0) -> dict | None:
        """The record the struck process wrote (pid, time, ...), waiting up to `wait` seconds for
        it; None when there is none."""
        end = time.monotonic() + wait
        while True:
            try:
                with open(self.control + ".fired") as f:
                    return json.load(f)
            except FileNotFoundError:
                if time.monotonic() >= end:
                    return None
            time.sleep(0.01)

    def disarm(self) -> dict | None:
        """Take the fault back unless a process claimed it; returns its record if one did."""
        try:
            os.rename(self.control, self.control + ".disarmed")
            return None
        except FileNotFoundError:  # claimed: its record follows at once
            return self.struck(wait=2.0)


class Monitor:
    """Polls both controllers in the background: a served or committed version that goes
    backwards, and a deployment that reports SERVING while its serving ranks disagree."""

    def __init__(self, dep: Deployment, every: float = 0.1) -> None:
        self.dep, self.every = dep, every
        self.backwards: list[str] = []
        self.torn: list[str] = []
        self._last: dict[str, tuple[str, int]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reshard-chaos-monitor", daemon=True)

    def start(self) -> Monitor:
        self.sample()  # what is served and committed now: the first version to compare with
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def take(self) -> tuple[list[str], list[str]]:
        """What was seen since the last call: (versions backwards, torn versions)."""
        with self._lock:
            out = (self.backwards, self.torn)
            self.backwards, self.torn = [], []
        return out

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.sample()

    def sample(self) -> None:
        inf = self.dep.status("inference", timeout=1.0)
        if inf is not None:
            if inf.has_version:
                self._advance("served", (inf.version.run, inf.version.step))
            ready = {(w.version.run, w.version.step) for w in inf.workers if w.state == "READY" and w.has_version}
            served = {(inf.version.run, inf.version.step)} if inf.has_version else set()
            if inf.serving_state == "SERVING" and (len(ready) > 1 or ready - served):
                with self._lock:
                    self.torn.append(f"SERVING with ranks at {', '.join(sorted(_v(v) for v in ready))}")
        tr = self.dep.status("trainer", timeout=1.0)
        if tr is not None and tr.has_committed:
            self._advance("committed", (tr.committed.run, tr.committed.step))

    def _advance(self, what: str, v: tuple[str, int]) -> None:
        last = self._last.get(what)
        if last is not None and _order(*v) < _order(*last):
            with self._lock:
                self.backwards.append(f"{what} {_v(last)} -> {_v(v)}")
        self._last[what] = v


@dataclasses.dataclass(slots=True)
class Cycle:
    """One faulted update and what followed."""

    fault: str
    kind: str
    """Role and action: the rows of the summary."""
    struck: bool = False
    pid: int = 0
    update_ok: bool = False
    update_error: str = ""
    update_seconds: float = 0.0
    hang: str = ""
    """Which outcome came later than the deadlines allow ('' when none)."""
    unrecovered: str = ""
    """What was still missing when --recover-timeout passed ('' when whole again)."""
    next_ok: bool = False
    next_error: str = ""
    committed: str = ""
    weights_error: str = ""
    whole_seconds: float = 0.0
    """From the faulted update's outcome (and the restart or resume) until the deployment was whole again."""
    next_seconds: float = 0.0
    recovery_seconds: float | None = None
    """From the fault to the next committed update (the faulted one, if it committed after it)."""
    backwards: list[str] = dataclasses.field(default_factory=list)
    torn: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    @property
    def clean(self) -> bool:
        return (self.struck and self.next_ok and not (self.hang or self.unrecovered or self.weights_error
                                                      or self.backwards or self.torn))


def run_cycle(dep: Deployment, monitor: Monitor, fault: Fault, on_struck: Callable[[dict], None] | None = None) -> Cycle:
    """Arm `fault`, trigger an update, resume or re-run what it struck, wait until the deployment
    is whole, trigger the next update and check the weights it serves."""
    s = dep.settings
    c = Cycle(fault=str(fault), kind=f"{fault.role} {fault.action}")
    t0 = time.monotonic()
    monitor.take()  # this cycle's observations only
    dep.arm(fault)
    result: list[Outcome] = []
    call = threading.Thread(target=lambda: result.append(dep.update()), name="reshard-chaos-update", daemon=True)
    call.start()
    rec = None
    while rec is None and call.is_alive():
        rec = dep.struck(wait=0.02)
    # Not struck while the update ran: a trainer worker's Release comes just after the outcome.
    rec = rec or dep.struck(wait=1.0) or dep.disarm()
    if rec is not None:
        if on_struck is not None:
            on_struck(rec)
        while not _react(dep, rec):  # the update may be waiting on the process struck
            time.sleep(0.02)
    call.join()
    out = result[0]
    c.struck, c.pid = rec is not None, (rec or {}).get("pid", 0)
    c.update_ok, c.update_error, c.update_seconds = out.ok, out.error, out.seconds
    if out.seconds > s.update_bound:
        c.hang = f"the faulted update's outcome came after {out.seconds:.1f}s (bound {s.update_bound:.0f}s)"
    t1 = time.monotonic()
    c.unrecovered = dep.wait_whole(s.recover_timeout, killed=c.pid if fault.action == "kill" else 0)
    c.whole_seconds = time.monotonic() - t1
    nxt = dep.update()
    c.next_ok, c.next_error, c.next_seconds = nxt.ok, nxt.error, nxt.seconds
    if nxt.seconds > s.update_timeout + 5.0:
        c.hang = c.hang or f"the next update's outcome came after {nxt.seconds:.1f}s"
    if nxt.ok:
        c.committed = _v(nxt.committed)
    if rec is not None:
        after = [o.ended for o in (out, nxt) if o.ok and o.ended >= rec["time"]]
        c.recovery_seconds = min(after) - rec["time"] if after else None
    c.weights_error = dep.check_weights(nxt.committed if nxt.ok else None)
    monitor.sample()
    c.backwards, c.torn = monitor.take()
    c.seconds = time.monotonic() - t0
    return c


def _react(dep: Deployment, rec: dict) -> bool:
    """Resume a frozen process once the freeze has lasted; re-run a killed controller. True when done."""
    if rec["action"] == "stop":
        if time.time() < rec["time"] + dep.settings.freeze:
            return False
        try:
            os.kill(rec["pid"], signal.SIGCONT)
        except ProcessLookupError:
            pass
        return True
    if rec["role"] in CONTROLLERS:
        if dep.procs[rec["role"]].poll() is None:
            return False  # not reaped yet
        dep.restart(rec["role"])
    return True  # a killed worker is restarted by its controller


def random_faults(n: int, seed: int, settings: Settings) -> list[Fault]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        role, phase, action = rng.choice(ROLES), rng.choice(PHASES), rng.choice(sorted(ACTIONS))
        workers = {"trainer-worker": settings.trainer_workers, "inference-worker": settings.inference_workers}.get(role)
        out.append(Fault(role, phase, action, rng.randrange(workers) if workers else None))
    return out


def summarize(cycles: list[Cycle]) -> dict:
    kinds: dict[str, list[Cycle]] = {}
    for c in cycles:
        kinds.setdefault(c.kind, []).append(c)

    def row(cs: list[Cycle]) -> dict:
        rec = [c.recovery_seconds for c in cs if c.recovery_seconds is not None]
        return {"count": len(cs), "struck": sum(c.struck for c in cs), "hangs": sum(bool(c.hang) for c in cs),
                "backwards": sum(len(c.backwards) > 0 for c in cs), "torn": sum(len(c.torn) > 0 for c in cs),
                "unrecovered": sum(bool(c.unrecovered) for c in cs), "next_failed": sum(not c.next_ok for c in cs),
                "wrong_weights": sum(bool(c.weights_error) for c in cs),
                "recovery_mean_s": statistics.fmean(rec) if rec else None, "recovery_max_s": max(rec) if rec else None}

    order = [f"{r} {a}" for r in ROLES for a in sorted(ACTIONS)]
    return {"kinds": {k: row(kinds[k]) for k in order if k in kinds}, "total": row(cycles)}


COLUMNS = (("count", "count"), ("struck", "struck"), ("hangs", "hangs"), ("backwards", "backwards"), ("torn", "torn"),
           ("unrecovered", "unrecovered"), ("next_failed", "next failed"), ("wrong_weights", "wrong weights"))


def print_table(summary: dict, seconds: float, cycles: int) -> None:
    head = f"{'fault':<24}" + "".join(f"{t:>{max(7, len(t) + 2)}}" for _, t in COLUMNS) + f"{'fault->commit s (mean, max)':>30}"
    print(head)
    rows = [*summary["kinds"].items(), ("total", summary["total"])]
    for i, (kind, r) in enumerate(rows):
        if i == len(rows) - 1:
            print("-" * len(head))
        rec = (f"{r['recovery_mean_s']:.1f}, {r['recovery_max_s']:.1f}" if r["recovery_mean_s"] is not None else "-")
        print(f"{kind:<24}" + "".join(f"{r[k]:>{max(7, len(t) + 2)}}" for k, t in COLUMNS) + f"{rec:>30}")
    print(f"\n{cycles} cycles in {seconds:.0f}s ({seconds / max(1, cycles):.1f}s per cycle)")


def main(a) -> int:
    try:
        settings = Settings(model=a.model, seed=a.seed, trainer_workers=a.trainer_workers,
                            inference_workers=a.inference_workers, update_timeout=a.update_timeout,
                            rpc_timeout=a.rpc_timeout, worker_timeout=a.worker_timeout, freeze=a.freeze,
                            recover_timeout=a.recover_timeout)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    if a.cycles < 1:
        print("chaos: --cycles must be at least 1", file=sys.stderr)
        return 2
    faults = random_faults(a.cycles, a.seed, settings)
    workdir = tempfile.mkdtemp(prefix="reshard-chaos-")
    dep = Deployment(settings, workdir)
    cycles: list[Cycle] = []
    t0 = time.monotonic()
    monitor = None
    try:
        dep.start()
        if why := dep.wait_whole(120):
            raise RuntimeError(f"the deployment did not come up: {why}\n{dep.logs()}")
        first = dep.update()  # every cycle starts from a committed step of the run
        if not first.ok:
            raise RuntimeError(f"the first update failed: {first.error}\n{dep.logs()}")
        monitor = Monitor(dep).start()
        for i, f in enumerate(faults):
            c = run_cycle(dep, monitor, f)
            cycles.append(c)
            print(f"cycle {i + 1}/{len(faults)} {c.fault}: {'ok' if c.clean else 'PROBLEM'}, "
                  f"update {'committed' if c.update_ok else 'failed'} in {c.update_seconds:.1f}s, "
                  f"next {c.committed or 'FAILED ' + c.next_error}"
                  + (f", fault->commit {c.recovery_seconds:.1f}s" if c.recovery_seconds is not None else "")
                  + "".join(f"; {what}: {x}" for what, x in (("hang", c.hang), ("unrecovered", c.unrecovered),
                                                             ("weights", c.weights_error),
                                                             ("backwards", "; ".join(c.backwards)),
                                                             ("torn", "; ".join(c.torn))) if x),
                  file=sys.stderr, flush=True)
    except RuntimeError as e:
        print(f"chaos: {e}", file=sys.stderr)
        return 1
    finally:
        if monitor is not None:
            monitor.stop()
        dep.close()
    seconds = time.monotonic() - t0
    summary = summarize(cycles)
    clean = all(c.clean for c in cycles)
    if a.json:
        print(json.dumps({"model": settings.model, "seed": a.seed, "settings": dataclasses.asdict(settings),
                          "seconds": seconds, "clean": clean, **summary,
                          "cycles": [dataclasses.asdict(c) for c in cycles]}, indent=2))
    else:
        print_table(summary, seconds, len(cycles))
    if clean:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"chaos: problems found; the services' logs are in {workdir}", file=sys.stderr)
    return 0 if clean else 1
