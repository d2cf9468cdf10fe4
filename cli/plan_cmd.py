"""`reshard plan`: plan a layout pair in one process and print the plan's figures."""

from __future__ import annotations

import ctypes
import gc
import json
import resource
import sys
import threading
import time

from reshard.common.layout.wire import layout_bytes, layout_fingerprint


def plan_figures(model: str, src_spec: str, dst_spec: str, bucket_bytes: int = 0, relay: bool = True) -> dict:
    """Build the two layouts, then time the complete plan (every rank's transfers) cold, in this process."""
    from reshard.common.models.frameworks import build, model_spec
    from reshard.common.plan.planner import PlanOptions, make_plan

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
        **control_figures(plan, src, dst),
    }


def control_figures(plan, src, dst) -> dict:
    """Control-plane bytes of one update of this pair, from the messages the services build (the
    verification arrays by `common.plan.verify`'s builders, the layouts by `layout_bytes`), with
    realistic values in the fixed-size fields. A steady update names layouts by fingerprint; the
    first one (or the first after a membership change) carries them once per worker stream."""
    import numpy as np

    from reshard.common.plan import verify
    from reshard.proto import reshard_pb2 as pb
    from reshard.proto import worker_pb2 as wpb

    S, D = plan.src_world, plan.dst_world
    sfp, dfp = layout_fingerprint(src), layout_fingerprint(dst)
    src_bytes, dst_bytes = layout_bytes(src), layout_bytes(dst)
    uid, version = "0123456789ab", pb.Version(run="run-2026-12-03T12-00-00", step=123456)
    session = pb.Session(id=uid, store_host="10.20.30.40", store_port=29500, src_world=S, dst_world=D, transport="nccl",
                         nccl_unique_id=bytes(128))
    membership = "0123abcd:99:" + ",".join(f"{r}/{1000000 + r}" for r in range(D))
    layout_reply = pb.LayoutReply(model="model", fingerprint=dfp, workers=D, devices=[f"cuda:{r % 8}" for r in range(D)],
                                  membership=membership)
    begin = pb.BeginUpdateRequest(update_id=uid, version=version, plan_digest=plan.digest, session=session, timeout_s=120.0,
                                  method="reshard", epoch=1 << 62, src_fingerprint=sfp)
    prepare = wpb.Prepare(update_id=uid, version=version, plan_digest=plan.digest, session=session, timeout_s=120.0,
                          method="reshard", src_fingerprint=sfp, dst_fingerprint=dfp)

    def cmd(i: int, **kw) -> wpb.ControllerMessage:
        return wpb.ControllerMessage(id=1 << 40 | i, **kw)

    def reply(i: int) -> wpb.WorkerMessage:
        return wpb.WorkerMessage(reply=wpb.Reply(id=1 << 40 | i, ok=True, seconds=0.123, bytes_total=1 << 40))

    memory = {"staging": 1 << 30, "shadow": 1 << 36, "nccl": 1 << 30, "update_peak": 1 << 31}
    zeros = np.zeros(plan.num_checksum_slots, dtype=np.uint32)
    steady: list[tuple[str, object]] = [
        ("GetLayoutRequest", pb.GetLayoutRequest(known_fingerprint=dfp)), ("LayoutReply", layout_reply),
        ("BeginUpdateRequest", begin), ("BeginUpdateReply", pb.BeginUpdateReply(bytes_total=plan.total_bytes)),
        ("FinishUpdateRequest", pb.FinishUpdateRequest(update_id=uid, expected=verify.dense(plan, zeros))),
        ("FinishUpdateReply", pb.FinishUpdateReply(committed=version, verify_seconds=1.0, bytes=plan.total_bytes,
                                                   requests_during=1 << 20, commit_seconds=1.0)),
    ]
    for side, world in (("trainer", S), ("inference", D)):
        for r in range(world):
            steady += [(f"{side}:prepare", cmd(r, prepare=prepare)), (f"{side}:reply", reply(r)),
                       (f"{side}:progress", wpb.WorkerMessage(progress=wpb.Progress(update_id=uid, bytes_done=1 << 40,
                                                                                   bytes_total=1 << 40)))]
            done = wpb.TransferDone(update_id=uid, ok=True, bytes=1 << 40, seconds=1.0, checksum_seconds=1.0, memory=memory)
            if side == "trainer":
                slots = plan.source_slots(r)
                done.checksums.CopyFrom(verify.report(plan, slots, np.zeros(len(slots), np.uint32)))
                steady.append(("trainer:release", cmd(r, release=wpb.Release(version=version))))
            else:
                steady += [("inference:verify", cmd(r, verify=wpb.Verify(update_id=uid, expected=verify.rank_expected(plan, r, zeros)))),
                           ("inference:reply", reply(r)), ("inference:commit", cmd(r, commit=wpb.Commit(update_id=uid, version=version))),
                           ("inference:reply", reply(r))]
            steady.append((f"{side}:done", wpb.WorkerMessage(done=done)))
    first = [("LayoutReply (with the layout)", pb.LayoutReply(layout=dst_bytes, **{f.name: v for f, v in layout_reply.ListFields()})),
             ("BeginUpdateRequest (with the source layout)", pb.BeginUpdateRequest(src_layout=src_bytes, **{f.name: v for f, v in begin.ListFields()})),
             ("Prepare (with both layouts)", cmd(0, prepare=wpb.Prepare(src_layout=src_bytes, dst_layout=dst_bytes,
                                                                          **{f.name: v for f, v in prepare.ListFields()})))]
    sizes = [(name, m.ByteSize()) for name, m in steady]
    total = sum(n for _, n in sizes)
    name, largest = max(sizes + [(n, m.ByteSize()) for n, m in first], key=lambda x: x[1])
    extra = sum(m.ByteSize() for _, m in first[:2]) + (S + D) * (first[2][1].ByteSize() - cmd(0, prepare=prepare).ByteSize())
    return {"control_bytes_per_update": total, "first_update_extra_control_bytes": extra,
            "max_control_message_bytes": largest, "max_control_message": name,
            "checksum_slots": plan.num_checksum_slots}


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
