"""Defects an outside review found (issue 28), each reproduced against real services in real
processes, with the workers embedded in this test process over real gloo groups."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from reshard.common.models.presets import megatron_layout, model_config, vllm_layout
from reshard.inference_svc.worker import InferenceWorker
from reshard.tools.synth import tensor_value
from reshard.trainer_svc.worker import TrainerWorker

from .cluster import cli, free_port, stop_processes

pytestmark = pytest.mark.integration
SEED = 5
CFG = model_config("tiny")


def canonical(step: int) -> dict[str, torch.Tensor]:
    return {n: tensor_value(SEED, n, step, t.shape, torch.bfloat16) for n, t in CFG.tensors().items()}


def fill(layout, rank: int, tensors: dict[str, torch.Tensor], full: dict[str, torch.Tensor]) -> None:
    for desc in layout.ranks[rank]:
        for p in desc.pieces:
            tensors[desc.name][p.region.slices()].copy_(full[p.tensor][p.box.slices()])


def expect_exact(layout, rank: int, got: dict[str, torch.Tensor], step: int, what: str) -> None:
    """`got` (a rank's buffers) holds exactly canonical(step), padding aside (never written)."""
    want = {d.name: torch.full(d.shape, float("nan"), dtype=torch.bfloat16) for d in layout.ranks[rank]}
    fill(layout, rank, want, canonical(step))
    for name, t in got.items():
        keep = ~torch.isnan(want[name].float())
        assert torch.equal(t[keep], want[name][keep]), f"{what}: rank {rank} {name} is not step {step}"


class Services:
    """An inference and a trainer controller (real processes) for embedded workers."""

    def __init__(self, run: str, trainer_args: tuple[str, ...] = (), inference_args: tuple[str, ...] = (),
                 trainers: int = 2, inferences: int = 2) -> None:
        self.inf, self.tr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        self.inf_w, self.tr_w = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        self.procs = [
            subprocess.Popen([sys.executable, "-m", "reshard.cli", "inference", "--listen", self.inf, "--workers",
                              str(inferences), "--external-workers", "--worker-listen", self.inf_w, *inference_args],
                             stderr=subprocess.DEVNULL, start_new_session=True),
            subprocess.Popen([sys.executable, "-m", "reshard.cli", "trainer", "--listen", self.tr, "--workers", str(trainers),
                              "--inference", self.inf, "--external-workers", "--run", run, "--worker-listen", self.tr_w,
                              *trainer_args], stderr=subprocess.DEVNULL, start_new_session=True),
        ]

    def close(self) -> None:
        stop_processes(self.procs)


@pytest.mark.slow  # quick suite under 300 s on 2 cores (CI runs it with the slow ones)
def test_a_publish_during_a_transfer_never_tears_the_snapshot_it_reads():
    """Item 1: with snapshot=True, publish(k+1) right after publish(k), while step k is still being
    sent, must not overwrite the bytes in flight: every version inference commits holds exactly that
    step's weights (checked at each commit, in the commit hook)."""
    src, dst = megatron_layout(CFG, 2), vllm_layout(CFG, 2)
    svc = Services("snap", trainer_args=("--bucket-bytes", "4096"))
    commits: list[tuple[int, int, dict]] = []  # (rank, step, live weights as committed)
    lock = threading.Lock()
    workers: list = []
    try:
        infs = []
        for r in range(2):
            bufs = {d.name: (d, torch.zeros(d.shape, dtype=torch.bfloat16)) for d in dst.ranks[r]}
            holder: dict = {}

            def hook(v, r=r, holder=holder):
                with lock:
                    commits.append((r, v.step, {n: t.clone() for n, t in holder["w"].live.items()}))

            holder["w"] = w = InferenceWorker(svc.inf_w, r, 2, dst.tensors, bufs, commit_hooks=(hook,)).start()
            infs.append(w)
        trs = []
        for r in range(2):
            bufs = {d.name: (d, torch.zeros(d.shape, dtype=torch.bfloat16)) for d in src.ranks[r]}
            fill(src, r, {n: t for n, (_, t) in bufs.items()}, canonical(1))
            # Rank 0 stalls 2 s after its first round of step 1: the next publish lands mid-transfer.
            trs.append(TrainerWorker(svc.tr_w, r, 2, src.tensors, bufs, run="snap", snapshot=True,
                                     fault={"slow_after": 0, "slow_seconds": 2.0, "once": 1} if r == 0 else None).start())
        workers = infs + trs
        for w in workers:
            assert w.wait_connected(60)
        first = [w.publish(1) for w in trs]
        t0 = time.monotonic()
        while not any(w._current for w in trs):  # step 1's transfer began on the trainer ranks
            assert time.monotonic() - t0 < 60, "the update never started"
            time.sleep(0.01)
        time.sleep(0.3)
        for r, w in enumerate(trs):  # the optimizer writes step 2 into the live weights, and publishes it
            fill(src, r, w.live, canonical(2))
        second = [w.publish(2) for w in trs]
        for h in first + second:
            assert h.wait_outcome(90) is not None, "no outcome"
        assert all(h.ok for h in second), [h.error for h in second]
        for w in infs:
            assert w.wait_for_version(2, "snap", timeout=60) is not None
        with lock:
            seen = list(commits)
        assert {s for _, s, _ in seen} <= {1, 2} and any(s == 2 for _, s, _ in seen), [s for _, s, _ in seen]
        for r, step, live in seen:
            expect_exact(dst, r, live, step, f"committed version snap:{step}")
        # The second publish waited for the snapshot's read to end (its stall), or step 1 was superseded.
        assert all(h.ok for h in first) or all("snapshot holds" in h.error for h in first if not h.ok), \
            [h.error for h in first]
    finally:
        for w in workers:
            w.stop()
        svc.close()


@pytest.mark.slow  # over 6 s: the quick suite keeps under 5 minutes on 2 cores
def test_a_partial_update_after_a_failed_inplace_update_keeps_the_torn_tensors_out_of_service():
    """Item 2: an in-place update that fails midway tears every tensor it carried; a later partial
    update (`--tensors`) makes only its own tensors whole, so the deployment stays NOT_SERVING (and
    its ranks hold) until an update carries the rest."""
    from .cluster import Cluster

    env = {"RESHARD_FAULT_RANK": "1", "RESHARD_FAULT_SLOW_AFTER": "0", "RESHARD_FAULT_SLOW_SECONDS": "30",
           "RESHARD_FAULT_ONCE": "1"}
    c = Cluster("tiny", inference_workers=2, update_timeout=4, bucket_bytes=4096, inference_env=env,
                inference_staging="inplace")
    try:
        rc, out, err = c.update()
        assert rc != 0, out
        c.wait_for(lambda s: s["serving_state"] == "NOT_SERVING" and not s["update_in_progress"],
                   what="NOT_SERVING after a failed in-place update")
        rc, out, err = c.update("--tensors", "model.norm.weight")
        assert rc == 0, err + c.logs()
        st = c.status()
        assert st["serving_state"] == "NOT_SERVING", st
        assert "torn" in st["last_error"], st["last_error"]
        rc, out, err = c.update()
        assert rc == 0, err + c.logs()
        step = out["committed"]["step"]
        c.wait_for(lambda s: s["serving_state"] == "SERVING", what="SERVING after a full update")
        for name in ("model.layers.0.self_attn.q_proj.weight", "model.norm.weight"):
            got, v = c.dump(name)
            assert v["step"] == step and torch.equal(got, c.expected(name, step)), name
    finally:
        c.close()


class CuttableProxy:
    """A TCP relay from a local port to `target` whose connections the test can cut at once (a
    network fault between a worker and its controller); new connections are relayed as before."""

    def __init__(self, target: str) -> None:
        import socket

        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.server = socket.socket()
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(16)
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.conns: list = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while True:
            try:
                a, _ = self.server.accept()
            except OSError:
                return
            try:
                b = socket.create_connection(self.target)
            except OSError:
                a.close()
                continue
            with self.lock:
                self.conns += [a, b]
            for x, y in ((a, b), (b, a)):
                threading.Thread(target=self._pipe, args=(x, y), daemon=True).start()

    @staticmethod
    def _pipe(x, y) -> None:
        import socket

        try:
            while data := x.recv(65536):
                y.sendall(data)
        except OSError:
            pass
        for s in (x, y):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        import socket

        with self.lock:
            conns, self.conns = self.conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass

    def close(self) -> None:
        self.server.close()
        self.cut()


@pytest.mark.slow  # the quick suite's time: 4-6 s
def test_a_trainer_worker_that_reattaches_after_its_update_failed_gets_its_release():
    """Item 4: the update fails because a trainer worker's connection broke mid-transfer; the Release
    of that version goes to the workers attached then. The one that reattaches must get it too, or
    its publish handle waits for good."""
    src, dst = megatron_layout(CFG, 2), vllm_layout(CFG, 2)
    svc = Services("rel", trainer_args=("--bucket-bytes", "4096"))
    proxy = CuttableProxy(svc.tr_w)
    workers: list = []
    try:
        for r in range(2):
            bufs = {d.name: (d, torch.zeros(d.shape, dtype=torch.bfloat16)) for d in dst.ranks[r]}
            workers.append(InferenceWorker(svc.inf_w, r, 2, dst.tensors, bufs).start())
        trs = []
        for r in range(2):
            bufs = {d.name: (d, torch.zeros(d.shape, dtype=torch.bfloat16)) for d in src.ranks[r]}
            fill(src, r, {n: t for n, (_, t) in bufs.items()}, canonical(1))
            trs.append(TrainerWorker(proxy.address if r == 0 else svc.tr_w, r, 2, src.tensors, bufs, run="rel",
                                     fault={"slow_after": 0, "slow_seconds": 3.0, "once": 1} if r == 1 else None).start())
        workers += trs
        for w in workers:
            assert w.wait_connected(60)
        handles = [w.publish(1) for w in trs]
        t0 = time.monotonic()
        while not trs[1]._current:
            assert time.monotonic() - t0 < 60, "the update never started"
            time.sleep(0.01)
        time.sleep(0.3)
        proxy.cut()  # rank 0's stream breaks mid-transfer: the update fails; rank 0 reattaches
        for r, h in enumerate(handles):
            assert h.wait(30), f"trainer rank {r}'s publish handle never became writable"
            assert h.wait_outcome(5) is False, (r, h.ok, h.error)
        # And the next step goes through.
        for r, w in enumerate(trs):
            fill(src, r, w.live, canonical(2))
        handles = [w.publish(2) for w in trs]
        assert all(h.wait_outcome(60) for h in handles), [h.error for h in handles]
    finally:
        for w in workers:
            w.stop()
        proxy.close()
        svc.close()


@pytest.mark.slow  # 3-5 s: the quick suite's margin under 5 minutes on slower machines
def test_connected_means_accepted_by_a_controller_for_this_rank():
    """Item 5: nothing listening is not 'connected'."""
    from reshard.common.layout.core import Box, LocalBuffer, Piece, TensorSpec

    spec = TensorSpec("w", (4,), "float32")
    desc = LocalBuffer("w", (4,), "float32", (Piece("w", Box((0,), (4,)), Box((0,), (4,))),))
    w = InferenceWorker(f"127.0.0.1:{free_port()}", 0, 1, {"w": spec}, {"w": (desc, torch.zeros(4))}).start()
    try:
        assert not w.wait_connected(3), "connected to a port nobody listens on"
    finally:
        w.stop()


@pytest.mark.slow  # 3-5 s: the quick suite's margin under 5 minutes on slower machines
def test_a_second_worker_for_a_live_rank_is_refused_and_says_so():
    """Items 5 and 18: a second worker for a rank whose worker is alive is refused, even from the same
    process (its pid is the holder's: a pid alone proves nothing), and it knows it was refused
    (wait_connected returns False at once) instead of reporting 'connected'. The holder keeps the rank."""
    from reshard.common.layout.core import Box, LocalBuffer, Piece, TensorSpec

    svc = Services("dup", trainers=1, inferences=1)
    spec = TensorSpec("w", (4,), "float32")
    desc = LocalBuffer("w", (4,), "float32", (Piece("w", Box((0,), (4,)), Box((0,), (4,))),))
    first = second = None
    try:
        first = InferenceWorker(svc.inf_w, 0, 1, {"w": spec}, {"w": (desc, torch.zeros(4))}).start()
        assert first.wait_connected(60)
        pid = first.controller_pid
        second = InferenceWorker(svc.inf_w, 0, 1, {"w": spec}, {"w": (desc, torch.zeros(4))}).start()
        t0 = time.monotonic()
        assert not second.wait_connected(30), "a second worker for a live rank reported connected"
        assert time.monotonic() - t0 < 20 and second.refused and "held by live worker" in second.last_error, \
            second.last_error
        time.sleep(1.0)
        assert first._connected.is_set() and first.controller_pid == pid, "the holder lost its rank"
        st = json.loads(cli("status", "--inference", svc.inf, "--json", check=True).stdout)
        assert [w["pid"] for w in st["workers"]] == [os.getpid()] and st["workers"][0]["state"] != "DEAD", st
        # A rank outside the deployment (a vLLM rank numbered over more replicas than it has) is refused
        # too, at once, with the reason; not retried as if the controller were unreachable.
        outside = InferenceWorker(svc.inf_w, 1, 2, {"w": spec}, {"w": (desc, torch.zeros(4))}).start()
        t0 = time.monotonic()
        assert not outside.wait_connected(30)
        assert time.monotonic() - t0 < 20 and outside.refused and "does not fit" in outside.last_error, \
            outside.last_error
    finally:
        for w in (first, second, locals().get("outside")):
            if w is not None:
                w.stop()
        svc.close()


SLOW_START = '''import os, time
with open("/proc/self/cmdline", "rb") as f:
    _cmd = f.read()
if b"standalone" in _cmd and os.environ.get("RESHARD_TEST_SLOW_START"):
    time.sleep(float(os.environ["RESHARD_TEST_SLOW_START"]))  # a worker's imports on a loaded machine
'''


@pytest.mark.slow  # over 6 s: the quick suite keeps under 5 minutes on 2 cores
def test_an_update_asked_for_before_the_workers_attached_waits_for_them(tmp_path):
    """Item 8: with the services started as the README says and `reshard update --wait` run as soon
    as status answers, the first update must wait (within its own deadline) for workers that are
    slow to start, and status says what it waits for. Here every standalone worker takes 4 s longer
    to start than the control-plane deadline (a sitecustomize on their path sleeps first)."""
    (tmp_path / "sitecustomize.py").write_text(SLOW_START)
    env = dict(os.environ, RESHARD_TEST_SLOW_START="5",
               PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH", "")])))
    inf, tr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen([sys.executable, "-m", "reshard.cli", "inference", "--listen", inf, "--workers", "2",
                          "--model", "tiny", "--rpc-timeout", "1"], env=env, stderr=subprocess.DEVNULL,
                         start_new_session=True),
        subprocess.Popen([sys.executable, "-m", "reshard.cli", "trainer", "--listen", tr, "--workers", "2", "--model",
                          "tiny", "--inference", inf, "--run", "busy", "--rpc-timeout", "1"], env=env,
                         stderr=subprocess.DEVNULL, start_new_session=True),
    ]
    try:
        t0 = time.monotonic()
        while cli("status", "--trainer", tr, "--json", timeout=30).returncode != 0:
            assert time.monotonic() - t0 < 60, "the trainer controller never answered"
            time.sleep(0.1)
        upd = subprocess.Popen([sys.executable, "-m", "reshard.cli", "update", "--trainer", tr, "--wait", "--json"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        seen = ""
        while upd.poll() is None and not seen:
            st = json.loads(cli("status", "--trainer", tr, "--json", check=True).stdout)
            if st["progress"]["phase"] == "WAITING":
                seen = st["progress"]["detail"]
            time.sleep(0.1)
        out, err = upd.communicate(timeout=120)
        assert upd.returncode == 0, err
        assert json.loads(out)["committed"]["step"] == 1
        assert "not attached yet" in seen, seen
    finally:
        stop_processes(procs)


@pytest.mark.slow  # the quick suite's time: 4-6 s
def test_malformed_requests_are_refused_at_the_door_naming_the_field():
    """The outside probe's malformed requests: each gets INVALID_ARGUMENT naming the field, from a
    real controller, before anything reaches a worker (they got UNKNOWN with a traceback, or were
    accepted and failed later on the workers); the deployment still serves afterwards."""
    import grpc

    from reshard.proto import reshard_pb2 as pb
    from reshard.proto import reshard_pb2_grpc as rgrpc
    from reshard.proto import worker_pb2_grpc as wgrpc

    from .cluster import Cluster

    c = Cluster("tiny", inference_workers=2)
    try:
        good = dict(update_id="u1", version=pb.Version(run="r", step=1), src_layout=b"RSLx", plan_digest="d",
                    timeout_s=10)
        session = dict(id="s1", store_host="127.0.0.1", store_port=1234, src_world=2, dst_world=2, transport="gloo")
        probes = [
            ({"bucket_bytes": 3}, {}, "bucket_bytes"),
            ({}, {"transport": "bogus"}, "session.transport"),
            ({}, {"src_world": -3}, "session.src_world"),
            ({}, {"dst_world": 10 ** 9}, "session.dst_world"),
            ({}, {"store_port": 70000}, "session.store_port"),
            ({"update_id": "x" * (1 << 20)}, {}, "update_id"),
            ({"version": pb.Version(run="r" * (1 << 20), step=1)}, {}, "version.run"),
            ({"version": pb.Version(run="r", step=-1)}, {}, "version.step"),
            ({"tensors": ["p" * 100_000]}, {}, "tensors"),
        ]
        with grpc.insecure_channel(c.inf, options=[("grpc.max_send_message_length", 8 << 20)]) as ch:
            stub = rgrpc.InferenceServiceStub(ch)
            for over, sess, field in probes:
                req = pb.BeginUpdateRequest(**{**good, **over}, session=pb.Session(**{**session, **sess}))
                with pytest.raises(grpc.RpcError) as e:
                    stub.BeginUpdate(req, timeout=30)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details(), \
                    (field, e.value.code(), e.value.details()[:300])
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Dump(pb.DumpRequest(tensor="model.norm.weight", rank=-1), timeout=30))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        with grpc.insecure_channel(c.tr) as ch:
            with pytest.raises(grpc.RpcError) as e:
                rgrpc.TrainerServiceStub(ch).TriggerUpdate(pb.TriggerUpdateRequest(tensors=["*" * 100_000]), timeout=30)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tensors" in e.value.details()
        # A worker stream with no hello at all (on the worker listener): a clear refusal, not UNKNOWN.
        waddr = c.status()["worker_address"]
        with grpc.insecure_channel(waddr) as ch:
            with pytest.raises(grpc.RpcError) as e:
                list(wgrpc.WorkerControlStub(ch).Attach(iter(()), timeout=30))
            assert e.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED), e.value
        rc, out, err = c.update()
        assert rc == 0, err + c.logs()
    finally:
        c.close()


@pytest.mark.slow  # over 6 s: the quick suite keeps under 5 minutes on 2 cores
def test_fencing_survives_an_inference_restart_and_cannot_be_taken_by_naming_an_epoch():
    """Item 15: epochs are granted by inference (one more than any before, kept in its run folder),
    not taken from a caller's clock or request: a trainer controller fenced out by a newer one stays
    fenced out across an inference controller restart, and a BeginUpdate naming epoch 2**62 is
    refused without fencing anyone."""
    import grpc

    from reshard.proto import reshard_pb2 as pb

    inf = f"127.0.0.1:{free_port()}"
    inf_cmd = [sys.executable, "-m", "reshard.cli", "inference", "--listen", inf, "--workers", "2", "--model", "tiny"]

    def trainer(port: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "reshard.cli", "trainer", "--listen", port, "--workers", "2",
                                 "--model", "tiny", "--inference", inf, "--run", "fence"], stderr=subprocess.DEVNULL,
                                start_new_session=True)

    def serving(flag: str, addr: str) -> None:
        t0 = time.monotonic()
        while True:
            r = cli("status", flag, addr, "--json", timeout=30)
            if r.returncode == 0 and json.loads(r.stdout)["serving_state"] == "SERVING":
                return
            assert time.monotonic() - t0 < 90, f"{addr} never served: {r.stderr}"
            time.sleep(0.2)

    def update(tr: str) -> tuple[int, str]:
        serving("--inference", inf)
        serving("--trainer", tr)
        r = cli("update", "--trainer", tr, "--wait", "--json", timeout=120)
        return r.returncode, r.stdout + r.stderr

    a, b = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen(inf_cmd, stderr=subprocess.DEVNULL, start_new_session=True), trainer(a)]
    try:
        rc, out = update(a)
        assert rc == 0, out
        procs.append(trainer(b))  # a second trainer controller (a restart elsewhere) takes over
        rc, out = update(b)
        assert rc == 0, out
        rc, out = update(a)
        assert rc != 0 and "fenced" in out, out
        # The inference controller restarts (its workers with it): the fence holds.
        stop_processes(procs[:1])
        procs[0] = subprocess.Popen(inf_cmd, stderr=subprocess.DEVNULL, start_new_session=True)
        rc, out = update(a)
        assert rc != 0 and "fenced" in out, out
        # Naming an epoch is no way in: refused, and the holder keeps pushing.
        with grpc.insecure_channel(inf) as ch:
            from reshard.proto import reshard_pb2_grpc as rgrpc

            with pytest.raises(grpc.RpcError) as e:
                rgrpc.InferenceServiceStub(ch).BeginUpdate(pb.BeginUpdateRequest(
                    update_id="x", version=pb.Version(run="fence", step=10 ** 6), src_layout=b"RSL", plan_digest="0",
                    epoch=1 << 62, session=pb.Session(id="s", transport="gloo", store_host="127.0.0.1", store_port=1,
                                                      src_world=2, dst_world=2)), timeout=30)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "not granted" in e.value.details()
        rc, out = update(b)
        assert rc == 0, out
    finally:
        stop_processes(procs)


@pytest.mark.slow  # the quick suite stays under 5 minutes on 2 cores; CI runs it with the slow tests
def test_the_controller_takes_the_staging_its_workers_report():
    """Item 26: a deployment of embedded in-place workers behind a controller started without --staging
    (standalone workers' setting, shadow by default): a transfer that fails midway tears their weights,
    so the deployment must say NOT_SERVING (it said SERVING, judging by its own flag). Item 27: with
    external workers and no --model, no model label is made up."""
    src, dst = megatron_layout(CFG, 2), vllm_layout(CFG, 2)
    svc = Services("stg", trainer_args=("--bucket-bytes", "4096", "--update-timeout", "4"),
                   inference_args=("--update-timeout", "4"))
    workers: list = []
    try:
        for r in range(2):
            bufs = {d.name: (d, torch.zeros(d.shape, dtype=torch.bfloat16)) for d in dst.ranks[r]}
            workers.append(InferenceWorker(svc.inf_w, r, 2, dst.tensors, bufs, staging="inplace").start())
        trs = []
        for r in range(2):
            bufs = {d.name: (d, torch.zeros(d.shape, dtype=torch.bfloat16)) for d in src.ranks[r]}
            fill(src, r, {n: t for n, (_, t) in bufs.items()}, canonical(1))
            trs.append(TrainerWorker(svc.tr_w, r, 2, src.tensors, bufs, run="stg").start())
        workers += trs
        for w in workers:
            assert w.wait_connected(60)
        handles = [w.publish(1) for w in trs]
        assert all(h.wait_outcome(60) is True for h in handles), [h.error for h in handles]
        t0 = time.monotonic()
        while json.loads(cli("status", "--inference", svc.inf, "--json", check=True).stdout)["serving_state"] != "SERVING":
            assert time.monotonic() - t0 < 30, "the deployment never served step 1"
            time.sleep(0.2)
        trs[0].fault = {"slow_after": 0, "slow_seconds": 30.0, "once": 1}  # step 2 stalls past the deadline
        for r, w in enumerate(trs):
            fill(src, r, w.live, canonical(2))
        handles = [w.publish(2) for w in trs]
        assert all(h.wait_outcome(60) is False for h in handles), [h.error for h in handles]
        t0 = time.monotonic()
        while True:
            st = json.loads(cli("status", "--inference", svc.inf, "--json", check=True).stdout)
            if st["serving_state"] == "NOT_SERVING" and not st["update_in_progress"]:
                break
            assert time.monotonic() - t0 < 30, st
            time.sleep(0.2)
        assert st["model"] == "", st["model"]
        assert not any(w.serving_ok for w in workers[:2])
    finally:
        for w in workers:
            w.stop()
        svc.close()


@pytest.mark.slow  # quick suite under 300 s on 2 cores (CI runs it with the slow ones)
def test_an_inference_worker_killed_mid_transfer_is_named_as_the_cause():
    """Item 21: after an inference worker dies mid-transfer, the update's error named only the
    trainer's raw data-plane error; it must name the dead rank."""
    import signal

    from .cluster import Cluster

    env = {"RESHARD_FAULT_RANK": "1", "RESHARD_FAULT_SLOW_AFTER": "0", "RESHARD_FAULT_SLOW_SECONDS": "5",
           "RESHARD_FAULT_ONCE": "1"}
    c = Cluster("tiny", inference_workers=2, bucket_bytes=4096, inference_env=env)
    try:
        victim = c.worker_pid(1)
        proc = subprocess.Popen([sys.executable, "-m", "reshard.cli", "update", "--trainer", c.tr, "--wait", "--json"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        c.wait_for(lambda s: s["update_in_progress"] and s["progress"]["phase"] == "TRANSFER"
                   and int(s["progress"]["bytes_done"]) > 0, timeout=60, what="TRANSFER with progress")
        os.kill(victim, signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode != 0
        assert "inference worker rank 1" in err and "died" in err, err
    finally:
        c.close()
