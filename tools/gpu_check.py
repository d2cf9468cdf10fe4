"""`make gpu-check`: every GPU test plus a short GPU benchmark, figures printed as JSON.

    python scripts/gpu_check.py [--out FILE] [--skip-tests]

Runs from a checkout without installing reshard (scripts/gpu_check.py maps the package
first). Sections, each timed and each failing on its own (its error goes into the JSON):

- tests: `pytest -m gpu tests/gpu` (in this process, so the mapping holds);
- copy: device-to-device copy bandwidth (the yardstick);
- pack: packing strided column shards into a staging buffer and unpacking them back
  (the engine's `pack`/`unpack` on a real plan, and plain column slices of a big matrix),
  as GB/s and as a fraction of the copy bandwidth;
- checksum: the exact per-piece checksum computed on the device (`box_checksum_torch`),
  GB/s, and its equality with the host path (`box_checksum`) on every case;
- nccl_self: send/recv to self through the binding and NcclTransport, GB/s, verified;
- abort: a 2-rank communicator whose peer never joins: fails at its deadline, abort latency;
- ipc: CUDA IPC between two processes on one GPU: the child maps the parent's trainer
  buffers and runs its share of a plan from them, every piece verified, GB/s;
- colocated: a full update through both services with every trainer and inference worker on
  this GPU: the backend picks CUDA IPC, two updates commit verified, and every tensor read
  back through the Dump RPC equals the synthetic weights of its step, bit for bit;
- hybrid_one_gpu: the same with one trainer and one inference worker and `--backend hybrid`:
  the trainer rank hosts the GPU (alone in an NCCL communicator) and writes the inference
  rank's pieces through IPC mappings (one GPU cannot show NCCL between GPUs: tests/gpu has a
  two-GPU test that skips here);
- memory: NCCL's connection buffers (init, first round, steady), staging, shadow, snapshot.

Meant to finish in well under 5 minutes on one H200.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import pickle
import subprocess
import sys
import time
import traceback

import torch

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # through scripts/gpu_check.py's links too
GB = 1e9


def _timed(fn, iters: int) -> float:
    """Seconds per call of `fn` on the current stream (CUDA events), after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def section_copy(dev) -> dict:
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    s = _timed(lambda: b.copy_(a), 10)
    return {"bytes": n, "copy_GBps": n / s / GB}


def section_checksum(dev) -> dict:
    """The device checksum's speed, and its sums against the host path's on the same values:
    several dtypes, odd offsets and lengths, strided views (the column shards the engine sums)."""
    from reshard.common.dataplane.checksum import box_checksum, box_checksum_torch

    g = torch.Generator(device=dev).manual_seed(7)
    cases = []
    for dtype, shape, box in ((torch.bfloat16, (4096, 8192), ((0, 0), (4096, 8192))),
                              (torch.bfloat16, (4096, 8192), ((17, 1023), (2001, 4097))),
                              (torch.float32, (1000, 771), ((3, 5), (997, 765))),
                              (torch.int8, (333, 129), ((1, 3), (300, 125))),
                              (torch.float16, (65537,), ((9,), (65521,)))):
        full = torch.randint(-2**15, 2**15, shape, generator=g, device=dev, dtype=torch.int32).to(dtype)
        (off, size) = box
        view = full[tuple(slice(o, o + n) for o, n in zip(off, size))]
        cases.append((view, off, shape))
    equal = [box_checksum_torch(v, o, sh) == box_checksum(v.cpu(), o, sh) for v, o, sh in cases]
    big, off, shape = cases[0]
    s = _timed(lambda: box_checksum_torch(big, off, shape), 5)
    strided, soff, sshape = cases[1]
    s2 = _timed(lambda: box_checksum_torch(strided, soff, sshape), 5)
    t0 = time.perf_counter()
    box_checksum(big.cpu(), off, shape)
    host = time.perf_counter() - t0
    nbytes = big.numel() * big.element_size()
    return {"cases": len(cases), "equal_to_host": equal, "ok": all(equal), "bytes": nbytes,
            "device_GBps": nbytes / s / GB, "device_strided_GBps": strided.numel() * 2 / s2 / GB,
            "host_GBps_incl_copy": nbytes / host / GB}


def _pack_columns(dev) -> dict:
    """A (8192 x 28672) bf16 matrix in 4 column slices (a TP split), packed one after the other and back."""
    rows, cols, tp = 8192, 28672, 4
    w = torch.randn(rows, cols, device=dev).to(torch.bfloat16)
    back = torch.empty_like(w)
    staging = torch.empty(w.numel() * 2, dtype=torch.uint8, device=dev)
    step = cols // tp
    shards = [(r * step, (r + 1) * step) for r in range(tp)]

    def pack_cols():
        off = 0
        for c0, c1 in shards:
            n = rows * (c1 - c0)
            staging[off * 2:(off + n) * 2].view(torch.bfloat16).view(rows, c1 - c0).copy_(w[:, c0:c1])
            off += n

    def unpack_cols():
        off = 0
        for c0, c1 in shards:
            n = rows * (c1 - c0)
            back[:, c0:c1].copy_(staging[off * 2:(off + n) * 2].view(torch.bfloat16).view(rows, c1 - c0))
            off += n

    nbytes = w.numel() * 2
    res = {"shape": [rows, cols], "shards": tp, "bytes": nbytes,
           "pack_GBps": nbytes / _timed(pack_cols, 5) / GB, "unpack_GBps": nbytes / _timed(unpack_cols, 5) / GB}
    res["verified"] = bool(torch.equal(back, w))
    return res


def section_pack(dev, copy_gbps: float | None) -> dict:
    from reshard.common.dataplane.engine import StagingPool, pack, unpack
    from reshard.common.layout.core import dtype_of
    from reshard.common.models.frameworks import build
    from reshard.common.plan.planner import PlanOptions, make_plan

    out: dict = {"columns": _pack_columns(dev)}
    # The demo's layout pair: Megatron TP=2 -> vLLM TP=4 on llama-1g; trainer rank 0's staged messages.
    model, src_spec, dst_spec = "llama-1g", "framework=megatron,tp=2", "framework=vllm,tp=4"
    src, dst = build(model, src_spec), build(model, dst_spec)
    plan = make_plan(src, dst, PlanOptions())
    sbufs = {b.name: torch.randn(b.shape, device=dev).to(dtype_of(b.dtype)) for b in src.ranks[0]}
    dbufs = {b.name: torch.empty(b.shape, dtype=dtype_of(b.dtype), device=dev) for b in dst.ranks[0]}
    sends = [m for m in plan.sends.get(0, []) if not m.send_direct]
    recvs = [m for m in plan.recvs.get(0, []) if not m.recv_direct]
    pool = StagingPool(dev)
    buf = pool.get(max([m.staged_bytes for m in sends + recvs], default=1))
    sb = sum(m.nbytes for m in sends)
    rb = sum(m.nbytes for m in recvs)
    out["plan"] = {"model": model, "src": src_spec, "dst": dst_spec, "staged_send_bytes": sb, "staged_recv_bytes": rb,
                   "pack_GBps": sb / _timed(lambda: [pack(m, sbufs, buf) for m in sends], 3) / GB if sends else None,
                   "unpack_GBps": rb / _timed(lambda: [unpack(m, dbufs, buf) for m in recvs], 3) / GB if recvs else None}
    if copy_gbps:
        for k in ("columns", "plan"):
            for d in ("pack", "unpack"):
                v = out[k].get(f"{d}_GBps")
                out[k][f"{d}_fraction_of_copy"] = v / copy_gbps if v else None
    return out


def section_nccl_self(dev) -> dict:
    from reshard.common.dataplane.nccl import load_library
    from reshard.common.dataplane.nccl_transport import NcclTransport

    lib = load_library()
    free0 = torch.cuda.mem_get_info(dev)[0]
    t0 = time.monotonic()
    t = NcclTransport(lib.unique_id(), 0, 1, 60.0, device=dev, session="self")
    out = {"nccl_version": lib.version, "library": lib.path, "init_seconds": time.monotonic() - t0,
           "nccl_bytes_after_init": t.connection_bytes}
    n = 256 << 20
    a = torch.randint(0, 255, (n,), dtype=torch.uint8, device=dev)
    b = torch.zeros_like(a)

    def round_trip():
        ws = [t.send(a, 0, 1), t.recv(b, 0, 1)]
        t.flush()
        for w in ws:
            w.wait(30.0)

    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    t1 = time.monotonic()
    round_trip()
    out["first_round_seconds"] = time.monotonic() - t1
    out["first_round_allocator_peak"] = torch.cuda.max_memory_allocated(dev) - base
    out["nccl_bytes_after_first_round"] = t.connection_bytes
    out["verified"] = bool(torch.equal(a, b))
    b.zero_()
    iters = 10
    torch.cuda.reset_peak_memory_stats(dev)
    t1 = time.monotonic()
    for _ in range(iters):
        round_trip()
    dt = (time.monotonic() - t1) / iters
    out["steady_allocator_peak"] = torch.cuda.max_memory_allocated(dev) - base
    out["self_GBps"] = n / dt / GB
    out["verified"] = out["verified"] and bool(torch.equal(a, b))
    out["free_bytes_drop_total"] = free0 - torch.cuda.mem_get_info(dev)[0]
    t.close()
    return out


def section_abort(dev) -> dict:
    from reshard.common.dataplane.nccl import load_library
    from reshard.common.dataplane.nccl_transport import NcclTransport
    from reshard.common.dataplane.transport import TransportError

    lib = load_library()
    deadline = 5.0
    t0 = time.monotonic()
    try:
        NcclTransport(lib.unique_id(), 0, 2, deadline, device=dev, session="lonely")
    except TransportError as e:
        total = time.monotonic() - t0
        return {"deadline_s": deadline, "failed_after_s": total, "abort_latency_s": total - deadline,
                "error": str(e)[:300], "ok": deadline <= total < deadline + 10}
    return {"ok": False, "error": "a 2-rank communicator initialised without its peer"}


def _ipc_layouts():
    from reshard.common.models.frameworks import build
    from reshard.common.plan.planner import PlanOptions, make_plan

    model = "medium"
    src, dst = build(model, "framework=megatron,tp=1"), build(model, "framework=vllm,tp=2")
    return model, src, dst, make_plan(src, dst, PlanOptions(relay=False))


def _fill_src(src, dev) -> dict:
    from reshard.common.layout.core import dtype_of
    from reshard.tools.synth import init_box

    bufs = {}
    for b in src.ranks[0]:
        cpu = torch.zeros(b.shape, dtype=dtype_of(b.dtype))
        for p in b.pieces:
            init_box(p.view(cpu), 0, p.tensor, p.box.offset, src.tensors[p.tensor].shape)
        bufs[b.name] = cpu.to(dev)
    return bufs


def section_ipc(dev) -> dict:
    from reshard.common.dataplane.cuda_ipc import export_tensor

    model, src, dst, plan = _ipc_layouts()
    bufs = _fill_src(src, dev)
    handles = [export_tensor(t, n) for n, t in bufs.items()]
    try:
        from reshard.common.dataplane.cuda_ipc import export_buffers, import_buffers  # noqa: F401  (the protobuf form)

        proto = export_buffers(bufs)
    except ImportError:
        proto = b""
    payload = base64.b64encode(pickle.dumps({"handles": handles, "proto": proto, "device": str(dev)})).decode()
    r = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "gpu_check.py"), "--ipc-child"], input=payload,
                       capture_output=True, text=True, timeout=240, cwd=REPO)
    if r.returncode != 0:
        raise RuntimeError(f"IPC child failed ({r.returncode}): {r.stderr[-2000:]}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    res["model"] = model
    res["src_bytes"] = sum(t.numel() * t.element_size() for t in bufs.values())
    return res


def ipc_child() -> int:
    """The importing process: map the parent's trainer buffers, run both vLLM ranks' share of the
    plan from them, verify every piece against independently generated values."""
    from reshard.common.dataplane.cuda_ipc import import_buffers, import_tensor, run_plan_from_peers
    from reshard.common.layout.core import dtype_of
    from reshard.tools.synth import init_box

    msg = pickle.loads(base64.b64decode(sys.stdin.read()))
    dev = torch.device(msg["device"])
    torch.cuda.set_device(dev)
    _, src, dst, plan = _ipc_layouts()
    if msg["proto"]:
        mapped = import_buffers(msg["proto"])
        via = "protobuf CudaIpcHandles"
    else:
        mapped = {h.name: import_tensor(h) for h in msg["handles"]}
        via = "pickled IpcHandle (no protobuf here)"
    out = {"handles_via": via, "ranks": dst.world}
    dbufs = [{b.name: torch.zeros(b.shape, dtype=dtype_of(b.dtype), device=dev) for b in dst.ranks[r]} for r in range(dst.world)]
    t0 = time.monotonic()
    nbytes = sum(run_plan_from_peers(plan, r, {0: mapped}, dbufs[r]) for r in range(dst.world))
    out["first_update_seconds"] = time.monotonic() - t0
    t0 = time.monotonic()
    iters = 5
    for _ in range(iters):
        for r in range(dst.world):
            run_plan_from_peers(plan, r, {0: mapped}, dbufs[r])
    out["update_GBps"] = nbytes * iters / (time.monotonic() - t0) / GB
    out["bytes"] = nbytes
    bad = []
    for r in range(dst.world):
        for b in dst.ranks[r]:
            held = dbufs[r][b.name].cpu()
            for p in b.pieces:
                want = torch.empty(p.box.size, dtype=dtype_of(b.dtype))
                init_box(want, 0, p.tensor, p.box.offset, dst.tensors[p.tensor].shape)
                if not torch.equal(p.view(held), want):
                    bad.append(f"rank {r} {b.name} {p.tensor}")
    out["verified"] = not bad
    out["mismatches"] = bad[:5]
    del mapped
    print(json.dumps(out))
    return 0


def section_memory(dev, nccl_self: dict | None) -> dict:
    from reshard.common.layout.core import dtype_of
    from reshard.common.models.frameworks import build
    from reshard.inference_svc.worker import InferenceWorker
    from reshard.trainer_svc.worker import TrainerWorker

    src, dst = build("medium", "framework=megatron,tp=1"), build("medium", "framework=vllm,tp=2")
    out = {}
    for side, lay, cls, kw in (("trainer", src, TrainerWorker, {"snapshot": True}), ("inference", dst, InferenceWorker, {})):
        bufs = {b.name: (b, torch.zeros(b.shape, dtype=dtype_of(b.dtype), device=dev)) for b in lay.ranks[0]}
        w = cls("127.0.0.1:1", 0, lay.world, lay.tensors, bufs, **kw)
        w._pool.get(2 * (16 << 20))  # the default bucket, double-buffered, as an update would size it
        out[side] = {"device": w.device, **w.memory_report()}
        w.stop()
    if nccl_self:
        out["nccl"] = {k: nccl_self.get(k) for k in ("nccl_bytes_after_init", "nccl_bytes_after_first_round",
                                                      "first_round_allocator_peak", "steady_allocator_peak")}
    out["device_total_bytes"] = torch.cuda.get_device_properties(dev).total_memory
    return out


def section_colocated(dev, workers: int = 2, backend: str = "auto", expect: str = "ipc") -> dict:
    """trainer_svc and inference_svc (`workers` each), every worker on this GPU, driven through the
    CLI; read back through the Dump RPC against the synthetic weights. With 2 + 2 and backend auto:
    CUDA IPC. With 1 + 1 and backend hybrid: a hybrid session's host (the trainer rank, alone in an
    NCCL communicator) writes its guest's (the inference rank's) pieces through IPC mappings."""
    import socket

    import grpc

    from reshard.common.control.supervisor import stop_processes
    from reshard.common.layout.core import dtype_of
    from reshard.common.models.presets import model_config
    from reshard.proto import reshard_pb2 as pb
    from reshard.proto import reshard_pb2_grpc as rgrpc
    from reshard.tools.synth import tensor_value

    def port() -> int:
        with socket.socket() as so:
            so.bind(("127.0.0.1", 0))
            return so.getsockname()[1]

    model, seed = "small", 0
    inf, tr = f"127.0.0.1:{port()}", f"127.0.0.1:{port()}"
    env = dict(os.environ)  # PYTHONPATH reaches this checkout's reshard (scripts/gpu_check.py), as for the workers
    cmd = [sys.executable, "-m", "reshard.cli"]
    common = ["--model", model, "--device", str(dev), "--update-timeout", "120", "--seed", str(seed)]
    n = str(workers)
    procs = [subprocess.Popen(cmd + ["inference", "--listen", inf, "--workers", n, *common], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True),
             subprocess.Popen(cmd + ["trainer", "--listen", tr, "--workers", n, "--inference", inf, "--run", "colo",
                                     "--backend", backend, *common],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)]
    out: dict = {"model": model, "workers": f"trainer {n} + inference {n}, all on {dev}", "backend_flag": backend}
    try:
        def status(flag: str, addr: str) -> dict:
            r = subprocess.run(cmd + ["status", flag, addr, "--json"], env=env, capture_output=True, text=True, timeout=60)
            return json.loads(r.stdout) if r.returncode == 0 else {}

        deadline = time.monotonic() + 120
        while not (status("--inference", inf).get("serving_state") == "SERVING"
                   and status("--trainer", tr).get("serving_state") == "SERVING"):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                return {"ok": False, "error": "services did not come up", "stderr": [p.stderr.read()[-2000:] if p.poll() is not None else ""
                                                                                  for p in procs]}
            time.sleep(0.5)
        updates = []
        for _ in range(2):
            r = subprocess.run(cmd + ["update", "--trainer", tr, "--wait", "--json"], env=env, capture_output=True, text=True,
                               timeout=300)
            updates.append(json.loads(r.stdout) if r.stdout.strip() else {"ok": False, "error": r.stderr[-1500:]})
        st = status("--trainer", tr)
        out["updates"] = [{k: u.get(k) for k in ("ok", "error", "committed")} for u in updates]
        out["backend"] = [d.get("backend") for d in st.get("deployments", [])]
        hist = [h for h in st.get("history", []) if h.get("ok")]
        out["update_seconds"] = [float(h.get("seconds", 0)) for h in hist]
        out["verified"] = bool(hist) and all(h.get("verified") for h in hist)
        step = int(updates[-1].get("committed", {}).get("step", -1)) if updates[-1].get("ok") else -1
        bad, checked = [], 0
        with grpc.insecure_channel(inf, options=[("grpc.max_receive_message_length", 256 << 20)]) as ch:
            stub = rgrpc.InferenceServiceStub(ch)
            for name, spec in model_config(model).tensors().items():
                data, first = bytearray(), None
                for chunk in stub.Dump(pb.DumpRequest(tensor=name), timeout=120):
                    first = first or chunk
                    data += chunk.data
                got = torch.frombuffer(data, dtype=dtype_of(first.dtype)).view(list(first.shape))
                checked += 1
                if not torch.equal(got, tensor_value(seed, name, step, spec.shape, dtype_of(first.dtype))):
                    bad.append(name)
        out.update(step=step, tensors_checked=checked, tensors_wrong=bad[:10],
                   ok=all(u.get("ok") for u in updates) and out["backend"] == [expect] and out["verified"] and not bad)
        return out
    finally:
        stop_processes(procs, 20)


def run_tests() -> dict:
    try:
        import pytest
    except ImportError:
        return {"ran": False, "reason": "pytest is not installed here"}
    t0 = time.monotonic()
    # --noconftest: the suite's conftest wants hypothesis, which GPU images may lack.
    code = pytest.main(["-q", "-m", "gpu", "-p", "no:cacheprovider", "--noconftest", "-rs", os.path.join(REPO, "tests", "gpu")])
    return {"ran": True, "exit_code": int(code), "ok": int(code) == 0, "seconds": time.monotonic() - t0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="", help="also write the JSON here")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--ipc-child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.ipc_child:
        return ipc_child()
    if not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "no CUDA device: nothing to check"}))
        return 2
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    report: dict = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "device": torch.cuda.get_device_name(dev)}
    t_all = time.monotonic()

    def run(name, fn, *args):
        t0 = time.monotonic()
        try:
            report[name] = fn(*args)
        except Exception as e:  # noqa: BLE001 - one failed section must not hide the others
            report[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]}
        report[name + "_seconds"] = round(time.monotonic() - t0, 2)
        print(f"gpu-check: {name} done in {report[name + '_seconds']}s", file=sys.stderr, flush=True)

    if not a.skip_tests:
        run("tests", run_tests)
    run("copy", section_copy, dev)
    run("pack", section_pack, dev, report["copy"].get("copy_GBps"))
    run("checksum", section_checksum, dev)
    run("nccl_self", section_nccl_self, dev)
    run("abort", section_abort, dev)
    run("ipc", section_ipc, dev)
    run("colocated", section_colocated, dev)
    run("hybrid_one_gpu", section_colocated, dev, 1, "hybrid", "hybrid")
    run("memory", section_memory, dev, report["nccl_self"] if "error" not in report["nccl_self"] else None)
    report["seconds"] = round(time.monotonic() - t_all, 1)
    failed = [k for k, v in report.items() if isinstance(v, dict) and ("error" in v or v.get("ok") is False
                                                                     or v.get("verified") is False)]
    report["failed_sections"] = failed
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            f.write(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
