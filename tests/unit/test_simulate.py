"""The cluster model's arithmetic on hand-computed cases, and its plumbing from real plans."""

from __future__ import annotations

import dataclasses

import pytest

from reshard.common.models.frameworks import build
from reshard.common.plan.planner import PlanOptions, make_plan
from reshard.tools.simulate import (
    Cluster,
    Phase,
    broadcast_phases,
    cluster_by_name,
    gloo_tree,
    owner_broadcast_traffic,
    phase_time,
    plan_traffic,
    predict,
    preset_by_name,
    serialized_traffic,
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


def shared_host(**kw) -> Cluster:
    base = dict(gpus_per_node=8, nvlink_gbps=2.0, nic_gbps=2.0, latency_s=1e-3, copy_gbps=4.0, copy_op_s=1e-3,
                node_cpu_gbps=3.0, cores=2, colocated=True)
    base.update(kw)
    return Cluster(**base)


def test_shared_host_the_busiest_process_or_the_shared_cores():
    c = shared_host()
    ph = Phase("source")
    ph.add(0, 2, 1 * GB, messages=10)
    ph.add(1, 3, 1 * GB, messages=10)
    # Each process moves 1 GB at the one-pair rate: 0.5 s. The cores move 2 GB at 3 GB/s: 0.667 s.
    r = phase_time(c, 2, 2, ph)
    assert r.seconds == pytest.approx(2 / 3)
    assert r.bottleneck == "shared CPU of node 0"
    ph.copies[0] += 2 * GB
    ph.copy_ops[0] += 100
    # Rank 0 now also packs 2 GB at 4 GB/s and makes 100 copies of 1 ms: 0.5 + 0.5 + 0.1 = 1.1 s of its
    # own; the cores take 2/3 s + 0.6 s / 2 = 0.967 s.
    r = phase_time(c, 2, 2, ph)
    assert r.seconds == pytest.approx(1.1)
    assert r.bottleneck == "process of rank 0 (trainer 0)"


def test_shared_host_counts_a_relaying_process_both_ways_and_its_checksums():
    c = shared_host(node_cpu_gbps=100.0, checksum_gbps=1.0, checksum_op_s=0.01)
    ph = Phase("relay")
    ph.add(2, 3, 1 * GB)
    ph.add(3, 4, 1 * GB)
    ph.checksums[3] += 0.5 * GB
    ph.checksum_ops[3] += 10
    # Rank 3 receives 1 GB and sends 1 GB at 2 GB/s (1 s), then checksums 0.5 GB at 1 GB/s plus 10 x 10 ms.
    assert phase_time(c, 2, 3, ph).seconds == pytest.approx(1.0 + 0.5 + 0.1)


def test_steps_and_the_start_cost():
    c = shared_host(round_s=1e-3, collective_s=5e-3, start_s=0.25)
    rounds = Phase("source", steps=4)
    rounds.add(0, 2, 0.3 * GB)  # 0.15 s at the one-pair rate; 0.1 s on the cores
    windows = Phase("owner broadcast", steps=2, step="collective")
    p = predict(c, 2, 1, [rounds, windows])
    assert [r.seconds for r in p.phases] == pytest.approx([0.15 + 0.004, 0.010])
    assert p.seconds == pytest.approx(0.25 + 0.154 + 0.010)


def test_plan_traffic_packing_first_and_verification():
    """The first round's packing and the last round's unpacking are phases of their own;
    verification checksums what every sender sends and every receiver receives, after 2 x S
    exchange steps."""
    src, dst = build("tiny", "framework=megatron,tp=2"), build("tiny", "framework=vllm,tp=2,dp=2")
    plan = make_plan(src, dst, PlanOptions(relay=False))
    plain = {p.name: p for p in plan_traffic(plan)}
    ph = {p.name: p for p in plan_traffic(plan, checksums=True)}
    assert list(ph) == ["first packing", "source", "last unpacking", "verify"]
    assert plan.num_rounds == 1  # so the sender packs everything before it sends, and the receiver
    staged, unstaged = {}, {}  # unpacks everything once it has landed
    for m in plan.messages:
        if not m.send_direct:
            staged[m.src] = staged.get(m.src, 0) + m.nbytes
        if not m.recv_direct:
            unstaged[2 + m.dst] = unstaged.get(2 + m.dst, 0) + m.nbytes
    assert staged and unstaged
    for r, n in staged.items():
        assert plain["first packing"].copies[r] == n and plain["source"].copies.get(r, 0) == 0
    for r, n in unstaged.items():
        assert plain["last unpacking"].copies[r] == n and plain["source"].copies.get(r, 0) == 0
    # The per-message path (weighted plans) splits the copies the same way as the columns' path.
    weighted = {p.name: p for p in plan_traffic(plan, weight=lambda name: 1.0)}
    assert list(weighted) == list(plain)
    for name, p in plain.items():
        assert {r: v for r, v in weighted[name].copies.items() if v} == {r: v for r, v in p.copies.items() if v}, name
    assert ph["verify"].steps == 2 * 2
    for d in range(4):
        assert ph["verify"].checksums[2 + d] == sum(m.nbytes for m in plan.messages if m.dst == d)
    for s in range(2):
        assert ph["source"].checksums[s] == sum(m.nbytes for m in plan.messages if m.src == s)
        assert ph["source"].checksum_ops[s] == sum(len(m.segments) for m in plan.messages if m.src == s)


def test_a_shared_host_needs_its_rates():
    with pytest.raises(ValueError, match="node_cpu_gbps and copy_gbps"):
        Cluster(cores=2, node_cpu_gbps=1.0)


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


def test_gloo_tree_generations():
    # Member v receives from v minus its highest bit and sends to v + 2**i for each higher bit i.
    assert gloo_tree(3) == [[(0, 1), (0, 2)]]
    assert gloo_tree(5) == [[(0, 1), (0, 2), (0, 4)], [(1, 3)]]
    assert gloo_tree(8) == [[(0, 1), (0, 2), (0, 4)], [(1, 3), (1, 5), (2, 6)], [(3, 7)]]


def test_broadcast_tree_and_rings():
    (tree,) = broadcast_phases(Cluster(broadcast="tree"), 0, [0, 1, 2, 3], 8.0, 4.0)
    assert sorted(tree.links) == [(0, 1), (0, 2), (1, 3)]
    assert all(v == [8.0, 2.0] for v in tree.links.values())  # every edge carries both buckets
    # Member 1 forwards each bucket to member 3 while the root sends the next one to member 2:
    # only the last bucket's forward shows, one fill step for the one later generation.
    assert (tree.steps, tree.step, tree.fill_steps, tree.fill_bytes) == (2, "collective", 1, 4.0)
    ring = broadcast_phases(Cluster(gpus_per_node=2, broadcast="ring"), 0, [0, 1, 2, 3], 8.0, 8.0)
    assert len(ring) == 1
    assert sum(v[0] for v in ring[0].links.values()) == pytest.approx(2 * 3 * 4.0)  # 2 rings of 3 hops, 4 B each


def test_gloo_broadcast_on_a_shared_host():
    # 1 GB from rank 0 to ranks 1 and 2 in one bucket: rank 0 sends 2 GB at the pair rate (1 s);
    # the cores move 2 GB at 3 GB/s; plus one collective step.
    c = shared_host(collective_s=0.01)
    (ph,) = broadcast_phases(dataclasses.replace(c, broadcast="tree"), 0, [0, 1, 2], 1 * GB, 1 * GB)
    assert phase_time(c, 1, 2, ph).seconds == pytest.approx(1.0 + 0.01)
    # With 4 receivers, rank 0 sends 3 GB (1.5 s, more than the cores' 4 GB / 3 GB/s), and rank 1
    # forwards to rank 3 after it received: one more bucket on the slowest link (0.5 s; the measured
    # collective step already holds the tree's latencies).
    (ph,) = broadcast_phases(dataclasses.replace(c, broadcast="tree"), 0, [0, 1, 2, 3, 4], 1 * GB, 1 * GB)
    assert phase_time(c, 1, 4, ph).seconds == pytest.approx(1.5 + 0.01 + 0.5)


def test_owner_broadcast_windows():
    c = shared_host(node_cpu_gbps=100.0, collective_s=0.01, broadcast="tree")
    windows = [{"items": [(0, 1 * GB, False), (1, 0.5 * GB, True)], "keep": {2: (1 * GB, 2), 3: (0.5 * GB, 1)}},
               {"items": [(0, 0.2 * GB, False)], "keep": {2: (0.2 * GB, 1), 3: (0, 0)}}]
    (ph,) = owner_broadcast_traffic(c, 2, 2, windows)
    assert ph.links == {(0, 2): [1.2 * GB, 2.0], (0, 3): [1.2 * GB, 2.0], (1, 2): [0.5 * GB, 1.0],
                        (1, 3): [0.5 * GB, 1.0]}
    assert ph.steps == 2 and ph.fill_steps == 0  # trees of 3 members: the root sends to both at once
    # The windows pipeline. Rank 0 sends 2.4 GB at 2 GB/s (1.2 s); rank 1 packs 0.5 GB (0.125 s +
    # 1 ms) and sends 1 GB (0.5 s); rank 2 receives 1.7 GB (0.85 s) and copies out 1.2 GB in 3
    # copies (0.3 s + 3 ms). Rank 0 is the busiest; plus one collective step per window.
    assert phase_time(c, 2, 2, ph).seconds == pytest.approx(1.2 + 2 * 0.01)
    # Five members: the root's child 1 forwards to 3, so the last box lags once, by the largest box.
    (ph,) = owner_broadcast_traffic(c, 1, 4, [{"items": [(0, 1 * GB, False)], "keep": {}},
                                              {"items": [(0, 2 * GB, False)], "keep": {}}])
    assert (ph.fill_steps, ph.fill_bytes) == (1, 2 * GB)
    # Rank 0 sends 3 GB to each of 3 children (4.5 s); fill 2 GB at 2 GB/s; two steps.
    assert phase_time(c, 1, 4, ph).seconds == pytest.approx(4.5 + 1.0 + 2 * 0.01)
    assert owner_broadcast_traffic(c, 1, 4, []) == []


def test_serialized_copies_its_own_shards_first_then_gathers():
    src = build("tiny", "framework=megatron,tp=2")
    c = shared_host(broadcast="tree")
    phases = serialized_traffic(c, src, 2, 1000.0, {2: 500.0, 3: 500.0}, bucket_bytes=600.0)
    assert [p.name for p in phases] == ["local copy", "gather", "broadcast"]
    assert not phases[0].links and phases[0].copies[0] > 0
    assert set(phases[1].links) == {(1, 0)} and phases[1].steps == 1
    b = phases[2]
    assert set(b.links) == {(0, 2), (0, 3)} and b.steps == 2  # 1000 B in buckets of 600 B
    assert b.copies[0] == 1000.0 and b.copies[2] == 1500.0  # rank 0 packs; receivers copy the bucket, then keep


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
    from reshard.common.models.frameworks import build
    from reshard.common.plan.planner import PlanOptions, make_plan
    from reshard.tools.simulate import plan_traffic

    plan = make_plan(build("tiny", "framework=megatron,tp=2"), build("tiny", "framework=vllm,tp=2,dp=3"),
                     PlanOptions(bucket_bytes=4096, direct_min_bytes=1024, max_message_bytes=8192))
    fast = {p.name: p for p in plan_traffic(plan)}
    slow = {p.name: p for p in plan_traffic(plan, weight=lambda name: 1.0)}
    assert set(fast) == set(slow) == {"first packing", "source", "relay"}
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


def test_local_profile_from_calibration_spans():
    """The bench's calibration: a rate is bytes over the span from the first rank's start to the
    last rank's end, the median over the passes after the warm one; steps are spans over 50."""
    from reshard.tools.bench import _PROBE_STEPS, _PROBE_STREAM_BYTES, _PROBE_STREAM_COUNT, _STEPS, _local_cluster, calibration

    raw = {"ranks": 4, "latency_s": 1e-4, "copy_gbps": 5.0, "copy_op_s": 5e-6, "checksum_gbps": 2.0,
           "checksum_op_s": 1e-4, "stream_bytes": 1e9}
    spans = []
    for rep, (one, two) in enumerate([(9.0, 9.0), (0.5, 0.5), (0.4, 0.8), (0.5, 1.0)]):  # pass 0 is the warm-up
        spans += [(("stream", 1), rep, 0, 10.0, 10.0 + one), (("stream", 1), rep, 1, 10.1, 10.0 + one)]
        spans += [(("stream", 2), rep, g, 20.0, 20.0 + two * (g + 1) / 4) for g in range(4)]
        spans += [(("rounds", 2, 2), rep, g, 0.0, 0.1) for g in range(4)]
        spans += [(("windows", 2, 2), rep, g, 0.0, 0.2) for g in range(4)]
    spans += [(("start", 2, 2), rep, g, 0.0, 0.006) for rep in range(3) for g in range(4)]
    # Probes in the repeats of layout pair 0 (2 -> 2): every pass counts.
    for rep, (one, two) in enumerate([(0.25, 0.5), (0.3, 0.6), (0.2, 0.4)], start=1):
        key = ("probe", 0)
        spans += [((*key, ("stream", 1)), rep, g, 5.0, 5.0 + one) for g in range(2)]
        spans += [((*key, ("stream", 2)), rep, g, 5.0, 5.0 + two) for g in range(4)]
        spans += [((*key, "rounds"), rep, g, 0.0, 0.03) for g in range(4)]
        spans += [((*key, "windows"), rep, g, 0.0, 0.05) for g in range(4)]
        spans += [((*key, "start"), rep, g, 0.0, 0.03) for g in range(4)]
    cal = calibration(raw, spans, [(2, 2)], {0: (2, 2), 1: (2, 2)})
    assert cal["pair_gbps"] == pytest.approx(1e9 / 0.5 / 1e9)  # median of 0.5, 0.4, 0.5 s
    shape = cal["shapes"]["2->2"]
    assert shape["aggregate_streams"] == 2
    assert shape["aggregate_gbps"] == pytest.approx(2e9 / 0.8 / 1e9)  # median of 0.5, 0.8, 1.0 s
    assert shape["round_s"] == pytest.approx(0.1 / _STEPS)
    assert shape["collective_s"] == pytest.approx(0.2 / _STEPS)
    # The start round moves 1 MiB per pair: 4 MiB over the shared cores at 2.5 GB/s is what the
    # model already gives it (each process moves 2 MiB at 2 GB/s, less), and so is one round.
    assert shape["start_s"] == pytest.approx(0.006 - 4 * (1 << 20) / 2.5e9 - 0.1 / _STEPS)
    c = _local_cluster(cal, 2, 2)
    assert (c.nvlink_gbps, c.node_cpu_gbps, c.round_s) == pytest.approx((2.0, 2.5, 0.002))
    assert c.colocated and c.broadcast == "tree" and c.cores >= 1
    probes = cal["layouts"]["0"]
    stream = _PROBE_STREAM_BYTES * _PROBE_STREAM_COUNT
    assert probes["pair_gbps"] == pytest.approx(stream / 0.25 / 1e9)  # median of 0.25, 0.3, 0.2 s
    assert probes["aggregate_gbps"] == pytest.approx(2 * stream / 0.5 / 1e9)
    assert probes["round_s"] == pytest.approx(0.03 / _PROBE_STEPS) and probes["passes"] == 3
    assert probes["collective_s"] == pytest.approx(0.05 / _PROBE_STEPS)
    burst = max(2 * (1 << 20) / (probes["pair_gbps"] * 1e9), 4 * (1 << 20) / (probes["aggregate_gbps"] * 1e9))
    assert probes["start_s"] == pytest.approx(0.03 - burst - 0.003) and probes["start_s"] > 0
    c = _local_cluster(cal, 2, 2, 0)  # layout pair 0 is predicted from its own probes
    assert (c.nvlink_gbps, c.node_cpu_gbps, c.round_s, c.start_s) == pytest.approx(
        (probes["pair_gbps"], probes["aggregate_gbps"], 0.003, probes["start_s"]))
    assert "1" not in cal["layouts"] and _local_cluster(cal, 2, 2, 1).round_s == pytest.approx(0.002)  # no probes
    assert "alone" not in cal and cal["copy_gbps"] == 5.0
    # Copy and checksum rates measured with every core busy replace rank 0's rates alone.
    busy = calibration(raw, spans, [(2, 2)], busy_rates={"copy_gbps": [4.0, 3.0], "checksum_gbps": [1.5, 1.7, 1.6]})
    assert (busy["copy_gbps"], busy["checksum_gbps"]) == pytest.approx((3.5, 1.6))
    assert busy["alone"] == {"copy_gbps": 5.0, "checksum_gbps": 2.0}
    assert _local_cluster(busy, 2, 2).copy_gbps == pytest.approx(3.5)


def test_owner_broadcast_windows_follow_the_owners():
    """Window k holds every owner's k-th box; every receiver copies out what it keeps."""
    from reshard.tools.bench_methods import _owner_items, owner_broadcast_windows

    src, dst = build("tiny", "framework=megatron,tp=2"), build("tiny", "framework=vllm,tp=2")
    items = _owner_items(src)
    windows = owner_broadcast_windows(src, dst)
    assert len(windows) == max(len(v) for v in items.values())
    for o, v in items.items():
        assert [n for w in windows for (owner, n, _) in w["items"] if owner == o] == [it.nbytes for it in v]
    for d in (2, 3):
        kept = sum(w["keep"][d][0] for w in windows)
        assert kept == sum(p.box.numel * 2 for b in dst.ranks[d - 2] for p in b.pieces)  # bf16: all it holds


def test_short_runs_get_more_repeats():
    """Every rank takes the slowest rank's first runs; the fastest method decides how many repeats
    give it about `min_seconds` of timed runs, between `repeats` and `max_repeats`."""
    import datetime

    from torch.distributed import HashStore
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    from reshard.tools.bench import _agree_repeats

    pg = ProcessGroupGloo(HashStore(), 0, 1, datetime.timedelta(seconds=30))
    opts = {"min_seconds": 0.3, "repeats": 3, "max_repeats": 30}
    assert _agree_repeats(pg, [0.5, 0.04, 0.2], opts) == 8  # 0.3 s / 40 ms
    assert _agree_repeats(pg, [0.5, 0.001], opts) == 30  # capped
    assert _agree_repeats(pg, [0.5, 0.2], opts) == 3  # long runs: the floor
    assert _agree_repeats(pg, [0.001], dict(opts, min_seconds=0.0)) == 3  # off
