"""Standalone workers as child processes, restarted when they die, with backoff and a budget.

A worker that keeps dying soon after it starts (before it attaches to its controller) is
not restarted forever: each quick failure doubles the wait before the next start (up to
`max_delay`), and after `max_failures` quick failures in a row the rank is given up (state
FAILED) with its exit status and the last lines of its stderr, which the controllers show in
`status` and in errors such as "workers [0, 1] are not attached".

A controller that dies (SIGKILL, a crash) leaves its workers running with the weights they hold.
Re-run with the same command line, it adopts them instead of starting new ones: each Supervisor
records its workers (pid and command line) in a small run file keyed by role and address
(`run_file`); the next one reads it, waits up to `adopt_s` for each recorded worker that still
runs to attach again (workers reconnect within 2 s), and starts new processes only for the
others. A worker left without a controller (`watch_controller`) keeps what it holds for
`RESHARD_ORPHAN_GRACE_S` seconds (default 60) and stops if no controller has adopted it by then."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import fcntl
import json
import logging
import os
import re
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from reshard.common.control.security import worker_environ

log = logging.getLogger("reshard.supervisor")

# `python -c` with the working directory taken off sys.path, for Pythons without `-P` (3.10).
_BOOT = ("import runpy, sys; del sys.path[0]; m = sys.argv.pop(1); "
         "runpy.run_module(m, run_name='__main__', alter_sys=True)")


SUPERVISOR_PID = "RESHARD_SUPERVISOR_PID"  # set in the environment of the workers a Supervisor starts


ORPHAN_GRACE = "RESHARD_ORPHAN_GRACE_S"  # seconds a worker whose controller died waits to be adopted
CONTROLLER_PID_KEY = "reshard-controller-pid"  # initial metadata of a worker stream: who adopted the worker


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie waiting to be reaped does not)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return not os.path.isdir("/proc")  # gone meanwhile, or a system without /proc
    except (OSError, IndexError):
        return True


def _cmdline(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0")[:-1]]
    except OSError:
        return None


def watch_controller(stop: threading.Event, controller_pid: Callable[[], int], refused: Callable[[], bool] = lambda: False,
                     every: float = 0.5, grace: float | None = None) -> None:
    """In a standalone worker started by a controller: set `stop` once it has had no live controller
    for `grace` seconds (RESHARD_ORPHAN_GRACE_S, default 60). Its controller is the process that
    started it, or the one it attached to last (`controller_pid()`, 0 for none): a restarted
    controller adopts the workers its predecessor left. An orphan whose rank another worker holds
    (`refused()`) stops at once. A worker started by hand is left alone."""
    parent = os.environ.get(SUPERVISOR_PID, "")
    if not parent.isdigit():
        return
    if grace is None:
        try:
            grace = float(os.environ.get(ORPHAN_GRACE, "60"))
        except ValueError:
            grace = 60.0

    def has_controller() -> bool:
        if os.getppid() == int(parent):
            return True
        pid = controller_pid()
        return pid != int(parent) and pid_alive(pid)

    def watch() -> None:
        since = None  # when it lost its controller
        while not stop.wait(every):
            if has_controller():
                if since is not None:
                    log.warning("adopted by controller pid %d", controller_pid())
                since = None
                continue
            now = time.monotonic()
            if since is None:
                since = now
                log.warning("controller pid %s is gone: keeping this worker for %.0fs for a restarted controller to adopt",
                            controller_pid() or parent, grace)
            if refused():
                log.warning("another worker holds this rank at the restarted controller: stopping")
                stop.set()
            elif now - since >= grace:
                log.warning("no controller adopted this worker within %.0fs: stopping", grace)
                stop.set()

    threading.Thread(target=watch, name="reshard-supervisor-watch", daemon=True).start()


class RunDirError(ValueError):
    """A run folder that another user could write into or read."""


def check_run_dir(path: str, uid: int | None = None) -> str:
    """`path`, created with mode 0700 when missing; refused when it is not a folder owned by `uid`
    (this process's user) or when others may enter it (any group or other permission): whoever can
    write there could replace the worker socket or plant a run file whose worker token a restarted
    controller trusts, and whoever can read there could read that token."""
    uid = os.getuid() if uid is None else uid
    try:
        os.makedirs(path, mode=0o700)  # the mode of a folder made here, whatever the umask leaves of it
        os.chmod(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise RunDirError(f"cannot create the run folder {path}: {e.strerror}; set RESHARD_RUN_DIR to a folder of "
                          "your own with mode 0700") from None
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) and st.st_uid == uid:  # a link of our own: judge what it points to
        st = os.stat(path)
    fix = (f"remove it (if it is not yours, ask its owner or an administrator) or run `chmod 700 {path}` if it is yours, "
           "or set RESHARD_RUN_DIR to a folder of your own with mode 0700")
    if not stat.S_ISDIR(st.st_mode):
        what = "a link another user made" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise RunDirError(f"the run folder {path} is {what}: {fix}")
    if st.st_uid != uid:
        raise RunDirError(f"the run folder {path} belongs to uid {st.st_uid}, not to this user (uid {uid}): another user "
                          f"could replace the worker socket or plant a run file there; {fix}")
    if st.st_mode & 0o077:
        raise RunDirError(f"the run folder {path} is open to other users (mode {stat.S_IMODE(st.st_mode):04o}): they could "
                          f"replace the worker socket or read and plant run files there; {fix}")
    return path


def run_dir() -> str:
    """The folder where controllers keep their run files and worker sockets, checked
    (`check_run_dir`): RESHARD_RUN_DIR, else $XDG_RUNTIME_DIR/reshard, else reshard-UID in the
    temp dir (the usual case in containers)."""
    return check_run_dir(os.environ.get("RESHARD_RUN_DIR") or (
        os.path.join(os.environ["XDG_RUNTIME_DIR"], "reshard") if os.environ.get("XDG_RUNTIME_DIR")
        else os.path.join(tempfile.gettempdir(), f"reshard-{os.getuid()}")))


def run_file(role: str, address: str) -> str:
    """Where the Supervisor of `role`'s controller serving `address` records its workers, in the
    checked run folder (`run_dir`). Raises RunDirError."""
    return os.path.join(run_dir(), f"{role}-{re.sub(r'[^A-Za-z0-9_.-]', '_', address)}.json")


def recorded_worker_token(path: str) -> str:
    """The worker token a previous controller recorded in its run file ('' if none): the workers
    it left running hold it, and a restarted controller must accept them."""
    try:
        with open(path) as f:
            token = json.load(f).get("worker_token", "")
    except (OSError, ValueError, AttributeError):
        return ""
    return token if isinstance(token, str) else ""


def stop_processes(procs: list, grace: float = 15.0) -> None:
    """SIGTERM each `subprocess.Popen` still running, then SIGKILL any that outlives `grace` seconds."""
    import subprocess

    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def module_command(module: str) -> list[str]:
    """`python -m module` that never imports from the working directory: a folder named like
    our package there (a checkout's root, say) must not shadow the installed package."""
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-m", module]
    return [sys.executable, "-c", _BOOT, module]


LINE_MAX = 8192
"""Bytes of a worker's log line passed on and kept: a longer line keeps its head and its last
LINE_END bytes, with the count of the bytes cut between them."""
LINE_END = 2048
LOG_MAX = 4 << 20
"""A worker's log file is emptied once read past this size (the run folder is often in memory)."""
_REPORT_LINE = 400  # characters of each last line in an exit report (which `status` and errors carry)


class WorkerLog:
    """A worker's stderr: a file the worker appends to (its fd 2), read here line by line.

    Never a pipe. A pipe blocks the worker as soon as its reader stops (a 1 MiB line once killed
    the reader and wedged workers for good), and dies with its controller, so a restarted
    controller that adopts the worker would never hear from it again. A file in the run folder
    (`path`) outlives the controller: its successor opens it and reads on, and has the worker's last
    words when it dies. Without a run folder the file has no name. What was in the file before
    this one opened it is not read (`last_lines` gives its end)."""

    CHUNK = 1 << 20  # bytes read at a time

    def __init__(self, path: str = "") -> None:
        self.path = path
        if path:
            self.fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        else:
            self.fd, name = tempfile.mkstemp(prefix="reshard-worker-", suffix=".log")
            os.unlink(name)
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) | os.O_APPEND)
        # O_APPEND: once this side empties the file, the worker writes at its new end, not past a hole
        self.pos = os.fstat(self.fd).st_size
        self.behind = 0  # bytes written and not yet read, as of the last read
        self._head, self._end, self._cut = bytearray(), bytearray(), 0  # the line being read

    def last_lines(self, window: int = 64 << 10) -> list[bytes]:
        """The complete lines in the file's last `window` bytes; reading goes on after them."""
        start = max(0, self.pos - window)
        data = os.pread(self.fd, self.pos - start, start)
        end = data.rfind(b"\n") + 1
        self.pos = start + end  # a line still being written is read whole by `read`
        lines = data[:end].split(b"\n")[:-1]
        return [self._bounded(ln) for ln in lines[1 if start else 0:]]  # the window's first line may be cut

    def read(self, final: bool = False) -> list[bytes]:
        """The lines written since the last read (at most CHUNK bytes of them), each at most about
        LINE_MAX bytes; with `final` (the worker is gone) a last line without its newline too."""
        size = os.fstat(self.fd).st_size
        if size < self.pos:  # emptied meanwhile (by a previous controller)
            self.pos, self._head, self._end, self._cut = 0, bytearray(), bytearray(), 0
        data = os.pread(self.fd, min(self.CHUNK, size - self.pos), self.pos)
        self.pos += len(data)
        self.behind = size - self.pos
        parts = data.split(b"\n")
        out = []
        for i, part in enumerate(parts):
            self._add(part)
            if i < len(parts) - 1 or (final and not self.behind and self._started()):
                out.append(self._take())
        if self.pos >= LOG_MAX and not self.behind and not self._started():
            os.ftruncate(self.fd, 0)  # what the worker writes in this very instant is lost
            self.pos = 0
        return out

    def close(self, remove: bool = False) -> None:
        os.close(self.fd)
        if remove and self.path:
            try:
                os.unlink(self.path)
            except OSError:
                pass

    def _started(self) -> bool:
        return bool(self._head or self._cut or self._end)

    def _add(self, b: bytes) -> None:
        room = LINE_MAX - LINE_END - len(self._head)
        if room > 0:
            self._head += b[:room]
            b = b[room:]
        if b:
            self._end += b
            if len(self._end) > LINE_END:
                self._cut += len(self._end) - LINE_END
                del self._end[:-LINE_END]

    def _take(self) -> bytes:
        line = bytes(self._head) + (f" ... [{self._cut} bytes cut] ... ".encode() if self._cut else b"") + bytes(self._end)
        self._head, self._end, self._cut = bytearray(), bytearray(), 0
        return line

    def _bounded(self, line: bytes) -> bytes:
        self._add(line)
        return self._take()


def _pass_on(lines: list[bytes]) -> None:
    """Write a worker's lines to our stderr; a failure there (closed, a broken pipe) loses them."""
    out = sys.stderr
    try:
        if getattr(out, "buffer", None) is not None:
            out.buffer.write(b"".join(ln + b"\n" for ln in lines))
        else:
            out.write("".join(ln.decode(errors="replace") + "\n" for ln in lines))
        out.flush()
    except (OSError, ValueError):
        pass


def _report_line(line: str) -> str:
    n = _REPORT_LINE
    return line if len(line) <= n else f"{line[:n * 3 // 4]} ... {line[-n // 4:]}"


@dataclasses.dataclass(slots=True)
class _Rank:
    proc: subprocess.Popen | None = None
    adopted: int = 0  # pid of a worker the previous controller started (not our child), once it attached
    argv: list[str] = dataclasses.field(default_factory=list)  # its command line, recorded in the run file
    started: float = 0.0
    failures: int = 0  # quick failures in a row
    attached: bool = False  # this process attached to its controller: a clean start, whenever it exits
    state: str = "STARTING"  # STARTING | ADOPTING | RUNNING | RESTARTING | FAILED | STOPPED
    error: str = ""  # the last failure: exit status and the tail of its stderr
    tail: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=20))
    log: WorkerLog | None = None  # its stderr
    reader: asyncio.Task | None = None  # follows `log`

    @property
    def pid(self) -> int:
        """The live process holding this rank (0: none)."""
        if self.proc is not None and self.proc.poll() is None:
            return self.proc.pid
        return self.adopted


class Supervisor:
    """Starts `world` worker processes (`command(rank)`) and restarts any that exits; with a
    `run_file`, adopts the workers a previous controller at the same address left running."""

    def __init__(self, role: str, world: int, command: Callable[[int], list[str]], *, delay: float = 0.5,
                 max_delay: float = 30.0, max_failures: int = 5, healthy_after: float = 20.0,
                 poll: float = 0.1, run_file: str | None = None, adopt_s: float = 10.0,
                 env: dict[str, str] | None = None) -> None:
        self.role, self.world, self.command = role, world, command
        # Added to the workers' environment, which holds no other credentials (their worker token:
        # never on a command line).
        self.env = dict(env or {})
        self.delay, self.max_delay, self.max_failures = delay, max_delay, max_failures
        self.healthy_after = healthy_after  # a worker that ran this long (or attached) had a clean start
        self.poll = poll
        self.run_file, self.adopt_s = run_file, adopt_s
        self.ranks = {r: _Rank() for r in range(world)}
        self.starts = 0  # processes started, restarts included
        self.adoptions = 0  # workers of a previous controller taken over
        self.stopping = False
        self._due: dict[int, float] = {}  # rank -> when it starts again (or stops waiting for its adoption)
        self._expect: dict[int, int] = {}  # rank -> pid of the previous controller's worker it waits for

    # -- what the controllers show -------------------------------------------------------
    def state(self, rank: int) -> str:
        return self.ranks[rank].state

    def error(self, rank: int) -> str:
        """Why `rank` is not running ('' when it is, or has not failed yet)."""
        r = self.ranks[rank]
        if r.state == "ADOPTING":
            return f"waiting for pid {self._expect.get(rank)}, left running by the previous controller, to attach again"
        if r.state in ("RUNNING", "STOPPED") or not r.error:
            return ""
        if r.state == "FAILED":
            return f"gave up after {r.failures} failed starts: {r.error}"
        return f"restarting after {r.failures} failed start(s): {r.error}"

    @property
    def pids(self) -> dict[int, int]:
        return {k: r.pid for k, r in self.ranks.items() if r.pid}

    def accepts(self, rank: int, pid: int) -> bool:
        """Whether a worker process `pid` may attach as `rank`: not while another process we run (or
        wait for) holds that rank; an orphan that comes late takes a rank nobody holds."""
        if rank not in self.ranks:
            return False
        holder = self.holder(rank)
        return not holder or holder == pid

    def holder(self, rank: int) -> int:
        """The process that holds `rank` (or that it waits for while adopting); 0 for none."""
        r = self.ranks[rank]
        return self._expect.get(rank, 0) if r.state == "ADOPTING" else r.pid

    def attached(self, rank: int, pid: int) -> None:
        """The controller's word that a worker attached: however soon it dies after that (killed,
        say), it had a clean start and is restarted after the shortest wait. A worker the previous
        controller left is adopted here."""
        r = self.ranks.get(rank)
        if r is None:
            return
        if r.proc is not None and r.proc.pid == pid:
            r.attached = True
        elif r.pid == 0 and r.state in ("ADOPTING", "RESTARTING", "FAILED", "STARTING") and pid_alive(pid):
            expected = self._expect.pop(rank, 0) == pid
            r.adopted, r.proc, r.attached, r.state, r.started = pid, None, True, "RUNNING", time.monotonic()
            r.argv = r.argv if expected else (_cmdline(pid) or [])
            self._due.pop(rank, None)
            self.adoptions += 1
            log.info("adopted %s worker rank %d (pid %d), left running by the previous controller", self.role, rank, pid)
            self._open_log(rank, adopted=True)
            self._follow_log(rank, lambda: pid_alive(pid))
            self._save()

    # -- the run file ------------------------------------------------------------------------
    def _save(self) -> None:
        if not self.run_file or self.stopping:
            return
        workers = {str(k): {"pid": r.pid, "argv": r.argv} for k, r in self.ranks.items() if r.pid}
        try:
            os.makedirs(os.path.dirname(self.run_file), mode=0o700, exist_ok=True)
            tmp = f"{self.run_file}.{os.getpid()}.tmp"
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                json.dump({"controller": os.getpid(), "role": self.role, "workers": workers,
                           "worker_token": self.env.get("RESHARD_TOKEN_WORKER", "")}, f)
            os.replace(tmp, self.run_file)
        except OSError as e:
            log.warning("cannot record the %s workers in %s (%s): a restarted controller will not adopt them",
                        self.role, self.run_file, e)

    def _previous(self) -> dict[int, int]:
        """Workers a previous controller at this address recorded and that still run as recorded."""
        if not self.run_file:
            return {}
        try:
            with open(self.run_file) as f:
                data = json.load(f)
            recorded = {int(k): (int(v["pid"]), list(v.get("argv", []))) for k, v in data.get("workers", {}).items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
            log.warning("ignoring the unreadable run file %s (%s)", self.run_file, e)
            return {}
        if data.get("controller") != os.getpid() and pid_alive(int(data.get("controller") or 0)) \
                and _cmdline(int(data["controller"])) is not None and data.get("role") == self.role:
            log.warning("the %s controller pid %s recorded in %s still runs: not adopting its workers",
                        self.role, data["controller"], self.run_file)
            return {}
        out = {}
        for rank, (pid, argv) in recorded.items():
            if rank in self.ranks and pid_alive(pid) and (not argv or _cmdline(pid) in (None, argv)):
                out[rank] = pid
                self.ranks[rank].argv = argv
        return out

    # -- running -------------------------------------------------------------------------
    async def _spawn(self, rank: int) -> None:
        r = self.ranks[rank]
        r.attached, r.adopted = False, 0
        r.argv = list(self.command(rank))
        self._open_log(rank)
        # subprocess, not asyncio's (uvloop's) subprocess: that one fork()s this gRPC process, and
        # gRPC's fork handlers then run in it (with gRPC's threads busy they skip their work, and
        # once in about 30 starts the child died of SIGSEGV before its exec). Popen without
        # preexec_fn and without uid/gid changes starts the child with vfork (Python 3.10+ on
        # Linux; posix_spawn where close_fds is off), which runs no fork handlers. So no
        # GRPC_ENABLE_FORK_SUPPORT is needed: a controller never forks.
        # Its controller's environment less every role's credentials: a worker gets only what `env`
        # gives it (its worker token).
        r.proc = subprocess.Popen(r.argv, stdin=subprocess.DEVNULL, stderr=r.log.fd, close_fds=True,
                                  env={**worker_environ(os.environ, ""), **self.env, SUPERVISOR_PID: str(os.getpid())})
        r.started, r.state = time.monotonic(), "RUNNING"
        self.starts += 1
        proc = r.proc
        self._follow_log(rank, lambda: proc.poll() is None)
        log.info("started %s worker rank %d (pid %d)", self.role, rank, r.proc.pid)
        self._save()

    def _open_log(self, rank: int, adopted: bool = False) -> None:
        """A fresh WorkerLog for `rank` (its file in the run folder, when there is one); for an
        `adopted` worker, with the last lines it wrote so far as its tail."""
        r = self.ranks[rank]
        if r.reader is not None:
            r.reader.cancel()  # the previous process's, if it has not finished
        if r.log is not None:
            r.log.close()
        r.tail.clear()
        path = f"{os.path.splitext(self.run_file)[0]}.worker{rank}.log" if self.run_file else ""
        try:
            r.log = WorkerLog(path)
        except OSError as e:
            log.warning("cannot open %s (%s): %s worker rank %d logs to a file without a name, which a restarted "
                        "controller cannot read", path, e, self.role, rank)
            r.log = WorkerLog()
        if adopted:
            r.tail.extend(ln.decode(errors="replace").rstrip() for ln in r.log.last_lines())

    def _follow_log(self, rank: int, live: Callable[[], bool]) -> None:
        r = self.ranks[rank]
        r.reader = asyncio.get_running_loop().create_task(self._follow(r.log, r.tail, live))

    async def _follow(self, wlog: WorkerLog, tail: collections.deque, live: Callable[[], bool]) -> None:
        """Pass a worker's log on to our stderr, keeping its last lines, until the worker is gone
        and everything it wrote is read. Only cancelling stops it: a line of any length is cut
        (`WorkerLog`), a failure to pass lines on loses them, and one to read is retried while the
        worker lives."""
        failed = False
        while True:
            try:
                done = not live()
                lines = wlog.read(final=done)
                tail.extend(ln.decode(errors="replace").rstrip() for ln in lines)
                if lines:
                    _pass_on(lines)
                if done and not wlog.behind:
                    return
            except Exception as e:  # noqa: BLE001 - never stop reading while the worker may write
                if not failed:
                    log.warning("cannot read a %s worker's log %s (%s); retrying", self.role, wlog.path or "(unnamed)", e)
                failed = True
                if not live():
                    return
            await asyncio.sleep(0 if wlog.behind else self.poll)

    async def _exited(self, rank: int) -> float:
        """Record a worker's exit; returns the delay before it is started again (<0: give up)."""
        r = self.ranks[rank]
        proc = r.proc
        lived = time.monotonic() - r.started
        if r.reader is not None:
            try:
                await asyncio.wait_for(r.reader, 2.0)  # the last lines it wrote
            except (asyncio.TimeoutError, asyncio.CancelledError):
                pass
        lines = [_report_line(ln) for ln in r.tail if ln.strip()][-5:]
        words = ": " + " | ".join(lines) if lines else ""
        if proc is None:  # an adopted worker: not our child, its exit status is its first parent's
            r.error = f"pid {r.adopted} (adopted) exited after {lived:.1f}s" + words
            r.adopted = 0
        else:
            code = proc.returncode
            how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit status {code}"
            r.error = f"pid {proc.pid} {how} after {lived:.1f}s" + words
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
        previous = self._previous()
        now = time.monotonic()
        for rank in range(self.world):
            if rank in previous:
                r = self.ranks[rank]
                r.state, self._expect[rank], self._due[rank] = "ADOPTING", previous[rank], now + self.adopt_s
                log.info("waiting up to %.0fs for %s worker rank %d (pid %d), left running by the previous controller, "
                         "to attach again", self.adopt_s, self.role, rank, previous[rank])
            else:
                await self._spawn(rank)
        due = self._due
        while not self.stopping:
            await asyncio.sleep(self.poll)
            now = time.monotonic()
            for rank, r in self.ranks.items():
                if self.stopping:
                    break
                if r.state == "RUNNING" and ((r.proc is not None and r.proc.poll() is not None)
                                             or (r.proc is None and not pid_alive(r.adopted))):
                    wait = await self._exited(rank)
                    if wait >= 0:
                        due[rank] = time.monotonic() + wait
                elif r.state == "ADOPTING" and (now >= due.get(rank, 0.0) or not pid_alive(self._expect.get(rank, 0))):
                    pid = self._expect.pop(rank, 0)
                    if pid_alive(pid):  # frozen, or attached elsewhere: it must not come back beside the new one
                        log.warning("%s worker rank %d (pid %d) of the previous controller did not attach within %.0fs; "
                                    "stopping it and starting a new one", self.role, rank, pid, self.adopt_s)
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except (ProcessLookupError, PermissionError):
                            pass
                    await self._spawn(rank)
                elif r.state == "RESTARTING" and now >= due.get(rank, 0.0):
                    await self._spawn(rank)

    async def stop(self, grace: float = 5.0) -> None:
        self.stopping = True
        procs = [r.proc for r in self.ranks.values() if r.proc is not None and r.proc.poll() is None]
        adopted = [r.adopted for r in self.ranks.values() if r.proc is None and r.adopted]
        for p in procs:
            p.terminate()
        for pid in adopted:
            try:
                os.kill(pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            await asyncio.wait_for(asyncio.gather(self._reaped(procs), self._gone(adopted)), grace)
        except asyncio.TimeoutError:
            for p in procs:
                if p.poll() is None:
                    log.warning("%s worker pid %d ignored SIGTERM; killing it", self.role, p.pid)
                    p.kill()
            for pid in adopted:
                if pid_alive(pid):
                    log.warning("%s worker pid %d ignored SIGTERM; killing it", self.role, pid)
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
            await self._reaped(procs)
        readers = [r.reader for r in self.ranks.values() if r.reader is not None and not r.reader.done()]
        if readers:
            await asyncio.wait(readers, timeout=1.0)  # the last lines they wrote
        for r in self.ranks.values():
            if r.state != "FAILED":
                r.state = "STOPPED"
            r.adopted = 0
            if r.reader is not None:
                r.reader.cancel()
            if r.log is not None:
                r.log.close(remove=True)  # a clean stop: their lines went to our stderr
                r.log = None
        if self.run_file:  # a clean stop leaves nothing to adopt
            try:
                os.unlink(self.run_file)
            except OSError:
                pass

    @staticmethod
    async def _reaped(procs: list[subprocess.Popen]) -> None:
        while any(p.poll() is None for p in procs):
            await asyncio.sleep(0.05)

    @staticmethod
    async def _gone(pids: list[int]) -> None:
        while any(pid_alive(p) for p in pids):
            await asyncio.sleep(0.05)
