"""`reshard demo`: the embedded local default.

Starts inference_svc (4 workers, vLLM TP=4 layout) and trainer_svc (2 workers,
Megatron TP=2 layout) on 127.0.0.1 as real processes, runs several updates
(each after a simulated optimizer step), then the serialized baseline on the same
data and transport (a second trainer_svc of the same run, started with
`--transfer-method serialized`, takes over from the first: the public API carries no
such knob), and prints a table (or one JSON object with --json)."""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time

from reshard.common.control.supervisor import stop_processes
from reshard.common.models.presets import model_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "reshard.cli", *args], capture_output=True, text=True, timeout=timeout)


def _status(flag: str, addr: str) -> dict:
    r = _cli("status", flag, addr, "--json", timeout=30)
    if r.returncode != 0:
        raise RuntimeError(r.stderr.strip())
    return json.loads(r.stdout)


def run_demo(a) -> int:
    if getattr(a, "rl", False):
        from reshard.tools.rl_loop import run

        return run(a)
    if getattr(a, "engine", "reshard") == "vllm":
        from reshard.tools.vllm_scene import run

        return run(a)
    cfg = model_config(a.model)
    log = open(os.devnull, "w") if a.json else sys.stderr
    inf_addr, tr_addr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    env = dict(os.environ, RESHARD_LOG_LEVEL=os.environ.get("RESHARD_LOG_LEVEL", "WARNING"))
    print(f"reshard demo: model {a.model} ({cfg.payload_bytes / 1e9:.2f} GB of {cfg.dtype}), "
          f"trainer Megatron TP={a.trainer_workers} -> inference vLLM TP={a.inference_workers}, gloo on 127.0.0.1", file=log, flush=True)
    procs = []

    def trainer(method: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "reshard.cli", "--log-level", "WARNING", "trainer", "--listen", tr_addr,
                                 "--workers", str(a.trainer_workers), "--model", a.model, "--inference", inf_addr, "--run", "demo",
                                 "--update-timeout", "600", "--transfer-method", method], env=env, stderr=log, stdout=log)

    try:
        procs.append(subprocess.Popen([sys.executable, "-m", "reshard.cli", "--log-level", "WARNING", "inference", "--listen", inf_addr,
                                       "--workers", str(a.inference_workers), "--model", a.model], env=env, stderr=log, stdout=log))
        procs.append(trainer("reshard"))
        results = {"model": a.model, "payload_bytes": cfg.payload_bytes, "trainer_workers": a.trainer_workers,
                   "inference_workers": a.inference_workers, "transport": "gloo", "updates": [], "baseline": [],
                   "fixed_cost_updates": [], "fixed_cost_s": None}

        def one(method: str, tensors: str = "") -> dict:
            r = _cli("update", "--trainer", tr_addr, "--wait", "--json", "--timeout", "900",
                     *(("--tensors", tensors) if tensors else ()), timeout=1000)
            if r.returncode != 0 and not r.stdout.strip():
                raise RuntimeError(f"{method} update failed: {r.stderr.strip()}")
            out = json.loads(r.stdout)
            if not out["ok"]:
                raise RuntimeError(f"{method} update failed: {out['error']}")
            st = _status("--trainer", tr_addr)
            rec = next(h for h in reversed(st["history"]) if h["version"]["step"] == str(out["committed"]["step"]) or int(h["version"]["step"]) == out["committed"]["step"])
            if rec.get("method", "reshard") != method:
                raise RuntimeError(f"update {out['committed']} moved by {rec.get('method')!r}, not {method!r}")
            secs = float(rec.get("seconds", 0.0))
            row = {"version": f"{out['committed']['run']}:{out['committed']['step']}", "method": method, "seconds": secs,
                   "transfer_seconds": float(rec.get("transfer_seconds", 0.0)), "bytes": int(rec.get("bytes", 0)),
                   "verify_seconds": float(rec.get("verify_seconds", 0.0)), "verified": bool(rec.get("verified", False)),
                   "requests_during": int(rec.get("requests_during", 0)),
                   "phases": {k: float(v) for k, v in rec.get("phase_seconds", {}).items()}}
            row["gbps"] = row["bytes"] / row["seconds"] / 1e9 if row["seconds"] else 0.0
            print(f"  {method:10s} {row['version']:>18s}  {row['seconds']:7.3f} s  {row['bytes'] / 1e9:6.3f} GB  "
                  f"{row['gbps']:6.2f} GB/s  "
                  f"verify {row['verify_seconds']:.3f} s  verified {'yes' if row['verified'] else 'NO'}", file=log, flush=True)
            return row

        def wait_up() -> None:
            deadline = time.monotonic() + 120
            while True:
                try:
                    st = _status("--inference", inf_addr)
                    if st["serving_state"] == "SERVING" and _status("--trainer", tr_addr)["serving_state"] == "SERVING":
                        return
                except (RuntimeError, ValueError):
                    pass
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise RuntimeError("services did not come up")
                time.sleep(0.5)

        wait_up()
        # The first update of each method opens its session and allocates its buffers once ("cold");
        # the speedup compares the warm updates that follow, as a training run sees them.
        for i in range(a.updates):
            results["updates"].append(dict(one("reshard"), cold=i == 0))
        # The fixed cost of an update, all overhead: updates carrying one tensor of a few kB (the
        # smallest the model has) through the same services, every phase of a full update but no bytes.
        tiny = min(cfg.tensors().values(), key=lambda t: (math.prod(t.shape), t.name)).name
        for _ in range(a.fixed_cost_updates):
            results["fixed_cost_updates"].append(dict(one("reshard", tiny), tensor=tiny))
        if results["fixed_cost_updates"]:
            results["fixed_cost_s"] = statistics.median(r["seconds"] for r in results["fixed_cost_updates"])
        if a.baseline_updates:  # the same run, continued by a trainer_svc that moves updates the serialized way
            procs[1].terminate()
            procs[1].wait(30)
            procs[1] = trainer("serialized")
            wait_up()
        for i in range(a.baseline_updates):
            results["baseline"].append(dict(one("serialized"), cold=i == 0))
        inf = _status("--inference", inf_addr)
        results["requests_served"] = int(inf.get("requests_served", 0))
        results["requests_during_updates"] = int(inf.get("requests_during_updates", 0))
        ups = results["updates"]

        def warm_median(rows: list[dict]) -> float:
            """The median of the warm updates: one slow outlier on a shared machine does not move it."""
            warm = [r["seconds"] for r in rows if not r["cold"]] or [r["seconds"] for r in rows]
            return statistics.median(warm) if warm else 0.0

        median, base = warm_median(ups), warm_median(results["baseline"])
        results["reshard_seconds"] = median
        results["baseline_seconds"] = base
        results["speedup_vs_serialized"] = base / median if median and base else None
        results["verified"] = all(u["verified"] for u in ups + results["baseline"])
        if a.json:
            print(json.dumps(results, indent=2))
        else:
            print_table(results)
        return 0 if results["verified"] else 1
    finally:
        stop_processes(procs)


def print_table(r: dict) -> None:
    print()
    print(f"{'update':<8}{'version':>20}{'seconds':>10}{'GB':>9}{'GB/s':>8}{'verify s':>10}{'verified':>10}{'requests':>10}")
    rows = [("reshard", u) for u in r["updates"]] + [("serial", u) for u in r["baseline"]]
    for kind, u in rows:
        kind = kind + ("*" if u["cold"] else "")
        print(f"{kind:<8}{u['version']:>20}{u['seconds']:>10.3f}{u['bytes'] / 1e9:>9.3f}{u['gbps']:>8.2f}"
              f"{u['verify_seconds']:>10.3f}{'yes' if u['verified'] else 'NO':>10}{u['requests_during']:>10}")
    sp = r["speedup_vs_serialized"]
    print(f"\nreshard {r['reshard_seconds']:.3f} s/update vs serialized {r['baseline_seconds']:.3f} s/update: "
          f"speedup {sp:.2f}x (medians of warm updates; * = cold: session setup and first allocation)" if sp else "\n(no baseline run)")
    if r.get("fixed_cost_s") is not None:
        print(f"fixed cost per update (a partial update of {r['fixed_cost_updates'][0]['tensor']}, "
              f"{r['fixed_cost_updates'][0]['bytes']} bytes; median of {len(r['fixed_cost_updates'])}): "
              f"{r['fixed_cost_s']:.3f} s")
    print(f"inference served {r['requests_served']} requests, {r['requests_during_updates']} of them during updates")
