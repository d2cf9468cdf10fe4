"""`reshard control-scale`: the control plane's cost per update at a real model's scale, on one
machine. Both real controllers (`reshard trainer`, `reshard inference`, external workers) drive
dry workers (`reshard.tools.dry_workers`: the real worker protocol, meta buffers, no data plane)
for DeepSeek-V3's Megatron tp=1,pp=4,dp=32,ep=16 (128 ranks) -> vLLM tp=8,dp=16 (128 ranks) by
default. Each update's time, phase by phase, is then what the control plane costs: negotiation,
planning on every worker, the prepare and verify fan-out, the commit. It is printed beside the
update's control bytes and its largest message, with the controllers' peak memory. On a GPU
fleet, where the bytes cross NVLink or InfiniBand in milliseconds to seconds, this is the part
of an update that does not shrink with faster links.

The dry workers share a few host processes (64 ranks each by default), so their planning
competes for those processes' cores. The figures are an upper bound on what one rank per
process would see."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

DEFAULT_MODEL = "deepseek-v3"
DEFAULT_SRC = "framework=megatron,tp=1,pp=4,dp=32,ep=16"
DEFAULT_DST = "framework=vllm,tp=8,dp=16"


def _status(role: str, address: str) -> dict | None:
    r = subprocess.run([sys.executable, "-m", "reshard.cli", "status", f"--{role}", address, "--json", "--timeout", "10"],
                       capture_output=True, text=True)
    return json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run(model: str = DEFAULT_MODEL, src: str = DEFAULT_SRC, dst: str = DEFAULT_DST, updates: int = 2,
        per_host: int = 64, timeout: float = 600.0, say=lambda msg: None) -> dict:
    """Start it all, run `updates` updates, stop it all; the figures as one dict. Raises
    RuntimeError (with the logs' tails) if an update does not commit in `timeout`."""
    from reshard.common.models.frameworks import world_of

    S, D = world_of(src), world_of(dst)
    logdir = tempfile.mkdtemp(prefix="reshard-control-scale-")
    env = dict(os.environ, RESHARD_LOG_LEVEL=os.environ.get("RESHARD_LOG_LEVEL", "WARNING"))
    cli = [sys.executable, "-m", "reshard.cli"]
    dry = [sys.executable, "-m", "reshard.tools.dry_workers", "--model", model]
    inf, tr = f"127.0.0.1:{_free_port()}", f"127.0.0.1:{_free_port()}"
    inf_w, tr_w = f"unix:{logdir}/inference-workers.sock", f"unix:{logdir}/trainer-workers.sock"

    def spawn(args: list[str], name: str, **kw) -> subprocess.Popen:
        return subprocess.Popen(args, env=env, stderr=open(f"{logdir}/{name}.log", "w"), start_new_session=True, **kw)

    def tails() -> str:
        out = []
        for n in sorted(os.listdir(logdir)):
            if n.endswith(".log"):
                out.append(f"--- {n}\n" + open(os.path.join(logdir, n)).read()[-2000:])
        return "\n".join(out)

    common = ["--model", model, "--external-workers", "--update-timeout", str(int(timeout)), "--worker-timeout", "60"]
    procs = [spawn([*cli, "inference", "--listen", inf, "--workers", str(D), "--worker-listen", inf_w, *common], "inference"),
             spawn([*cli, "trainer", "--listen", tr, "--workers", str(S), "--worker-listen", tr_w, "--inference", inf,
                    "--run", "dry", *common], "trainer")]
    t0 = time.monotonic()
    try:
        for lo in range(0, D, per_host):
            procs.append(spawn([*dry, "--role", "inference", "--controller", inf_w, "--ranks", f"{lo}-{min(D, lo + per_host) - 1}",
                                "--layout", dst], f"inference-{lo}"))
        while True:
            st = _status("inference", inf)
            if st is not None and st.get("serving_state") == "SERVING":
                break
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"{D} inference workers did not attach in {timeout:.0f} s\n{tails()}")
            time.sleep(1.0)
        attach_s = time.monotonic() - t0
        say(f"{D} inference workers attached in {attach_s:.1f} s; starting {S} trainer workers, {updates} updates")
        hosts = [spawn([*dry, "--role", "trainer", "--controller", tr_w, "--ranks", f"{lo}-{min(S, lo + per_host) - 1}",
                        "--layout", src, "--steps", str(updates)], f"trainer-{lo}", stdout=subprocess.PIPE, text=True)
                 for lo in range(0, S, per_host)]
        procs += hosts
        deadline = time.monotonic() + timeout
        for p in hosts:
            while True:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{updates} updates did not commit in {timeout:.0f} s\n{tails()}")
                line = p.stdout.readline()
                if not line:
                    raise RuntimeError(f"a trainer host exited ({p.poll()})\n{tails()}")
                if line.strip() == f"released step {updates}":
                    break
        out = {"model": model, "src": src, "dst": dst, "src_ranks": S, "dst_ranks": D, "workers_per_process": per_host,
               "attach_seconds": attach_s, "updates": [], "controller_peak_rss_bytes": {}}
        hist = {side: [r for r in (_status(side, addr) or {}).get("history", []) if r.get("ok")]
                for side, addr in (("trainer", tr), ("inference", inf))}
        for i in range(min(len(hist["trainer"]), len(hist["inference"]))):
            row = {"step": int(hist["trainer"][i]["version"]["step"])}
            for side, recs in hist.items():
                r = recs[i]
                row[side] = {"seconds": r["seconds"], "phase_seconds": r.get("phase_seconds", {}),
                             "control_bytes": int(r["control_bytes"]), "max_control_message": r["max_control_message"],
                             "max_control_message_bytes": int(r["max_control_message_bytes"])}
            out["updates"].append(row)
        for name, p in (("inference", procs[0]), ("trainer", procs[1])):
            out["controller_peak_rss_bytes"][name] = peak_rss(p.pid)
        return out
    finally:
        _stop(procs)


def print_report(r: dict) -> None:
    print(f"{r['model']}: {r['src']} ({r['src_ranks']} ranks) -> {r['dst']} ({r['dst_ranks']} ranks), dry workers "
          f"({r['workers_per_process']} per process); inference attached in {r['attach_seconds']:.1f} s")
    for u in r["updates"]:
        for side in ("trainer", "inference"):
            x = u[side]
            phases = ", ".join(f"{k} {v:.2f}" for k, v in sorted(x["phase_seconds"].items(), key=lambda kv: -kv[1]))
            print(f"step {u['step']} {side:<9} {x['seconds']:6.2f} s ({phases}); control {x['control_bytes'] / 1e6:.1f} MB, "
                  f"largest {x['max_control_message']} {x['max_control_message_bytes'] / 1e6:.2f} MB")
    rss = ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in r["controller_peak_rss_bytes"].items() if v)
    if rss:
        print(f"controllers' peak memory: {rss}")


def main(a) -> int:
    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        r = run(a.model, a.src, a.dst, a.updates, a.per_process, a.timeout, say)
    except (RuntimeError, ValueError) as e:
        print(f"control-scale: {e}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps(r))
    else:
        print_report(r)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("control-scale", help="the control plane's time and message sizes per update at a real model's "
                                             "scale, with dry workers (no data plane)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model preset (default {DEFAULT_MODEL})")
    p.add_argument("--src", default=DEFAULT_SRC, help=f"trainer layout (default {DEFAULT_SRC})")
    p.add_argument("--dst", default=DEFAULT_DST, help=f"inference layout (default {DEFAULT_DST})")
    p.add_argument("--updates", type=int, default=3, help="updates to run (default 3; the first plans cold)")
    p.add_argument("--per-process", type=int, default=64, help="dry workers per host process (default 64)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the workers to attach and for the updates")
    p.add_argument("--json", action="store_true")
    p.set_defaults(_main=main)
