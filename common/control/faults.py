"""Faults struck at a chosen phase of an update: the test hook of the failure matrix
(tests/integration/test_failure_matrix.py) and of `reshard chaos`.

Off unless RESHARD_FAULT_AT is set when the process starts: it is read once, at import, and
an unset hook costs one test of a module constant. Its value is an instruction,

    ROLE:PHASE:ACTION[:RANK]          e.g. inference-worker:COMMIT:kill:1

or `@PATH`, a control file holding one, read each time a hook is reached: a fault can then be
armed while everything runs, without restarting anything (`reshard chaos` does this). ROLE is
`trainer` or `inference` (the controllers), `trainer-worker` or `inference-worker`; PHASE one
of PHASES; ACTION `kill` (SIGKILL) or `stop` (SIGSTOP: whoever armed it sends SIGCONT); RANK
a worker's rank (any rank when left out). Standalone workers inherit their controller's
environment, so arming the controllers arms their workers too.

A fault strikes once. From a control file, the process that strikes claims the file (renames
it away: of several that match, one strikes) and writes PATH.fired before the signal: JSON
with the fault, the pid struck and the wall-clock time. An instruction given directly strikes
once per process, and with RESHARD_FAULT_MARKER=PATH once for good: the marker (holding the
same JSON) is made as it strikes, and a process that finds it (a restarted one) does not strike.

Where each cell strikes. A worker with nothing to do in a phase (its controller negotiates
alone; a trainer worker takes no part in VERIFY) is struck by its controller as the controller
enters that phase, the worker's pid taken from the controller's hub (same host):

    ROLE              NEGOTIATE           CONNECT          TRANSFER              VERIFY             COMMIT
    trainer           phase NEGOTIATE     phase CONNECT    phase TRANSFER        phase VERIFY       FinishUpdate returned:
                                                                                                    committed on inference,
                                                                                                    not yet recorded
    inference         BeginUpdate taken   phase CONNECT    phase TRANSFER        phase VERIFY       phase COMMIT
    trainer-worker    by its controller   Prepare          after its first       by its controller  Release (the controller
                      (NEGOTIATE)         received         round of bytes        (VERIFY)           is done with the version)
    inference-worker  by its controller   Prepare          after its first       Verify received    Commit received
                      (NEGOTIATE)         received         round of bytes
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import time
from typing import TYPE_CHECKING

from reshard.common.control.phases import Phase

if TYPE_CHECKING:
    from reshard.common.control.hub import WorkerHub

log = logging.getLogger("reshard.faults")

ROLES = ("trainer", "inference", "trainer-worker", "inference-worker")
PHASES = tuple(p.value for p in (Phase.NEGOTIATE, Phase.CONNECT, Phase.TRANSFER, Phase.VERIFY, Phase.COMMIT))
ACTIONS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
BY_CONTROLLER = {("trainer-worker", "NEGOTIATE"), ("trainer-worker", "VERIFY"), ("inference-worker", "NEGOTIATE")}
"""Worker cells struck by the worker's controller: the worker has no step of its own there."""


@dataclasses.dataclass(frozen=True, slots=True)
class Fault:
    role: str
    phase: str
    action: str
    rank: int | None = None
    """A worker's rank; None: any rank."""

    @classmethod
    def parse(cls, text: str) -> Fault:
        parts = text.strip().split(":")
        ok = len(parts) in (3, 4) and parts[0] in ROLES and parts[1] in PHASES and parts[2] in ACTIONS
        if ok and len(parts) == 4:
            ok = parts[3].isdigit() and parts[0].endswith("-worker")
        if not ok:
            raise ValueError(f"fault {text!r}: expected ROLE:PHASE:ACTION[:RANK], ROLE one of {', '.join(ROLES)}, "
                             f"PHASE one of {', '.join(PHASES)}, ACTION kill or stop, RANK for workers only")
        return cls(parts[0], parts[1], parts[2], int(parts[3]) if len(parts) == 4 else None)

    def __str__(self) -> str:
        return f"{self.role}:{self.phase}:{self.action}" + (f":{self.rank}" if self.rank is not None else "")


_SPEC = os.environ.get("RESHARD_FAULT_AT", "")
_CONTROL = _SPEC[1:] if _SPEC.startswith("@") else ""
SPEC_ERROR = ""  # why RESHARD_FAULT_AT did not parse: the services refuse to start with it (cli.check_environment)
try:
    _FIXED = Fault.parse(_SPEC) if _SPEC and not _CONTROL else None
except ValueError as _e:
    _FIXED, SPEC_ERROR = None, str(_e)
_MARKER = os.environ.get("RESHARD_FAULT_MARKER", "")
_struck = False
_bad_control = ""  # a control file's text that did not parse (logged once)


def at_phase(role: str, phase: str, rank: int | None = None, workers: WorkerHub | None = None) -> None:
    """Strike here if the armed fault names this point. `role` is the caller's (one of ROLES),
    `rank` a worker's own; a controller passes its WorkerHub as `workers`, to strike the worker
    cells of BY_CONTROLLER."""
    if not _SPEC:
        return
    fault = _armed()
    if fault is None or fault.phase != phase:
        return
    by_controller = (fault.role, phase) in BY_CONTROLLER
    if fault.role == role and not by_controller and fault.rank in (None, rank):
        pid = os.getpid()
    elif workers is not None and by_controller and fault.role == f"{role}-worker":
        pids = {w.rank: w.pid for w in workers.alive()}
        rank = min(pids, default=None) if fault.rank is None else fault.rank
        if rank not in pids:
            return
        pid = pids[rank]
    else:
        return
    record = {"fault": str(fault), "role": fault.role, "phase": phase, "action": fault.action, "rank": rank,
              "pid": pid, "by": os.getpid(), "time": time.time()}
    if not _claim(record):
        return
    log.warning("fault injection: %s, pid %d", fault, pid)
    os.kill(pid, ACTIONS[fault.action])


def _armed() -> Fault | None:
    global _bad_control
    if _FIXED is not None:
        return None if _struck else _FIXED
    try:
        with open(_CONTROL) as f:
            text = f.read()
    except FileNotFoundError:
        return None
    try:
        return Fault.parse(text)
    except ValueError as e:
        if text != _bad_control:
            _bad_control = text
            log.error("fault control file %s: %s", _CONTROL, e)
        return None


def _claim(record: dict) -> bool:
    """Make this the one strike of the armed fault, and say so where whoever armed it looks."""
    global _struck
    if _CONTROL:
        mine = f"{_CONTROL}.{os.getpid()}"
        try:
            os.rename(_CONTROL, mine)  # atomic: of several processes that match, one strikes
        except FileNotFoundError:
            return False
        write_json(_CONTROL + ".fired", record)
        os.unlink(mine)
        return True
    if _struck:
        return False
    _struck = True
    if _MARKER:
        try:
            fd = os.open(_MARKER, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
    return True


def write_json(path: str, obj: object) -> None:
    """Write `path` whole or not at all (a reader never sees half of it)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)
