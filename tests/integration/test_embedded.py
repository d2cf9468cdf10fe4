"""The embedding API: TrainerWorker and InferenceWorker inside the user's own
process (this test process), attached to real services started through the CLI."""

import json
import subprocess
import sys
import time

import pytest
import torch

from reshard.common.models.presets import megatron_layout, model_config, vllm_layout
from reshard.inference_svc.worker import InferenceWorker
from reshard.tools.synth import tensor_value
from reshard.trainer_svc.worker import TrainerWorker

from .cluster import cli, free_port, stop_processes

pytestmark = pytest.mark.integration
SEED = 3


def canonical(cfg, step):
    return {n: tensor_value(SEED, n, step, t.shape, torch.bfloat16) for n, t in cfg.tensors().items()}


def fill(layout, rank, tensors, full):
    for desc in layout.ranks[rank]:
        for p in desc.pieces:
            tensors[desc.name][p.region.slices()].copy_(full[p.tensor][p.box.slices()])


def _recording(emit, into: list):
    """A worker's `emit`, noting each message's kind first."""
    def record(msg):
        kind = msg.WhichOneof("kind")
        if kind == "progress":
            kind = "connected" if msg.progress.connected else "bytes"
        into.append(kind)
        return emit(msg)
    return record


# slow without a snapshot (the quick suite's time: 4 s); the snapshot case runs the same path and more
@pytest.mark.parametrize("snapshot", [pytest.param(False, marks=pytest.mark.slow), True])
def test_embedded_workers_publish_and_commit(snapshot):
    cfg = model_config("tiny")
    inf, tr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    inf_w, tr_w = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"  # the worker listeners
    procs = [
        subprocess.Popen([sys.executable, "-m", "reshard.cli", "inference", "--listen", inf, "--workers", "2",
                          "--model", "my-tiny", "--external-workers", "--worker-listen", inf_w], stderr=subprocess.DEVNULL, start_new_session=True),
        subprocess.Popen([sys.executable, "-m", "reshard.cli", "trainer", "--listen", tr, "--workers", "2",
                          "--model", "my-tiny", "--inference", inf, "--external-workers", "--run", "emb",
                          "--worker-listen", tr_w],
                         stderr=subprocess.DEVNULL, start_new_session=True),
    ]
    src, dst = megatron_layout(cfg, 2), vllm_layout(cfg, 2)
    events = []
    sent: dict[int, list] = {}  # what each trainer rank told its controller, in order
    trainers, inferences = [], []
    try:
        for r in range(2):
            bufs = {d.name: (d, torch.zeros(d.shape, dtype=torch.bfloat16)) for d in dst.ranks[r]}
            inferences.append(InferenceWorker(inf_w, r, 2, dst.tensors, bufs, pause=lambda r=r: events.append(("pause", r)),
                                              resume=lambda r=r: events.append(("resume", r)),
                                              commit_hooks=(lambda v, r=r: events.append(("commit", r, v.step)),)).start())
        full = canonical(cfg, 1)
        for r in range(2):
            bufs = {d.name: (d, torch.zeros(d.shape, dtype=torch.bfloat16)) for d in src.ranks[r]}
            fill(src, r, {n: t for n, (_, t) in bufs.items()}, full)
            w = TrainerWorker(tr_w, r, 2, src.tensors, bufs, run="emb", snapshot=snapshot)
            w.emit = _recording(w.emit, sent.setdefault(r, []))
            trainers.append(w.start())
        for w in trainers + inferences:
            assert w.wait_connected(60)
        for step in (1, 2):
            if step == 2:
                full = canonical(cfg, 2)
                for r, w in enumerate(trainers):
                    fill(src, r, w.live, full)
            handles = [w.publish(step) for w in trainers]  # every rank, at the same point
            for h in handles:
                assert h.wait(60), "weights never became writable"
                assert h.writable
                assert h.wait_outcome(60) is True and h.error == "" and h.delivered.step == step, (h.ok, h.error)
            if snapshot:
                assert all(h.stall_seconds == 0.0 for h in handles)
            t0 = time.monotonic()
            while any(w.version is None or w.version.step != step for w in inferences):
                assert time.monotonic() - t0 < 60, "inference never committed"
                time.sleep(0.05)
            for r, w in enumerate(inferences):
                want = {d.name: torch.full(d.shape, float("nan"), dtype=torch.bfloat16) for d in dst.ranks[r]}
                fill(dst, r, want, full)
                for name, t in w.live.items():
                    keep = ~torch.isnan(want[name].float())  # padding rows are not written
                    assert torch.equal(t[keep], want[name][keep]), f"rank {r} {name} at step {step}"
                assert ("commit", r, step) in events
        assert ("pause", 0) in events and ("resume", 0) in events
        # CONNECT: each rank says it joined the session and reached its peers before any byte moves.
        for r, msgs in sent.items():
            order = [k for k in msgs if k in ("connected", "bytes", "done")]
            assert order.count("connected") == 2 and order.count("done") == 2, (r, order)
            for i, k in enumerate(order):
                if k != "connected":
                    assert "connected" in order[:i] and order[:i].count("connected") > order[:i].count("done"), (r, order)
        # --model is only a label with external workers; 64-bit integers print as JSON numbers.
        st = json.loads(cli("status", "--trainer", tr, "--json", check=True).stdout)
        assert st["model"] == "my-tiny" and st["committed"] == {"run": "emb", "step": 2}
        assert [h["version"]["step"] for h in st["history"] if h["ok"]][-1] == 2
        assert all(isinstance(h["bytes"], int) for h in st["history"]) and st["history"][-1]["bytes"] > 0
        # stop() closes the data-plane sessions itself: a gloo group left for the interpreter's exit
        # to tear down can abort the host process ("terminate called without an active exception").
        sessions = [t for w in trainers + inferences for t in w._sessions.values()]
        assert sessions and all(t._pg is not None for t in sessions)
        for w in trainers + inferences:
            w.stop()
        assert all(t._pg is None for t in sessions), "a stopped worker left a data-plane session open"
    finally:
        for w in trainers + inferences:
            w.stop()
        stop_processes(procs)


@pytest.mark.slow  # 3-5 s: the quick suite's margin under 5 minutes on slower machines
def test_a_layout_mismatch_reaches_a_rank_waiting_for_that_version():
    """An update the inference controller refuses (the trainer's layout disagrees with the engine's)
    is told to every rank with its version and the reason naming the first mismatch: a rank
    waiting to serve that version (an engine's weight-update call) stops waiting at once, and
    keeps what it served."""
    cfg = model_config("tiny")
    inf, tr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    inf_w, tr_w = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen([sys.executable, "-m", "reshard.cli", "inference", "--listen", inf, "--workers", "2",
                          "--external-workers", "--worker-listen", inf_w], stderr=subprocess.DEVNULL, start_new_session=True),
        subprocess.Popen([sys.executable, "-m", "reshard.cli", "trainer", "--listen", tr, "--workers", "1", "--inference", inf,
                          "--external-workers", "--run", "mm", "--worker-listen", tr_w],
                         stderr=subprocess.DEVNULL, start_new_session=True),
    ]
    dst = vllm_layout(cfg, 2)
    bad = next(n for n in dst.tensors if n.endswith("q_proj.weight"))
    spec = dst.tensors[bad]
    src_tensors = dict(dst.tensors)
    src_tensors[bad] = type(spec)(bad, (spec.shape[0] + 8, spec.shape[1]), spec.dtype)  # a wider q_proj
    from reshard.common.layout.core import Box, LocalBuffer, Piece

    src_bufs = {n: (LocalBuffer(n, t.shape, t.dtype, (Piece(n, Box.full(t.shape), Box.full(t.shape)),)),
                    torch.zeros(t.shape, dtype=torch.bfloat16)) for n, t in src_tensors.items()}
    workers = []
    try:
        for r in range(2):
            bufs = {d.name: (d, torch.zeros(d.shape, dtype=torch.bfloat16)) for d in dst.ranks[r]}
            workers.append(InferenceWorker(inf_w, r, 2, dst.tensors, bufs).start())
        trainer = TrainerWorker(tr_w, 0, 1, src_tensors, src_bufs, run="mm").start()
        workers.append(trainer)
        for w in workers:
            assert w.wait_connected(60)
        handle = trainer.publish(5)
        t0 = time.monotonic()
        for w in workers[:2]:
            assert w.wait_for_version(5, "mm", timeout=60) is None
            why = w.failure(5, "mm")
            assert why is not None and bad in why, why
            assert w.version is None  # it serves what it served: nothing was committed
        assert time.monotonic() - t0 < 30, "the waiting ranks were not told at once"
        # The trainer learns it too: its handle says the update failed, and why.
        assert handle.wait(60) and handle.ok is False and bad in handle.error, (handle.ok, handle.error)
    finally:
        for w in workers:
            w.stop()
        stop_processes(procs)
