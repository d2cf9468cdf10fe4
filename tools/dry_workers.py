"""Many workers in one process that speak the real worker protocol but skip the data plane:
for driving real controllers at the scale of DeepSeek-V3 (128 -> 128) on a laptop.

Buffers are meta tensors (shapes without memory). A "transfer" reports, per destination piece,
a checksum that is additive over boxes like the real one but computed from positions alone
(the sum of the elements' flat indices, plus their count), so the controllers' verification
path (slots, merged sums, each rank's share) is exercised for real: a rank whose share is
routed wrongly fails its check. (The per-piece check itself, `verify.check_rank`, is the unit
tests' job: here it would cost minutes of one core for 128 ranks of 45,000 pieces.)

    python -m reshard.tools.dry_workers --role trainer --controller HOST:PORT --ranks 0-63
        --model deepseek-v3 --layout framework=megatron,tp=1,pp=4,dp=32,ep=16 [--steps 2]
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time

import numpy as np
import torch

from reshard.common.dataplane.checksum import P
from reshard.common.layout.core import LayoutError, dtype_of
from reshard.common.models.frameworks import build
from reshard.inference_svc.worker import InferenceWorker
from reshard.proto import reshard_pb2 as pb
from reshard.trainer_svc.worker import TrainerWorker


def position_sums(off: np.ndarray, size: np.ndarray, shape: np.ndarray) -> np.ndarray:
    """Per box (rows of offsets and sizes inside tensors of `shape`, all (n, D), padded with
    offset 0 and size 1): the sum over its elements of (flat index + 1), mod P. Additive over
    disjoint boxes, like the real checksum, and computed from positions alone."""
    n, D = off.shape
    strides = np.ones((n, D), dtype=np.int64)
    for d in range(D - 2, -1, -1):
        strides[:, d] = strides[:, d + 1] * shape[:, d + 1]
    numel = np.prod(size, axis=1)
    # mod P = 2**32: products wrap mod 2**64 in uint64, which keeps them right mod 2**32
    u = lambda a: (np.asarray(a, dtype=np.int64) % P).astype(np.uint64)  # noqa: E731
    mask = np.uint64(P - 1)
    total = u(numel)
    for d in range(D):
        s, o = size[:, d], off[:, d]
        span = u(s * o + s * (s - 1) // 2)  # the sum of the indexes along d
        rest = u(numel // np.maximum(s, 1))
        total = (total + np.where(s > 0, (u(strides[:, d]) * span * rest) & mask, np.uint64(0))) & mask
    total = total.astype(np.int64)
    return total


def _shape_rows(shapes: dict, names: list[str], idx: np.ndarray, D: int) -> np.ndarray:
    table = np.ones((len(names) + 1, D), dtype=np.int64)
    for i, name in enumerate(names):
        dims = tuple(shapes[name]) if name in shapes else ()
        table[i, :len(dims)] = dims
    return table[idx]


class DryTrainer(TrainerWorker):
    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.device = "cpu"  # what the controllers pick a backend by; no byte ever moves

    def _run_transfer(self, p, plan, src, dst):
        m, g = plan._m, plan._g
        mine = np.flatnonzero(~m["relay"] & (m["src"] == self.rank))
        lo, hi = m["lo"][mine], m["hi"][mine]
        n = hi - lo
        seg = np.repeat(lo - np.concatenate(([0], np.cumsum(n)[:-1])), n) + np.arange(int(n.sum()))
        dst_rank = np.repeat(m["dst"][mine], n)
        keep = g["piece"][seg] >= 0
        seg, dst_rank = seg[keep], dst_rank[keep]
        D = g["off"].shape[1]
        shape = _shape_rows(self.shapes, plan._tensor_names, g["tensor"][seg], D)
        vals = position_sums(g["off"][seg], g["size"][seg], shape)
        sums: dict = {}
        names = plan._buffer_names
        for d, b, i, v in zip(dst_rank.tolist(), g["dbuf"][seg].tolist(), g["piece"][seg].tolist(), vals.tolist()):
            key = (d, names[b], i)
            sums[key] = (sums.get(key, 0) + v) % P
        return sums, plan.send_bytes(self.rank), 0.0


class DryInference(InferenceWorker):
    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.device = "cpu"

    def _run_transfer(self, p, plan, src, dst):
        return {}, plan.recv_bytes(self.rank), 0.0

    async def _on_verify(self, v, cid: int) -> dict:
        """What the real worker checks (its share of the merged sums, in its order), against
        position sums of the pieces it holds."""
        plan, _ = self.prepared(v.update_id)
        if v.expected.plan_digest != plan.digest:
            raise LayoutError(f"expected checksums for plan {v.expected.plan_digest}, not {plan.digest}")
        t = plan._dst_table
        rows = plan._class_piece_rows(int(t.rank_class[self.rank]))
        D = t.p_off.shape[1]
        got = position_sums(t.p_off[rows], t.p_size[rows], _shape_rows(self.shapes, t.tensor_names, t.p_tensor[rows], D))
        want = np.frombuffer(v.expected.values, dtype="<u4").astype(np.int64)
        if len(want) != len(got) or not np.array_equal(want, got):
            bad = int(np.flatnonzero(want != got)[0]) if len(want) == len(got) else -1
            raise LayoutError(f"dry inference rank {self.rank}: expected checksums differ (piece {bad} of {len(got)})")
        return {}


def ranks(spec: str) -> list[int]:
    lo, _, hi = spec.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=["trainer", "inference"], required=True)
    ap.add_argument("--controller", required=True)
    ap.add_argument("--ranks", required=True, help="first-last")
    ap.add_argument("--model", required=True)
    ap.add_argument("--layout", required=True)
    ap.add_argument("--steps", type=int, default=0, help="trainer: publish steps 1..N, each once the last is released")
    ap.add_argument("--run", default="dry")
    a = ap.parse_args(argv)
    logging.basicConfig(level=os.environ.get("RESHARD_LOG_LEVEL", "WARNING"),
                        format=f"%(asctime)s dry-{a.role}[{a.ranks}] %(levelname)s %(message)s")
    layout = build(a.model, a.layout)
    workers = []
    for r in ranks(a.ranks):
        bufs = {d.name: (d, torch.empty(d.shape, dtype=dtype_of(d.dtype), device="meta")) for d in layout.ranks[r]}
        if a.role == "trainer":
            w = DryTrainer(a.controller, r, layout.world, layout.tensors, bufs, run=a.run, model=a.model)
        else:
            w = DryInference(a.controller, r, layout.world, layout.tensors, bufs, model=a.model,
                             version=pb.Version(run="checkpoint", step=0))
        workers.append(w.start())
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    for w in workers:
        if not w.wait_connected(120):
            print(f"worker {w.rank} did not connect", file=sys.stderr)
            return 1
    for step in range(1, a.steps + 1):
        handles = [w.publish(step) for w in workers]
        t0 = time.monotonic()
        while not all(h.wait(0.1) for h in handles):
            if stop.is_set() or time.monotonic() - t0 > 300:
                print(f"step {step} was not released", file=sys.stderr)
                return 1
        print(f"released step {step}", flush=True)
    stop.wait()
    for w in workers:
        w.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
