"""The cluster model's arithmetic on hand-computed cases, and its plumbing from real plans."""

from __future__ import annotations

import pytest

from reshard.common.frameworks import build
from reshard.common.planner import PlanOptions, make_plan
from reshard.common.simulate import (
    Cluster,
    Phase,
    broadcast_phases,
    cluster_by_name,
    phase_time,
    plan_traffic,
    predict,
    preset_by_name,
    simulate,
)

GB = 1e9


def one_gpu_nodes(**kw) -> Cluster:
    base = dict(gpus_per_node=1, nvlink_gbps=100.0, nic_gbps=10.0, latency_s=0.0)
    base.update(kw)
    return Cluster(**base)


def test_two_senders_one_receiver_over_the_nic():
    ph = Phase("source")
    ph.add(0, 2, 10 * GB)
    ph.add(1, 2, 10 * GB)
    r = phase_time(one_gpu_nodes(), 2, 1, ph)
    assert r.seconds == pytest.approx(2.0)  # 20 GB into one 10 GB/s NIC
    assert r.bottleneck == "nic ingress of rank 2 (inference 0)"


def test_latency_is_charged_per_message_on_the_sender():
    ph = Phase("source")
    ph.add(0, 1, 1 * GB, messages=100)
    r = phase_time(one_gpu_nodes(latency_s=1e-3), 1, 1, ph)
    assert r.seconds == pytest.approx(0.1 + 0.1)  # 1 GB at 10 GB/s + 100 x 1 ms
    assert r.bottleneck == "nic egress of rank 0 (trainer 0)"


def test_same_node_uses_nvlink_and_the_busiest_port_wins():
    c = Cluster(gpus_per_node=4, nvlink_gbps=100.0, nic_gbps=10.0, latency_s=0.0, colocated=True)
    ph = Phase("source")
    ph.add(0, 2, 50 * GB)  # same node (ranks 0-3): NVLink
    ph.add(1, 3, 20 * GB)
    ph.add(0, 4, 4 * GB)  # rank 4 is on node 1: NIC, 0.4 s
    r = phase_time(c, 2, 3, ph)
    assert r.seconds == pytest.approx(0.5)
    assert r.bottleneck in ("nvlink egress of rank 0 (trainer 0)", "nvlink ingress of rank 2 (inference 0)")


def test_disaggregated_placement_puts_inference_on_its_own_nodes():
    c = Cluster(gpus_per_node=8, nvlink_gbps=100.0, nic_gbps=10.0, latency_s=0.0)
    ph = Phase("source")
    ph.add(0, 8, 1 * GB)  # 8 trainer ranks fill node 0; inference 0 starts node 1
    assert phase_time(c, 8, 8, ph).bottleneck == "nic egress of rank 0 (trainer 0)"


def test_hierarchical_spreads_over_the_nodes_nics():
    c = Cluster(gpus_per_node=4, nvlink_gbps=100.0, nic_gbps=10.0, latency_s=0.0)
    ph = Phase("source")
    ph.add(0, 4, 40 * GB)
    assert phase_time(c, 4, 4, ph).seconds == pytest.approx(4.0)
    h = phase_time(c, 4, 4, ph, hierarchical=True)
    assert h.seconds == pytest.approx(1.0)  # 40 GB over 4 NICs of 10 GB/s; NVLink legs 30 GB / 100 GB/s
    assert h.bottleneck in ("nic egress of node 0 (trainer)", "nic ingress of node 1 (inference)")


def test_shared_cpu_adds_wire_bytes_copies_and_messages():
    c = Cluster(gpus_per_node=8, nvlink_gbps=10.0, nic_gbps=10.0, latency_s=1e-3, copy_gbps=4.0,
                copy_op_s=1e-3, node_cpu_gbps=1.0, colocated=True)
    ph = Phase("source")
    ph.add(0, 2, 1 * GB, messages=10)
    ph.add(1, 3, 1 * GB, messages=10)
    ph.copies[0] += 2 * GB
    ph.copy_ops[0] += 100
    r = phase_time(c, 2, 2, ph)
    # 2 GB / 1 GB/s + 20 messages x 1 ms + 2 GB / 4 GB/s + 100 x 1 ms
    assert r.seconds == pytest.approx(2.0 + 0.02 + 0.5 + 0.1)
    assert r.bottleneck == "shared CPU of node 0"


def test_phases_add_up_and_name_the_longest():
    c = one_gpu_nodes()
    a, b = Phase("source"), Phase("relay")
    a.add(0, 1, 10 * GB)
    b.add(1, 2, 30 * GB)
    p = predict(c, 1, 2, [a, b])
    assert p.seconds == pytest.approx(4.0)
    assert p.bottleneck == "nic egress of rank 1 (inference 0), in the relay phase"


def test_relay_chain_fill():
    c = one_gpu_nodes()
    ph = Phase("relay", fill_steps=2, fill_bytes=1 * GB)
    ph.add(1, 2, 10 * GB)
    assert phase_time(c, 1, 2, ph).seconds == pytest.approx(1.0 + 2 * 0.1)


def test_broadcast_tree_and_rings():
    tree = broadcast_phases(Cluster(broadcast="tree"), 0, [0, 1, 2, 3], 8.0, 4.0)
    assert [sorted(p.links) for p in tree] == [[(0, 1)], [(0, 2), (1, 3)]]
    assert all(v == [8.0, 2.0] for p in tree for v in p.links.values())
    ring = broadcast_phases(Cluster(gpus_per_node=2, broadcast="ring"), 0, [0, 1, 2, 3], 8.0, 8.0)
    assert len(ring) == 1
    assert sum(v[0] for v in ring[0].links.values()) == pytest.approx(2 * 3 * 4.0)  # 2 rings of 3 hops, 4 B each


def test_plan_traffic_matches_the_plan():
    src, dst = build("tiny", "framework=megatron,tp=2"), build("tiny", "framework=vllm,tp=2,dp=2")
    plan = make_plan(src, dst, PlanOptions())
    phases = {p.name: p for p in plan_traffic(plan)}
    assert phases["source"].wire_bytes == sum(m.wire_bytes for m in plan.messages if not m.relay)
    assert phases["relay"].wire_bytes == sum(m.wire_bytes for m in plan.messages if m.relay)
    assert all(a < 2 <= b for a, b in phases["source"].links)  # trainer -> inference
    assert all(a >= 2 and b >= 2 for a, b in phases["relay"].links)
    assert not any(p.copies for p in plan_traffic(plan, copies=False))


def test_simulate_reports_the_keys_and_a_faithful_representative():
    c = cluster_by_name("h100-8x400g")
    exact = simulate("small", "framework=megatron,tp=2,pp=2", "framework=vllm,tp=2,dp=2", c, exact=True)
    rep = simulate("small", "framework=megatron,tp=2,pp=2", "framework=vllm,tp=2,dp=2", c)
    for r in (exact, rep):
        assert r["predicted_seconds"] > 0 and r["baseline_predicted_seconds"] > r["predicted_seconds"]
        assert r["bottleneck"]
    assert rep["plan"].startswith("representative: 2 of 4")
    assert rep["trainer_egress_bytes"] == pytest.approx(exact["trainer_egress_bytes"], rel=0.02)
    assert rep["predicted_seconds"] == pytest.approx(exact["predicted_seconds"], rel=0.1)


def test_bad_names_and_values_say_what_is_valid():
    with pytest.raises(ValueError, match="valid clusters"):
        cluster_by_name("nope")
    with pytest.raises(ValueError, match="valid presets"):
        preset_by_name("nope")
    with pytest.raises(ValueError, match="nic_gbps"):
        Cluster(nic_gbps=0)
    with pytest.raises(ValueError, match="broadcast"):
        Cluster(broadcast="star")


def test_plan_traffic_from_columns_matches_messages():
    """plan_traffic sums the plan's columns; summing its Message objects gives the same phases."""
    from reshard.common.frameworks import build
    from reshard.common.planner import PlanOptions, make_plan
    from reshard.common.simulate import plan_traffic

    plan = make_plan(build("tiny", "framework=megatron,tp=2"), build("tiny", "framework=vllm,tp=2,dp=3"),
                     PlanOptions(bucket_bytes=4096, direct_min_bytes=1024, max_message_bytes=8192))
    fast = {p.name: p for p in plan_traffic(plan)}
    slow = {p.name: p for p in plan_traffic(plan, weight=lambda name: 1.0)}
    assert set(fast) == set(slow) == {"source", "relay"}
    for k in fast:
        assert fast[k].links == slow[k].links  # integral sums: exact
        assert dict(fast[k].copies) == pytest.approx(dict(slow[k].copies))
        assert dict(fast[k].copy_ops) == pytest.approx(dict(slow[k].copy_ops))
        assert fast[k].fill_bytes == slow[k].fill_bytes and fast[k].fill_steps == slow[k].fill_steps


def test_overlapping_relay_phase_shares_ports():
    """A relay phase that overlaps the source phase is timed with it: loads add per port, the
    fill stays; sequential phases add their times."""
    c = one_gpu_nodes()
    src, relay = Phase("source"), Phase("relay", fill_steps=1, fill_bytes=1 * GB)
    src.add(0, 1, 10 * GB)      # trainer 0 -> inference 0
    relay.add(1, 2, 10 * GB)    # inference 0 -> inference 1: a different port pair
    seq = predict(c, 1, 2, [src, relay])
    relay.overlaps_previous = True
    both = predict(c, 1, 2, [src, relay])
    assert seq.seconds == pytest.approx(1.0 + 1.0 + 0.1)
    assert both.seconds == pytest.approx(1.0 + 0.1) and [p.name for p in both.phases] == ["source+relay"]
    relay.add(0, 2, 10 * GB)    # now trainer 0's egress carries 20 GB in the merged phase
    assert predict(c, 1, 2, [src, relay]).seconds == pytest.approx(2.0 + 0.1)
