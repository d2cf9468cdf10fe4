"""Standalone workers as child processes, restarted when they die, with backoff and a budget.

A worker that keeps dying soon after it starts (before it attaches to its controller) is
not restarted forever: each quick failure doubles the wait before the next start (up to
`max_delay`), and after `max_failures` quick failures in a row the rank is given up (state
FAILED) with its exit status and the last lines of its stderr, which the controllers show in
`status` and in errors such as "workers [0, 1] are not attached". The workers stop when their
controller is gone: restarted, it starts its own."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger("reshard.supervisor")

# `python -c` with the working directory taken off sys.path, for Pythons without `-P` (3.10).
_BOOT = ("import runpy, sys; del sys.path[0]; m = sys.argv.pop(1); "
         "runpy.run_module(m, run_name='__main__', alter_sys=True)")


SUPERVISOR_PID = "RESHARD_SUPERVISOR_PID"  # set in the environment of the workers a Supervisor starts


def stop_with_supervisor(stop: threading.Event, every: float = 0.5) -> None:
    """In a standalone worker: set `stop` once the controller that started it is gone (killed,
    say). That controller, restarted, starts workers of its own; an orphan left running would
    take its rank back from them, again and again. A worker started by hand is left alone."""
    pid = os.environ.get(SUPERVISOR_PID, "")
    if not pid.isdigit():
        return

    def watch() -> None:
        while not stop.wait(every):
            if os.getppid() != int(pid):
                log.warning("controller pid %s is gone: stopping", pid)
                stop.set()

    threading.Thread(target=watch, name="reshard-supervisor-watch", daemon=True).start()


def module_command(module: str) -> list[str]:
    """`python -m module` that never imports from the working directory: a folder named like
    our package there (a checkout's root, say) must not shadow the installed package."""
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-m", module]
    return [sys.executable, "-c", _BOOT, module]


@dataclasses.dataclass(slots=True)
class _Rank:
    proc: asyncio.subprocess.Process | None = None
    started: float = 0.0
    failures: int = 0  # quick failures in a row
    attached: bool = False  # this process attached to its controller: a clean start, whenever it exits
    state: str = "STARTING"  # STARTING | RUNNING | RESTARTING | FAILED | STOPPED
    error: str = ""  # the last failure: exit status and the tail of its stderr
    tail: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=20))
    reader: asyncio.Task | None = None


class Supervisor:
    """Starts `world` worker processes (`command(rank)`) and restarts any that exits."""

    def __init__(self, role: str, world: int, command: Callable[[int], list[str]], *, delay: float = 0.5,
                 max_delay: float = 30.0, max_failures: int = 5, healthy_after: float = 20.0,
                 poll: float = 0.1) -> None:
        self.role, self.world, self.command = role, world, command
        self.delay, self.max_delay, self.max_failures = delay, max_delay, max_failures
        self.healthy_after = healthy_after  # a worker that ran this long (or attached) had a clean start
        self.poll = poll
        self.ranks = {r: _Rank() for r in range(world)}
        self.starts = 0  # processes started, restarts included
        self.stopping = False

    # -- what the controllers show -------------------------------------------------------
    def state(self, rank: int) -> str:
        return self.ranks[rank].state

    def error(self, rank: int) -> str:
        """Why `rank` is not running ('' when it is, or has not failed yet)."""
        r = self.ranks[rank]
        if r.state in ("RUNNING", "STOPPED") or not r.error:
            return ""
        if r.state == "FAILED":
            return f"gave up after {r.failures} failed starts: {r.error}"
        return f"restarting after {r.failures} failed start(s): {r.error}"

    @property
    def pids(self) -> dict[int, int]:
        return {k: r.proc.pid for k, r in self.ranks.items() if r.proc is not None and r.proc.returncode is None}

    def attached(self, rank: int, pid: int) -> None:
        """The controller's word that a worker attached: however soon it dies after that (killed,
        say), it had a clean start and is restarted after the shortest wait."""
        r = self.ranks.get(rank)
        if r is not None and r.proc is not None and r.proc.pid == pid:
            r.attached = True

    # -- running -------------------------------------------------------------------------
    async def _spawn(self, rank: int) -> None:
        r = self.ranks[rank]
        r.tail.clear()
        r.attached = False
        r.proc = await asyncio.create_subprocess_exec(*self.command(rank), stdin=asyncio.subprocess.DEVNULL,
                                                      stderr=asyncio.subprocess.PIPE,
                                                      env={**os.environ, SUPERVISOR_PID: str(os.getpid())})
        r.started, r.state = time.monotonic(), "RUNNING"
        self.starts += 1
        r.reader = asyncio.get_running_loop().create_task(self._forward(r.proc, r.tail))
        log.info("started %s worker rank %d (pid %d)", self.role, rank, r.proc.pid)

    @staticmethod
    async def _forward(proc: asyncio.subprocess.Process, tail: collections.deque) -> None:
        """Pass the worker's stderr through to ours, keeping its last lines."""
        assert proc.stderr is not None
        while True:
            line = await proc.stderr.readline()
            if not line:
                return
            tail.append(line.decode(errors="replace").rstrip())
            sys.stderr.buffer.write(line)
            sys.stderr.flush()

    async def _exited(self, rank: int) -> float:
        """Record a worker's exit; returns the delay before it is started again (<0: give up)."""
        r = self.ranks[rank]
        proc = r.proc
        if r.reader is not None:
            try:
                await asyncio.wait_for(r.reader, 2.0)  # the last lines it wrote
            except (asyncio.TimeoutError, asyncio.CancelledError):
                pass
        lived = time.monotonic() - r.started
        code = proc.returncode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit status {code}"
        lines = [ln for ln in r.tail if ln.strip()][-5:]
        r.error = f"pid {proc.pid} {how} after {lived:.1f}s" + (": " + " | ".join(lines) if lines else "")
        r.failures = r.failures + 1 if lived < self.healthy_after and not r.attached else 1
        if r.failures >= self.max_failures:
            r.state = "FAILED"
            log.error("%s worker rank %d keeps failing; not restarting it (%s)", self.role, rank, self.error(rank))
            return -1.0
        wait = min(self.max_delay, self.delay * 2 ** (r.failures - 1))
        r.state = "RESTARTING"
        log.warning("%s worker rank %d %s; restarting it in %.1fs", self.role, rank, r.error, wait)
        return wait

    async def run(self) -> None:
        for rank in range(self.world):
            await self._spawn(rank)
        due: dict[int, float] = {}  # rank -> when it starts again
        while not self.stopping:
            await asyncio.sleep(self.poll)
            now = time.monotonic()
            for rank, r in self.ranks.items():
                if self.stopping:
                    break
                if r.state == "RUNNING" and r.proc is not None and r.proc.returncode is not None:
                    wait = await self._exited(rank)
                    if wait >= 0:
                        due[rank] = time.monotonic() + wait
                elif r.state == "RESTARTING" and now >= due.get(rank, 0.0):
                    await self._spawn(rank)

    async def stop(self, grace: float = 5.0) -> None:
        self.stopping = True
        procs = [r.proc for r in self.ranks.values() if r.proc is not None and r.proc.returncode is None]
        for p in procs:
            p.terminate()
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in procs)), grace)
        except asyncio.TimeoutError:
            for p in procs:
                if p.returncode is None:
                    log.warning("%s worker pid %d ignored SIGTERM; killing it", self.role, p.pid)
                    p.kill()
            await asyncio.gather(*(p.wait() for p in procs))
        for r in self.ranks.values():
            if r.state != "FAILED":
                r.state = "STOPPED"
            if r.reader is not None:
                r.reader.cancel()
