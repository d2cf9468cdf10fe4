"""`reshard bench`: reshard, the serialized baseline, per-tensor broadcast from the owners and
the raw ceiling, side by side, on the same layouts, bytes and transport, in one run.

One process per rank (trainer ranks, then inference ranks), spawned once, all on one
TCPStore; each layout pair gets a fresh gloo session among the ranks it uses. Before the
layouts, a separate micro-measurement with synthetic buffers (ping-pong, streams at each layout
pair's concurrency, rounds of tiny messages, windows of tiny broadcasts, copies, checksums)
calibrates the simulator's local profile; its start, rounds, windows and streams run again
in each of a layout's repeats, and that layout is predicted from them: nothing is fitted to
the bench's own results. Each method runs once first (poisoned receive buffers, then a
bit-exact check against an independent regeneration of the weights: reported apart as the
first update), then `--repeats` more times, or more for short runs (`--min-seconds`,
`--max-repeats`); methods rotate each repeat so drift favours none.
"""

from __future__ import annotations

import json
import math
import os
import platform
import queue as queue_mod
import resource
import secrets
import statistics
import sys
import time
import traceback

DEFAULT_SIZES = "small,medium,llama-1g"
DEFAULT_SRC = "framework=megatron,tp=2"
DEFAULT_DST = "framework=vllm,tp={n}"
TIMEOUT_S = 900.0


def _configs(a) -> list[dict]:
    from reshard.common.models.frameworks import model_spec, world_of

    out = []
    for model in [s.strip() for s in a.sizes.split(",") if s.strip()]:
        model_spec(model)  # a clear error for an unknown name
        for n in [int(x) for x in str(a.dst_ranks).split(",") if x.strip()]:
            dst = a.dst.format(n=n)
            out.append({"model": model, "src": a.src, "dst": dst, "S": world_of(a.src), "D": world_of(dst)})
    return out


# -- the rank processes ------------------------------------------------------------------

def _control_group(host: str, port: int, prefix: str, rank: int, world: int):
    import datetime

    from torch.distributed import PrefixStore, TCPStore
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    store = TCPStore(host, port, world_size=None, is_master=False, timeout=timeout, wait_for_workers=False)
    return ProcessGroupGloo(PrefixStore(prefix, store), rank, world, timeout)


def _calibrate(g: int, world: int, host: str, port: int, nonce: str, shapes: list[tuple[int, int]], quick: bool,
               q) -> None:
    """The separate micro-measurement: this machine's transport, copies and checksums, with
    synthetic buffers and no layout. Rank 0 reports the single-process figures; every rank
    reports the (start, end) of its timed spans, which the parent turns into rates: a span runs
    from the first rank leaving a barrier to the last rank finishing, as the bench times a run."""
    import torch

    from reshard.common.dataplane.transport import GlooTransport
    from reshard.tools import bench_methods as bm

    t = GlooTransport(host, port, f"{nonce}-calib", g, world, TIMEOUT_S)
    ctl = _control_group(host, port, f"bench/{nonce}/calib-ctl", g, world)
    deadline = time.monotonic() + TIMEOUT_S
    big, count, passes = (16 << 20, 2, 1) if quick else (64 << 20, 4, 5)
    # Allocated and touched once, as the update's buffers are, and reused by every stream.
    bufs = [torch.ones(big, dtype=torch.uint8) for _ in range(2)]
    out: dict = {"ranks": world}
    if g < 2:
        rtt = {}
        for size, iters in ((8, 50 if quick else 200), (64 << 10, 20), (1 << 20, 10), (big, 3)):
            rtt[size] = bm.ping_pong(t, g, 1 - g, size, iters, deadline)
        out.update(latency_s=rtt[8] / 2, rtt_seconds={str(k): v for k, v in rtt.items()})

    def timed(key, rep: int, active: bool, fn) -> None:
        ctl.barrier().wait()
        t0 = time.monotonic()
        if active:
            fn()
            q.put(("calib_span", key, rep, g, t0, time.monotonic()))
        ctl.barrier().wait()

    # Streams in pairs (0->1, 2->3, ...), k pairs at once: one pair is a link's rate, and k pairs
    # fill the processes a layout pair runs (the shared cores' aggregate at that concurrency).
    # Passes alternate between the concurrencies and the shapes, so drift on this machine (other
    # work on its cores) favours none of them; the first pass warms connections and is not used.
    ks = sorted({1} | {min(world, s + d) // 2 for s, d in shapes})
    for rep in range(1 + passes):
        for k in ks:
            timed(("stream", k), rep, g < 2 * k, lambda: bm.stream(t, g, g ^ 1, g % 2 == 0, bufs, count, deadline))
    # Per layout shape (S trainer ranks, D inference ranks, as the bench places them): one update's
    # synchronisation steps without the bytes.
    for rep in range(3 if quick else 21):
        for s, d in shapes:
            timed(("start", s, d), rep, g < s + d, _sync_probes(t, g, s, d, _STEPS, deadline, bufs[0])["start"])
    for rep in range(1 + (passes and 5)):
        for s, d in shapes:
            probe = _sync_probes(t, g, s, d, _STEPS, deadline, bufs[0])
            timed(("rounds", s, d), rep, g < s + d, probe["rounds"])
            timed(("windows", s, d), rep, g < s + d, probe["windows"])
    if g == 0:
        out["copy_gbps"] = bm.copy_gbps(big, 3 if quick else 5)
        out["copy_op_s"] = bm.copy_op_seconds()
        out["checksum_gbps"] = bm.checksum_gbps()
        out["checksum_op_s"] = bm.checksum_op_seconds()
        out["checksum_throughput"] = bm.checksum_throughput(iters=3 if quick else 5)
        out["stream_bytes"] = big * count
        q.put(("calib", out))
    # The copy and checksum rates again with every core busy: one process per core, started
    # together. On shared cores a layout's processes copy and checksum at once, and each then
    # gets less than a process alone (memory bandwidth is shared too).
    for kind, fn in (("copy_gbps", lambda: bm.copy_gbps(big, 3 if quick else 5)), ("checksum_gbps", bm.checksum_gbps)):
        ctl.barrier().wait()
        if g < min(world, len(os.sched_getaffinity(0))):
            q.put(("calib_rate", kind, g, fn()))
    ctl.barrier().wait()
    t.close()


_STEPS = 50  # synchronisation steps per timed span of the calibration
_PROBE_STEPS = 10  # synchronisation steps per timed span of a probe in a repeat
# An update's start is timed as one round that moves this much between every sender and receiver,
# just after the ranks leave a barrier, as the bench times an update; whatever the model's rates and
# steps do not account for in it is the start cost (on two shared cores, mostly waiting for the
# processes to be scheduled together: a few ms once they move more than tiny messages).
_BURST_BYTES = 1 << 20
_PROBE_STREAM_BYTES = 32 << 20
_PROBE_STREAM_COUNT = 4


def _sync_probes(t, g: int, S: int, D: int, steps: int, deadline: float, buf) -> dict:
    """The synchronisation measurements of a layout shape (S trainer, D inference ranks), as
    callables for rank g: an update's start (one round of `_BURST_BYTES` per pair, from `buf`,
    allocated and touched by the caller), `steps` rounds of tiny messages, `steps` broadcast
    windows of tiny boxes."""
    from reshard.tools import bench_methods as bm

    src, dst = range(S), range(S, S + D)
    return {"start": lambda: bm.round_trip_rounds(t, g, src, dst, 1, deadline, _BURST_BYTES, buf),
            "rounds": lambda: bm.round_trip_rounds(t, g, src, dst, steps, deadline),
            "windows": lambda: bm.broadcast_windows(t, g, src, dst, steps, deadline)}


def _agree_repeats(ctl, firsts: list[float], opts: dict) -> int:
    """Timed repeats for one layout pair, the same on every rank: at least `repeats`, and more
    while the fastest method's first run (its slowest rank) is short, so that every method gets
    about `min_seconds` of timed runs (at most `max_repeats`). Short runs are the noisiest here:
    a few ms of scheduling on shared cores is their whole spread."""
    import torch
    import torch.distributed as dist

    x = torch.tensor(firsts, dtype=torch.float64)
    o = dist.AllreduceOptions()
    o.reduceOp = dist.ReduceOp.MAX
    ctl.allreduce([x], o).wait()
    fastest = max(float(x.min()), 1e-6)
    want = math.ceil(opts["min_seconds"] / fastest) if opts["min_seconds"] > 0 else 0
    return max(opts["repeats"], min(opts["max_repeats"], want))


def _probe(t, ctl, g: int, S: int, D: int, key: tuple, rep: int, bufs, q) -> None:
    """The calibration's measurements again, in a slot of a layout pair's repeats, with synthetic
    buffers on the same ranks: one update's start, rounds and broadcast windows without bytes,
    and streams for one pair and for the layout's concurrency. The layout's prediction uses
    these, so that whatever else loads the machine while the layout runs loads its calibration
    too. Nothing of the layout's own runs goes into them."""
    from reshard.tools import bench_methods as bm

    deadline = time.monotonic() + TIMEOUT_S
    pairs = max(1, (S + D) // 2)
    probes = [(kind, True, fn) for kind, fn in _sync_probes(t, g, S, D, _PROBE_STEPS, deadline, bufs[0]).items()]
    for k in sorted({1, pairs}):
        probes.append((("stream", k), g < 2 * k,
                       lambda: bm.stream(t, g, g ^ 1, g % 2 == 0, bufs, _PROBE_STREAM_COUNT, deadline)))
    for kind, active, fn in probes:
        ctl.barrier().wait()
        t0 = time.monotonic()
        if active:
            fn()
            q.put(("calib_span", (*key, kind), rep, g, t0, time.monotonic()))
    ctl.barrier().wait()


def calibration(raw: dict, spans: list[tuple], shapes: list[tuple[int, int]],
                layouts: dict[int, tuple[int, int]] | None = None,
                busy_rates: dict[str, list[float]] | None = None) -> dict:
    """The calibration from rank 0's figures and the ranks' timed spans: medians over the passes.
    `layouts`: layout pair index -> (S, D), for the probes taken in its repeats.
    `busy_rates`: copy and checksum rates measured with every core busy, one per process; their
    median replaces rank 0's rate alone, which is kept under `alone`."""
    from reshard.tools.simulate import Phase, phase_time

    layouts = layouts or {}
    by: dict[tuple, dict[int, list[float]]] = {}
    for key, rep, _g, t0, t1 in spans:
        by.setdefault(tuple(key), {}).setdefault(rep, []).extend((t0, t1))

    def spans_of(key, skip_first: bool = True) -> list[float]:
        reps = by.get(key, {})
        return [max(v) - min(v) for rep, v in sorted(reps.items()) if not (skip_first and rep == 0)]

    def span(key, skip_first: bool = True) -> float:
        vals = spans_of(key, skip_first)
        return statistics.median(vals) if vals else float("nan")

    cal = dict(raw)
    for kind, rates in (busy_rates or {}).items():
        if rates:
            cal.setdefault("alone", {})[kind] = raw[kind]
            cal[kind] = statistics.median(rates)
    per_stream = raw["stream_bytes"]
    streams = {key[1]: key[1] * per_stream / span(key) / 1e9 for key in by if key[0] == "stream"}
    cal["pair_gbps"] = streams[1]
    cal["streams_gbps"] = {str(k): v for k, v in sorted(streams.items())}

    def start_cost(shape: dict, s: int, d: int, start_span: float) -> float:
        # The start round, less what the model already gives it: its bytes and one round.
        burst = Phase("start", {(a, s + b): [float(_BURST_BYTES), 1.0] for a in range(s) for b in range(d)})
        c = _cluster(cal, dict(shape, start_s=0.0), shape.get("pair_gbps", cal["pair_gbps"]))
        return max(0.0, start_span - phase_time(c, s, d, burst).seconds - shape["round_s"])

    cal["shapes"] = {}
    for s, d in shapes:
        k = max(1, min(raw["ranks"], s + d) // 2)
        shape = {"aggregate_gbps": streams[k], "aggregate_streams": k, "round_s": span(("rounds", s, d)) / _STEPS,
                 "collective_s": span(("windows", s, d)) / _STEPS}
        shape["start_s"] = start_cost(shape, s, d, span(("start", s, d), skip_first=False))
        shape["samples_s"] = {kind: [round(x, 6) for x in spans_of((kind, s, d), kind != "start")]
                              for kind in ("rounds", "windows", "start")}
        cal["shapes"][f"{s}->{d}"] = shape
    cal["aggregate_gbps"] = streams[max(streams)]
    cal["layouts"] = {}
    for ci, (s, d) in layouts.items():
        rate = {key[2][1]: key[2][1] * _PROBE_STREAM_BYTES * _PROBE_STREAM_COUNT / span(key, False) / 1e9
                for key in by if key[:2] == ("probe", ci) and isinstance(key[2], tuple)}
        if not rate:
            continue  # no repeats, no probes: the calibration before the layouts stands
        shape = {"pair_gbps": rate[1], "aggregate_gbps": rate[max(rate)], "aggregate_streams": max(rate),
                 "round_s": span(("probe", ci, "rounds"), False) / _PROBE_STEPS,
                 "collective_s": span(("probe", ci, "windows"), False) / _PROBE_STEPS,
                 "passes": len(spans_of(("probe", ci, "start"), False))}
        shape["start_s"] = start_cost(shape, s, d, span(("probe", ci, "start"), False))
        cal["layouts"][str(ci)] = shape
    return cal


def rank_main(g: int, world: int, host: str, port: int, nonce: str, configs: list[dict], opts: dict, q) -> None:
    """One rank of the bench: calibration, then every layout pair it takes part in."""
    try:
        import torch

        # One intra-op thread per rank, as the standalone workers run: with several ranks per core,
        # torch's thread pool turns every copy into contention (50x slower packing here).
        torch.set_num_threads(1)
        from reshard.common.dataplane.transport import GlooTransport
        from reshard.common.models.frameworks import build
        from reshard.common.plan.planner import PlanOptions, make_plan
        from reshard.tools import bench_methods as bm

        _calibrate(g, world, host, port, nonce, opts["shapes"], opts["quick"], q)
        # Touched once and reused by the stream probes in a layout's repeats.
        probe_bufs = [torch.ones(_PROBE_STREAM_BYTES, dtype=torch.uint8) for _ in range(2)]
        weights: tuple[tuple, dict] | None = None  # a trainer rank's filled buffers, reused while (model, src) holds
        for ci, cfg in enumerate(configs):
            S, D = cfg["S"], cfg["D"]
            if g >= S + D:
                continue
            t_setup = time.monotonic()
            src, dst = build(cfg["model"], cfg["src"]), build(cfg["model"], cfg["dst"])
            plan = make_plan(src, dst, PlanOptions())
            side, index = ("src", g) if g < S else ("dst", g - S)
            t = GlooTransport(host, port, f"{nonce}-c{ci}", g, S + D, TIMEOUT_S)
            ctl = _control_group(host, port, f"bench/{nonce}/c{ci}/ctl", g, S + D)
            bucket = _bucket(opts["bucket_bytes"], sum(x.nbytes for x in dst.tensors.values()))
            key = (cfg["model"], cfg["src"], g)
            filled = weights[1] if (side == "src" and weights and weights[0] == key) else None
            weights = None
            rb = bm.RankBench(t, side, index, src, dst, plan, seed=opts["seed"], bucket_bytes=bucket, filled=filled,
                              fp8=opts["fp8"])
            if side == "src":
                weights = (key, rb.buffers)
            ctl.barrier().wait()
            if g == 0:
                q.put(("ready", ci, time.monotonic() - t_setup))
            methods = [*bm.METHODS, bm.FP8_METHOD] if opts["fp8"] else list(bm.METHODS)
            firsts: dict[str, float] = {}
            repeats, rep = opts["repeats"], 0
            while rep <= repeats:
                # After the first runs the probes take a slot of the rotation: like the methods, they
                # follow each method in turn, so they see the same mix of what ran just before.
                slots = methods if rep == 0 else [*methods, "probe"]
                k = rep % len(slots)
                for meth in slots[k:] + slots[:k]:
                    if meth == "probe":
                        _probe(t, ctl, g, S, D, ("probe", ci), rep, probe_bufs, q)
                        continue
                    first = rep == 0
                    if first:
                        rb.poison()
                    ctl.barrier().wait()
                    t0 = time.monotonic()
                    out = rb.run(meth, t0 + TIMEOUT_S)
                    t1 = time.monotonic()
                    exact = None
                    if first:
                        firsts[meth] = t1 - t0
                        exact = rb.ceiling_exact() if meth == "ceiling" else rb.received_exact(meth)
                    q.put(("run", {"cfg": ci, "method": meth, "rep": rep, "rank": g, "side": side, "t0": t0, "t1": t1,
                                   "bytes": out.bytes, "extra_bytes": out.extra_bytes, "checksums_ok": out.ok,
                                   "exact": exact}))
                if rep == 0:
                    repeats = _agree_repeats(ctl, [firsts[m] for m in methods], opts)
                    if g == 0:
                        q.put(("repeats", ci, repeats))
                rep += 1
            ctl.barrier().wait()
            t.close()
            del rb
        q.put(("done", g))
    except BaseException:  # noqa: BLE001 - the parent reports it and stops the others
        q.put(("error", g, traceback.format_exc()))


# -- the parent -----------------------------------------------------------------------------

def _local_cluster(cal: dict, S: int, D: int, ci: int | None = None):
    """The simulator's local profile for a layout pair of S + D ranks, from the calibration alone:
    the probes taken in that layout's repeats (`ci`) where there are some, else the
    calibration before the layouts."""
    shape = cal["shapes"][f"{S}->{D}"]
    pair = cal["pair_gbps"]
    probes = cal.get("layouts", {}).get(str(ci))
    if probes:
        shape, pair = probes, probes["pair_gbps"]
    return _cluster(cal, shape, pair)


def _cluster(cal: dict, shape: dict, pair: float):
    """The local profile: this machine's rates and steps (`shape`: one layout shape's), one pair at `pair` GB/s."""
    from reshard.tools.simulate import Cluster

    return Cluster(name="local", gpus_per_node=max(1, cal["ranks"]), nvlink_gbps=pair,
                   nic_gbps=pair, latency_s=cal["latency_s"], copy_gbps=cal["copy_gbps"],
                   copy_op_s=cal["copy_op_s"], node_cpu_gbps=shape["aggregate_gbps"], cores=len(os.sched_getaffinity(0)),
                   checksum_gbps=cal["checksum_gbps"], checksum_op_s=cal["checksum_op_s"], round_s=shape["round_s"],
                   collective_s=shape["collective_s"], start_s=shape["start_s"], broadcast="tree", colocated=True)


def predictions(cfg: dict, cal: dict, bucket_bytes: int, ci: int | None = None) -> dict[str, float]:
    """The local profile's predictions for one layout pair, per method (seconds)."""
    from collections import defaultdict

    from reshard.common.models.frameworks import build
    from reshard.common.plan.planner import PlanOptions, make_plan
    from reshard.tools.bench_methods import owner_broadcast_windows
    from reshard.tools.simulate import owner_broadcast_traffic, plan_traffic, predict, serialized_traffic

    src, dst = build(cfg["model"], cfg["src"]), build(cfg["model"], cfg["dst"])
    S, D = src.world, dst.world
    c = _local_cluster(cal, S, D, ci)
    plan = make_plan(src, dst, PlanOptions())
    keep: dict[int, float] = defaultdict(float)
    pieces: dict[int, float] = defaultdict(float)
    for d, bufs in enumerate(dst.ranks):
        for b in bufs:
            for p in b.pieces:
                spec = dst.tensors[p.tensor]
                keep[S + d] += p.box.numel * spec.nbytes / spec.numel
                pieces[S + d] += 1
    payload = float(sum(t.nbytes for t in dst.tensors.values()))
    return {
        "reshard": predict(c, S, D, plan_traffic(plan)).seconds,
        "reshard+verify": predict(c, S, D, plan_traffic(plan, checksums=True)).seconds,
        "ceiling": predict(c, S, D, plan_traffic(plan, copies=False)).seconds,
        "serialized": predict(c, S, D, serialized_traffic(c, src, D, payload, keep, _bucket(bucket_bytes, payload),
                                                          dst_pieces=pieces)).seconds,
        "broadcast": predict(c, S, D, owner_broadcast_traffic(c, S, D, owner_broadcast_windows(src, dst))).seconds,
    }


def _bucket(bucket_bytes: int, payload: float) -> int:
    """The baseline's broadcast bucket: as configured, but no larger than the model (rounded up to 1 MiB)."""
    return int(min(bucket_bytes, max(1 << 20, math.ceil(payload / (1 << 20)) << 20)))


def _machine_busy_seconds() -> tuple[float, float] | None:
    """CPU seconds every core of this machine has spent busy so far, and wall seconds; None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / hz, time.monotonic()


def _fmt_bytes(n: float) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def run_bench(a) -> int:
    import multiprocessing as mp

    from torch.distributed import TCPStore

    from reshard.common.models.frameworks import model_spec
    from reshard.tools.bench_methods import FP8_METHOD, METHODS

    if a.quick:
        a.sizes, a.dst_ranks, a.repeats, a.min_seconds = "tiny", "2", min(a.repeats, 1), 0.0
    try:
        configs = _configs(a)
    except ValueError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    if not configs:
        print("bench: nothing to run (empty --sizes or --dst-ranks)", file=sys.stderr)
        return 2
    world = max(c["S"] + c["D"] for c in configs)
    world = max(world, 2)
    log = sys.stderr

    def say(msg: str) -> None:
        print(msg, file=log, flush=True)

    host = "127.0.0.1"
    load0 = os.getloadavg()
    busy0 = _machine_busy_seconds()
    store = TCPStore(host, 0, world_size=None, is_master=True, wait_for_workers=False)
    port = store.port
    nonce = secrets.token_hex(4)
    shapes = sorted({(c["S"], c["D"]) for c in configs})
    opts = {"quick": a.quick, "repeats": a.repeats, "seed": a.seed, "bucket_bytes": a.bucket_mib << 20,
            "shapes": shapes, "min_seconds": a.min_seconds, "max_repeats": max(a.repeats, a.max_repeats), "fp8": a.fp8}
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    say(f"reshard bench: {len(configs)} layout pairs, {world} rank processes on {os.cpu_count()} cores, gloo on {host}; "
        f"methods {', '.join(METHODS + ((FP8_METHOD,) if a.fp8 else ()))}; 1 first run + {a.repeats} repeats each")
    procs = [ctx.Process(target=rank_main, args=(g, world, host, port, nonce, configs, opts, q), daemon=True)
             for g in range(world)]
    for p in procs:
        p.start()
    cal: dict = {}
    raw: dict = {}
    spans: list[tuple] = []
    runs: dict[tuple, list[dict]] = {}
    repeats: dict[int, int] = {}
    busy: dict[str, list[float]] = {}
    done: set[int] = set()
    try:
        while len(done) < world:
            try:
                msg = q.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [g for g, p in enumerate(procs) if p.exitcode is not None and g not in done]
                if dead:
                    raise RuntimeError(f"rank process {dead[0]} exited with code {procs[dead[0]].exitcode}")
                continue
            kind = msg[0]
            if kind == "error":
                raise RuntimeError(f"rank {msg[1]} failed:\n{msg[2]}")
            if kind == "done":
                done.add(msg[1])
            elif kind == "calib_span":
                spans.append(msg[1:])
            elif kind == "calib":
                raw = msg[1]
            elif kind == "calib_rate":
                busy.setdefault(msg[1], []).append(msg[3])
            elif kind == "repeats":
                repeats[msg[1]] = msg[2]
                if msg[2] > a.repeats:
                    say(f"    short runs: {msg[2]} repeats, for about {a.min_seconds:g} s of timed runs per method")
            elif kind == "ready":
                if not cal:  # every rank has finished the calibration by now
                    cal = calibration(raw, spans, shapes, busy_rates=busy)
                    say(_calibration_line(cal))
                cfg = configs[msg[1]]
                say(f"[{msg[1] + 1}/{len(configs)}] {cfg['model']} ({_fmt_bytes(model_spec(cfg['model']).payload_bytes)}) "
                    f"{cfg['src']} -> {cfg['dst']}: ready in {msg[2]:.1f} s")
            elif kind == "run":
                r = msg[1]
                key = (r["cfg"], r["method"], r["rep"])
                runs.setdefault(key, []).append(r)
                cfg = configs[r["cfg"]]
                if len(runs[key]) == cfg["S"] + cfg["D"]:
                    rows = runs[key]
                    secs = max(x["t1"] for x in rows) - min(x["t0"] for x in rows)
                    tag = "first" if r["rep"] == 0 else f"repeat {r['rep']}/{repeats.get(r['cfg'], a.repeats)}"
                    say(f"    {tag:>12} {r['method']:<15} {secs:8.3f} s")
    except BaseException:
        for p in procs:
            if p.is_alive():
                p.terminate()
        raise
    for p in procs:
        p.join(30)
    cal = calibration(raw, spans, shapes, {ci: (c["S"], c["D"]) for ci, c in enumerate(configs)}, busy)
    results = _summarize(configs, runs, cal, a, say)
    results["machine"]["load_average_start_end"] = [round(load0[0], 2), round(os.getloadavg()[0], 2)]
    busy1 = _machine_busy_seconds()
    if busy0 is not None and busy1 is not None:
        ours = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
                   for f in ("ru_utime", "ru_stime"))
        results["machine"]["cpu_seconds"] = {"wall": round(busy1[1] - busy0[1], 1), "busy": round(busy1[0] - busy0[0], 1),
                                             "bench": round(ours, 1),
                                             "others": round(max(0.0, busy1[0] - busy0[0] - ours), 1)}
    if a.json:
        print(json.dumps(results, indent=2))
    else:
        print_table(results)
    if a.plot:
        try:
            plot(results, a.plot)
            say(f"plot written to {a.plot}")
        except ImportError:
            say("plot skipped: matplotlib is not installed (pip install 'reshard[bench]')")
    return 0 if results["verified"] else 1


def _calibration_line(cal: dict, sep: str = "; ") -> str:
    alone = cal.get("alone", {})

    def busy(kind: str) -> str:
        return f" with every core busy ({alone[kind]:.2f} alone)" if kind in alone else ""

    parts = [f"latency {cal['latency_s'] * 1e6:.0f} us per message, one pair {cal['pair_gbps']:.2f} GB/s, packing "
             f"copies {cal['copy_gbps']:.2f} GB/s{busy('copy_gbps')} + {cal['copy_op_s'] * 1e6:.1f} us each",
             f"checksums {cal['checksum_gbps']:.2f} GB/s per core{busy('checksum_gbps')} + "
             f"{cal['checksum_op_s'] * 1e6:.0f} us each"]
    ct = cal.get("checksum_throughput")
    if ct:
        parts.append(f"checksum throughput on {ct['bytes'] / 2**20:.0f} MiB, this process's torch threads: host path "
                     f"{ct['host_gbps']:.2f} GB/s, device path (torch ops, on CPU) {ct['torch_gbps']:.2f} GB/s, "
                     f"memcpy of the same bytes {ct['memcpy_gbps']:.2f} GB/s")
    parts += [f"{k} ranks: {v['aggregate_streams']} streams {v['aggregate_gbps']:.2f} GB/s, round "
              f"{v['round_s'] * 1e6:.0f} us, broadcast window {v['collective_s'] * 1e6:.0f} us, start "
              f"{v['start_s'] * 1e6:.0f} us" for k, v in cal["shapes"].items()]
    return "calibration: " + sep.join(parts)


def _summarize(configs, runs, cal, a, say) -> dict:
    from reshard.common.models.frameworks import model_spec
    from reshard.tools.bench_methods import FP8_METHOD, METHODS

    out_cfgs = []
    all_ok = True
    for ci, cfg in enumerate(configs):
        try:
            pred = predictions(cfg, cal, a.bucket_mib << 20, ci)
        except Exception as e:  # noqa: BLE001 - a prediction must not lose the measurements
            say(f"prediction for {cfg['model']} {cfg['dst']} failed: {e}")
            pred = {}
        methods = {}
        for meth in (*METHODS, FP8_METHOD):
            reps = []
            for rep in sorted(r for c, m, r in runs if (c, m) == (ci, meth)):
                rows = runs.get((ci, meth, rep), [])
                if not rows:
                    continue
                reps.append({"rep": rep, "seconds": max(x["t1"] for x in rows) - min(x["t0"] for x in rows),
                             "bytes": sum(x["bytes"] for x in rows), "rows": rows})
            if not reps:
                continue
            first = reps[0]
            steady = [r["seconds"] for r in reps[1:]] or [first["seconds"]]
            med = statistics.median(steady)
            exact_ok = all(x["exact"] is not False for x in first["rows"])
            csum_ok = all(x["checksums_ok"] is not False for r in reps for x in r["rows"])
            verified = exact_ok and csum_ok
            all_ok &= verified
            nbytes = first["bytes"]
            extra_tr = max((x["extra_bytes"] for r in reps for x in r["rows"] if x["side"] == "src"), default=0)
            extra_inf = max((x["extra_bytes"] for r in reps for x in r["rows"] if x["side"] == "dst"), default=0)
            m = {"seconds": med, "first_seconds": first["seconds"], "repeats": steady, "bytes": nbytes,
                 "gbps": nbytes / med / 1e9 if med else 0.0,
                 "peak_extra_bytes": {"trainer": extra_tr, "inference": extra_inf},
                 "verified": verified, "bit_exact": exact_ok}
            if meth == "reshard+verify":
                m["checksums_ok"] = csum_ok
            p = pred.get(meth)
            if p is not None:
                m["predicted_seconds"] = p
                m["error_pct"] = (p - med) / med * 100 if med else None
            methods[meth] = m
        rs = methods.get("reshard", {}).get("seconds")
        summary = {}
        if rs:
            summary = {
                "speedup_vs_serialized": methods["serialized"]["seconds"] / rs if "serialized" in methods else None,
                "speedup_vs_broadcast": methods["broadcast"]["seconds"] / rs if "broadcast" in methods else None,
                "fraction_of_ceiling": methods["ceiling"]["seconds"] / rs if "ceiling" in methods else None,
                "verification_seconds": methods["reshard+verify"]["seconds"] - rs if "reshard+verify" in methods else None,
            }
            if FP8_METHOD in methods:  # the same model into the engine serving it as block FP8, in the same run
                summary["fp8_over_bf16"] = methods[FP8_METHOD]["seconds"] / rs
                summary["fp8_bytes_over_bf16"] = methods[FP8_METHOD]["bytes"] / max(1, methods["reshard"]["bytes"])
        out_cfgs.append({"model": cfg["model"], "payload_bytes": model_spec(cfg["model"]).payload_bytes,
                         "src": cfg["src"], "dst": cfg["dst"], "src_ranks": cfg["S"], "dst_ranks": cfg["D"],
                         "methods": methods, "reshard": summary})
    errs = [abs(m["error_pct"]) for c in out_cfgs for m in c["methods"].values() if m.get("error_pct") is not None]
    by_method: dict[str, list[float]] = {}
    for c in out_cfgs:
        for name, m in c["methods"].items():
            if m.get("error_pct") is not None:
                by_method.setdefault(name, []).append(abs(m["error_pct"]))
    return {
        "machine": {"cores": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                    "transport": "gloo on 127.0.0.1"},
        "memory_note": "peak_extra_bytes: storage of the staging and scratch tensors a method allocates and keeps, "
                       "max over trainer ranks and over inference ranks; model buffers excluded",
        "timing_note": "seconds: median of the repeats (first run reported apart as first_seconds); one run spans "
                       "from the first rank leaving a barrier to the last rank finishing",
        "calibration": cal,
        "configs": out_cfgs,
        "prediction_mean_abs_error_pct": sum(errs) / len(errs) if errs else None,
        "prediction_max_abs_error_pct": max(errs) if errs else None,
        "prediction_abs_error_pct_by_method": {k: {"mean": sum(v) / len(v), "max": max(v)} for k, v in by_method.items()},
        "verified": all_ok,
    }


def print_table(r: dict) -> None:
    cal = r["calibration"]
    print("\n" + _calibration_line(cal, sep="\n  ").replace("calibration:", "calibration (separate micro-measurement):"))
    head = f"{'model':<10}{'S->I':>6}  {'method':<15}{'first s':>9}{'median s':>10}{'GB moved':>10}{'GB/s':>7}" \
           f"{'extra MB tr/inf':>17}{'predicted':>11}{'error':>8}  ok"
    print(head)
    print("-" * len(head))
    for ci, c in enumerate(r["configs"]):
        pr = cal.get("layouts", {}).get(str(ci))
        if pr:
            print(f"{'':<18}probes in its repeats ({pr['passes']}): one pair {pr['pair_gbps']:.2f} GB/s, "
                  f"{pr['aggregate_streams']} streams {pr['aggregate_gbps']:.2f} GB/s, round {pr['round_s'] * 1e6:.0f} us, "
                  f"window {pr['collective_s'] * 1e6:.0f} us, start {pr['start_s'] * 1e6:.0f} us")
        for name, m in c["methods"].items():
            pred = f"{m['predicted_seconds']:.3f}" if "predicted_seconds" in m else "-"
            err = f"{m['error_pct']:+.0f}%" if m.get("error_pct") is not None else "-"
            extra = f"{m['peak_extra_bytes']['trainer'] / 1e6:.0f}/{m['peak_extra_bytes']['inference'] / 1e6:.0f}"
            print(f"{c['model']:<10}{c['src_ranks']:>3}->{c['dst_ranks']:<2} {name:<15}{m['first_seconds']:>9.3f}"
                  f"{m['seconds']:>10.3f}{m['bytes'] / 1e9:>10.3f}{m['gbps']:>7.2f}{extra:>17}{pred:>11}{err:>8}  "
                  f"{'yes' if m['verified'] else 'NO'}")
        s = c["reshard"]
        if s:
            print(f"{'':<18}reshard: {s['speedup_vs_serialized']:.2f}x vs serialized, {s['speedup_vs_broadcast']:.2f}x vs "
                  f"owner broadcast, {s['fraction_of_ceiling']:.2f} of the ceiling, verification +{s['verification_seconds']:.3f} s")
            if "fp8_over_bf16" in s:
                print(f"{'':<18}block FP8 (quantized on the trainer ranks): {s['fp8_over_bf16']:.2f}x the BF16 update's "
                      f"time, {s['fp8_bytes_over_bf16']:.2f}x its bytes")
    if r["prediction_mean_abs_error_pct"] is not None:
        print(f"\nsimulator on these layouts (calibrated by the probes, not by the layouts' runs): mean |error| "
              f"{r['prediction_mean_abs_error_pct']:.0f}%, max {r['prediction_max_abs_error_pct']:.0f}%")
        print("  by method: " + ", ".join(f"{k} {v['mean']:.0f}% (max {v['max']:.0f}%)"
                                          for k, v in r["prediction_abs_error_pct_by_method"].items()))
    cpu = r["machine"].get("cpu_seconds")
    if cpu:
        print(f"machine: {r['machine']['cores']} cores, load average {r['machine']['load_average_start_end'][0]} at the "
              f"start; of {cpu['busy']:.0f} busy core-seconds in {cpu['wall']:.0f} s, other processes used "
              f"{cpu['others']:.0f}")
    print(f"all methods verified bit-exact: {'yes' if r['verified'] else 'NO'}")


def plot(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfgs = r["configs"]
    max_d = max(c["dst_ranks"] for c in cfgs)
    biggest = max(c["payload_bytes"] for c in cfgs)
    methods = list(cfgs[0]["methods"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for meth in methods:
        by_size = sorted((c["payload_bytes"] / 1e9, c["methods"][meth]["seconds"]) for c in cfgs
                         if c["dst_ranks"] == max_d and meth in c["methods"])
        by_dst = sorted((c["dst_ranks"], c["methods"][meth]["seconds"]) for c in cfgs
                        if c["payload_bytes"] == biggest and meth in c["methods"])
        if by_size:
            axes[0].plot(*zip(*by_size), marker="o", label=meth)
        if by_dst:
            axes[1].plot(*zip(*by_dst), marker="o", label=meth)
    axes[0].set(xlabel="model size (GB of bf16)", ylabel="seconds per update (median)",
                title=f"time vs model size ({cfgs[0]['src_ranks']} -> {max_d} ranks)", xscale="log", yscale="log")
    name = next(c["model"] for c in cfgs if c["payload_bytes"] == biggest)
    axes[1].set(xlabel="inference ranks", ylabel="seconds per update (median)", title=f"time vs inference ranks ({name})")
    axes[1].set_xticks(sorted({c["dst_ranks"] for c in cfgs}))
    for ax in axes:
        ax.grid(True, alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle(f"reshard bench, gloo on loopback, {r['machine']['cores']} cores", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(a) -> int:
    if a.repeats < 0 or a.bucket_mib < 1 or a.min_seconds < 0 or a.max_repeats < 0:
        print("bench: --repeats, --max-repeats and --min-seconds must be >= 0 and --bucket-mib >= 1", file=sys.stderr)
        return 2
    return run_bench(a)



def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="reshard vs serialized vs owner broadcast vs the raw ceiling, measured side by side")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"models to sweep (default {DEFAULT_SIZES})")
    p.add_argument("--dst-ranks", default="2,4", help="inference rank counts to sweep (default 2,4)")
    p.add_argument("--src", default=DEFAULT_SRC, help=f"trainer layout (default {DEFAULT_SRC})")
    p.add_argument("--dst", default=DEFAULT_DST, help=f"inference layout, {{n}} = inference ranks (default {DEFAULT_DST})")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats after the first run (default 3)")
    p.add_argument("--min-seconds", type=float, default=0.3,
                   help="repeat short runs until each method has about this many timed seconds (default 0.3)")
    p.add_argument("--max-repeats", type=int, default=30, help="at most this many repeats of short runs (default 30)")
    p.add_argument("--bucket-mib", type=int, default=256, help="serialized baseline's broadcast bucket (default 256)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default="reshard-bench.png", help="PNG plot path ('' for none)")
    p.add_argument("--fp8", action="store_true",
                   help="also reshard into the destination serving a block-FP8 checkpoint (its linear weights "
                        "float8_e4m3fn with scales, quantized on the trainer ranks): FP8 beside BF16, in the same run")
    p.add_argument("--quick", action="store_true", help="smallest model, 2 inference ranks, 1 repeat (tests)")
    p.add_argument("--json", action="store_true", help="print one JSON object (progress goes to stderr)")
    p.set_defaults(_main=main)
