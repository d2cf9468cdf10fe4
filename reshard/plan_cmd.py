"""`reshard plan`: plan a layout pair in one process and print the plan's figures."""

from __future__ import annotations

import gc
import json
import resource
import sys
import time
from collections import defaultdict


def plan_figures(model: str, src_spec: str, dst_spec: str, bucket_bytes: int = 0) -> dict:
    from reshard.common.frameworks import build, model_spec
    from reshard.common.planner import PlanOptions, make_plan

    m = model_spec(model)
    gc.collect()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    src, dst = build(m, src_spec), build(m, dst_spec)
    t1 = time.perf_counter()
    plan = make_plan(src, dst, PlanOptions(bucket_bytes=bucket_bytes) if bucket_bytes else PlanOptions())
    t2 = time.perf_counter()
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    sends = [plan.send_bytes(r) for r in range(src.world)]
    recvs = [plan.recv_bytes(r) for r in range(dst.world)]
    relays = [sum(m.nbytes for m in plan.relay_sends.get(r, [])) for r in range(dst.world)]
    links: dict[tuple[bool, int, int], int] = defaultdict(int)
    for msg in plan.messages:
        links[(msg.relay, msg.src, msg.dst)] += msg.nbytes
    return {
        "model": model, "src": src_spec, "dst": dst_spec,
        "plan_seconds": t2 - t0, "layout_seconds": t1 - t0,
        "num_ranks_src": src.world, "num_ranks_dst": dst.world,
        "num_tensors": len(dst.tensors),
        "num_transfers": sum(len(msg.segments) for msg in plan.messages),
        "num_messages": len(plan.messages), "num_rounds": plan.num_rounds,
        "bytes_total": plan.total_bytes,
        "max_rank_send_bytes": max(sends), "mean_rank_send_bytes": sum(sends) // len(sends),
        "max_rank_recv_bytes": max(recvs),
        "max_link_bytes": max(links.values(), default=0),
        "trainer_egress_bytes": plan.source_bytes,
        "trainer_egress_bytes_without_relay": plan.total_bytes,
        "relay_bytes": plan.total_bytes - plan.source_bytes,
        "max_rank_relay_bytes": max(relays, default=0),
        "replicas_fed_by_relay": len(plan.primary_of),
        "send_imbalance": max(sends) / (sum(sends) / len(sends)) - 1 if sum(sends) else 0.0,
        "peak_memory_bytes": max(0, rss1 - rss0),
        "digest": plan.digest,
    }


def main(a) -> int:
    try:
        fig = plan_figures(a.model, a.src, a.dst, a.bucket_bytes)
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
