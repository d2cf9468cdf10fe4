"""The serialized baseline, done as good frameworks do it, on the same transport.

Gather every tensor onto trainer rank 0 (the planner's gather plan, buffers
reused), then broadcast whole canonical tensors from rank 0 to every inference
rank in packed buckets; each inference rank keeps its slice. Measured beside
reshard in the demo, on the same data."""

from __future__ import annotations

import dataclasses
import time

import torch

from reshard.common.dataplane.checksum import box_checksum
from reshard.common.dataplane.engine import Engine, StagingPool
from reshard.common.dataplane.transport import Transport, TransportError
from reshard.common.layout.core import Box, Layout, LocalBuffer, Piece, dtype_of
from reshard.common.layout.wire import layout_fingerprint
from reshard.common.plan.planner import PlanOptions, make_plan


def _gather_layout(src: Layout) -> Layout:
    bufs = tuple(
        LocalBuffer(t.name, t.shape, t.dtype, (Piece(t.name, Box.full(t.shape), Box.full(t.shape)),))
        for t in src.tensors.values()
    )
    return Layout(dict(src.tensors), (bufs,))


def _buckets(dst: Layout, bucket_bytes: int) -> list[list[tuple[str, int, int]]]:
    """Whole tensors in canonical order, packed into buckets of (tensor, byte start, byte count)."""
    out, cur, used = [], [], 0
    for t in sorted(dst.tensors.values(), key=lambda t: t.name):
        start = 0
        while start < t.nbytes:
            n = min(t.nbytes - start, bucket_bytes - used)
            cur.append((t.name, start, n))
            used += n
            start += n
            if used == bucket_bytes:
                out.append(cur)
                cur, used = [], 0
    if cur:
        out.append(cur)
    return out


def run(side: str, transport: Transport, session, rank: int, src: Layout, dst: Layout,
        buffers: dict[str, torch.Tensor], shapes, pool: StagingPool, deadline: float, progress, timeout: float,
        bucket_bytes: int = 32 << 20, checksums: bool = True):
    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TransportError("update deadline passed during the serialized transfer")
        return remaining

    S, D = session.src_world, session.dst_world
    members = (0, *range(S, S + D))
    # Every rank, a member or not: NCCL makes the group's own communicator (collectively), so that
    # the broadcast is NCCL's collective rather than a star of sends from rank 0.
    transport.prepare_broadcast([members], left())
    cache = pool.__dict__.setdefault("baseline", {})
    buckets = _buckets(dst, bucket_bytes)
    total = sum(n for b in buckets for _, _, n in b)
    sums: dict = {}
    csum = 0.0
    if side == "src":
        # The gather is planned once per layout (staging of at most 32 MiB per round); the
        # broadcast buckets may be larger.
        key = ("gather", layout_fingerprint(src), min(bucket_bytes, 32 << 20))
        gplan = cache.get(key)
        if gplan is None:
            gplan = make_plan(src, _gather_layout(src), PlanOptions(bucket_bytes=key[2]))
            for old in [k for k in cache if isinstance(k, tuple) and k[0] == "gather"]:
                del cache[old]
            cache[key] = gplan
        if rank != 0:
            eng = Engine(transport, gplan, "src", rank, buffers, shapes, pool, deadline, checksums=False, dst_offset=0)
            eng.run()
            return {}, eng.bytes_done, 0.0
        full = cache.get("full")
        if full is None or set(full) != set(src.tensors):
            full = {t.name: torch.empty(t.shape, dtype=dtype_of(t.dtype), device=pool.device) for t in src.tensors.values()}
            cache["full"] = full
        local = [m for m in gplan.sends.get(0, [])]
        for m in local:  # rank 0's own shards: a local copy
            for seg in m.segments:
                seg.dst.view(full[seg.dst.buffer], seg.box.size).copy_(seg.src.view(buffers[seg.src.buffer], seg.box.size))
        remote = dataclasses.replace(gplan, recvs={0: [m for m in gplan.recvs.get(0, []) if m.src != 0]})
        Engine(transport, remote, "dst", 0, full, shapes, pool, deadline, checksums=False).run()
        flat = {n: t.view(-1).view(torch.uint8) for n, t in full.items()}
        staging = pool.get(bucket_bytes)
        done = 0
        for b in buckets:
            pos = 0
            for name, start, n in b:
                staging[pos : pos + n].copy_(flat[name][start : start + n])
                pos += n
            transport.broadcast(staging[:pos], members).wait(left())
            done += pos
            progress(done, total)
        if not checksums:
            return sums, done, csum
        t0 = time.perf_counter()
        for drank, bufs in enumerate(dst.ranks):
            for buf in bufs:
                for i, p in enumerate(buf.pieces):
                    sums[(drank, buf.name, i)] = box_checksum(full[p.tensor][p.box.slices()], p.box.offset, shapes[p.tensor])
        csum = time.perf_counter() - t0
        return sums, done, csum
    # Inference rank: receive every bucket, keep its slices.
    mine: dict[str, list[tuple[str, Piece]]] = {}
    for buf in dst.ranks[rank]:
        for p in buf.pieces:
            mine.setdefault(p.tensor, []).append((buf.name, p))
    largest = max(t.nbytes for t in dst.tensors.values())
    scratch = cache.get("scratch")
    if scratch is None or scratch.numel() < largest:
        scratch = torch.empty(largest, dtype=torch.uint8, device=pool.device)
        cache["scratch"] = scratch
    staging = pool.get(bucket_bytes)
    done = 0
    for b in buckets:
        size = sum(n for _, _, n in b)
        transport.broadcast(staging[:size], members).wait(left())
        pos = 0
        for name, start, n in b:
            spec = dst.tensors[name]
            scratch[start : start + n].copy_(staging[pos : pos + n])
            pos += n
            if start + n == spec.nbytes:  # tensor complete: keep my slices
                whole = scratch[: spec.nbytes].view(dtype_of(spec.dtype)).view(spec.shape)
                for bname, p in mine.get(name, ()):
                    p.view(buffers[bname]).copy_(whole[p.box.slices()])
        done += size
        progress(done, total)
    return {}, done, 0.0
