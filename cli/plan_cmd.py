"""`reshard plan`: plan a layout pair in one process and print the plan's figures."""

from __future__ import annotations

import ctypes
import gc
import json
import resource
import sys
import threading
import time


def plan_figures(model: str, src_spec: str, dst_spec: str, bucket_bytes: int = 0, relay: bool = True) -> dict:
    """Build the two layouts, then time the complete plan (every rank's transfers) cold, in this process."""
    from reshard.common.frameworks import build, model_spec
    from reshard.common.planner import PlanOptions, make_plan

    m = model_spec(model)
    t0 = time.perf_counter()
    src, dst = build(m, src_spec), build(m, dst_spec)
    t1 = time.perf_counter()
    gc.collect()
    opts = PlanOptions(relay=relay, **({"bucket_bytes": bucket_bytes} if bucket_bytes else {}))
    with _PeakRss() as mem:
        t2 = time.perf_counter()
        plan = make_plan(src, dst, opts)
        t3 = time.perf_counter()
    per = plan.rank_bytes()
    sends, recvs, relays = per["send"], per["recv"], per["relay"]
    links = plan.link_bytes()
    staging = _max_staging(plan)
    mean_send = int(sends.sum()) // max(1, len(sends))
    return {
        "model": model, "src": src_spec, "dst": dst_spec,
        "plan_seconds": t3 - t2, "layout_seconds": t1 - t0,
        "num_ranks_src": src.world, "num_ranks_dst": dst.world,
        "num_tensors": len(dst.tensors),
        "num_transfers": plan.num_segments,
        "num_messages": plan.num_messages, "num_rounds": plan.num_rounds,
        "bytes_total": plan.total_bytes,
        "max_rank_send_bytes": int(sends.max()), "mean_rank_send_bytes": mean_send,
        "max_rank_recv_bytes": int(recvs.max()),
        "max_link_bytes": max(links.values(), default=0),
        "trainer_egress_bytes": plan.source_bytes,
        "relay_bytes": plan.total_bytes - plan.source_bytes,
        "max_rank_relay_bytes": int(relays.max(initial=0)),
        "replicas_fed_by_relay": len(plan.primary_of),
        "max_rank_staging_bytes": staging,
        "send_imbalance": float(sends.max() / (sends.sum() / len(sends)) - 1) if sends.sum() else 0.0,
        # The planner's own memory: the peak resident growth while planning (sampled every 2 ms;
        # the layouts, built before, are not counted), and what the finished plan keeps.
        "peak_memory_bytes": mem.peak,
        "plan_memory_bytes": plan.nbytes,
        "digest": plan.digest,
    }


def _max_staging(plan) -> int:
    """The largest staging pool any rank's engine allocates for this plan: twice its most
    staged round (the engine double-buffers rounds)."""
    import numpy as np

    t = plan.message_table()
    S = plan.src_world
    # Endpoint ids: source rank r is r, destination rank d is S + d (a relay's sender included).
    send_ep = np.where(t["relay"], S + t["src"], t["src"])
    recv_ep = S + t["dst"]
    ep = np.concatenate([send_ep[~t["sd"]], recv_ep[~t["rd"]]])
    rnd = np.concatenate([t["round"][~t["sd"]], t["round"][~t["rd"]]])
    val = np.concatenate([t["staged_bytes"][~t["sd"]], t["staged_bytes"][~t["rd"]]])
    if not len(ep):
        return 0
    key = ep * (int(rnd.max()) + 1) + rnd
    _, inv = np.unique(key, return_inverse=True)
    return 2 * int(np.bincount(inv.reshape(-1), weights=val).max())


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:  # not Linux: the lifetime peak is the best there is
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _PeakRss:
    """Peak growth of resident memory over a block, sampled by a thread."""

    def __enter__(self) -> _PeakRss:
        self.base = self.top = _rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.top = max(self.top, _rss())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        self.top = max(self.top, _rss())

    @property
    def peak(self) -> int:
        return self.top - self.base


# mallopt parameters, from glibc's <malloc.h>
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def tune_process_for_planning() -> None:
    """Tune this process, which `reshard plan` owns and which exits when done, for one large plan.

    Process-wide and not undone: the library never does this, since it runs inside trainers and
    engines. The layouts and the plan are millions of acyclic objects and hundreds of arrays of
    tens of MB. The cyclic collector would rescan the objects over and over (more than half of
    the layout build time), and glibc would hand each freed array back to the kernel and fault it
    in again, zeroed, for the next one. Arrays up to 32 MiB then come from a heap that is kept,
    and numpy's huge-page advice is off: with THP defrag=madvise each huge-page fault may compact
    memory first, while small pages of a reused heap fault once (for the Kimi-K2 plan, 0.3-0.5 s
    of system time instead of 0.9-1.2 s)."""
    gc.disable()
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    hugepage = getattr(core.multiarray, "_set_madvise_hugepage", None)
    if hugepage is not None:
        hugepage(False)
    try:
        libc = ctypes.CDLL(None)
        # int mallopt(int param, int value);
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return  # not glibc: nothing more to tune
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mallopt(_M_MMAP_THRESHOLD, 32 << 20)  # glibc's ceiling, and where its own dynamic threshold ends
    mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    mallopt(_M_TOP_PAD, 16 << 20)


def main(a) -> int:
    tune_process_for_planning()
    try:
        fig = plan_figures(a.model, a.src, a.dst, a.bucket_bytes, relay=not getattr(a, "no_relay", False))
    except ValueError as e:
        print(f"plan failed: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(fig, indent=2))
        return 0
    w = max(len(k) for k in fig)
    for k, v in fig.items():
        if isinstance(v, float):
            v = f"{v:.3f}"
        elif isinstance(v, int) and "bytes" in k:
            v = f"{v} ({v / 1e9:.3f} GB)"
        print(f"{k:<{w}}  {v}")
    return 0
