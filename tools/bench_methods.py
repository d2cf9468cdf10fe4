"""The ways `reshard bench` moves one update, run by every rank over one Transport.

Ranks: trainer r is transport rank r, inference d is S + d. Every method moves the
same model (synthetic weights, `synth`, step 0) between the same two layouts:

- reshard: our plan and engine, as the workers run them (sender checksums when verifying;
  the receivers then compare them with `receiver_checksums`, as the services do at VERIFY).
- serialized: `baseline.run` (gather on trainer rank 0, broadcast whole tensors in buckets).
- broadcast: per-tensor broadcast from the owning trainer ranks, no gather. Every distinct
  source box (a piece held by a trainer rank; replicated boxes are sent by one holder, the
  least loaded) is broadcast by its owner, as it lies in the owner's buffer, to every
  inference rank; the boxes of one tensor together make the whole tensor, so every inference
  rank receives every whole tensor, and copies out the parts it holds. Owners run at the same
  time: the k-th box of every owner is in flight together.
- reshard-fp8 (`reshard bench --fp8`): reshard into the destination as it serves a block-FP8
  checkpoint (`quantized.fp8_destination`: its linear weights float8_e4m3fn, with scales, where
  both sides hold them in whole 128 x 128 blocks); each
  trainer rank quantizes its pieces at every run (timed, as the trainer worker does), FP8 values
  and scales cross the wire. Checked against the weights regenerated and quantized whole block
  by whole block on the inference rank.
- ceiling: the plan's own messages (the same byte matrix, relays included, the same rounds and
  tags) as plain preallocated buffers: no packing, no checksums, no control plane.

Memory is accounted as the bytes of the staging and scratch tensors a method allocates and
keeps (model buffers excluded).
"""

from __future__ import annotations

import dataclasses
import pickle
import statistics
import time
from collections import defaultdict
from types import SimpleNamespace

import torch

from reshard.common.dataplane.checksum import P
from reshard.common.dataplane.engine import Engine, StagingPool, receiver_checksums
from reshard.common.dataplane.transport import Transport, Work
from reshard.common.layout.core import Layout, dtype_of
from reshard.common.plan.planner import Plan, Side
from reshard.common.quant import QuantizedBuffers
from reshard.tools import baseline
from reshard.tools.synth import init_box

METHODS = ("reshard", "reshard+verify", "serialized", "broadcast", "ceiling")
FP8_METHOD = "reshard-fp8"  # with --fp8
SENTINEL = 0xFF  # as bf16 (0xFFFF) a NaN: synthetic weights never hold one
_CSUM_TAG = 1 << 28


@dataclasses.dataclass(slots=True)
class Outcome:
    bytes: int = 0
    """Bytes this rank received over the transport (gather senders count what they sent to rank 0)."""
    extra_bytes: int = 0
    """Staging and scratch bytes the method holds on this rank."""
    ok: bool | None = None
    """Receiver-side verification (checksums) where the method does it."""


def _timeout(deadline: float) -> float:
    return max(0.001, deadline - time.monotonic())


def _wait_all(works: list[Work], deadline: float) -> None:
    for w in works:
        w.wait(_timeout(deadline))


class RankBench:
    """One rank's state for one layout pair: its buffers (synthetic weights on trainer ranks,
    receive buffers and their expected contents on inference ranks) and the methods."""

    def __init__(self, transport: Transport, side: str, index: int, src: Layout, dst: Layout, plan: Plan,
                 seed: int = 0, bucket_bytes: int = 256 << 20, filled: dict[str, torch.Tensor] | None = None,
                 fp8: bool = False) -> None:
        self.t, self.side, self.index = transport, side, index
        self.src, self.dst, self.plan = src, dst, plan
        self.S, self.D = src.world, dst.world
        self.seed, self.bucket_bytes = seed, bucket_bytes
        layout = src if side == "src" else dst
        self.descs = {b.name: b for b in layout.ranks[index]}
        self.shapes = {n: t.shape for n, t in layout.tensors.items()}
        self.expected: dict[str, torch.Tensor] = {}
        if filled is not None:  # a trainer rank's weights, already made for this source layout
            self.buffers = filled
        else:
            self.buffers = {n: torch.empty(b.shape, dtype=dtype_of(b.dtype)) for n, b in self.descs.items()}
        if side == "src" and filled is None:
            self._fill(self.buffers)
        else:
            self.expected = {n: torch.empty_like(t) for n, t in self.buffers.items()}
            for t in self.expected.values():
                t.view(-1).view(torch.uint8).fill_(SENTINEL)
            self._fill(self.expected)
        self.pools = {m: StagingPool() for m in (*METHODS, FP8_METHOD)}
        self._owner_items = _owner_items(src)
        self._bcast: dict = {}
        # The ceiling's plain buffers, made before any timing: this rank's sends hold its pattern.
        S = self.S
        if side == "src":
            self._ceiling_msgs = (plan.sends.get(index, []), [])
        else:
            self._ceiling_msgs = (plan.relay_sends.get(index, []), plan.recvs.get(index, []))
        me = index if side == "src" else S + index
        self._ceiling_bufs = (pattern(me, sum(m.wire_bytes for m in self._ceiling_msgs[0])),
                              torch.empty(sum(m.wire_bytes for m in self._ceiling_msgs[1]), dtype=torch.uint8))
        self.fp8 = _Fp8(self) if fp8 else None

    def _fill(self, bufs: dict[str, torch.Tensor]) -> None:
        layout = self.src if self.side == "src" else self.dst
        for name, desc in self.descs.items():
            for p in desc.pieces:
                init_box(p.view(bufs[name]), self.seed, p.tensor, p.box.offset, layout.tensors[p.tensor].shape)

    # -- verification --------------------------------------------------------------------
    def poison(self) -> None:
        """Fill the receive buffers with the sentinel, so a method that leaves a byte unwritten fails."""
        if self.side == "dst":
            for t in self.buffers.values():
                t.view(-1).view(torch.uint8).fill_(SENTINEL)
            self._ceiling_bufs[1].fill_(SENTINEL)
            if self.fp8 is not None:
                for t in self.fp8.buffers.values():
                    t.view(-1).view(torch.uint8).fill_(SENTINEL)

    def received_exact(self, method: str = "reshard") -> bool:
        """Bit-exact comparison of everything received with an independent regeneration."""
        if self.side != "dst":
            return True
        got, want = (self.fp8.buffers, self.fp8.expected) if method == FP8_METHOD else (self.buffers, self.expected)
        return all(torch.equal(got[n].view(-1).view(torch.uint8), want[n].view(-1).view(torch.uint8)) for n in got)

    # -- methods -------------------------------------------------------------------------
    def run(self, method: str, deadline: float) -> Outcome:
        return getattr(self, "_" + method.replace("+", "_").replace("-", "_"))(deadline)

    def _reshard(self, deadline: float, verify: bool = False) -> Outcome:
        pool = self.pools["reshard+verify" if verify else "reshard"]
        eng = Engine(self.t, self.plan, self.side, self.index, self.buffers, self.shapes, pool, deadline,
                     checksums=verify and self.side == "src")
        sums = eng.run()
        out = Outcome(extra_bytes=pool.nbytes)
        if self.side == "dst":
            out.bytes = sum(m.wire_bytes for m in self.plan.recvs.get(self.index, ()))
        if verify:
            out.ok = self._exchange_checksums(sums, deadline)
        return out

    def _reshard_fp8(self, deadline: float) -> Outcome:
        f = self.fp8
        pool = self.pools[FP8_METHOD]
        if self.side == "src":  # quantized at every run, as the trainer worker does at every transfer
            bufs = QuantizedBuffers(f.src.ranks[self.index], self.descs, self.buffers)
        else:
            bufs = f.buffers
        Engine(self.t, f.plan, self.side, self.index, bufs, f.shapes, pool, deadline).run()
        out = Outcome(extra_bytes=pool.nbytes)
        if self.side == "dst":
            out.bytes = sum(m.wire_bytes for m in f.plan.recvs.get(self.index, ()))
        return out

    def _reshard_verify(self, deadline: float) -> Outcome:
        return self._reshard(deadline, verify=True)

    def _exchange_checksums(self, sums: dict, deadline: float) -> bool | None:
        """Trainer ranks send their checksums to every inference rank (the controller's role at VERIFY);
        inference ranks combine them and compare with what they hold."""
        if self.side == "src":
            data = torch.frombuffer(bytearray(pickle.dumps(sorted(sums.items()))), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
            works = []
            for d in range(self.D):
                works.append(self.t.send(size.view(torch.uint8), self.S + d, _CSUM_TAG))
                works.append(self.t.send(data, self.S + d, _CSUM_TAG + 1))
            _wait_all(works, deadline)
            return None
        sent: dict = defaultdict(int)
        for s in range(self.S):
            size = torch.zeros(1, dtype=torch.int64)
            self.t.recv(size.view(torch.uint8), s, _CSUM_TAG).wait(_timeout(deadline))
            data = torch.empty(int(size.item()), dtype=torch.uint8)
            self.t.recv(data, s, _CSUM_TAG + 1).wait(_timeout(deadline))
            for k, v in pickle.loads(data.numpy().tobytes()):
                sent[k] = (sent[k] + v) % P
        expected = self.plan.expected_checksums(dict(sent))
        got = receiver_checksums(self.plan, self.index, self.buffers, self.dst, self.shapes)
        return all(k in expected and expected[k] % P == v for k, v in got.items())

    def _serialized(self, deadline: float) -> Outcome:
        pool = self.pools["serialized"]
        session = SimpleNamespace(src_world=self.S, dst_world=self.D)
        _, done, _ = baseline.run(self.side, self.t, session, self.index, self.src, self.dst, self.buffers, self.shapes,
                                  pool, deadline, lambda a, b: None, timeout=_timeout(deadline),
                                  bucket_bytes=self.bucket_bytes, checksums=False)
        cache = pool.__dict__.get("baseline", {})
        extra = pool.nbytes + sum(t.numel() * t.element_size() for v in cache.values()
                                  for t in (v.values() if isinstance(v, dict) else [v]) if isinstance(t, torch.Tensor))
        # Bytes over the transport: the gather (counted by its senders) and the broadcast (by its receivers).
        nbytes = done if (self.side == "dst" or self.index != 0) else 0
        return Outcome(bytes=nbytes, extra_bytes=extra)

    def _broadcast(self, deadline: float) -> Outcome:
        items = self._owner_items
        members = {o: (o, *range(self.S, self.S + self.D)) for o in items}
        windows = max((len(v) for v in items.values()), default=0)
        st = self._bcast
        # Collective, on every rank: each owner's group gets its own communicator on NCCL (made once).
        self.t.prepare_broadcast([members[o] for o in sorted(items)], _timeout(deadline))
        if self.side == "src":
            mine = items.get(self.index, [])
            if "staging" not in st:
                need = max((it.nbytes for it in mine if not it.contiguous), default=0)
                st["staging"] = torch.empty(need, dtype=torch.uint8)
            for it in mine:
                buf = self.buffers[it.buffer]
                view = it.side.view(buf, it.box.size)
                if it.contiguous:
                    flat = view.reshape(-1).view(torch.uint8)
                else:
                    flat = st["staging"][: it.nbytes]
                    flat.view(buf.dtype).view(it.box.size).copy_(view)
                self.t.broadcast(flat, members[self.index]).wait(_timeout(deadline))
            return Outcome(extra_bytes=st["staging"].numel())
        if "scratch" not in st:
            st["scratch"] = {o: torch.empty(max(it.nbytes for it in v), dtype=torch.uint8) for o, v in items.items()}
            mine: dict[str, list] = defaultdict(list)
            for b in self.dst.ranks[self.index]:
                for p in b.pieces:
                    mine[p.tensor].append((b.name, p))
            st["mine"] = mine
        scratch, mine = st["scratch"], st["mine"]
        received = 0
        for k in range(windows):
            batch = [(o, v[k]) for o, v in sorted(items.items()) if k < len(v)]
            works = [self.t.broadcast(scratch[o][: it.nbytes], members[o]) for o, it in batch]
            _wait_all(works, deadline)
            for o, it in batch:
                received += it.nbytes
                whole = scratch[o][: it.nbytes].view(dtype_of(it.dtype)).view(it.box.size)
                for bname, p in mine.get(it.tensor, ()):
                    inter = p.box.intersect(it.box)
                    if inter is None:
                        continue
                    rel = inter.slices_in(it.box)
                    dst_rel = inter.slices_in(p.box)
                    p.view(self.buffers[bname])[dst_rel].copy_(whole[rel])
        return Outcome(bytes=received, extra_bytes=sum(t.numel() for t in scratch.values()))

    def _ceiling(self, deadline: float) -> Outcome:
        S = self.S
        sends, recvs = self._ceiling_msgs
        sbuf, rbuf = self._ceiling_bufs
        by_round: dict[int, list] = defaultdict(list)
        pos = 0
        for m in sends:
            by_round[m.round].append((self.t.send, sbuf[pos : pos + m.wire_bytes], S + m.dst, m.tag))
            pos += m.wire_bytes
        pos = 0
        for m in recvs:
            by_round[m.round].append((self.t.recv, rbuf[pos : pos + m.wire_bytes], S + m.src if m.relay else m.src, m.tag))
            pos += m.wire_bytes
        for r in sorted(by_round):
            _wait_all([op(buf, peer, tag) for op, buf, peer, tag in by_round[r]], deadline)
        return Outcome(bytes=rbuf.numel(), extra_bytes=sbuf.numel() + rbuf.numel())

    def ceiling_exact(self) -> bool:
        """Every received ceiling message holds the bytes its sender's pattern puts at that offset."""
        if self.side != "dst":
            return True
        S = self.S
        offsets: dict[tuple, int] = {}
        for owner, msgs in [(s, self.plan.sends.get(s, [])) for s in range(S)] + \
                           [(S + d, self.plan.relay_sends.get(d, [])) for d in range(self.D)]:
            pos = 0
            for m in msgs:
                offsets[(m.relay, m.src, m.dst, m.round, m.tag)] = pos
                pos += m.wire_bytes
        rbuf, pos = self._ceiling_bufs[1], 0
        for m in self.plan.recvs.get(self.index, []):
            sender = S + m.src if m.relay else m.src
            start = offsets[(m.relay, m.src, m.dst, m.round, m.tag)]
            if not matches_pattern(rbuf[pos : pos + m.wire_bytes], sender, start):
                return False
            pos += m.wire_bytes
        return True


_CHUNK = 1 << 22


class _Fp8:
    """The block-FP8 twin of a layout pair: the destination serving FP8, the source as the trainer
    controller rewrites it (quantized on the trainer ranks), their plan; an inference rank's receive
    buffers and what they must hold: the weights regenerated (`synth`, in the trainer's dtype) and
    quantized whole block by whole block (`common/quant.py`), never through the plan."""

    def __init__(self, rb: RankBench) -> None:
        from reshard.common.layout.quantized import fp8_destination, quantized_source, whole_block_tensors
        from reshard.common.plan.planner import PlanOptions, make_plan

        # The linear weights both sides hold in whole blocks (a trainer shard that splits blocks would
        # need the engine to quantize: bf16 on the wire, as the BF16 update)
        self.dst = fp8_destination(rb.dst, whole_block_tensors(rb.src))
        self.src = quantized_source(rb.src, self.dst)
        self.plan = make_plan(self.src, self.dst, PlanOptions())
        self.shapes = {n: t.shape for n, t in self.src.tensors.items()}
        self.buffers: dict[str, torch.Tensor] = {}
        self.expected: dict[str, torch.Tensor] = {}
        if rb.side == "dst":
            for b in self.dst.ranks[rb.index]:
                self.buffers[b.name] = torch.empty(b.shape, dtype=dtype_of(b.dtype))
                self.expected[b.name] = want = torch.empty(b.shape, dtype=dtype_of(b.dtype))
                want.view(-1).view(torch.uint8).fill_(SENTINEL)  # padding: never written
                for p in b.pieces:
                    p.view(want).copy_(self._expected(rb, p))

    def _expected(self, rb: RankBench, p) -> torch.Tensor:
        from reshard.common.layout.quantized import BLOCK, SCALE_SUFFIX
        from reshard.common.quant import fp8_block_quantize

        if p.tensor.endswith(SCALE_SUFFIX) and p.tensor.removesuffix(SCALE_SUFFIX) in self.dst.tensors:
            weight = p.tensor.removesuffix(SCALE_SUFFIX)
            shape = self.dst.tensors[weight].shape
            lo = [o * k for o, k in zip(p.box.offset, BLOCK)]
            hi = [min((o + n) * k, s) for o, n, k, s in zip(p.box.offset, p.box.size, BLOCK, shape)]
            return fp8_block_quantize(self._regenerate(rb, weight, lo, [h - l_ for h, l_ in zip(hi, lo)]))[1]
        held = self._regenerate(rb, p.tensor, p.box.offset, p.box.size)
        if self.dst.tensors[p.tensor].dtype == "float8_e4m3fn":
            return fp8_block_quantize(held)[0]
        return held

    def _regenerate(self, rb: RankBench, name: str, offset, size) -> torch.Tensor:
        out = torch.empty(tuple(size), dtype=dtype_of(rb.src.tensors[name].dtype))
        init_box(out, rb.seed, name, tuple(offset), rb.src.tensors[name].shape)
        return out


def _pattern_chunk(rank: int, start: int, n: int) -> torch.Tensor:
    i = torch.arange(start, start + n, dtype=torch.int64)
    return ((i * 7 + (i >> 8) * 3 + rank * 13) & 0xFF).to(torch.uint8)


def pattern(rank: int, n: int, start: int = 0) -> torch.Tensor:
    """The bytes a ceiling sender holds: a function of its rank and the byte offset
    (made a few MiB at a time, to keep the temporaries small)."""
    out = torch.empty(n, dtype=torch.uint8)
    for pos in range(0, n, _CHUNK):
        k = min(_CHUNK, n - pos)
        out[pos : pos + k] = _pattern_chunk(rank, start + pos, k)
    return out


def matches_pattern(got: torch.Tensor, rank: int, start: int) -> bool:
    return all(torch.equal(got[pos : pos + _CHUNK], _pattern_chunk(rank, start + pos, min(_CHUNK, got.numel() - pos)))
               for pos in range(0, got.numel(), _CHUNK))


@dataclasses.dataclass(frozen=True, slots=True)
class OwnerItem:
    tensor: str
    box: object
    buffer: str
    side: Side
    dtype: str
    nbytes: int
    contiguous: bool


def _owner_items(src: Layout) -> dict[int, list[OwnerItem]]:
    """Distinct source boxes, each given to one holder (least loaded so far), per owner in canonical order."""
    holders: dict[tuple, list] = defaultdict(list)
    for rank, bufs in enumerate(src.ranks):
        for buf in bufs:
            for p in buf.pieces:
                start, strides = p.base(buf.shape)
                holders[(p.tensor, p.box)].append((rank, buf.name, Side(buf.name, start, strides), buf.dtype))
    load: dict[int, int] = defaultdict(int)
    out: dict[int, list[OwnerItem]] = defaultdict(list)
    for (tensor, box), hs in sorted(holders.items(), key=lambda kv: (kv[0][0], kv[0][1].offset, kv[0][1].size)):
        nbytes = box.numel * dtype_of(hs[0][3]).itemsize
        rank, bname, side, dtype = min(hs, key=lambda h: (load[h[0]], h[0]))
        load[rank] += nbytes
        out[rank].append(OwnerItem(tensor, box, bname, side, dtype, nbytes, side.contiguous(box.size)))
    return dict(out)


def owner_broadcast_windows(src: Layout, dst: Layout) -> list[dict]:
    """What the owner broadcast moves, window by window, as `_broadcast` runs it: in window k,
    every owner's k-th box, (owner, bytes, packed: not contiguous in its buffer); and per
    inference rank (global) the bytes it copies out and the copies it makes (one per box x piece
    overlap)."""
    items = _owner_items(src)
    pieces: dict[int, dict[str, list]] = {}
    for d, bufs in enumerate(dst.ranks):
        mine: dict[str, list] = defaultdict(list)
        for b in bufs:
            for p in b.pieces:
                mine[p.tensor].append(p)
        pieces[src.world + d] = mine
    windows = []
    for k in range(max((len(v) for v in items.values()), default=0)):
        batch = [it for _, v in sorted(items.items()) if k < len(v) for it in (v[k],)]
        keep: dict[int, list[float]] = {}
        for d, mine in pieces.items():
            n = ops = 0.0
            for it in batch:
                size = dtype_of(it.dtype).itemsize
                for p in mine.get(it.tensor, ()):
                    inter = p.box.intersect(it.box)
                    if inter is not None:
                        n += inter.numel * size
                        ops += 1
            keep[d] = (n, ops)
        owners = [o for o, v in sorted(items.items()) if k < len(v)]
        windows.append({"items": [(o, float(it.nbytes), not it.contiguous) for o, it in zip(owners, batch)],
                        "keep": keep})
    return windows


# -- calibration: this machine's transport, measured apart from any layout -----------------

def ping_pong(t: Transport, me: int, peer: int, nbytes: int, iters: int, deadline: float) -> float:
    """Seconds of one round trip of `nbytes` between transport ranks `me` (who starts) and `peer`."""
    buf = torch.zeros(max(1, nbytes), dtype=torch.uint8)
    t0 = time.perf_counter()
    for i in range(iters):
        if me < peer:
            t.send(buf, peer, 100 + i).wait(_timeout(deadline))
            t.recv(buf, peer, 100 + i).wait(_timeout(deadline))
        else:
            t.recv(buf, peer, 100 + i).wait(_timeout(deadline))
            t.send(buf, peer, 100 + i).wait(_timeout(deadline))
    return (time.perf_counter() - t0) / iters


def stream(t: Transport, me: int, peer: int, sender: bool, bufs: list[torch.Tensor], count: int,
           deadline: float) -> float:
    """One-way stream of `count` messages (the first buffer of `bufs` on the sender; the receiver
    cycles through them), then a 1-byte acknowledgement. Seconds. The buffers are allocated and
    touched by the caller, as the update's buffers are: a fresh allocation's page faults are not
    the link's rate (on this machine they fill memory at well under 1 GB/s)."""
    ack = torch.zeros(1, dtype=torch.uint8)
    t0 = time.perf_counter()
    if sender:
        _wait_all([t.send(bufs[0], peer, 500 + i) for i in range(count)], deadline)
        t.recv(ack, peer, 499).wait(_timeout(deadline))
    else:
        _wait_all([t.recv(bufs[i % len(bufs)], peer, 500 + i) for i in range(count)], deadline)
        t.send(ack, peer, 499).wait(_timeout(deadline))
    return time.perf_counter() - t0


def round_trip_rounds(t: Transport, me: int, senders: range, receivers: range, rounds: int, deadline: float,
                      nbytes: int = 64, buf: torch.Tensor | None = None) -> None:
    """`rounds` synchronisation steps of point-to-point messages: in each, every sender posts an
    `nbytes` message to every receiver, and everyone waits for theirs (an update's rounds; with
    the default 64 bytes, without the bytes). `buf`: allocated and touched by the caller, at least
    `nbytes` per peer (a fresh allocation's page faults would be timed too)."""
    need = nbytes * max(len(senders), len(receivers))
    if buf is None or buf.numel() * buf.element_size() < need:
        buf = torch.zeros(need, dtype=torch.uint8)
    buf = buf.view(torch.uint8).reshape(-1)[:need]
    for r in range(rounds):
        works = []
        if me in senders:
            works = [t.send(buf[:nbytes], d, 700 + r) for d in receivers]
        elif me in receivers:
            works = [t.recv(buf[i * nbytes : (i + 1) * nbytes], s, 700 + r) for i, s in enumerate(senders)]
        _wait_all(works, deadline)


def broadcast_windows(t: Transport, me: int, owners: range, receivers: range, windows: int, deadline: float) -> None:
    """`windows` steps of concurrent broadcasts: in each, every owner broadcasts 64 bytes to every
    receiver, and the receivers wait for all of them (the owner broadcast's windows, without the bytes)."""
    buf = torch.zeros(64 * len(owners), dtype=torch.uint8)
    members = {o: (o, *receivers) for o in owners}
    t.prepare_broadcast([members[o] for o in owners], _timeout(deadline))
    for _ in range(windows):
        if me in owners:
            t.broadcast(buf[:64], members[me]).wait(_timeout(deadline))
        elif me in receivers:
            _wait_all([t.broadcast(buf[i * 64 : (i + 1) * 64], members[o]) for i, o in enumerate(owners)], deadline)


def checksum_op_seconds(n: int = 200) -> float:
    """Fixed cost of one checksum of a small box (a piece's or a segment's), each at its own
    position in a tensor, as the engine and the receivers compute them: seconds."""
    from reshard.common.dataplane.checksum import box_checksum

    x = torch.zeros(8, 64, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    for i in range(n):
        box_checksum(x, (8 * i, 64 * i), (8 * n, 64 * n))
    return (time.perf_counter() - t0) / n


def checksum_gbps(nbytes: int = 32 << 20, iters: int = 5) -> float:
    """Checksum rate of this process (`box_checksum` over a bf16 matrix), GB/s: the median pass."""
    from reshard.common.dataplane.checksum import box_checksum

    cols = 4096
    x = torch.randn(max(1, nbytes // (cols * 2)), cols).to(torch.bfloat16)
    box_checksum(x, (0, 0), tuple(x.shape))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        box_checksum(x, (0, 0), tuple(x.shape))
        times.append(time.perf_counter() - t0)
    return x.numel() * 2 / statistics.median(times) / 1e9


def checksum_throughput(nbytes: int = 32 << 20, iters: int = 5) -> dict:
    """Checksum throughput of this process beside a plain copy (memcpy) of the same bytes, GB/s, the
    median pass each, over one contiguous bf16 matrix: the host path (`box_checksum`, what ranks on
    CPU run: torch's int32 product of aligned words, else numpy's) and the device path (`box_checksum_tensor`, torch ops, the ones a GPU runs,
    here on CPU tensors)."""
    from reshard.common.dataplane.checksum import box_checksum, box_checksum_tensor

    cols = 4096
    x = torch.randn(max(1, nbytes // (cols * 2)), cols).to(torch.bfloat16)
    out = torch.empty_like(x)
    shape, n = tuple(x.shape), x.numel() * 2

    def rate(fn) -> float:
        fn()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return n / statistics.median(times) / 1e9

    return {"bytes": n, "memcpy_gbps": rate(lambda: out.copy_(x)), "host_gbps": rate(lambda: box_checksum(x, (0, 0), shape)),
            "torch_gbps": rate(lambda: box_checksum_tensor(x, (0, 0), shape))}


def copy_op_seconds(n: int = 2000) -> float:
    """Fixed cost of one small packing copy as the engine makes it (strided views of a flattened
    buffer into a staged byte range), seconds."""
    src = torch.randn(n, 64).to(torch.bfloat16)
    out = torch.empty(n * 64 * 2, dtype=torch.uint8)
    flat = src.reshape(-1)
    t0 = time.perf_counter()
    for i in range(n):
        view = out[i * 128 : (i + 1) * 128].view(torch.bfloat16).view((1, 64))
        view.copy_(flat.as_strided((1, 64), (64, 1), flat.storage_offset() + i * 64))
    return (time.perf_counter() - t0) / n


def copy_gbps(nbytes: int = 64 << 20, iters: int = 5) -> float:
    """Packing bandwidth of this process: strided halves of a bf16 matrix into a contiguous buffer
    and back (what the engine's pack and unpack do), GB/s of bytes moved: the median pass."""
    cols = 4096
    rows = max(1, nbytes // (cols * 2))
    src = torch.randn(rows, 2 * cols).to(torch.bfloat16)
    out = torch.empty(rows, cols, dtype=torch.bfloat16)
    out.copy_(src[:, :cols])
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out.copy_(src[:, :cols])
        src[:, cols:].copy_(out)
        times.append(time.perf_counter() - t0)
    return 2 * out.numel() * 2 / statistics.median(times) / 1e9
