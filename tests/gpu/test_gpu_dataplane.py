"""The GPU data plane on a real GPU (`make gpu-check`; skipped without CUDA or libnccl)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from reshard.common.dataplane.backend import buffers_device
from reshard.common.dataplane.engine import Engine, StagingPool
from reshard.common.dataplane.transport import TransportError
from reshard.common.layout.core import dtype_of
from reshard.common.models.frameworks import build
from reshard.common.plan.planner import PlanOptions, make_plan
from reshard.tools.synth import init_box

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def lib():
    from reshard.common.dataplane.nccl import NcclUnavailable, load_library

    try:
        return load_library()
    except NcclUnavailable as e:
        pytest.skip(f"no libnccl: {e}")


def _filled(layout, rank, dev):
    bufs = {}
    for b in layout.ranks[rank]:
        cpu = torch.zeros(b.shape, dtype=dtype_of(b.dtype))
        for p in b.pieces:
            init_box(p.view(cpu), 0, p.tensor, p.box.offset, layout.tensors[p.tensor].shape)
        bufs[b.name] = cpu.to(dev)
    return bufs


def _check(layout, rank, bufs):
    for b in layout.ranks[rank]:
        held = bufs[b.name].cpu()
        for p in b.pieces:
            want = torch.empty(p.box.size, dtype=dtype_of(b.dtype))
            init_box(want, 0, p.tensor, p.box.offset, layout.tensors[p.tensor].shape)
            assert torch.equal(p.view(held), want), f"rank {rank} {b.name} {p.tensor}"


def test_self_send_recv(lib):
    from reshard.common.dataplane.nccl_transport import NcclTransport

    t = NcclTransport(lib.unique_id(), 0, 1, 30.0, device="cuda:0", session="self")
    a = torch.randint(0, 255, (10 << 20,), dtype=torch.uint8, device="cuda:0")
    b = torch.zeros_like(a)
    works = [t.send(a, 0, 3), t.recv(b, 0, 3)]
    t.flush()
    for w in works:
        w.wait(30.0)
    assert torch.equal(a, b)
    t.close()


def test_warm_up_then_rounds_in_stream_order(lib):
    """The stream-ordered primitives on a real GPU: a warm-up connects rank 0 to itself, then rounds
    are queued back to back (each round's receive copied out on the copy stream after a device
    wait, the next round reusing the buffers), and the host waits once, at the end."""
    from reshard.common.dataplane.nccl_transport import NcclTransport

    t = NcclTransport(lib.unique_id(), 0, 1, 30.0, device="cuda:0", session="ordered")
    t.warm_up({0}, {0}, 30.0)
    rounds = [torch.randint(0, 255, (4 << 20,), dtype=torch.uint8, device="cuda:0") for _ in range(8)]
    out = torch.zeros(8, 4 << 20, dtype=torch.uint8, device="cuda:0")
    stage = [torch.empty(4 << 20, dtype=torch.uint8, device="cuda:0") for _ in range(2)]
    last = []
    with t.copy_context():
        for i, a in enumerate(rounds):
            works = [t.send(a, 0, i), t.recv(stage[i % 2], 0, i)]
            t.flush()
            for w in works:
                w.device_wait(30.0)  # the copy stream waits; the host does not
            out[i].copy_(stage[i % 2])
            last = works
        for w in last:
            w.wait(30.0)
    assert all(torch.equal(out[i], a) for i, a in enumerate(rounds))
    t.close()


def test_a_peer_that_never_joins_fails_at_the_deadline(lib):
    from reshard.common.dataplane.nccl_transport import NcclTransport

    t0 = time.monotonic()
    with pytest.raises(TransportError, match="not done within 3.0s"):
        NcclTransport(lib.unique_id(), 0, 2, 3.0, device="cuda:0", session="lonely")
    assert time.monotonic() - t0 < 3.0 + 10.0


def test_engine_on_device_buffers():
    """pack/unpack and direct segments with CUDA buffers and a device staging pool (loopback wire)."""
    from tests.unit.loopback import Loopback

    src, dst = build("small", "framework=megatron,tp=2"), build("small", "framework=vllm,tp=2")
    plan = make_plan(src, dst, PlanOptions(bucket_bytes=1 << 16))
    shapes = {n: t.shape for n, t in src.tensors.items()}
    wire: dict = {}
    deadline = time.monotonic() + 60
    for r in range(src.world):
        Engine(Loopback(r, wire), plan, "src", r, _filled(src, r, "cuda:0"), shapes, StagingPool("cuda:0"), deadline).run()
    for r in range(dst.world):
        out = {b.name: torch.zeros(b.shape, dtype=dtype_of(b.dtype), device="cuda:0") for b in dst.ranks[r]}
        Engine(Loopback(src.world + r, wire), plan, "dst", r, out, shapes, StagingPool("cuda:0"), deadline).run()
        _check(dst, r, out)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL puts one rank per GPU: needs two")
def test_engine_over_nccl_two_gpus(lib):
    from reshard.common.dataplane.nccl_transport import NcclTransport

    src, dst = build("small", "framework=megatron,tp=1"), build("small", "framework=vllm,tp=1")
    plan = make_plan(src, dst, PlanOptions(bucket_bytes=1 << 16))
    shapes = {n: t.shape for n, t in src.tensors.items()}
    uid = lib.unique_id()
    out = {b.name: torch.zeros(b.shape, dtype=dtype_of(b.dtype), device="cuda:1") for b in dst.ranks[0]}
    errors = []

    def side(role, rank, dev, bufs):
        try:
            torch.cuda.set_device(dev)
            t = NcclTransport(uid, rank, 2, 60.0, device=dev, session="two")
            Engine(t, plan, role, 0, bufs, shapes, StagingPool(dev), time.monotonic() + 60).run()
            t.close()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=side, args=("src", 0, "cuda:0", _filled(src, 0, "cuda:0"))),
               threading.Thread(target=side, args=("dst", 1, "cuda:1", out))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors, errors
    _check(dst, 0, out)


def test_cuda_ipc_between_two_processes():
    from reshard.tools.gpu_check import section_ipc

    res = section_ipc(torch.device("cuda", 0))
    assert res["verified"], res["mismatches"]
    assert res["bytes"] > 0


def test_workers_report_cuda_device_and_memory():
    from reshard.trainer_svc.worker import TrainerWorker

    lay = build("tiny", "framework=megatron,tp=1")
    bufs = {b.name: (b, torch.zeros(b.shape, dtype=dtype_of(b.dtype), device="cuda")) for b in lay.ranks[0]}
    assert buffers_device(t for _, t in bufs.values()) == f"cuda:{torch.cuda.current_device()}"
    w = TrainerWorker("127.0.0.1:1", 0, 1, lay.tensors, bufs, snapshot=True)
    try:
        rep = w.memory_report()
        assert w.device.startswith("cuda:") and rep["snapshot"] == sum(t.nbytes for _, t in bufs.values())
        assert w._pool.device.type == "cuda"
    finally:
        w.stop()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_device_checksum_equals_the_host_path(dtype):
    """The engine's sums on the device are the host's, bit for bit (strided views included)."""
    from reshard.common.dataplane.checksum import box_checksum, box_checksum_torch

    full = torch.randint(-100, 100, (257, 513), dtype=torch.int32, device="cuda").to(dtype)
    for off, size in (((0, 0), (257, 513)), ((3, 7), (250, 499)), ((256, 1), (1, 511))):
        view = full[off[0]:off[0] + size[0], off[1]:off[1] + size[1]]
        assert box_checksum_torch(view, off, full.shape) == box_checksum(view.cpu(), off, full.shape)


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize("workers,device,backend,picked", [
    # every worker on GPU 0: CUDA IPC
    (2, "cuda:0", "auto", "ipc"),
    # hybrid forced with one trainer and one inference worker on GPU 0: the trainer rank hosts the GPU
    # (an NCCL communicator of one) and writes the inference rank's pieces through IPC mappings
    (1, "cuda:0", "hybrid", "hybrid"),
    # a trainer rank and an inference rank on each of two GPUs (rank % count): auto picks hybrid, NCCL
    # carries what crosses GPUs and each host writes its guest's pieces
    pytest.param(2, "cuda", "auto", "hybrid", marks=pytest.mark.skipif(_gpus() < 2, reason="needs two GPUs")),
], ids=["ipc", "hybrid-one-gpu", "hybrid-two-gpus"])
def test_colocated_update_through_the_services(workers, device, backend, picked):
    """Trainer and inference workers sharing GPUs: the backend is the one expected, the update
    commits verified, and what inference holds equals the step's weights, read back through Dump."""
    from reshard.common.models.presets import model_config
    from tests.integration.cluster import Cluster

    c = Cluster("tiny", inference_workers=workers, trainer_workers=workers,
                trainer_args=("--device", device, "--backend", backend), inference_args=("--device", device))
    try:
        code, out, err = c.update()
        assert code == 0 and out and out["ok"], err
        st = c.status("trainer")
        assert [d["backend"] for d in st["deployments"]] == [picked] and st["history"][-1]["verified"]
        step = int(out["committed"]["step"])
        for name in model_config("tiny").tensors():
            got, version = c.dump(name)
            assert torch.equal(got, c.expected(name, step)), name
    finally:
        c.close()
