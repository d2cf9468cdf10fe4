"""reshard on Ray (reshard.integrations.ray): a local Ray cluster of two nodes (Ray's own cluster
utilities), both controllers as Ray actors, trainer ranks and inference ranks in Ray actors of
the test's own (as a framework's trainer group and engine actors hold them), on different nodes.
Weights move over real gloo and are checked against an independent reconstruction. Killing a
trainer actor mid-update fails that update within the worker timeout; Ray restarts the actor, its
worker attaches again, and the next update commits; after shutdown no process is left."""

import os
import time

import pytest

if not os.environ.get("CI"):  # CI installs it (the dev extra): there, a missing Ray fails
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'reshard[ray]')")
import ray  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # a Ray cluster start (about 10 s) and six actor processes
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEED, MODEL, WORLD = 11, "tiny", 2


def _full(step: int) -> dict:
    import torch

    from reshard.common.models.presets import model_config
    from reshard.tools.synth import tensor_value

    return {n: tensor_value(SEED, n, step, t.shape, torch.bfloat16) for n, t in model_config(MODEL).tensors().items()}


def _fill(layout, rank: int, tensors: dict, full: dict) -> None:
    for desc in layout.ranks[rank]:
        for p in desc.pieces:
            tensors[desc.name][p.region.slices()].copy_(full[p.tensor][p.box.slices()])


class TrainerRank:
    """A framework's trainer actor: its rank's Megatron TP shards, published at each step."""

    def __init__(self, dep, rank: int) -> None:
        import torch

        from reshard.common.models.presets import megatron_layout, model_config
        from reshard.trainer_svc.worker import TrainerWorker

        self.rank, self.layout = rank, megatron_layout(model_config(MODEL), WORLD)
        bufs = {d.name: (d, torch.zeros(d.shape, dtype=torch.bfloat16)) for d in self.layout.ranks[rank]}
        self.worker = TrainerWorker(dep.trainer_workers, rank, WORLD, self.layout.tensors, bufs, run="ray",
                                    security=dep.security()).start()

    def pid(self) -> int:
        return os.getpid()

    def connected(self, timeout: float) -> bool:
        return self.worker.wait_connected(timeout)

    def stall_next(self, seconds: float) -> None:
        """Its next transfer stalls after its first round (a data plane that stops while the control plane answers)."""
        self.worker.fault = {"slow_after": 0, "slow_seconds": seconds, "once": 1}

    def publish(self, step: int) -> tuple[bool | None, str, float]:
        _fill(self.layout, self.rank, self.worker.live, _full(step))
        t0 = time.monotonic()
        h = self.worker.publish(step)
        ok = h.wait_outcome(120)
        return ok, h.error, time.monotonic() - t0


class InferenceRank:
    """An engine actor: its rank's vLLM TP layout, received into its buffers."""

    def __init__(self, dep, rank: int) -> None:
        import torch

        from reshard.common.models.presets import model_config, vllm_layout
        from reshard.inference_svc.worker import InferenceWorker

        self.rank, self.layout = rank, vllm_layout(model_config(MODEL), WORLD)
        bufs = {d.name: (d, torch.zeros(d.shape, dtype=torch.bfloat16)) for d in self.layout.ranks[rank]}
        self.worker = InferenceWorker(dep.inference_workers, rank, WORLD, self.layout.tensors, bufs,
                                      security=dep.security()).start()

    def pid(self) -> int:
        return os.getpid()

    def connected(self, timeout: float) -> bool:
        return self.worker.wait_connected(timeout)

    def check(self, step: int) -> tuple[int | None, list[str]]:
        """(the step it holds, the buffers that differ from the step's weights cut independently)."""
        import torch

        v = self.worker.wait_for_version(step, "ray", timeout=30)
        want = {d.name: torch.full(d.shape, float("nan"), dtype=torch.bfloat16) for d in self.layout.ranks[self.rank]}
        _fill(self.layout, self.rank, want, _full(step))
        bad = []
        for name, t in self.worker.live.items():
            keep = ~torch.isnan(want[name].float())  # padding rows are not written
            if not torch.equal(t[keep], want[name][keep]):
                bad.append(name)
        return (v.step if v is not None else None), bad


def _trainer_phase(addr: str) -> tuple[str, int]:
    import grpc

    from reshard.proto import reshard_pb2 as pb
    from reshard.proto import reshard_pb2_grpc as rgrpc

    with grpc.insecure_channel(addr) as ch:
        st = rgrpc.TrainerServiceStub(ch).GetStatus(pb.StatusRequest(), timeout=5)
    return st.progress.phase, st.progress.version.step


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _start_cluster():
    from ray.cluster_utils import Cluster

    c = Cluster()
    try:
        c.add_node(num_cpus=2, resources={"node0": 8}, include_dashboard=False)
        c.add_node(num_cpus=2, resources={"node1": 8})
    except Exception:
        c.shutdown()  # what did start goes, before another try
        raise
    return c


@pytest.fixture(scope="module")
def cluster():
    """One two-node cluster for the module's tests. Ray gives a raylet a fixed 30 s to register
    with its GCS; on a loaded machine a node's start can miss it, so a start that times out is
    torn down and tried once more (a second failure fails the tests)."""
    try:
        c = _start_cluster()
    except Exception as e:  # Ray raises a bare Exception for the startup timeout
        if "timed out during startup" not in str(e):
            raise
        time.sleep(2)
        c = _start_cluster()
    ray.init(address=c.address, namespace="reshard-test", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT, "RESHARD_LOG_LEVEL": "WARNING", "OMP_NUM_THREADS": "1"}})
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def test_ray_actors_update_and_a_killed_actor_fails_only_its_update(cluster):
    from reshard.integrations.ray import RayDeployment

    assert len({n["NodeID"] for n in ray.nodes() if n["Alive"]}) == 2
    dep = RayDeployment.start(trainer_workers=WORLD, inference_workers=WORLD, run="ray", worker_timeout=5.0)
    assert dep.trainer.startswith("127.0.0.1:")  # one host: loopback, no credentials needed
    assert RayDeployment.connect() == dep  # found by name from any process of the job
    with pytest.raises(ValueError, match="already runs"):  # one deployment per name
        RayDeployment.start(trainer_workers=WORLD, inference_workers=WORLD)
    pids = set(dep.pids().values())
    on = {r: {"resources": {f"node{r}": 1}, "num_cpus": 0} for r in (0, 1)}
    # Trainer ranks on node1, engine ranks on node0.
    Tr = ray.remote(max_restarts=1, max_task_retries=0, max_concurrency=2)(TrainerRank)
    Inf = ray.remote(max_concurrency=2)(InferenceRank)
    trainers = [Tr.options(**on[1]).remote(dep, r) for r in range(WORLD)]
    engines = [Inf.options(**on[0]).remote(dep, r) for r in range(WORLD)]
    try:
        assert all(ray.get([a.connected.remote(60) for a in trainers + engines]))
        pids |= set(ray.get([a.pid.remote() for a in trainers + engines]))

        # 1. An update while every actor lives: committed on every rank, bit for bit.
        out = ray.get([a.publish.remote(1) for a in trainers])
        assert all(ok for ok, _, _ in out), out
        for step, bad in ray.get([a.check.remote(1) for a in engines]):
            assert step == 1 and bad == [], bad

        # 2. Rank 0 stalls its next transfer for 30 s after its first round: update 2 is in flight
        #    when rank 1's actor is killed.
        ray.get(trainers[0].stall_next.remote(30))
        pending = [a.publish.remote(2) for a in trainers]
        t0 = time.monotonic()
        while _trainer_phase(dep.trainer) != ("TRANSFER", 2):
            assert time.monotonic() - t0 < 60, "update 2 never reached TRANSFER"
            time.sleep(0.02)
        ray.kill(trainers[1], no_restart=False)  # the actor dies; Ray restarts it
        ok, err, took = ray.get(pending[0], timeout=60)
        assert ok is False and "trainer worker died" in err, err
        assert took < 30, f"the update took {took:.1f}s to fail after its worker's actor died"
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(pending[1], timeout=60)

        # 3. The restarted actor built its worker anew and attached: the next update commits.
        t0 = time.monotonic()
        while True:
            try:
                assert ray.get(trainers[1].connected.remote(60))
                break
            except ray.exceptions.ActorUnavailableError:  # still restarting
                assert time.monotonic() - t0 < 60, "Ray did not restart the trainer actor"
                time.sleep(0.2)
        pids.add(ray.get(trainers[1].pid.remote()))
        out = ray.get([a.publish.remote(3) for a in trainers])
        assert all(ok for ok, _, _ in out), out
        for step, bad in ray.get([a.check.remote(3) for a in engines]):
            assert step == 3 and bad == [], bad
    finally:
        for a in trainers + engines:
            ray.kill(a, no_restart=True)
        dep.shutdown()
    # Nothing left: every actor's process (the controllers', the ranks', the one Ray restarted).
    t0 = time.monotonic()
    while [p for p in pids if _alive(p)]:
        assert time.monotonic() - t0 < 20, f"processes left: {[p for p in pids if _alive(p)]}"
        time.sleep(0.2)


def test_ray_controllers_off_loopback_need_and_use_credentials(cluster, tmp_path):
    """With `credentials` (a `reshard certs` folder) the controllers listen on the node's address,
    serving TLS and accepting its tokens; the ranks' actors attach with the worker token and the CA,
    and an update commits. A plaintext call to the controller is refused."""
    import subprocess
    import sys

    import grpc

    from reshard.integrations.ray import RayDeployment
    from reshard.proto import reshard_pb2 as pb
    from reshard.proto import reshard_pb2_grpc as rgrpc

    ip = ray.util.get_node_ip_address()
    certs = tmp_path / "certs"
    r = subprocess.run([sys.executable, "-m", "reshard.cli", "certs", "--out", str(certs), "--host", ip],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    dep = RayDeployment.start(trainer_workers=WORLD, inference_workers=WORLD, run="ray", credentials=str(certs),
                              name="secured")
    assert dep.trainer.startswith(f"{ip}:") and dep.trainer_workers.startswith(f"{ip}:")
    assert set(dep.worker_credentials()) == {"token", "tls_ca"}
    trainers = [ray.remote(TrainerRank).options(num_cpus=0).remote(dep, r) for r in range(WORLD)]
    engines = [ray.remote(InferenceRank).options(num_cpus=0).remote(dep, r) for r in range(WORLD)]
    try:
        assert all(ray.get([a.connected.remote(60) for a in trainers + engines]))
        out = ray.get([a.publish.remote(1) for a in trainers])
        assert all(ok for ok, _, _ in out), out
        for step, bad in ray.get([a.check.remote(1) for a in engines]):
            assert step == 1 and bad == [], bad
        with grpc.insecure_channel(dep.trainer) as ch:  # no TLS, no token: refused
            with pytest.raises(grpc.RpcError):
                rgrpc.TrainerServiceStub(ch).GetStatus(pb.StatusRequest(), timeout=5)
    finally:
        for a in trainers + engines:
            ray.kill(a, no_restart=True)
        dep.shutdown()
