"""`reshard dump` of a large tensor between real processes: bit-exact, streamed through the
inference controller a region at a time (its peak memory grows by far less than the tensor),
at most MAX_CONCURRENT_DUMPS at once, and never torn by the commits of updates running meanwhile."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch

from reshard.common.layout.core import dtype_of
from reshard.inference_svc.service import DUMP_REGION_BYTES, MAX_CONCURRENT_DUMPS
from reshard.proto import reshard_pb2 as pb
from reshard.proto import reshard_pb2_grpc as rgrpc

from .cluster import Cluster, cli, dump_rpc

pytestmark = pytest.mark.integration

# The biggest preset that starts in seconds on a small machine: its embedding is 31 MiB of bf16
# (llama-1g's 125 MiB one needs gigabytes and a minute of synthetic weights on both sides).
MODEL = "medium"
TENSOR = "model.embed_tokens.weight"
WARM = "model.layers.0.mlp.gate_proj.weight"  # 5.5 MiB
# TP=2 with two replicas: a dump reads each part from one holder, and regions straddle two ranks.
LAYOUT = "framework=vllm,tp=2,dp=2"
COMMIT_SECONDS = 0.4  # rank 1 commits this much later than its peers: a dump overlaps commits often
UPDATES = 2


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(MODEL, inference_layout=LAYOUT, trainer_workers=1,
                inference_env={"RESHARD_FAULT_RANK": "1", "RESHARD_FAULT_COMMIT_SECONDS": str(COMMIT_SECONDS)})
    yield c
    c.close()


def peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def expected(c: Cluster, step: int, cache: dict = {}) -> torch.Tensor:  # noqa: B006 - the module's cache
    key = (c.seed, step)
    if key not in cache:
        cache[key] = c.expected(TENSOR, step)
    return cache[key]


def step_of(version: pb.Version) -> int:
    assert version.run in ("checkpoint", "run1"), version
    return version.step


def reassemble(chunks) -> tuple[torch.Tensor, pb.Version]:
    data, first = bytearray(), None
    for chunk in chunks:
        first = first or chunk
        assert chunk.offset == len(data) and len(chunk.data) <= 1 << 20
        assert chunk.version == first.version, "one dump, one version"
        data += chunk.data
    assert len(data) == first.total_bytes
    return torch.frombuffer(data, dtype=dtype_of(first.dtype)).view(list(first.shape)).clone(), first.version


@pytest.mark.slow  # over 6 s: the quick suite keeps under 5 minutes on 2 cores
def test_dump_is_exact_bounded_and_limited(cluster, tmp_path):
    c = cluster
    pid = c.procs[0].pid  # `reshard inference`: the controller runs in the CLI's process
    nbytes = expected(c, 0).numel() * 2
    assert nbytes > 4 * DUMP_REGION_BYTES
    # A first, smaller dump (two regions, each from both TP ranks' fused gate_up buffers) pays what
    # the controller's first dump costs whatever its size (threads, gRPC's buffers, allocator arenas).
    got, version = dump_rpc(c.inf, WARM)
    assert version == {"run": "checkpoint", "step": 0} and torch.equal(got, c.expected(WARM, 0))
    before = peak_rss_mib(pid)

    # (a) The CLI's dump, bit-exact against the weights regenerated here.
    cli("dump", "--inference", c.inf, "--tensor", TENSOR, "--out", str(tmp_path / "dump.pt"), check=True)
    d = torch.load(tmp_path / "dump.pt")
    assert d["version"] == {"run": "checkpoint", "step": 0}
    assert torch.equal(d["tensor"], expected(c, 0))

    # (b) Two dumps held open (their client reads one chunk, then waits: the controller stalls on
    # flow control mid-tensor), two more through the CLI at the same time: refused at once.
    # No BDP probing: the held streams' receive windows stay small, so neither can take the whole
    # tensor into its client's buffers and end while the other dumps are tried.
    channels = [grpc.insecure_channel(c.inf, options=[("grpc.http2.bdp_probe", 0)]) for _ in range(3)]
    try:
        held = [rgrpc.InferenceServiceStub(ch).Dump(pb.DumpRequest(tensor=TENSOR), timeout=60) for ch in channels[:2]]
        firsts = [next(h) for h in held]
        procs = [subprocess.Popen([sys.executable, "-m", "reshard.cli", "dump", "--inference", c.inf, "--tensor", TENSOR,
                                   "--out", str(tmp_path / f"refused-{i}.pt"), "--timeout", "30"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
        outs = [p.communicate(timeout=60) for p in procs]
        for p, (_, err) in zip(procs, outs):
            assert p.returncode != 0 and "RESOURCE_EXHAUSTED" in err, err
            assert f"{MAX_CONCURRENT_DUMPS} dumps in progress; retry when one ends" in err, err
        assert not list(tmp_path.glob("refused-*"))
        # A client that goes away frees its slot: the next dump is taken (once the server sees the cancel).
        held[1].cancel()
        deadline = time.monotonic() + 10
        while True:
            again = rgrpc.InferenceServiceStub(channels[2]).Dump(pb.DumpRequest(tensor=TENSOR), timeout=60)
            try:
                first = next(again)
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline, e
                time.sleep(0.05)
        for stream in ([first, *again], [firsts[0], *held[0]]):  # both finish, exact
            got, version = reassemble(stream)
            assert step_of(version) == 0 and torch.equal(got, expected(c, 0))
    finally:
        for ch in channels:
            ch.close()
    after = peak_rss_mib(pid)
    print(f"\ninference controller peak RSS (VmHWM): {before:.1f} MiB before, {after:.1f} MiB after "
          f"(+{after - before:.1f} MiB) for dumps of a {nbytes / 2**20:.1f} MiB tensor, two at once")
    # Assembling the tensor whole (and copying it to bytes) costs several times its size per dump: the
    # controller that did grew by about 128 MiB for one dump of this tensor, 255 MiB for a dump then two at once.
    assert after - before < 2 * nbytes / 2**20, f"peak RSS grew by {after - before:.1f} MiB"


@pytest.mark.slow  # updates in a loop; the seqlock's logic is also tested in process below
def test_dump_during_commits_is_never_torn(cluster):
    c = cluster
    updates: list[int] = []
    failed: list[str] = []
    done = threading.Event()

    def update_loop():  # through the trainer's RPCs: what `reshard update --wait` calls
        try:
            with grpc.insecure_channel(c.tr) as ch:
                stub = rgrpc.TrainerServiceStub(ch)
                for _ in range(UPDATES):
                    rep = stub.TriggerUpdate(pb.TriggerUpdateRequest(), timeout=60)
                    out = stub.WaitForVersion(pb.WaitForVersionRequest(version=rep.version, timeout_s=60), timeout=65)
                    if not out.ok:
                        failed.append(out.error)
                        return
                    updates.append(out.committed.step)
        except grpc.RpcError as e:
            failed.append(f"{e.code().name}: {e.details()}")
        finally:
            done.set()

    t = threading.Thread(target=update_loop)
    t.start()
    results: list[tuple[str, int | None]] = []
    with grpc.insecure_channel(c.inf, options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
        stub = rgrpc.InferenceServiceStub(ch)
        while not done.is_set():
            try:
                got, version = reassemble(stub.Dump(pb.DumpRequest(tensor=TENSOR), timeout=60))
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.ABORTED, f"{e.code().name}: {e.details()}"
                m = re.fullmatch(r"version (\S+):(\d+) was committed while the dump of version (\S+):(\d+) streamed; "
                                 r"run it again", e.details())
                assert m and int(m[2]) > int(m[4]), e.details()
                results.append(("ABORTED", None))
                continue
            step = step_of(version)
            assert torch.equal(got, expected(c, step)), (f"dump labelled {version.run}:{version.step} differs from that "
                                                         f"version in {int((got != expected(c, step)).sum())} elements")
            results.append(("OK", step))
    t.join()
    assert not failed and len(updates) == UPDATES, failed
    print(f"\n{len(results)} dumps during {UPDATES} updates: "
          f"{sum(r == 'OK' for r, _ in results)} exact (steps {sorted({s for r, s in results if r == 'OK'})}), "
          f"{sum(r == 'ABORTED' for r, _ in results)} aborted by a commit")
    assert any(r == "OK" for r, _ in results)
    got, version = reassemble(rgrpc.InferenceServiceStub(ch := grpc.insecure_channel(c.inf)).Dump(pb.DumpRequest(tensor=TENSOR), timeout=60))
    ch.close()
    assert (version.run, version.step) == ("run1", updates[-1])
    assert torch.equal(got, expected(c, version.step))


def test_a_read_back_takes_no_serving_lock_and_is_never_torn_by_a_commit():
    """In process, one worker: a read back copies while an engine step holds the serving lock, and a
    region read while commits copy other values into the live weights is always one version's."""
    import numpy as np

    from reshard.common.layout.core import Box, LocalBuffer, Piece, TensorSpec
    from reshard.inference_svc.worker import InferenceWorker
    from reshard.proto import worker_pb2 as wpb

    shape = (512, 2048)  # 4 MiB of float32: a copy takes long enough for commits to overlap it
    desc = LocalBuffer("w", shape, "float32", (Piece("w", Box.full(shape), Box.full(shape)),))
    w = InferenceWorker("127.0.0.1:1", 0, 1, {"w": TensorSpec("w", shape, "float32")}, {"w": (desc, torch.zeros(shape))},
                        version=pb.Version(run="r", step=0))
    sent: list[wpb.WorkerMessage] = []
    w.emit = sent.append
    region = wpb.Read(tensor="w", offset=[64, 0], size=[256, 2048])

    def read() -> tuple[int, np.ndarray]:
        sent.clear()
        w._read(region, 1)
        assert all(m.piece.offset == [64, 0] and m.piece.size == [256, 2048] for m in sent)
        assert sent[-1].piece.last and not any(m.piece.last for m in sent[:-1])
        data = np.frombuffer(b"".join(m.piece.data for m in sent), dtype=np.float32)
        assert data.size == 256 * 2048
        return sent[0].piece.version.step, data

    try:
        with w.serving():  # an engine step: the old read back waited for it (READ_LOCK_TIMEOUT), then failed
            t0 = time.monotonic()
            step, data = read()
            assert time.monotonic() - t0 < 1.0 and step == 0 and not data.any()
        stop = threading.Event()
        steps = [0]

        def commits():
            while not stop.is_set():
                steps.append(steps[-1] + 1)
                w.shadow["w"].fill_(float(steps[-1]))
                w._commit(pb.Version(run="r", step=steps[-1]))
                time.sleep(0.005)  # back to back, far more often than any trainer commits

        t = threading.Thread(target=commits)
        t.start()
        try:
            seen = set()
            for _ in range(60):
                step, data = read()
                assert data.min() == data.max() == step, f"a region labelled step {step} holds {np.unique(data)[:8]}"
                seen.add(step)
        finally:
            stop.set()
            t.join()
        assert len(seen) > 1 and steps[-1] > 1
    finally:
        w._dp.shutdown()
