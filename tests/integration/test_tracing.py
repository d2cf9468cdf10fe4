"""Traces: with an OpenTelemetry tracer provider set, each update is one trace holding the phase
spans of both controllers and the spans of every worker, linked through the gRPC metadata between
the controllers and the worker protocol. Both controllers run in this process (their real gRPC
servers, on a loop of their own) so that one in-memory exporter sees every span; the workers are
the embedding API's, moving real bytes over gloo."""

import os
import subprocess
import sys
import time

import pytest
import torch

from reshard.common.models.presets import megatron_layout, model_config, vllm_layout
from reshard.tools.synth import tensor_value
from reshard.trainer_svc.worker import TrainerWorker

from .cluster import free_port
from .inprocess import deployment

otel_sdk = pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry import trace  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

pytestmark = pytest.mark.integration
PHASES = ("negotiate", "connect", "transfer", "verify")


@pytest.fixture(scope="module")
def exporter():
    exp = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not hasattr(provider, "add_span_processor"):  # none set in this process yet
        provider = otel_sdk.TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exp))
    yield exp
    exp.shutdown()


def _fill(layout, rank, tensors, full):
    for desc in layout.ranks[rank]:
        for p in desc.pieces:
            tensors[desc.name][p.region.slices()].copy_(full[p.tensor][p.box.slices()])


def test_each_update_is_one_trace_with_both_controllers_and_every_worker(exporter):
    exporter.clear()
    cfg = model_config("tiny")
    src, dst = megatron_layout(cfg, 2), vllm_layout(cfg, 2)
    with deployment(dst) as (tr_w, workers):
        trainers = []
        for r in range(2):
            bufs = {d.name: (d, torch.zeros(d.shape, dtype=torch.bfloat16)) for d in src.ranks[r]}
            trainers.append(TrainerWorker(tr_w, r, 2, src.tensors, bufs, run="traced").start())
        workers += trainers
        for w in workers:
            assert w.wait_connected(60)
        for step in (1, 2):
            full = {n: tensor_value(5, n, step, t.shape, torch.bfloat16) for n, t in cfg.tensors().items()}
            for r, w in enumerate(trainers):
                _fill(src, r, w.live, full)
            handles = [w.publish(step) for w in trainers]
            for h in handles:
                assert h.wait_outcome(60) is True, h.error
        t0 = time.monotonic()
        while sum(s.name == "inference-worker.commit" for s in exporter.get_finished_spans()) < 4:
            assert time.monotonic() - t0 < 10, "the workers' commit spans never ended"
            time.sleep(0.05)

    spans = exporter.get_finished_spans()
    roots = [s for s in spans if s.name == "reshard.update"]
    assert len(roots) == 2, [s.name for s in spans]
    assert all(r.parent is None and r.status.is_ok for r in roots)
    versions = sorted(r.attributes["reshard.version"] for r in roots)
    assert versions == ["traced:1", "traced:2"]
    by_trace: dict[int, list] = {}
    for s in spans:
        by_trace.setdefault(s.context.trace_id, []).append(s)
    assert set(by_trace) == {r.context.trace_id for r in roots}, "a span outside the updates' traces"
    for root in roots:
        mine = by_trace[root.context.trace_id]
        ids = {s.context.span_id: s for s in mine}
        names = [s.name for s in mine]
        # Both controllers' phases, each once, children of the trainer's update span.
        for phase in PHASES:
            assert names.count(f"trainer.{phase}") == 1, names
        for phase in PHASES + ("commit",):
            assert names.count(f"inference.{phase}") == 1, names
        for s in mine:
            if s.name.startswith(("trainer.", "inference.")):
                assert s.parent.span_id == root.context.span_id, s.name
        # Every worker: its prepare and transfer, inference ranks their verify and commit, each
        # under the phase of its own controller that asked for it.
        for role in ("trainer", "inference"):
            for cmd in ("prepare", "transfer"):
                got = sorted(s.attributes["reshard.rank"] for s in mine if s.name == f"{role}-worker.{cmd}")
                assert got == [0, 1], (role, cmd, names)
            for s in mine:
                if s.name == f"{role}-worker.prepare":
                    assert ids[s.parent.span_id].name == f"{role}.connect"
                if s.name == f"{role}-worker.transfer":
                    assert ids[s.parent.span_id].name == f"{role}-worker.prepare"
                    assert s.attributes["reshard.bytes"] > 0
        for cmd in ("verify", "commit"):
            parents = [ids[s.parent.span_id].name for s in mine if s.name == f"inference-worker.{cmd}"]
            assert parents == [f"inference.{cmd}"] * 2, (cmd, parents)
        assert root.attributes["reshard.bytes"] > 0 and root.attributes["reshard.ok"] is True


def test_a_failed_update_ends_its_trace_as_an_error(exporter):
    """A refused update (the trainer's layout disagrees with the engine's: the trainer finds it as it
    plans) is one trace too, its root and the phase it failed in marked as errors naming the cause."""
    exporter.clear()
    cfg = model_config("tiny")
    dst = vllm_layout(cfg, 2)
    bad = next(n for n in dst.tensors if n.endswith("q_proj.weight"))
    spec = dst.tensors[bad]
    src_tensors = dict(dst.tensors)
    src_tensors[bad] = type(spec)(bad, (spec.shape[0] + 8, spec.shape[1]), spec.dtype)
    from reshard.common.layout.core import Box, LocalBuffer, Piece

    with deployment(dst) as (tr_w, workers):
        for r in range(2):  # rank 0 holds every tensor whole, rank 1 nothing
            bufs = {} if r else {n: (LocalBuffer(n, t.shape, t.dtype, (Piece(n, Box.full(t.shape), Box.full(t.shape)),)),
                                     torch.zeros(t.shape, dtype=torch.bfloat16)) for n, t in src_tensors.items()}
            workers.append(TrainerWorker(tr_w, r, 2, src_tensors, bufs, run="traced").start())
        for w in workers:
            assert w.wait_connected(60)
        handles = [w.publish(1) for w in workers[2:]]
        for h in handles:
            assert h.wait_outcome(60) is False and bad in h.error
    spans = exporter.get_finished_spans()
    roots = [s for s in spans if s.name == "reshard.update"]
    assert len(roots) == 1
    root = roots[0]
    assert not root.status.is_ok and bad in root.status.description
    failed = [s for s in spans if s.name.startswith("trainer.") and not s.status.is_ok]
    assert [s.name for s in failed] == ["trainer.negotiate"], [(s.name, s.status) for s in spans]
    assert {s.context.trace_id for s in spans} == {root.context.trace_id}


def test_no_provider_no_spans_and_nothing_on_the_wire():
    """Without a tracer provider (the default: the API alone), nothing is made or carried."""
    code = ("from reshard.common.control import tracing, hub\n"
            "from reshard.proto import worker_pb2 as wpb\n"
            "assert tracing.start('x') is None and not tracing.enabled()\n"
            "tracing.set_current(tracing.start('y'))\n"
            "h = hub.WorkerHub(1, 'trainer')\n"
            "class C: alive = True\n"
            "import asyncio\n"
            "C.queue = asyncio.Queue()\n"
            "h._put(C, wpb.ControllerMessage(id=1, prepare=wpb.Prepare(update_id='u')))\n"
            "assert not C.queue.get_nowait().trace\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if not k.startswith("OTEL_")})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_the_environment_configures_a_process_reshard_starts():
    """OTEL_TRACES_EXPORTER=console in a process reshard starts: spans printed, named for the
    service; an exporter nobody installed is named in a warning, and nothing else changes."""
    code = ("import logging, sys\n"
            "logging.basicConfig(level='INFO')\n"
            "from reshard.common.control import tracing\n"
            "ok = tracing.configure_from_env(sys.argv[1])\n"
            "s = tracing.start('probe', attributes={'reshard.rank': 3})\n"
            "tracing.end(s)\n"
            "print('configured' if ok else 'off', flush=True)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", code, "trainer"], capture_output=True, text=True, timeout=60,
                         env={**env, "OTEL_TRACES_EXPORTER": "console"})
    assert out.returncode == 0, out.stderr
    assert "configured" in out.stdout and '"name": "probe"' in out.stdout
    assert '"service.name": "reshard-trainer"' in out.stdout and '"reshard.rank": 3' in out.stdout
    out = subprocess.run([sys.executable, "-c", code, "trainer"], capture_output=True, text=True, timeout=60,
                         env={**env, "OTEL_TRACES_EXPORTER": "nosuch"})
    assert out.returncode == 0 and out.stdout.strip() == "off" and "'nosuch'" in out.stderr, out.stderr
    out = subprocess.run([sys.executable, "-c", code, "trainer"], capture_output=True, text=True, timeout=60, env=env)
    assert out.stdout.strip() == "off" and "probe" not in out.stdout


def _console_spans(text: str) -> list[dict]:
    """The spans a console exporter printed (indented JSON objects, one after another)."""
    import json

    dec, out, i = json.JSONDecoder(), [], 0
    while (i := text.find("{\n", i)) >= 0:
        obj, i = dec.raw_decode(text, i)
        out.append(obj)
    return out


@pytest.mark.slow
def test_real_processes_export_one_trace_per_update(tmp_path):
    """The controllers and their standalone workers, each a process of its own, set up from
    OTEL_TRACES_EXPORTER=console: every span of an update, from five processes, is in one trace."""
    from .cluster import cli, stop_processes

    inf, tr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    env = dict({k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
               OTEL_TRACES_EXPORTER="console", OTEL_BSP_SCHEDULE_DELAY="100")
    outs = {name: open(tmp_path / f"{name}.out", "w") for name in ("inference", "trainer")}
    procs = [subprocess.Popen([sys.executable, "-m", "reshard.cli", "inference", "--listen", inf, "--workers", "2",
                               "--model", "tiny"], env=env, stdout=outs["inference"], stderr=subprocess.DEVNULL,
                              start_new_session=True),
             subprocess.Popen([sys.executable, "-m", "reshard.cli", "trainer", "--listen", tr, "--workers", "2", "--model",
                               "tiny", "--inference", inf, "--run", "otel"], env=env, stdout=outs["trainer"],
                              stderr=subprocess.DEVNULL, start_new_session=True)]
    try:
        for _ in range(2):
            t0 = time.monotonic()
            while (r := cli("update", "--trainer", tr, "--wait", "--json")).returncode != 0:
                assert time.monotonic() - t0 < 60, r.stderr
                time.sleep(0.5)
    finally:
        stop_processes(procs)  # SIGTERM: each process flushes its spans as it exits
        for f in outs.values():
            f.close()
    spans = {name: _console_spans((tmp_path / f"{name}.out").read_text()) for name in outs}
    roots = [s for s in spans["trainer"] if s["name"] == "reshard.update"]
    assert len(roots) == 2
    for root in roots:
        tid = root["context"]["trace_id"]
        mine = [s for side in spans.values() for s in side if s["context"]["trace_id"] == tid]
        names = sorted(s["name"] for s in mine)
        for role in ("trainer", "inference"):
            assert names.count(f"{role}.negotiate") == 1 and names.count(f"{role}-worker.transfer") == 2, names
        assert names.count("inference-worker.commit") == 2, names
        services = {s["resource"]["attributes"]["service.name"] for s in mine}
        assert services == {"reshard-trainer", "reshard-inference", "reshard-trainer-worker", "reshard-inference-worker"}
