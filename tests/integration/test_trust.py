"""Trustworthy updates: regression tests for the seams of the update path (issue 11).
Real services in real processes, real gloo groups; weights checked against an independent
regeneration (synth.tensor_value), never against the planner."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from reshard.common.models.presets import megatron_layout, model_config
from reshard.tools.synth import tensor_value
from reshard.trainer_svc.worker import TrainerWorker

from .cluster import Cluster, cli, dump_rpc, free_port, stop_processes

pytestmark = pytest.mark.integration
SEED = 5


def start(args: list[str], log: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "reshard.cli", *args], stdout=subprocess.DEVNULL,
                            stderr=open(log, "w"), start_new_session=True)


stop = stop_processes


def dump_from(addr: str, name: str) -> tuple[torch.Tensor, dict]:
    return dump_rpc(addr, name)


def status(addr: str, side: str) -> dict:
    import grpc
    from google.protobuf import json_format

    from reshard.proto import reshard_pb2 as pb
    from reshard.proto import reshard_pb2_grpc as rgrpc

    with grpc.insecure_channel(addr) as ch:
        stub = rgrpc.InferenceServiceStub(ch) if side == "inference" else rgrpc.TrainerServiceStub(ch)
        st = stub.GetStatus(pb.StatusRequest(), timeout=10)
    return json_format.MessageToDict(st, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def wait_status(addr: str, side: str, pred, timeout: float = 90, what: str = "") -> dict:
    t0, last = time.monotonic(), None
    while time.monotonic() - t0 < timeout:
        try:
            last = status(addr, side)
            if pred(last):
                return last
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}: {last}")


@pytest.mark.slow  # quick suite under 300 s on 2 cores (CI runs it with the slow ones)
def test_trainer_may_write_only_after_every_deployment_has_the_version(tmp_path):
    """An embedded trainer feeding two deployments overwrites its weights the moment wait() returns:
    both deployments must still commit exactly the published step (no torn weights). The workers
    are made without run= (the controller's run names the version) and publish right after start()."""
    cfg = model_config("tiny")
    a, b, tr, tr_w = (f"127.0.0.1:{free_port()}" for _ in range(4))
    procs = [start(["inference", "--listen", a, "--workers", "2", "--model", "tiny"], f"{tmp_path}/a.log"),
             start(["inference", "--listen", b, "--layout", "framework=vllm,tp=1,dp=2", "--model", "tiny"], f"{tmp_path}/b.log"),
             start(["trainer", "--listen", tr, "--workers", "2", "--model", "tiny", "--inference", a, "--inference", b,
                    "--external-workers", "--run", "ctl-run", "--worker-listen", tr_w], f"{tmp_path}/t.log")]
    src = megatron_layout(cfg, 2)
    trainers = []

    def fill(step: int | None) -> None:
        for r, w in enumerate(trainers):
            for desc in src.ranks[r]:
                for p in desc.pieces:
                    view = w.live[desc.name][p.region.slices()]
                    if step is None:
                        view.fill_(-7.0)  # the next step's weights, as far as reshard can tell
                    else:
                        view.copy_(tensor_value(SEED, p.tensor, step, cfg.tensors()[p.tensor].shape, torch.bfloat16)[p.box.slices()])

    try:
        for addr in (a, b):
            wait_status(addr, "inference", lambda s: s["serving_state"] == "SERVING", what=f"{addr} serving")
        for r in range(2):
            bufs = {d.name: (d, torch.zeros(d.shape, dtype=torch.bfloat16)) for d in src.ranks[r]}
            trainers.append(TrainerWorker(tr_w, r, 2, src.tensors, bufs))
        for step in (1, 2):
            fill(step)
            if step == 1:
                for w in trainers:
                    w.start()  # publish at once, before the stream is up: nothing may be dropped
            handles = [w.publish(step) for w in trainers]
            for h in handles:
                assert h.wait(90), f"step {step}: weights never became writable\n" + open(f"{tmp_path}/t.log").read()[-3000:]
            fill(None)  # the trainer writes step + 1 the moment it may
            st = status(tr, "trainer")
            assert {d["address"]: int(d["committed"]["step"]) for d in st["deployments"]} == {a: step, b: step}, st
            for addr in (a, b):
                for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight", "lm_head.weight"):
                    got, version = dump_from(addr, name)
                    assert version == {"run": "ctl-run", "step": step}
                    want = tensor_value(SEED, name, step, cfg.tensors()[name].shape, torch.bfloat16)
                    assert torch.equal(got, want), f"{addr} {name} at step {step} is torn"
    finally:
        for w in trainers:
            w.stop()
        stop(procs)


@pytest.mark.slow  # over 15 s
def test_outcome_belongs_to_its_deployment_when_one_is_detached_during_the_update(tmp_path):
    """Deployment A (slowed) is detached while it receives; deployment B cannot take the layout.
    The update must report B's failure, under B's address, at once (not hang or blame A)."""
    c = Cluster("small", inference_env={"RESHARD_FAULT_RANK": "0", "RESHARD_FAULT_SLOW_AFTER": "0",
                                        "RESHARD_FAULT_SLOW_SECONDS": "3", "RESHARD_FAULT_ONCE": "1"})
    b = f"127.0.0.1:{free_port()}"
    bproc = start(["inference", "--listen", b, "--workers", "2", "--model", "tiny"], f"{tmp_path}/b.log")
    try:
        wait_status(b, "inference", lambda s: s["serving_state"] == "SERVING", what="B serving")
        cli("attach", "--trainer", c.tr, "--inference", b, check=True)
        upd = subprocess.Popen([sys.executable, "-m", "reshard.cli", "update", "--trainer", c.tr, "--wait", "--timeout", "60"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # A's own phase: its rank 0 stalls 3 s in the transfer, while the trainer's ranks (done sending)
        # wait in VERIFY.
        c.wait_for(lambda s: s.get("progress", {}).get("phase") == "TRANSFER", what="A receiving")
        cli("detach", "--trainer", c.tr, "--inference", c.inf, check=True)
        out, err = upd.communicate(timeout=90)
        assert upd.returncode == 1, (upd.returncode, out, err, c.logs())
        assert b in err and c.inf not in err, err
    finally:
        stop([bproc])
        c.close()


def rpc(addr: str, method: str, request, timeout: float = 15):
    import grpc

    from reshard.proto import reshard_pb2_grpc as rgrpc

    with grpc.insecure_channel(addr) as ch:
        return getattr(rgrpc.InferenceServiceStub(ch), method)(request, timeout=timeout)


@pytest.mark.slow  # a 3 s stalled transfer
def test_dump_during_an_in_place_transfer_never_blocks_the_worker():
    """In-place staging holds the serving lock for the whole transfer: a read-back then must be
    refused at once, not block the worker's loop (which would strand the update)."""

    c = Cluster("tiny", inference_workers=2, inference_staging="inplace",
                inference_env={"RESHARD_FAULT_RANK": "0", "RESHARD_FAULT_SLOW_AFTER": "0", "RESHARD_FAULT_SLOW_SECONDS": "3",
                               "RESHARD_FAULT_ONCE": "1"})
    try:
        upd = subprocess.Popen([sys.executable, "-m", "reshard.cli", "update", "--trainer", c.tr, "--wait", "--json",
                                "--timeout", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        c.wait_for(lambda s: s.get("progress", {}).get("phase") == "TRANSFER", what="inference receiving")
        t0 = time.monotonic()
        with pytest.raises(AssertionError, match="UNAVAILABLE.*in place") as e:
            dump_from(c.inf, "lm_head.weight")
        assert time.monotonic() - t0 < 8, e.value
        out, err = upd.communicate(timeout=90)
        assert upd.returncode == 0, err + c.logs()
        got, version = dump_from(c.inf, "lm_head.weight")
        assert torch.equal(got, c.expected("lm_head.weight", version["step"]))
    finally:
        c.close()


@pytest.mark.slow  # a 3 s held commit
def test_commit_is_owned_by_finish_update_and_a_retry_gets_its_outcome():
    """During COMMIT nothing else may abort the update (a BeginUpdate or AbortUpdate is refused),
    and a retried FinishUpdate is answered from the recorded outcome without committing again."""
    import grpc

    from reshard.proto import reshard_pb2 as pb

    c = Cluster("tiny", inference_workers=2, inference_env={"RESHARD_FAULT_RANK": "0", "RESHARD_FAULT_COMMIT_SECONDS": "3"})
    try:
        upd = subprocess.Popen([sys.executable, "-m", "reshard.cli", "update", "--trainer", c.tr, "--wait", "--json",
                                "--timeout", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        st = c.wait_for(lambda s: s.get("progress", {}).get("phase") == "COMMIT", what="inference committing")
        uid = st["progress"]["update_id"]
        # Even a peer granted the newest epoch meanwhile (which fences the trainer out for its next update)
        # cannot begin an update over one that commits.
        lay = rpc(c.inf, "GetLayout", pb.GetLayoutRequest(acquire_epoch=True))
        with pytest.raises(grpc.RpcError) as e:
            rpc(c.inf, "BeginUpdate", pb.BeginUpdateRequest(
                update_id="intruder", version=pb.Version(run="other", step=9), src_layout=b"\0", epoch=lay.epoch,
                session=pb.Session(id="s", transport="gloo", store_host="127.0.0.1", store_port=1, src_world=2,
                                   dst_world=lay.workers)))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "COMMIT" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            rpc(c.inf, "AbortUpdate", pb.AbortUpdateRequest(update_id=uid, reason="too late"))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        out, err = upd.communicate(timeout=90)
        assert upd.returncode == 0, err + c.logs()
        step = json.loads(out)["committed"]["step"]
        before = c.status()
        rep = rpc(c.inf, "FinishUpdate", pb.FinishUpdateRequest(update_id=uid))  # a retry, with no checksums at all
        assert (rep.committed.run, rep.committed.step) == ("run1", step) and rep.bytes > 0
        after = c.status()
        assert len(after["history"]) == len(before["history"]) and after["history"][-1]["update_id"] == uid
        assert after["serving_state"] == "SERVING"
    finally:
        c.close()


@pytest.mark.slow  # over 15 s
def test_a_restarted_worker_never_serves_its_checkpoint_beside_the_new_version():
    """An inference worker killed after step N comes back with its checkpoint: it must not serve
    (held, the deployment DEGRADED) and is brought back to step N at once, not at the next step.
    Also defect 10: the repair must open a new data-plane session (the inference membership
    changed), never hand the restarted process the session its peers cached with the dead one:
    that repair would wait out the update deadline and fail first."""
    c = Cluster("tiny", inference_workers=2)
    try:
        rc, out, err = c.update()
        assert rc == 0, err + c.logs()
        step = out["committed"]["step"]
        old = c.worker_pid(1)
        t0 = time.monotonic()
        os.kill(old, signal.SIGKILL)
        healed = c.wait_for(lambda s: s["serving_state"] == "SERVING" and all(
            w["version"]["run"] == "run1" and int(w["version"]["step"]) == step for w in s["workers"])
            and c.worker_pid(1) != old, what="repaired")
        took = time.monotonic() - t0
        rank1 = next(w for w in healed["workers"] if w["rank"] == 1)
        assert set(rank1["requests_by_version"]) <= {f"run1:{step}"}, rank1  # never served its checkpoint
        assert took < 30, took
        print(f"kill to repaired: {took:.1f}s")
        failed = [h for h in c.status("trainer")["history"] if not h["ok"]]
        assert not failed, failed  # the repair succeeded at its first try
        got, version = dump_from(c.inf, "model.layers.0.self_attn.q_proj.weight")
        assert version == {"run": "run1", "step": step}
        assert torch.equal(got, c.expected("model.layers.0.self_attn.q_proj.weight", step))
        rc, out, err = c.update()  # and the next update commits
        assert rc == 0 and out["committed"]["step"] == step + 1, err
    finally:
        c.close()


@pytest.mark.slow  # over 15 s
def test_versions_never_go_backwards_and_a_newer_trainer_controller_fences_the_older(tmp_path):
    """Another run (or an older step) is refused unless the operator allows it, and then recorded;
    once a newer trainer controller has updated a deployment, the older one is fenced out."""
    c = Cluster("tiny", inference_workers=2)
    procs = []

    def trainer(*extra: str) -> str:
        addr = f"127.0.0.1:{free_port()}"
        procs.append(start(["trainer", "--listen", addr, "--workers", "2", "--model", "tiny", "--inference", c.inf,
                            "--run", "run2", *extra], f"{tmp_path}/trainer{len(procs)}.log"))
        wait_status(addr, "trainer", lambda s: s["serving_state"] == "SERVING", what="second trainer up")
        return addr

    def update(addr: str) -> tuple[int, str]:
        r = cli("update", "--trainer", addr, "--wait", "--json", "--timeout", "60", timeout=90)
        return r.returncode, r.stdout + r.stderr

    try:
        rc, out, err = c.update()
        assert rc == 0, err
        first = out["committed"]
        b = trainer()
        rc, text = update(b)
        assert rc != 0 and "another run" in text and "--allow-rollback" in text, text
        assert c.status()["version"] == {"run": "run1", "step": str(first["step"])}
        stop(procs)
        b = trainer("--allow-rollback")
        rc, text = update(b)
        assert rc == 0, text
        st = c.status()
        assert st["version"]["run"] == "run2" and "rollback allowed by the operator: from run1:1" in st["history"][-1]["note"]
        rc, out, err = c.update()  # the first controller, now older than the one that took over
        assert rc != 0 and "fenced" in (err + json.dumps(out)), err
        assert c.status()["version"]["run"] == "run2"
        stop(procs)  # restarted with the same command line and run: it continues after what inference holds
        b = trainer()
        rc, text = update(b)
        assert rc == 0 and '"step": 2' in text, text
    finally:
        stop(procs)
        c.close()


@pytest.mark.slow  # the failure matrix's trainer COMMIT kill restarts a trainer controller in make test
def test_a_restarted_trainer_controller_recovers_what_its_workers_published(tmp_path):
    """The trainer controller dies while it pushes an embedded trainer's step: restarted with the
    same command line, it learns the published version from its workers' hellos and pushes it, and
    the trainer's handles are released (not left waiting forever)."""
    cfg = model_config("tiny")
    inf, tr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    slow = {"RESHARD_FAULT_RANK": "0", "RESHARD_FAULT_SLOW_AFTER": "0", "RESHARD_FAULT_SLOW_SECONDS": "4",
            "RESHARD_FAULT_ONCE": "1"}
    env = dict(os.environ, **slow)
    procs = [subprocess.Popen([sys.executable, "-m", "reshard.cli", "inference", "--listen", inf, "--workers", "2",
                               "--model", "tiny"], env=env, stdout=subprocess.DEVNULL,
                              stderr=open(f"{tmp_path}/inf.log", "w"), start_new_session=True)]
    tr_w = f"unix:{tmp_path}/trainer-workers.sock"  # the same path after the restart: the workers find it again
    trainer_cmd = ["trainer", "--listen", tr, "--workers", "2", "--model", "tiny", "--inference", inf, "--external-workers",
                   "--run", "r", "--worker-listen", tr_w]
    procs.append(start(trainer_cmd, f"{tmp_path}/t1.log"))
    src = megatron_layout(cfg, 2)
    trainers = []
    try:
        wait_status(inf, "inference", lambda s: s["serving_state"] == "SERVING", what="inference serving")
        for r in range(2):
            bufs = {d.name: (d, torch.zeros(d.shape, dtype=torch.bfloat16)) for d in src.ranks[r]}
            for desc in src.ranks[r]:
                for p in desc.pieces:
                    bufs[desc.name][1][p.region.slices()].copy_(
                        tensor_value(SEED, p.tensor, 1, cfg.tensors()[p.tensor].shape, torch.bfloat16)[p.box.slices()])
            trainers.append(TrainerWorker(tr_w, r, 2, src.tensors, bufs).start())
        handles = [w.publish(1) for w in trainers]
        wait_status(inf, "inference", lambda s: s.get("progress", {}).get("phase") == "TRANSFER", what="transfer")
        os.killpg(procs[-1].pid, signal.SIGKILL)  # the controller dies mid-push
        procs[-1].wait()
        assert not any(h.writable for h in handles)
        procs.append(start(trainer_cmd, f"{tmp_path}/t2.log"))
        for h in handles:
            assert h.wait(60), (open(f"{tmp_path}/t2.log").read()[-3000:], status(tr, "trainer"), status(inf, "inference"))
        st = wait_status(inf, "inference", lambda s: s.get("version", {}).get("step") == "1", what="step 1 committed")
        assert st["version"]["run"] == "r"
        got, _ = dump_from(inf, "lm_head.weight")
        assert torch.equal(got, tensor_value(SEED, "lm_head.weight", 1, cfg.tensors()["lm_head.weight"].shape, torch.bfloat16))
    finally:
        for w in trainers:
            w.stop()
        stop(procs)
