"""One trainer, two inference deployments (one with two DP replicas that relay), each
with its own session: a deployment that dies does not stop the other from updating."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from reshard.common.layout.core import dtype_of
from reshard.common.models.frameworks import build

from .cluster import Cluster, cli, dump_rpc, free_port, stop_processes

pytestmark = pytest.mark.integration

NAMES = ["model.layers.0.self_attn.q_proj.weight", "model.layers.3.mlp.down_proj.weight", "lm_head.weight",
         "model.layers.1.self_attn.v_proj.weight"]


def dump_from(addr: str, name: str):
    return dump_rpc(addr, name)


@pytest.mark.slow  # over 15 s; test_trust drives two deployments in make test
def test_two_deployments_with_relays():
    c = Cluster("small")  # deployment A: vLLM TP=4
    b_addr = f"127.0.0.1:{free_port()}"
    b = subprocess.Popen([sys.executable, "-m", "reshard.cli", "inference", "--listen", b_addr, "--model", "small",
                          "--layout", "framework=vllm,tp=2,dp=2"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    try:
        t0 = time.monotonic()
        while '"SERVING"' not in cli("status", "--inference", b_addr, "--json").stdout:  # B's workers are up
            assert time.monotonic() - t0 < 90, "deployment B never served"
            time.sleep(0.5)
        r = cli("attach", "--trainer", c.tr, "--inference", b_addr, check=True)
        assert b_addr in r.stdout
        rc, out, err = c.update()
        assert rc == 0, err + c.logs()
        step = out["committed"]["step"]
        for name in NAMES:
            for addr in (c.inf, b_addr):
                got, version = dump_from(addr, name)
                assert version["step"] == step and torch.equal(got, c.expected(name, step)), (addr, name)
        st = json.loads(cli("status", "--trainer", c.tr, "--json", check=True).stdout)
        assert {d["address"] for d in st["deployments"]} == {c.inf, b_addr}
        # An update's bytes are the payload, each destination byte once, though B's replicas relay.
        layout = build("small", "framework=vllm,tp=2,dp=2")
        payload = sum(math.prod(p.box.size) * dtype_of(layout.tensors[p.tensor].dtype).itemsize
                      for bufs in layout.ranks for b in bufs for p in b.pieces)
        record = json.loads(cli("status", "--inference", b_addr, "--json", check=True).stdout)["history"][-1]
        assert int(record["bytes"]) == payload, (record, payload)
        assert all(int(d["committed"]["step"]) == step for d in st["deployments"])
        # Deployment B dies: the update fails there, and still reaches A.
        os.killpg(b.pid, signal.SIGKILL)
        b.wait()
        rc, out, err = c.update()
        assert rc != 0 and b_addr in ((out or {}).get("error", "") + err)
        st = json.loads(cli("status", "--trainer", c.tr, "--json", check=True).stdout)
        a_state = next(d for d in st["deployments"] if d["address"] == c.inf)
        assert int(a_state["committed"]["step"]) == step + 1
        got, version = dump_from(c.inf, NAMES[0])
        assert version["step"] == step + 1 and torch.equal(got, c.expected(NAMES[0], step + 1))
        # Detached, it no longer holds updates back.
        cli("detach", "--trainer", c.tr, "--inference", b_addr, check=True)
        rc, out, err = c.update()
        assert rc == 0, err
        assert out["committed"]["step"] == step + 2
        r = cli("detach", "--trainer", c.tr, "--inference", b_addr)
        assert r.returncode == 2 and "NOT_FOUND" in r.stderr
    finally:
        if b.poll() is None:
            os.killpg(b.pid, signal.SIGKILL)
        c.close()


@pytest.mark.slow  # the quick suite stays under 5 minutes on 2 cores; CI runs it with the slow tests
def test_an_inference_controller_that_comes_up_after_the_trainer_is_updated_at_once():
    """The trainer controller tried the inference address before it listened, so its channel is
    between connection attempts (gRPC backs off up to 2 s) when inference comes up. An update asked
    for right then waits for the connection instead of failing with "unreachable" (it did)."""
    import socket

    inf_port = free_port()
    inf, tr = f"127.0.0.1:{inf_port}", f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, "-m", "reshard.cli", "trainer", "--listen", tr, "--workers", "1",
                               "--model", "tiny", "--inference", inf, "--run", "late"],
                              stderr=subprocess.DEVNULL, start_new_session=True)]
    try:
        deadline = time.monotonic() + 60
        while cli("status", "--trainer", tr, "--json", timeout=60).returncode != 0:  # up, and trying inference
            assert time.monotonic() < deadline, "the trainer controller did not come up"
            time.sleep(0.5)
        time.sleep(2.0)  # its attempts at the inference address have failed: the channel backs off
        procs.append(subprocess.Popen([sys.executable, "-m", "reshard.cli", "inference", "--listen", inf, "--workers", "1",
                                       "--model", "tiny"], stderr=subprocess.DEVNULL, start_new_session=True))
        while True:  # the moment inference listens, not a status command's second later
            try:
                socket.create_connection(("127.0.0.1", inf_port), timeout=0.2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the inference controller did not come up"
                time.sleep(0.05)
        r = cli("update", "--trainer", tr, "--wait", "--json")
        out = json.loads(r.stdout)
        assert r.returncode == 0 and out["ok"] and out["verified"], (out, r.stderr)
    finally:
        stop_processes(procs)
