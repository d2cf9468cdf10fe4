"""A cluster model fed with the real plan: predicted update times and the bottleneck link.

The model is deliberately simple and stated in full, so its numbers can be checked by
hand. Every rank is a GPU (or, on the local profile, a process) with four ports:
NVLink egress and ingress (towards ranks of its own node) and NIC egress and ingress
(towards other nodes), each with the cluster's per-GPU bandwidth. A transfer of n bytes
from rank a to rank b loads a's egress and b's ingress port of the kind their placement
decides. A *phase* is a set of transfers that run at the same time; its time is that of
its busiest resource:

    t(resource) = bytes(resource) / bandwidth(resource) [+ messages * latency on egress]
    t(phase)    = max over resources of t(resource)  (+ pipeline fill, see below)

plus the phase's synchronisation steps (`round_s`, `collective_s`), and an update takes
the sum of its phases plus `start_s`. Packing/unpacking copies (`copy_gbps`, `copy_op_s`)
and checksums (`checksum_gbps`, `checksum_op_s`) are a resource of their rank where
configured (free on GPUs by default).

The local profile (`cores` set: the bench's machine) is a shared host instead: every rank
is a process on the same cores. A phase lasts as long as the busier of each process's own
work, done in turn (the bytes it sends and receives at the one-pair rate, its copies, its
checksums), and the shared cores (every wire byte at the aggregate rate of concurrent
streams, `node_cpu_gbps`, plus everyone's CPU work divided over the cores).

Traffic comes from the planner's plan, message by message (`wire_bytes` per
(source, destination) pair): the source phase holds every trainer -> inference message;
the relay phase holds replica -> replica relays, plus the fill of its pipelined chains
(one step per extra link). The engine starts a relay as soon as its buffers have landed,
so the relay phase runs during the source phase: the two are timed as one phase whose
ports carry both loads. A sender packs its first round before it sends anything, and a
receiver unpacks its last round once it has landed: each is a phase of its own. The serialized baseline is modelled as our own
implementation runs it: rank 0 copies its own shards, gathers the others', then
broadcasts (NCCL-like pipelined rings on a cluster, gloo's binomial tree locally).

`hierarchical` models NCCL M2N's hierarchical algorithm: bytes that cross nodes are
spread evenly over all NICs of the source node and of the destination node, moving
over NVLink to and from them; "direct" (the default) sends every byte through the
sending and receiving GPUs' own NICs.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Callable

import numpy as np

from reshard.common.layout.core import Layout
from reshard.common.layout.tables import unique_rows
from reshard.common.plan.planner import Plan, Side

GB = 1e9


@dataclasses.dataclass(kw_only=True, slots=True)
class Cluster:
    name: str = "custom"
    """A label for reports."""
    gpus_per_node: int = 8
    """GPUs sharing one NVLink domain."""
    nvlink_gbps: float = 450.0
    """NVLink bandwidth per GPU and direction, GB/s."""
    nic_gbps: float = 50.0
    """NIC bandwidth per GPU and direction across nodes, GB/s (400 Gb/s = 50 GB/s)."""
    latency_s: float = 10e-6
    """Fixed cost per message on its sender's port."""
    copy_gbps: float = 0.0
    """Packing/unpacking bandwidth per rank (0: free, e.g. device memory copies)."""
    copy_op_s: float = 0.0
    """Fixed cost of one packing/unpacking copy (one segment), seconds."""
    node_cpu_gbps: float = 0.0
    """Wire GB/s all ranks of a shared host move together, at least `cores` streams at once
    (the local profile; used when `cores` is set)."""
    cores: int = 0
    """Cores of a shared host (the local profile): every rank of a node is a process on the same
    cores, so their CPU work adds up there (0: ranks have hardware of their own, as GPUs do)."""
    checksum_gbps: float = 0.0
    """Checksum rate of one rank (one core), GB/s (0: verification is not modelled)."""
    checksum_op_s: float = 0.0
    """Fixed cost of one checksum (one box), seconds."""
    round_s: float = 0.0
    """One synchronisation step of point-to-point messages (post, rendezvous, wait), seconds."""
    collective_s: float = 0.0
    """One step of the broadcasts that run at once (the owners' k-th boxes), seconds."""
    start_s: float = 0.0
    """Fixed cost of one update: its first step, with the timing harness's start (seconds)."""
    broadcast: str = "ring"
    """How the baseline broadcasts: 'ring' (NCCL, pipelined, one ring per GPU of a node) or 'tree' (gloo)."""
    colocated: bool = False
    """Trainer and inference ranks share nodes (the local box) instead of using nodes of their own."""

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be at least 1, got {self.gpus_per_node}")
        for f in ("nvlink_gbps", "nic_gbps"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{f} must be positive, got {getattr(self, f)}")
        costs = ("latency_s", "copy_gbps", "copy_op_s", "node_cpu_gbps", "cores", "checksum_gbps", "checksum_op_s", "round_s",
                 "collective_s", "start_s")
        if min(getattr(self, f) for f in costs) < 0:
            raise ValueError(f"{', '.join(costs)} must not be negative")
        if self.cores and not (self.node_cpu_gbps and self.copy_gbps):
            raise ValueError("a shared host (cores > 0) needs node_cpu_gbps and copy_gbps")
        if self.broadcast not in ("ring", "tree"):
            raise ValueError(f"broadcast must be 'ring' or 'tree', not {self.broadcast!r}")


CLUSTERS: dict[str, Cluster] = {
    # 8 x H100 SXM per node: NVLink 4 (900 GB/s both directions), one 400 Gb/s NIC per GPU.
    "h100-8x400g": Cluster(name="h100-8x400g", gpus_per_node=8, nvlink_gbps=450.0, nic_gbps=50.0, latency_s=10e-6),
    # 8 x H20 per node: NVLink 900 GB/s both directions, one 400 Gb/s NIC per GPU.
    "h20-8x400g": Cluster(name="h20-8x400g", gpus_per_node=8, nvlink_gbps=450.0, nic_gbps=50.0, latency_s=10e-6),
    # GB200 NVL72 racks as NCCL M2N used them: 64 GPUs of one NVLink domain per side,
    # NVLink 5 (1.8 TB/s both directions), one 400 Gb/s NIC per GPU between racks.
    "gb200-nvl72": Cluster(name="gb200-nvl72", gpus_per_node=64, nvlink_gbps=900.0, nic_gbps=50.0, latency_s=5e-6),
}


def cluster_by_name(name: str) -> Cluster:
    try:
        return CLUSTERS[name]
    except KeyError:
        raise ValueError(f"unknown cluster {name!r}; valid clusters: {', '.join(CLUSTERS)}") from None


@dataclasses.dataclass(slots=True)
class Phase:
    """Transfers that run at the same time. Ranks are global: trainer r is r, inference d is S + d."""

    name: str
    links: dict[tuple[int, int], list[float]] = dataclasses.field(default_factory=dict)
    """(source rank, destination rank) -> [bytes, messages]."""
    copies: dict[int, float] = dataclasses.field(default_factory=lambda: defaultdict(float))
    """Rank -> bytes it packs or unpacks in this phase."""
    copy_ops: dict[int, float] = dataclasses.field(default_factory=lambda: defaultdict(float))
    """Rank -> packing/unpacking copies (segments) it makes in this phase."""
    fill_steps: int = 0
    """Extra pipeline steps (a relay chain of k links adds k - 1)."""
    fill_bytes: float = 0.0
    """Bytes of one pipeline step (the largest relay message)."""
    overlaps_previous: bool = False
    """Runs at the same time as the phase before it (relays overlap the source phase): the
    two share their ports and are timed as one."""
    checksums: dict[int, float] = dataclasses.field(default_factory=lambda: defaultdict(float))
    """Rank -> bytes it checksums in this phase."""
    checksum_ops: dict[int, float] = dataclasses.field(default_factory=lambda: defaultdict(float))
    """Rank -> checksums (boxes) it computes in this phase."""
    steps: float = 0.0
    """Synchronisation steps the phase runs one after another (rounds, broadcast windows)."""
    step: str = "round"
    """What one step costs: 'round' (point-to-point, `round_s`) or 'collective' (`collective_s`)."""

    def add(self, a: int, b: int, nbytes: float, messages: float = 1.0) -> None:
        cur = self.links.get((a, b))
        if cur is None:
            self.links[(a, b)] = [float(nbytes), float(messages)]
        else:
            cur[0] += nbytes
            cur[1] += messages

    @property
    def wire_bytes(self) -> float:
        return sum(v[0] for v in self.links.values())


@dataclasses.dataclass(slots=True)
class PhaseResult:
    name: str
    seconds: float
    bottleneck: str
    bytes: float


@dataclasses.dataclass(slots=True)
class Prediction:
    seconds: float
    bottleneck: str
    phases: list[PhaseResult]

    def to_json(self) -> dict:
        return {"seconds": self.seconds, "bottleneck": self.bottleneck,
                "phases": [dataclasses.asdict(p) for p in self.phases]}


class _Placement:
    def __init__(self, c: Cluster, src_world: int, dst_world: int) -> None:
        self.c, self.S, self.D = c, src_world, dst_world
        self.first_dst_node = 0 if c.colocated else math.ceil(src_world / c.gpus_per_node)

    def node(self, rank: int) -> int:
        g = self.c.gpus_per_node
        if self.c.colocated:
            return rank // g
        return rank // g if rank < self.S else self.first_dst_node + (rank - self.S) // g

    def name(self, rank: int) -> str:
        return f"rank {rank} (trainer {rank})" if rank < self.S else f"rank {rank} (inference {rank - self.S})"

    def node_name(self, node: int) -> str:
        if self.c.colocated:
            return f"node {node}"
        side = "trainer" if node < self.first_dst_node else "inference"
        return f"node {node} ({side})"


def phase_time(c: Cluster, src_world: int, dst_world: int, ph: Phase, hierarchical: bool = False) -> PhaseResult:
    """Seconds of one phase on cluster `c` and the resource that sets them."""
    if c.cores:
        return _shared_host_time(c, src_world, dst_world, ph)
    pl = _Placement(c, src_world, dst_world)
    res: dict[tuple[str, str, int], float] = defaultdict(float)
    nvl, nic, lat, g = c.nvlink_gbps * GB, c.nic_gbps * GB, c.latency_s, c.gpus_per_node
    for (a, b), (n, msgs) in ph.links.items():
        na, nb = pl.node(a), pl.node(b)
        if na == nb:
            res[("nvlink egress", "rank", a)] += n / nvl + msgs * lat
            res[("nvlink ingress", "rank", b)] += n / nvl
        elif hierarchical:
            # Spread over the G NICs of each node; (G-1)/G of the bytes hop over NVLink to or from them.
            res[("nic egress", "node", na)] += n / (g * nic) + msgs * lat / g
            res[("nic ingress", "node", nb)] += n / (g * nic)
            res[("nvlink egress", "rank", a)] += n * (g - 1) / g / nvl
            res[("nvlink ingress", "rank", b)] += n * (g - 1) / g / nvl
        else:
            res[("nic egress", "rank", a)] += n / nic + msgs * lat
            res[("nic ingress", "rank", b)] += n / nic
    for r, t in _cpu_work(c, ph).items():
        res[("copies", "rank", r)] += t
    if not res:
        return PhaseResult(ph.name, 0.0, "nothing to move", 0.0)
    key = max(sorted(res), key=lambda k: res[k])
    seconds = res[key] + _steps_and_fill(c, pl, ph)
    what, scope, who = key
    where = pl.name(who) if scope == "rank" else pl.node_name(who)
    return PhaseResult(ph.name, seconds, f"{what} of {where}", ph.wire_bytes)


def _cpu_work(c: Cluster, ph: Phase) -> dict[int, float]:
    """Seconds of packing, unpacking and checksumming each rank does in the phase, on one core."""
    out: dict[int, float] = defaultdict(float)
    for r in set(ph.copies) | set(ph.copy_ops) | set(ph.checksums) | set(ph.checksum_ops):
        t = ph.copies.get(r, 0.0) / (c.copy_gbps * GB) if c.copy_gbps else 0.0
        t += ph.copy_ops.get(r, 0.0) * c.copy_op_s
        if c.checksum_gbps:
            t += ph.checksums.get(r, 0.0) / (c.checksum_gbps * GB)
        t += ph.checksum_ops.get(r, 0.0) * c.checksum_op_s
        if t:
            out[r] = t
    return out


def _steps_and_fill(c: Cluster, pl: _Placement, ph: Phase) -> float:
    """The phase's synchronisation steps, and one pipelined step per extra chain link (the
    largest relay message on the slowest link used)."""
    t = ph.steps * (c.collective_s if ph.step == "collective" else c.round_s)
    if ph.fill_steps and ph.links:
        slowest = min(c.nvlink_gbps if pl.node(a) == pl.node(b) else c.nic_gbps for a, b in ph.links) * GB
        # A measured collective step already holds its tree's latencies; other fills pay one per link.
        lat = 0.0 if (ph.step == "collective" and c.collective_s) else c.latency_s
        t += ph.fill_steps * (ph.fill_bytes / slowest + lat)
    return t


def _shared_host_time(c: Cluster, src_world: int, dst_world: int, ph: Phase) -> PhaseResult:
    """A phase on a shared host (the local profile: one process per rank, all on `c.cores` cores).

    Each rank is a process that does its own work in turn: the bytes it sends and receives at
    the one-pair rate (`nvlink_gbps`, or `nic_gbps` across nodes), then its packing, unpacking
    and checksums. All of a node's processes share its cores: the wire bytes of every link at
    the aggregate rate of concurrent streams (`node_cpu_gbps`), plus everyone's CPU work over
    the cores. The phase lasts as long as the busier of the two, plus its steps and fill.
    """
    pl = _Placement(c, src_world, dst_world)
    res: dict[tuple[str, str, int], float] = defaultdict(float)
    for (a, b), (n, _) in ph.links.items():
        rate = (c.nvlink_gbps if pl.node(a) == pl.node(b) else c.nic_gbps) * GB
        res[("process", "rank", a)] += n / rate
        res[("process", "rank", b)] += n / rate
        res[("shared CPU", "node", pl.node(a))] += n / (c.node_cpu_gbps * GB)
    for r, t in _cpu_work(c, ph).items():
        res[("process", "rank", r)] += t
        res[("shared CPU", "node", pl.node(r))] += t / c.cores
    extra = _steps_and_fill(c, pl, ph)
    if not res:
        return PhaseResult(ph.name, extra, "synchronisation steps" if extra else "nothing to move", 0.0)
    key = max(sorted(res), key=lambda k: res[k])
    what, scope, who = key
    where = pl.name(who) if scope == "rank" else pl.node_name(who)
    return PhaseResult(ph.name, res[key] + extra, f"{what} of {where}", ph.wire_bytes)


def merge_phases(a: Phase, b: Phase) -> Phase:
    """Two concurrent phases as one: their loads add up on every port; b's pipeline fill stays."""
    out = Phase(f"{a.name}+{b.name}", {k: list(v) for k, v in a.links.items()},
                fill_steps=max(a.fill_steps, b.fill_steps), fill_bytes=max(a.fill_bytes, b.fill_bytes),
                steps=max(a.steps, b.steps), step=a.step)
    for k, (nb, nm) in b.links.items():
        out.add(k[0], k[1], nb, nm)
    for src in (a, b):
        for r, v in src.copies.items():
            out.copies[r] += v
        for r, v in src.copy_ops.items():
            out.copy_ops[r] += v
        for r, v in src.checksums.items():
            out.checksums[r] += v
        for r, v in src.checksum_ops.items():
            out.checksum_ops[r] += v
    return out


def predict(c: Cluster, src_world: int, dst_world: int, phases: list[Phase], hierarchical: bool = False) -> Prediction:
    timed: list[Phase] = []
    for ph in phases:
        timed.append(merge_phases(timed.pop(), ph) if ph.overlaps_previous and timed else ph)
    results = [phase_time(c, src_world, dst_world, ph, hierarchical) for ph in timed]
    total = sum(r.seconds for r in results) + (c.start_s if results else 0.0)
    busiest = max(results, key=lambda r: r.seconds) if results else None
    bottleneck = f"{busiest.bottleneck}, in the {busiest.name} phase" if busiest and busiest.seconds else "nothing to move"
    return Prediction(total, bottleneck, results)


# -- traffic from plans and layouts --------------------------------------------------

Weight = Callable[[str], float]


def layer_weight(scale: float) -> Weight:
    """Weight of a tensor or buffer name: `scale` for decoder-layer tensors, 1 for the rest."""
    def w(name: str) -> float:
        return scale if ".layers." in name else 1.0
    return w


def _message_weight(m, weight: Weight | None) -> float:
    if weight is None:
        return 1.0
    total = sum(s.nbytes for s in m.segments) or 1
    return sum(s.nbytes * weight(s.tensor or s.dst.buffer) for s in m.segments) / total


def _relay_depth(plan: Plan) -> int:
    sizes: dict[int, int] = defaultdict(int)
    for r, p in plan.primary_of.items():
        if r != p:
            sizes[p] += 1
    return max(sizes.values(), default=0)


def plan_traffic(plan: Plan, weight: Weight | None = None, copies: bool = True,
                 checksums: bool = False) -> list[Phase]:
    """The plan's messages as phases: source (trainer -> inference), then relays, one
    synchronisation step per round. `copies=False` leaves out packing (the raw ceiling: plain
    buffers). `checksums=True` adds verification: senders checksum what they send, during the
    transfer; then every inference rank checksums what it received, after one exchange step."""
    S = plan.src_world
    src, relay = Phase("source"), Phase("relay")
    if weight is None:
        _table_traffic(plan, src, relay, copies)
    # A sender packs its first round before it posts anything; later rounds are packed while the
    # round before is in flight. The first round's packing is a phase of its own.
    t = plan.message_table()
    sent = ~t["relay"]
    first = np.full(S, np.iinfo(np.int64).max)
    np.minimum.at(first, t["src"][sent], t["round"][sent])
    lead = Phase("first packing")
    # Symmetrically, a receiver unpacks its last round only after that round has landed.
    last = np.full(plan.dst_world, -1)
    np.maximum.at(last, t["dst"][sent], t["round"][sent])
    tail = Phase("last unpacking")
    for m in (plan.messages if weight is not None else ()):
        w = _message_weight(m, weight)
        a = S + m.src if m.relay else m.src
        b = S + m.dst
        ph = relay if m.relay else src
        ph.add(a, b, m.wire_bytes * w, w)
        if copies:
            if not m.send_direct:
                packing = lead if (not m.relay and m.round == first[m.src]) else ph
                packing.copies[a] += m.nbytes * w
                packing.copy_ops[a] += len(m.segments) * w
            if not m.recv_direct:
                unpacking = tail if (not m.relay and m.round == last[m.dst]) else ph
                unpacking.copies[b] += m.nbytes * w
                unpacking.copy_ops[b] += len(m.segments) * w
        if m.relay:
            relay.fill_bytes = max(relay.fill_bytes, float(m.wire_bytes))
    depth = _relay_depth(plan)
    relay.fill_steps = max(0, depth - 1)
    # The engine starts each relay as soon as its buffers have landed: relays run during the
    # source phase, not after it.
    relay.overlaps_previous = True
    src.steps = float(plan.num_rounds)
    phases = [p for p in (src, relay) if p.links]
    a = np.where(t["relay"], S + t["src"], t["src"])
    b = S + t["dst"]
    if copies and weight is None and sent.any():
        # The first round's packing and the last round's unpacking, moved out of the source phase.
        for to, side, offset, direct, edge in ((lead, "src", 0, "sd", first), (tail, "dst", S, "rd", last)):
            sel = sent & ~t[direct] & (t["round"] == edge[np.where(sent, t[side], 0)])
            nb = np.bincount(t[side][sel], weights=t["nbytes"][sel], minlength=len(edge))
            ns = np.bincount(t[side][sel], weights=t["segments"][sel], minlength=len(edge))
            for r in np.flatnonzero(nb).tolist():
                to.copies[offset + r] += float(nb[r])
                to.copy_ops[offset + r] += float(ns[r])
                src.copies[offset + r] -= float(nb[r])
                src.copy_ops[offset + r] -= float(ns[r])
    if lead.copies:
        phases.insert(0, lead)
    if tail.copies:
        phases.insert(phases.index(src) + (2 if relay.links else 1), tail)
    if checksums:
        # Senders checksum every segment they send, during the transfer; after an exchange (each
        # inference rank waits for two messages from every trainer rank, one after another: a
        # synchronisation step each), every inference rank checksums what it received.
        verify = Phase("verify", steps=2.0 * S)
        for ranks, ph, rows in ((a, src, sent), (b, verify, np.ones_like(sent))):
            ur, ri = np.unique(ranks[rows], return_inverse=True)
            nb = np.bincount(ri, weights=t["nbytes"][rows], minlength=len(ur))
            ns = np.bincount(ri, weights=t["segments"][rows], minlength=len(ur))
            for r, n, k in zip(ur.tolist(), nb.tolist(), ns.tolist()):
                ph.checksums[r] += n
                ph.checksum_ops[r] += k
        phases.append(verify)
    return phases


def _table_traffic(plan: Plan, src: Phase, relay: Phase, copies: bool) -> None:
    """plan_traffic from the plan's columns (no Message objects): same sums, at any scale."""
    t = plan.message_table()
    S = plan.src_world
    a = np.where(t["relay"], S + t["src"], t["src"])
    b = S + t["dst"]
    for ph, sel in ((src, ~t["relay"]), (relay, t["relay"])):
        if not sel.any():
            continue
        uniq, inv = unique_rows(a[sel], b[sel])
        wire = np.bincount(inv, weights=t["wire_bytes"][sel], minlength=len(uniq))
        count = np.bincount(inv, minlength=len(uniq))
        for (x, y), w, c in zip(uniq.tolist(), wire.tolist(), count.tolist()):
            ph.links[(x, y)] = [float(w), float(c)]
        if copies:
            nb, ns = t["nbytes"][sel], t["segments"][sel]
            for ranks, staged in ((a[sel], ~t["sd"][sel]), (b[sel], ~t["rd"][sel])):
                r, n, k = ranks[staged], nb[staged], ns[staged]
                if r.size:
                    ur, ri = np.unique(r, return_inverse=True)
                    for x, v, o in zip(ur.tolist(), np.bincount(ri, weights=n).tolist(), np.bincount(ri, weights=k).tolist()):
                        ph.copies[x] += v
                        ph.copy_ops[x] += o
    if t["relay"].any():
        relay.fill_bytes = float(t["wire_bytes"][t["relay"]].max())


def _distinct_boxes(src: Layout):
    """Per tensor: distinct source boxes -> list of (rank, contiguous in its buffer)."""
    out: dict[str, dict] = defaultdict(lambda: defaultdict(list))
    for rank, bufs in enumerate(src.ranks):
        for buf in bufs:
            for p in buf.pieces:
                start, strides = p.base(buf.shape)
                out[p.tensor][p.box].append((rank, Side(buf.name, start, strides).contiguous(p.box.size)))
    return out


def gather_bytes(src: Layout, weight: Weight | None = None):
    """What gathering every tensor onto trainer rank 0 moves: bytes each rank sends to rank 0,
    bytes each rank packs or unpacks, rank 0's local copies, and copy operations per rank.
    Replicated boxes are sent by rank 0 when it holds them, else by the least-loaded holder
    (as the planner balances)."""
    sent: dict[int, float] = defaultdict(float)
    copies: dict[int, float] = defaultdict(float)
    ops: dict[int, float] = defaultdict(float)
    local = 0.0
    for name, boxes in sorted(_distinct_boxes(src).items()):
        spec = src.tensors[name]
        w = weight(name) if weight else 1.0
        for box, holders in sorted(boxes.items(), key=lambda kv: (kv[0].offset, kv[0].size)):
            n = box.numel * spec.nbytes // spec.numel * w
            if any(r == 0 for r, _ in holders):
                local += n
                ops[0] += w
                continue
            rank, contiguous = min(holders, key=lambda h: (sent[h[0]], h[0]))
            sent[rank] += n
            if not contiguous:
                copies[rank] += n
                ops[rank] += w
            if box.contiguous_range(spec.shape) is None:
                copies[0] += n
                ops[0] += w
    return dict(sent), dict(copies), local, dict(ops)


def gloo_tree(n: int) -> list[list[tuple[int, int]]]:
    """gloo's broadcast among n members, root 0: member v receives from v minus its highest set
    bit, then sends to v + 2**i for every higher bit i, all at once. Edges by generation (the
    number of set bits of the receiver): generation g starts when g - 1 has delivered."""
    gens: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for v in range(1, n):
        gens[v.bit_count()].append((v - (1 << (v.bit_length() - 1)), v))
    return [gens[g] for g in sorted(gens)]


def broadcast_phases(c: Cluster, root: int, members: list[int], nbytes: float, bucket_bytes: float) -> list[Phase]:
    """`nbytes` from `root` to every other member, in buckets of `bucket_bytes`: gloo's binomial
    tree for 'tree', or one pipelined phase of G rings (one per GPU of a node) for 'ring'.

    The tree is one phase in which every edge carries every bucket, plus one collective step per
    bucket. A member that forwards does so while the root already sends the next bucket to its
    other children, so the buckets pipeline and only the last one's later generations show: one
    bucket on the slowest link per generation after the first (the phase's fill)."""
    order = [root] + [m for m in members if m != root]
    msgs = max(1.0, nbytes / bucket_bytes)
    if c.broadcast == "tree":
        gens = gloo_tree(len(order))
        ph = Phase("broadcast", steps=math.ceil(msgs), step="collective",
                   fill_steps=max(0, len(gens) - 1), fill_bytes=min(nbytes, bucket_bytes))
        for edges in gens:
            for a, b in edges:
                ph.add(order[a], order[b], nbytes, msgs)
        return [ph]
    ph = Phase("broadcast")
    g = c.gpus_per_node
    rings = max(1, min(g, len(order) - 1))
    rest = order[1:]
    for k in range(rings):
        ring = [root] + rest[k:] + rest[:k]  # each ring enters the receivers at another GPU
        for a, b in zip(ring, ring[1:]):
            ph.add(a, b, nbytes / rings, msgs / rings)
    return [ph]


def serialized_traffic(c: Cluster, src: Layout, dst_world: int, payload_bytes: float, dst_keep: dict[int, float],
                       bucket_bytes: float = 256 << 20, weight: Weight | None = None,
                       dst_pieces: dict[int, float] | None = None, gather_bucket: float = 32 << 20) -> list[Phase]:
    """Our serialized baseline: trainer rank 0 copies its own shards, gathers the others' (rounds
    of `gather_bucket`), then broadcasts whole tensors in buckets, packing each from the gathered
    tensors. `dst_keep`: global inference rank -> bytes it keeps (copied out of each bucket);
    `dst_pieces`: how many pieces (copies) that takes."""
    S = src.world
    sent, gcopies, local, gops = gather_bytes(src, weight)
    phases = []
    if local:  # before rank 0 posts a receive: the others wait
        own = Phase("local copy")
        own.copies[0] += local
        phases.append(own)
    gather = Phase("gather", steps=math.ceil(max(sent.values(), default=0.0) / gather_bucket))
    for r, n in sent.items():
        gather.add(r, 0, n, max(1.0, n / gather_bucket))
    for r, n in gcopies.items():
        gather.copies[r] += n
    for r, n in gops.items():
        gather.copy_ops[r] += n
    if gather.links:
        phases.append(gather)
    members = [0] + list(range(S, S + dst_world))
    bphases = broadcast_phases(c, 0, members, payload_bytes, bucket_bytes)
    ntensors = float(len(src.tensors))
    bphases[0].copies[0] += payload_bytes  # packing every bucket on rank 0
    bphases[0].copy_ops[0] += ntensors
    for d in range(S, S + dst_world):
        bphases[-1].copies[d] += payload_bytes + dst_keep.get(d, 0.0)  # bucket -> scratch, then its slices
        bphases[-1].copy_ops[d] += ntensors + (dst_pieces or {}).get(d, 0.0)
    return phases + bphases


def owner_broadcast_traffic(c: Cluster, src_world: int, dst_world: int, windows: list[dict]) -> list[Phase]:
    """Per-tensor broadcast from the owning trainer ranks, window by window: in window k every
    owner broadcasts its k-th box to every inference rank, all owners at once; then the receivers
    copy out what they keep, before they join the next window.

    The windows pipeline: an owner's broadcast call returns once it has sent, so owners run
    ahead, and a receiver copies window k out while the owners already send window k + 1. So
    all windows are one phase whose ports and processes carry every window's load, plus one
    collective step per window, plus one fill of the tree's later generations at the end (the
    last receiver that forwards lags by one box, the largest such box).

    `windows[k]`: {"items": [(owner, nbytes, packed)], "keep": {global inference rank: (bytes, copies)}};
    an owner packs a box that is not contiguous in its buffer (`packed`)."""
    members = list(range(src_world, src_world + dst_world))
    ph = Phase("owner broadcast", steps=float(len(windows)), step="collective")
    for w in windows:
        for o, n, packed in w["items"]:
            for sub in broadcast_phases(c, o, [o, *members], n, max(n, 1.0)):
                for (a, b), (nb, msgs) in sub.links.items():
                    ph.add(a, b, nb, msgs)
                if sub.fill_steps and (sub.fill_steps, n) > (ph.fill_steps, ph.fill_bytes):
                    ph.fill_steps, ph.fill_bytes = sub.fill_steps, n
            if packed:
                ph.copies[o] += n
                ph.copy_ops[o] += 1
        for d, (n, ops) in w["keep"].items():
            ph.copies[d] += n
            ph.copy_ops[d] += ops
    return [ph] if windows else []


# -- presets --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Preset:
    model: str
    """Model shape (common/frameworks MODEL_SPECS)."""
    src: str
    """Trainer layout spec."""
    dst: str
    """Inference layout spec."""
    cluster: str
    """The hardware the published figure used (or, where unknown, what we assume)."""
    wire_scale: float = 1.0
    """Bytes on the wire per bf16 byte (0.5: fp8)."""
    wire: str = "bf16"
    published: str = ""
    """The published figure to set beside the prediction, with its source."""
    exact: bool = False
    """Plan the full model by default (where the representative model would mislead)."""


PRESETS: dict[str, Preset] = {
    # NCCL M2N README: trainer TP=1 CP=1 EP=16 (expert DP 2) PP=4 on 128 GB200, generator TP=8 DP=16 on 128;
    # the model config comes from the public checkpoint, whose weights are fp8.
    "deepseek-v3": Preset(model="deepseek-v3", src="framework=megatron,tp=1,pp=4,dp=32,ep=16",
                          dst="framework=vllm,tp=8,dp=16", cluster="gb200-nvl72", wire_scale=0.5, wire="fp8",
                          published="NCCL M2N: 1.447 s hierarchical, 3.838 s direct (GB200 NVL72, 128+128)"),
    # NCCL M2N README: trainer TP=2 CP=2 EP=16 PP=4 on 64 GB200, generator TP=8 DP=8 on 64; bf16 checkpoint.
    "qwen3-235b": Preset(model="qwen3-235b-a22b", src="framework=megatron,tp=2,cp=2,pp=4,dp=4,ep=16,etp=1",
                         dst="framework=vllm,tp=8,dp=8", cluster="gb200-nvl72",
                         published="NCCL M2N: 0.989 s hierarchical, 2.175 s direct (GB200 NVL72, 64+64)"),
    # Perplexity: 256 training GPUs (FSDP, bf16) -> 128 inference GPUs, fp8 on the wire. Their exact
    # inference parallelism and hardware are not published: assumed TP=8 x 16 replicas with experts
    # spread over all 128 ranks (1 TB of fp8 does not fit 8 GPUs of a replica), on 8-GPU nodes with
    # one 400 Gb/s NIC per GPU. FSDP1 flat shards stand in for FSDP2's per-parameter shards: each
    # trainer sends the same bytes, in fewer and larger messages. Planned exactly (about 20 s): flat
    # ranges put each layer on other trainer ranks, which a representative layer cannot show.
    "kimi-k2": Preset(model="kimi-k2", src="framework=fsdp,dp=256,flat=1", dst="framework=vllm,tp=8,dp=16,ep=1",
                      cluster="h100-8x400g", wire_scale=0.5, wire="fp8", exact=True,
                      published="Perplexity: 1.3 s (256 -> 128 GPUs, fp8 on the wire, RDMA WRITE)"),
}


def preset_by_name(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}") from None


def scale_phases(phases: list[Phase], factor: float) -> list[Phase]:
    """Every byte times `factor` (a wire dtype other than the layout's: fp8 for bf16 is 0.5)."""
    if factor == 1.0:
        return phases
    out = []
    for ph in phases:
        q = Phase(ph.name, {k: [v[0] * factor, v[1]] for k, v in ph.links.items()},
                  defaultdict(float, {r: n * factor for r, n in ph.copies.items()}), defaultdict(float, ph.copy_ops),
                  ph.fill_steps, ph.fill_bytes * factor, ph.overlaps_previous,
                  defaultdict(float, {r: n * factor for r, n in ph.checksums.items()}),
                  defaultdict(float, ph.checksum_ops), ph.steps, ph.step)
        out.append(q)
    return out


# -- a layout pair, end to end ----------------------------------------------------------

def _representative_layers(src_spec: str, dst_spec: str) -> int:
    """Decoder layers of the representative model: one per pipeline chunk of either side."""
    from reshard.common.models.frameworks import parse_spec

    n = 1
    for spec in (src_spec, dst_spec):
        _, kw = parse_spec(spec)
        n = max(n, kw.get("pp", 1) * kw.get("vpp", 1))
    return n


def _layer_bytes(m) -> float:
    return float(sum(t.nbytes for n, t in m.tensors().items() if ".layers." in n))


def simulate(model: str, src_spec: str, dst_spec: str, cluster: Cluster, *, exact: bool = False,
             wire_scale: float = 1.0, bucket_bytes: int = 0, progress: Callable[[str], None] | None = None) -> dict:
    """Predict reshard (with and without relays, direct and hierarchical NIC use) and the
    serialized baseline for a layout pair, from the real plan.

    Unless `exact`, the plan is made for a representative model with one decoder layer per
    pipeline chunk (MoE layers only), and the bytes and messages of decoder-layer tensors are
    scaled to the full model's decoder-layer bytes; embeddings, final norm and head are exact."""
    import time

    from reshard.common.models.frameworks import build, model_spec
    from reshard.common.plan.planner import PlanOptions, make_plan

    say = progress or (lambda s: None)
    full = model_spec(model)
    reps = _representative_layers(src_spec, dst_spec)
    if exact or full.layers <= reps:
        m, scale, how = full, 1.0, "exact: the full model planned"
    else:
        m = dataclasses.replace(full, layers=reps, first_dense=0)
        scale = _layer_bytes(full) / _layer_bytes(m)
        how = (f"representative: {reps} of {full.layers} decoder layers planned"
               f"{' (all MoE)' if full.experts else ''}, their bytes and messages scaled by {scale:.2f} "
               f"to the full model's decoder layers; embeddings and head exact")
    weight = layer_weight(scale) if scale != 1.0 else None
    t0 = time.perf_counter()
    src, dst = build(m, src_spec), build(m, dst_spec)
    opts = dict(bucket_bytes=bucket_bytes) if bucket_bytes else {}
    say(f"planning {model} {src_spec} -> {dst_spec} ({how.split(':')[0]}) ...")
    plan = make_plan(src, dst, PlanOptions(relay=True, **opts))
    plan_nr = make_plan(src, dst, PlanOptions(relay=False, **opts)) if plan.primary_of else plan
    plan_s = time.perf_counter() - t0
    S, D = src.world, dst.world
    ph = scale_phases(plan_traffic(plan, weight), wire_scale)
    ph_nr = scale_phases(plan_traffic(plan_nr, weight), wire_scale)
    reshard = predict(cluster, S, D, ph)
    no_relay = predict(cluster, S, D, ph_nr)
    hier = predict(cluster, S, D, ph, hierarchical=True)
    payload = float(full.payload_bytes)
    keep: dict[int, float] = defaultdict(float)
    for d, bufs in enumerate(dst.ranks):
        for buf in bufs:
            for p in buf.pieces:
                spec = dst.tensors[p.tensor]
                keep[S + d] += p.box.numel * spec.nbytes / spec.numel * (weight(p.tensor) if weight else 1.0)
    base = predict(cluster, S, D, scale_phases(serialized_traffic(cluster, src, D, payload, keep, weight=weight), wire_scale))
    trainer_egress = sum(p.wire_bytes for p in ph if p.name == "source")
    return {
        "model": model, "src": src_spec, "dst": dst_spec, "src_ranks": S, "dst_ranks": D,
        "cluster": dataclasses.asdict(cluster), "wire_scale": wire_scale, "plan": how, "plan_seconds": plan_s,
        "payload_bytes": payload * wire_scale, "trainer_egress_bytes": trainer_egress,
        "wire_bytes": sum(p.wire_bytes for p in ph),
        "predicted_seconds": reshard.seconds, "bottleneck": reshard.bottleneck,
        "reshard": reshard.to_json(),
        "reshard_no_relay": no_relay.to_json(),
        "hierarchical": hier.to_json(),
        "direct_over_hierarchical": no_relay.seconds / hier.seconds if hier.seconds else None,
        "baseline_predicted_seconds": base.seconds, "baseline_bottleneck": base.bottleneck,
        "baseline": base.to_json(),
        "speedup_vs_serialized": base.seconds / reshard.seconds if reshard.seconds else None,
    }
