"""The control plane at DeepSeek-V3 scale: Megatron tp=1,pp=4,dp=32,ep=16 (128 ranks) -> vLLM
tp=8,dp=16 (128 ranks), through both real controllers, with 256 workers that speak the real
worker protocol but skip the data plane (tests/integration/dry_workers.py). Two updates commit;
no control message is over 16 MiB; the controllers' memory stays bounded."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import pytest

from tests.integration.cluster import Cluster, free_port, stop_processes

pytestmark = pytest.mark.integration  # starts real services in real processes

MODEL = "deepseek-v3"
SRC = "framework=megatron,tp=1,pp=4,dp=32,ep=16"
DST = "framework=vllm,tp=8,dp=16"
LIMIT = 16 << 20
# 64 workers share each host process (and its GIL) with their planning: a heartbeat may be late.


def peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.mark.slow  # about 100 s
@pytest.mark.timeout(900)
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads peak memory from /proc")
def test_deepseek_v3_128_to_128_two_updates_under_16_mib_per_message():
    inf, tr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    logdir = tempfile.mkdtemp(prefix="reshard-scale-")
    env = dict(os.environ, RESHARD_LOG_LEVEL="WARNING")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def spawn(args: list[str], name: str, **kw) -> subprocess.Popen:
        return subprocess.Popen(args, env=env, stderr=open(f"{logdir}/{name}.log", "w"), start_new_session=True, **kw)

    cli = [sys.executable, "-m", "reshard.cli"]
    inf_w, tr_w = f"unix:{logdir}/inference-workers.sock", f"unix:{logdir}/trainer-workers.sock"
    procs = [spawn([*cli, "inference", "--listen", inf, "--workers", "128", "--model", MODEL, "--external-workers",
                    "--worker-listen", inf_w,
                    "--update-timeout", "600", "--worker-timeout", "60"], "inference"),
             spawn([*cli, "trainer", "--listen", tr, "--workers", "128", "--model", MODEL, "--external-workers",
                    "--worker-listen", tr_w,
                    "--inference", inf, "--run", "dry", "--update-timeout", "600", "--worker-timeout", "60"], "trainer")]
    dry = [sys.executable, "-m", "tests.integration.dry_workers", "--model", MODEL]
    hosts = []
    t_start = time.monotonic()
    try:
        for lo in (0, 64):
            procs.append(spawn([*dry, "--role", "inference", "--controller", inf_w, "--ranks", f"{lo}-{lo + 63}", "--layout", DST],
                               f"inference-{lo}", cwd=root))
        c = Cluster.__new__(Cluster)
        c.inf, c.tr, c.logdir = inf, tr, logdir
        c.wait_for(lambda st: st["serving_state"] == "SERVING", timeout=300, what="128 inference workers attached")
        for lo in (0, 64):
            p = spawn([*dry, "--role", "trainer", "--controller", tr_w, "--ranks", f"{lo}-{lo + 63}", "--layout", SRC, "--steps", "2"],
                      f"trainer-{lo}", cwd=root, stdout=subprocess.PIPE, text=True)
            procs.append(p)
            hosts.append(p)
        t_attach = time.monotonic()
        print(f"inference attached in {t_attach - t_start:.1f} s")
        deadline = time.monotonic() + 600
        for p in hosts:
            lines = []
            while "released step 2" not in lines:
                assert time.monotonic() < deadline, "two updates did not commit in time"
                line = p.stdout.readline()
                assert line, f"trainer host exited {p.poll()}:\n" + "".join(open(f"{logdir}/{n}.log").read()[-3000:]
                                                                             for n in ("trainer", "inference", "trainer-0"))
                lines.append(line.strip())
        print(f"two updates in {time.monotonic() - t_attach:.1f} s (trainer workers starting included)")
        for side in ("trainer", "inference"):
            hist = c.status(side)["history"]
            recs = [r for r in hist if r["ok"]]
            assert [int(r["version"]["step"]) for r in recs] == [1, 2], [r.get("error") for r in hist]
            for r in recs:
                big = int(r["max_control_message_bytes"])
                assert 0 < big < LIMIT, (side, r["max_control_message"], big)
                print(f"{side} step {r['version']['step']}: control {int(r['control_bytes']) / 1e6:.1f} MB, largest "
                      f"{r['max_control_message']} {big / 1e6:.2f} MB, {r['seconds']:.1f} s {r.get('phase_seconds', {})}")
        # The second update sends no layout (fingerprints alone): far less than the first.
        steady = [int(r["control_bytes"]) for r in c.status("inference")["history"] if r["ok"]]
        assert steady[1] < steady[0] / 4, steady
        for name, p in (("inference", procs[0]), ("trainer", procs[1])):
            peak = peak_rss(p.pid)
            print(f"{name} controller peak RSS {peak / 2**30:.2f} GiB")
            assert peak < 3 << 30, f"{name} controller peaked at {peak / 2**30:.2f} GiB"
    finally:
        stop_processes(procs)
