"""Standalone workers as child processes, restarted when they die."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import time
from collections.abc import Callable

log = logging.getLogger("reshard.supervisor")


class Supervisor:
    """Starts `world` worker processes (`command(rank)`) and restarts any that exits."""

    def __init__(self, role: str, world: int, command: Callable[[int], list[str]], restart_delay: float = 0.5) -> None:
        self.role, self.world, self.command, self.delay = role, world, command, restart_delay
        self.procs: dict[int, subprocess.Popen] = {}
        self.stopping = False

    def spawn(self, rank: int) -> None:
        self.procs[rank] = subprocess.Popen(self.command(rank), stdin=subprocess.DEVNULL)
        log.info("started %s worker rank %d (pid %d)", self.role, rank, self.procs[rank].pid)

    async def run(self) -> None:
        for r in range(self.world):
            self.spawn(r)
        while not self.stopping:
            await asyncio.sleep(self.delay)
            for r, p in list(self.procs.items()):
                if p.poll() is not None and not self.stopping:
                    log.warning("%s worker rank %d (pid %d) exited with %s; restarting it", self.role, r, p.pid, p.returncode)
                    self.spawn(r)

    async def stop(self, grace: float = 5.0) -> None:
        self.stopping = True
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        t0 = time.monotonic()
        for p in self.procs.values():
            while p.poll() is None and time.monotonic() - t0 < grace:
                await asyncio.sleep(0.05)
            if p.poll() is None:
                log.warning("%s worker pid %d ignored SIGTERM; killing it", self.role, p.pid)
                p.kill()
                p.wait()
