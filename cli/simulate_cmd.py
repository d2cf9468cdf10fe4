"""`reshard simulate`: predicted update times of a layout pair on a modelled cluster, from the
real planner's plan (see tools/simulate.py for the model)."""

from __future__ import annotations

import dataclasses
import json
import sys


def add_parser(sub) -> None:
    from reshard.tools.simulate import CLUSTERS, PRESETS

    p = sub.add_parser("simulate", help="predict update times on a modelled cluster from the real plan")
    p.add_argument("--preset", choices=sorted(PRESETS), help="a published setup: model, layouts, hardware, wire dtype")
    p.add_argument("--model", help="model shape (with --src and --dst, instead of --preset)")
    p.add_argument("--src", help="trainer layout, e.g. framework=megatron,tp=1,pp=4,dp=32,ep=16")
    p.add_argument("--dst", help="inference layout, e.g. framework=vllm,tp=8,dp=16")
    p.add_argument("--cluster", choices=sorted(CLUSTERS), help="hardware (default: the preset's, or h100-8x400g)")
    p.add_argument("--gpus-per-node", type=int, help="override: GPUs per NVLink domain")
    p.add_argument("--nvlink-gbps", type=float, help="override: NVLink GB/s per GPU and direction")
    p.add_argument("--nic-gbps", type=float, help="override: NIC GB/s per GPU and direction")
    p.add_argument("--latency-us", type=float, help="override: microseconds per message")
    p.add_argument("--wire-dtype", choices=["bf16", "fp8"], help="bytes on the wire (default: the preset's, or bf16)")
    p.add_argument("--exact", action="store_true", help="plan the full model instead of a representative one (slow)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(_main=main)


def main(a) -> int:
    from reshard.tools.simulate import cluster_by_name, preset_by_name, simulate

    preset = preset_by_name(a.preset) if a.preset else None
    if preset is None and not (a.model and a.src and a.dst):
        print("simulate: give --preset NAME, or --model, --src and --dst", file=sys.stderr)
        return 2
    model = a.model or preset.model
    src = a.src or preset.src
    dst = a.dst or preset.dst
    cluster = cluster_by_name(a.cluster or (preset.cluster if preset else "h100-8x400g"))
    over = {k: v for k, v in (("gpus_per_node", a.gpus_per_node), ("nvlink_gbps", a.nvlink_gbps),
                              ("nic_gbps", a.nic_gbps),
                              ("latency_s", a.latency_us * 1e-6 if a.latency_us is not None else None)) if v is not None}
    try:
        if over:
            cluster = dataclasses.replace(cluster, name=cluster.name + "*", **over)
        wire = a.wire_dtype or (preset.wire if preset else "bf16")
        exact = a.exact or bool(preset and preset.exact)
        log = sys.stderr
        r = simulate(model, src, dst, cluster, exact=exact, wire_scale=0.5 if wire == "fp8" else 1.0,
                     progress=lambda s: print(s, file=log, flush=True))
    except ValueError as e:
        print(f"simulate: {e}", file=sys.stderr)
        return 2
    r["wire_dtype"] = wire
    if preset:
        r["preset"] = a.preset
        r["published"] = preset.published
    if a.json:
        print(json.dumps(r, indent=2))
        return 0
    print_report(r)
    return 0


def print_report(r: dict) -> None:
    c = r["cluster"]
    print(f"{r['model']}: {r['src']} ({r['src_ranks']} ranks) -> {r['dst']} ({r['dst_ranks']} ranks), "
          f"{r['wire_dtype']} on the wire, {r['payload_bytes'] / 1e9:.0f} GB")
    print(f"cluster {c['name']}: {c['gpus_per_node']} GPUs per NVLink domain, NVLink {c['nvlink_gbps']:.0f} GB/s, "
          f"NIC {c['nic_gbps']:.0f} GB/s per GPU, {c['latency_s'] * 1e6:.0f} us per message")
    print(f"plan: {r['plan']} ({r['plan_seconds']:.1f} s)")
    rows = [("reshard (relays, each GPU's own NIC)", r["reshard"]),
            ("reshard without relays (direct)", r["reshard_no_relay"]),
            ("reshard, hierarchical NIC use", r["hierarchical"]),
            ("serialized baseline", r["baseline"])]
    for name, p in rows:
        phases = ", ".join(f"{ph['name']} {ph['seconds']:.3f} s" for ph in p["phases"] if ph["seconds"] or ph["bytes"])
        print(f"  {name:<38} {p['seconds']:8.3f} s   bottleneck: {p['bottleneck']}   [{phases}]")
    if r.get("direct_over_hierarchical"):
        print(f"  direct / hierarchical: {r['direct_over_hierarchical']:.2f}x")
    if r.get("speedup_vs_serialized"):
        print(f"  reshard vs serialized: {r['speedup_vs_serialized']:.1f}x")
    if r.get("published"):
        print(f"  published: {r['published']}")
