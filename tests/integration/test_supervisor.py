"""Standalone workers start the same from any working directory, and a worker that cannot
start is given up after a few tries with its error shown, never restarted in a storm."""

import asyncio
import io
import json
import os
import pathlib
import shutil
import signal
import site
import subprocess
import sys
import time

import grpc
import pytest
import tomllib

from reshard.common.control.supervisor import LINE_MAX, LOG_MAX, Supervisor, module_command, pid_alive
from reshard.proto import reshard_pb2 as pb
from reshard.proto import reshard_pb2_grpc as rgrpc

from .cluster import free_port, live_members, stop_processes

pytestmark = pytest.mark.integration  # starts real services in real processes

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def installed(tmp_path):
    """A non-editable install of this checkout (the package tree pyproject's package-dir maps out,
    as a wheel installs it) on a Python without our editable finder, and a `reshard` entry script
    like the one pip writes. Returns (python, env, entry script)."""
    site_dir = tmp_path / "site"
    mapping = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in mapping.items():
        dest = site_dir.joinpath(*package.split("."))
        dest.mkdir(parents=True, exist_ok=True)
        for f in (REPO / folder).rglob("*.py"):  # subpackages too (reshard.common.layout, ...)
            rel = f.relative_to(REPO / folder)
            if rel.parts[0] in {m.split(".")[-1] for m in mapping if m.startswith(package + ".")}:
                continue  # a folder pyproject maps to its own package (none nest today)
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(f, dest / rel)
    deps = [p for p in site.getsitepackages() if "site-packages" in p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site_dir), *deps]))
    entry = tmp_path / "bin" / "reshard"
    entry.parent.mkdir()
    entry.write_text("import sys\nfrom reshard.cli import main\nsys.exit(main())\n")
    python = getattr(sys, "_base_executable", sys.executable)
    r = subprocess.run([python, "-c", "import reshard.common.control.supervisor as m; print(m.__file__)"], env=env, cwd="/",
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith(str(site_dir)), r.stderr + r.stdout
    return python, env, entry


def shadowing_folder(path: pathlib.Path) -> pathlib.Path:
    """What a checkout's root looks like to `python -m reshard...`: a `reshard/` package."""
    (path / "reshard").mkdir(parents=True)
    (path / "reshard" / "__init__.py").write_text("")
    return path


def test_module_command_ignores_the_working_directory(tmp_path, installed):
    python, env, _ = installed
    cwd = shadowing_folder(tmp_path / "checkout")
    r = subprocess.run([python, "-m", "reshard.common.control.supervisor"], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert "No module named 'reshard.common'" in r.stderr  # what plain -m does there
    cmd = module_command("reshard.common.control.supervisor")
    r = subprocess.run([python, *cmd[1:]], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_failing_worker_backs_off_and_is_given_up():
    script = "import sys; print('starting'); print('boom: cannot load the model', file=sys.stderr); sys.exit(3)"
    sup = Supervisor("inference", 2, lambda rank: [sys.executable, "-c", script], delay=0.1, max_failures=3, poll=0.02)

    async def go():
        task = asyncio.get_running_loop().create_task(sup.run())
        t0 = time.monotonic()
        while not all(sup.state(r) == "FAILED" for r in range(2)):
            assert time.monotonic() - t0 < 30, [sup.state(r) for r in range(2)]
            await asyncio.sleep(0.02)
        took = time.monotonic() - t0
        await asyncio.sleep(0.5)  # nothing more is started once given up
        starts = sup.starts
        sup.stopping = True
        await task
        await sup.stop()
        return took, starts

    took, starts = asyncio.run(go())
    assert starts == 6  # 3 tries for each of 2 ranks
    assert took >= 0.1 + 0.2  # the waits between tries double
    err = sup.error(0)
    assert "gave up after 3 failed starts" in err and "exit status 3" in err and "boom: cannot load the model" in err


def test_worker_that_ran_long_enough_starts_with_a_clean_budget():
    sup = Supervisor("trainer", 1, lambda rank: [sys.executable, "-c", "import time; time.sleep(0.3)"],
                     delay=0.01, max_failures=2, healthy_after=0.2, poll=0.02)

    async def go():
        task = asyncio.get_running_loop().create_task(sup.run())
        while sup.starts < 4:
            await asyncio.sleep(0.02)
        state = sup.state(0)
        sup.stopping = True
        await task
        await sup.stop()
        return state

    assert asyncio.run(go()) != "FAILED"  # every exit came after a healthy run: restarted each time


def test_worker_that_attached_is_restarted_however_soon_it_dies():
    """Killed after it attached (kill -9, a fault), a worker had a clean start: never given up."""
    sup = Supervisor("inference", 1, lambda rank: [sys.executable, "-c", "import time; time.sleep(0.3)"],
                     delay=0.01, max_failures=2, poll=0.02)

    async def go():
        task = asyncio.get_running_loop().create_task(sup.run())
        told = set()
        while sup.starts < 4:
            proc = sup.ranks[0].proc
            if proc is not None and proc.pid not in told:
                told.add(proc.pid)
                sup.attached(0, proc.pid)  # what the hub says when its hello arrives
            assert sup.state(0) != "FAILED", sup.error(0)
            await asyncio.sleep(0.01)
        sup.stopping = True
        await task
        await sup.stop()

    asyncio.run(go())


def test_orphaned_worker_waits_to_be_adopted_then_stops():
    """A controller killed with SIGKILL leaves its workers behind with the weights they hold: each
    waits RESHARD_ORPHAN_GRACE_S for a restarted controller to adopt it, then stops by itself."""
    worker = ("import threading; from reshard.common.control.supervisor import watch_controller\n"
              "stop = threading.Event(); watch_controller(stop, lambda: 0, every=0.05); stop.wait(60)")
    controller = (f"import os, subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {worker!r}], "
                  "env={**os.environ, 'RESHARD_SUPERVISOR_PID': str(os.getpid()), 'RESHARD_ORPHAN_GRACE_S': '1.5'}); "
                  "time.sleep(60)")
    ctl = subprocess.Popen([sys.executable, "-c", controller], start_new_session=True)
    try:
        t0 = time.monotonic()
        while len(live_members(ctl.pid)) < 2:
            assert time.monotonic() - t0 < 30, "the worker did not start"
            time.sleep(0.05)
        ctl.kill()
        ctl.wait()
        t0 = time.monotonic()
        while live_members(ctl.pid):
            assert time.monotonic() - t0 < 10, "the worker outlived its grace"
            time.sleep(0.05)
        assert time.monotonic() - t0 >= 1.0, "the orphan stopped before its grace ended"
    finally:
        stop_processes([ctl])
        for pid in live_members(ctl.pid):
            os.kill(pid, signal.SIGKILL)


def _status(addr: str) -> pb.Status | None:
    try:
        with grpc.insecure_channel(addr) as ch:
            return rgrpc.InferenceServiceStub(ch).GetStatus(pb.StatusRequest(), timeout=5)
    except grpc.RpcError:
        return None


@pytest.mark.slow  # quick suite under 300 s on 2 cores (CI runs it with the slow ones)
@pytest.mark.integration
def test_restarted_controller_adopts_the_workers_left_running(tmp_path):
    """Re-run with its command line, a killed controller takes back the workers its predecessor left
    (the same processes, with what they hold) instead of starting new ones; stopped cleanly, it
    stops them and leaves nothing to adopt."""
    inf = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, RESHARD_RUN_DIR=str(tmp_path / "run"))
    log_path = tmp_path / "inference.log"
    cmd = [*module_command("reshard.cli"), "inference", "--listen", inf, "--workers", "2", "--model", "tiny"]

    def start():
        with open(log_path, "a") as log:
            return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)

    def ready(what: str) -> pb.Status:
        t0 = time.monotonic()
        while True:
            st = _status(inf)
            if st is not None and all(w.state == "READY" for w in st.workers) and st.serving_state == "SERVING":
                return st
            assert time.monotonic() - t0 < 60, f"{what}: {st}\n" + log_path.read_text()[-3000:]
            time.sleep(0.1)

    first = start()
    procs = [first]
    try:
        pids = {w.rank: w.pid for w in ready("first start").workers}
        run_file = tmp_path / "run" / f"inference-{inf.replace(':', '_')}.json"
        assert {int(k): v["pid"] for k, v in json.loads(run_file.read_text())["workers"].items()} == pids
        first.kill()
        first.wait()
        assert sorted(live_members(first.pid)) == sorted(pids.values())  # still there, with their weights
        second = start()
        procs.append(second)
        st = ready("after the restart")
        assert {w.rank: w.pid for w in st.workers} == pids, "the restarted controller did not adopt the workers"
        assert st.version.run == "checkpoint"  # what they held (in a deployment with a trainer: its last step)
        assert "adopted inference worker rank 0" in log_path.read_text()
        stop_processes([second])
        t0 = time.monotonic()
        while any(pid_alive(p) for p in pids.values()):
            assert time.monotonic() - t0 < 10, "adopted workers outlived a clean stop"
            time.sleep(0.05)
        assert not run_file.exists()
    finally:
        stop_processes(procs)
        for pid in live_members(first.pid):
            os.kill(pid, signal.SIGKILL)

@pytest.mark.slow  # a non-editable install and two services: about 10 s
@pytest.mark.integration
def test_services_run_from_a_folder_holding_a_reshard_package(tmp_path, installed):
    """A user who installed reshard (not editable) and starts the services from the checkout's root."""
    python, env, entry = installed
    cwd = shadowing_folder(tmp_path / "checkout")
    inf, tr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    log_path = tmp_path / "services.log"
    log = open(log_path, "w")

    def reshard(*args):
        return [python, str(entry), *args]

    procs = [subprocess.Popen(reshard("inference", "--listen", inf, "--workers", "2", "--model", "tiny"), cwd=cwd, env=env,
                              stdout=subprocess.DEVNULL, stderr=log, start_new_session=True),
             subprocess.Popen(reshard("trainer", "--listen", tr, "--workers", "2", "--model", "tiny", "--inference", inf,
                                      "--run", "cwd"), cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)]
    try:
        for addr, stub in ((inf, rgrpc.InferenceServiceStub), (tr, rgrpc.TrainerServiceStub)):
            t0 = time.monotonic()
            while True:
                assert time.monotonic() - t0 < 60, log_path.read_text()[-3000:]
                try:
                    with grpc.insecure_channel(addr) as ch:
                        if stub(ch).GetStatus(pb.StatusRequest(), timeout=5).serving_state == "SERVING":
                            break
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        r = subprocess.run(reshard("update", "--trainer", tr, "--wait", "--json", "--timeout", "90"), cwd=cwd, env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr + log_path.read_text()[-3000:]
        assert json.loads(r.stdout)["committed"]["run"] == "cwd"
        assert "No module named" not in log_path.read_text()
    finally:
        stop_processes(procs)


def _wait_given_up(sup: Supervisor, within: float) -> None:
    async def go():
        task = asyncio.get_running_loop().create_task(sup.run())
        t0 = time.monotonic()
        try:
            while sup.state(0) != "FAILED":
                assert time.monotonic() - t0 < within, f"the worker did not exit within {within}s: {sup.state(0)}"
                await asyncio.sleep(0.05)
        finally:
            sup.stopping = True
            await task
            await sup.stop()

    asyncio.run(go())


def test_a_long_log_line_never_wedges_a_worker(capfd):
    """A worker that logs a 1 MiB line (a 100 KB `--tensors` pattern, a 1 MiB update id) used to
    kill the supervisor's reader of its stderr (asyncio's 64 KiB line limit): the worker then
    blocked writing and never answered again. Now it goes on and exits normally; what is passed on
    and kept is each line cut to LINE_MAX, its head and its end, and its last words are in its
    exit report."""
    script = ("import sys; w = sys.stderr.write; w('x' * (1 << 20) + '\\n'); "
              "[w(f'line {i}\\n') for i in range(2000)]; w('BEGIN' + 'y' * (1 << 20) + 'END\\n'); sys.exit(7)")
    sup = Supervisor("trainer", 1, lambda rank: [sys.executable, "-c", script], max_failures=1, poll=0.02)
    _wait_given_up(sup, 20)
    err = sup.error(0)
    assert "exit status 7" in err and "line 1999" in err, err
    last = sup.ranks[0].tail[-1]
    assert last.startswith("BEGINyyy") and last.endswith("yyyEND") and "bytes cut" in last, last[:200]
    assert len(last.encode()) < LINE_MAX + 100
    passed_on = capfd.readouterr().err.splitlines()
    assert "line 1999" in passed_on and any(ln.startswith("BEGINyyy") and ln.endswith("yyyEND") for ln in passed_on)
    assert max(len(ln.encode()) for ln in passed_on) < LINE_MAX + 100


def test_a_worker_log_that_cannot_be_passed_on_is_still_read(monkeypatch):
    """The reader survives any failure to pass a line on (our own stderr closed, a broken pipe):
    it keeps reading until the worker is done, so the worker never blocks on its log and its
    last words are kept."""

    class Broken(io.RawIOBase):
        def writable(self):
            return True

        def write(self, b):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(io.BufferedWriter(Broken())))
    script = "import sys; [print(f'line {i}', file=sys.stderr) for i in range(20000)]; sys.exit(5)"
    sup = Supervisor("trainer", 1, lambda rank: [sys.executable, "-c", script], max_failures=1, poll=0.02)
    _wait_given_up(sup, 20)
    assert "exit status 5" in sup.error(0) and "line 19999" in sup.error(0), sup.error(0)


def _ready(addr: str, log_path: pathlib.Path, what: str, within: float = 60) -> pb.Status:
    t0 = time.monotonic()
    while True:
        st = _status(addr)
        if st is not None and st.workers and all(w.state == "READY" for w in st.workers) and st.serving_state == "SERVING":
            return st
        assert time.monotonic() - t0 < within, f"{what}: {st}\n" + log_path.read_text()[-3000:]
        time.sleep(0.1)


def _wait_for(log_path: pathlib.Path, text: str, within: float = 15) -> str:
    t0 = time.monotonic()
    while text not in log_path.read_text():
        assert time.monotonic() - t0 < within, f"{text!r} not in the log:\n" + log_path.read_text()[-3000:]
        time.sleep(0.1)
    return log_path.read_text()


@pytest.mark.slow  # the quick suite stays under 5 minutes on 2 cores; CI runs it with the slow tests
@pytest.mark.integration
def test_adopted_workers_keep_their_log_and_last_words(tmp_path):
    """A restarted controller adopts the workers its predecessor left, whose stderr was a pipe to
    the dead controller: what they wrote afterwards was lost, and a later death was reported without
    their last words. Workers now write their stderr to a file in the run folder, which the new
    controller follows: their lines reach its log, and a death carries its last lines."""
    inf = f"127.0.0.1:{free_port()}"
    run_dir = tmp_path / "run"
    env = dict(os.environ, RESHARD_RUN_DIR=str(run_dir))
    cmd = [*module_command("reshard.cli"), "inference", "--listen", inf, "--workers", "2", "--model", "tiny"]
    logs = [tmp_path / "first.log", tmp_path / "second.log"]

    def start(log_path):
        with open(log_path, "w") as log:
            return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)

    first = start(logs[0])
    procs = [first]
    try:
        pids = {w.rank: w.pid for w in _ready(inf, logs[0], "first start").workers}
        first.kill()
        first.wait()
        second = start(logs[1])
        procs.append(second)
        st = _ready(inf, logs[1], "after the restart")
        assert {w.rank: w.pid for w in st.workers} == pids, "the restarted controller did not adopt the workers"
        # the worker's own word that it was adopted (it logs it once it sees its new controller)
        _wait_for(logs[1], f"inference-worker[0] WARNING adopted by controller pid {second.pid}")
        os.kill(pids[0], signal.SIGKILL)
        text = _wait_for(logs[1], f"pid {pids[0]} (adopted) exited")
        report = next(ln for ln in text.splitlines() if f"pid {pids[0]} (adopted) exited" in ln)
        assert "inference-worker[0]" in report, report  # its last words
        st = _ready(inf, logs[1], "after the adopted worker's death")
        assert st.workers[0].pid != pids[0]
        stop_processes([second])
        assert not list(run_dir.glob("*.log")), "a clean stop leaves no worker log behind"
    finally:
        stop_processes(procs)
        for pid in live_members(first.pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow  # the quick suite's time: 4-6 s
@pytest.mark.integration
def test_controller_starts_workers_without_forking(tmp_path):
    """A worker died of SIGSEGV once in about 30 restarts, 0.1 s after it was forked from the
    gRPC-serving controller. asyncio's (uvloop's) subprocess forks, and a fork() runs gRPC's fork
    handlers, which skip their work while gRPC threads run ("skipping fork() handlers", logged at
    INFO). Workers are now started by vfork/posix_spawn (subprocess.Popen), which runs no fork
    handlers: gRPC never sees a fork, at the first start or at a restart."""
    inf = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, RESHARD_RUN_DIR=str(tmp_path / "run"), GRPC_VERBOSITY="info")
    log_path = tmp_path / "inference.log"
    cmd = [*module_command("reshard.cli"), "inference", "--listen", inf, "--workers", "2", "--model", "tiny"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    try:
        pids = {w.rank: w.pid for w in _ready(inf, log_path, "first start").workers}
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        while _ready(inf, log_path, "after a worker's death").workers[1].pid == pids[1]:
            assert time.monotonic() - t0 < 30, log_path.read_text()[-3000:]
            time.sleep(0.1)
    finally:
        stop_processes([proc])
    text = log_path.read_text()
    assert "started inference worker rank 1" in text and "restarting it in" in text
    assert "fork_posix" not in text and "fork()" not in text, [ln for ln in text.splitlines() if "fork" in ln]


def test_a_worker_log_file_stays_bounded(tmp_path):
    """A worker's log file in the run folder (often in memory) is emptied once read past LOG_MAX;
    reading goes on from its new start, and the worker's later lines still arrive."""
    script = ("import sys, time; [print(f'line {i} ' + 'z' * 200, file=sys.stderr) for i in range(40000)]; "
              "print('after the flood', file=sys.stderr, flush=True); time.sleep(60)")
    sup = Supervisor("trainer", 1, lambda rank: [sys.executable, "-c", script], poll=0.02,
                     run_file=str(tmp_path / "trainer-x.json"))
    log_file = tmp_path / "trainer-x.worker0.log"

    async def go():
        task = asyncio.get_running_loop().create_task(sup.run())
        t0 = time.monotonic()
        try:
            while "after the flood" not in list(sup.ranks[0].tail):
                assert time.monotonic() - t0 < 20, list(sup.ranks[0].tail)[-3:]
                await asyncio.sleep(0.05)
            return log_file.stat().st_size
        finally:
            sup.stopping = True
            await task
            await sup.stop()

    size = asyncio.run(go())
    assert 40000 * 210 > 2 * LOG_MAX and size < LOG_MAX, size
    assert not log_file.exists()  # a clean stop removes it
