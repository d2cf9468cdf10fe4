"""The Grafana dashboard and the Prometheus alert rules in deploy/ name only metrics the
controllers export: the names are taken from a controller's registry as Prometheus would scrape
it (a status with a deployment and workers, one committed and one failed update recorded)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading

import pytest

from reshard.common.control.metrics import ControllerMetrics, failure_reason
from reshard.proto import reshard_pb2 as pb

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAME = re.compile(r"\breshard_[a-z_]+\b")


def exported(role: str) -> set[str]:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    async def status():
        st = pb.Status(role=role, has_version=True, version=pb.Version(run="r", step=3))
        st.deployments.append(pb.DeploymentStatus(address="inf:1", committed=pb.Version(run="r", step=2), has_committed=True))
        w = st.workers.add(rank=0, state="READY")
        w.memory["shadow"] = 10
        return st

    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    try:
        m = ControllerMetrics(role, status, loop)
        ok = pb.UpdateRecord(ok=True, seconds=1.0, bytes=100, transfer_seconds=0.5, deployment="inf:1")
        for ph in ("negotiate", "connect", "transfer", "verify", "commit"):
            ok.phase_seconds[ph] = 0.1
        m.record(ok)
        m.record(pb.UpdateRecord(ok=False, seconds=2.0, error="update deadline (120s) passed during the transfer"))
        m.requests.labels("/x", "OK").inc()
        m.latency.labels("/x").observe(0.01)
        text = generate_latest(m.registry).decode()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)
    names = set()
    for fam in text_string_to_metric_families(text):
        names |= {s.name for s in fam.samples}
    return names


def test_every_dashboard_and_alert_query_names_an_exported_metric():
    yaml = pytest.importorskip("yaml")
    names = exported("trainer") | exported("inference")
    assert "reshard_update_duration_seconds_bucket" in names and "reshard_deployment_lag_steps" in names
    dash = json.load(open(os.path.join(ROOT, "deploy", "grafana", "reshard.json")))
    assert dash["panels"], "an empty dashboard"
    for p in dash["panels"]:
        assert p["targets"], p["title"]
        for target in p["targets"]:
            used = set(NAME.findall(target["expr"]))
            assert used and used <= names, (p["title"], used - names)
    rules = yaml.safe_load(open(os.path.join(ROOT, "deploy", "prometheus", "alerts.yml")))
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    assert len(exprs) >= 5
    for e in exprs:
        assert set(NAME.findall(e)) <= names, set(NAME.findall(e)) - names
    scrape = yaml.safe_load(open(os.path.join(ROOT, "deploy", "prometheus", "prometheus.yml")))
    assert scrape["scrape_configs"][0]["job_name"] == "reshard"  # the alerts' `up{job="reshard"}`


def test_failure_reasons_are_a_bounded_set():
    assert failure_reason("incompatible layouts, nothing transferred: tensor 'x': shape mismatch") == "incompatible"
    assert failure_reason("partial update: 'no.such' matches no canonical tensor of the destination") == "incompatible"
    assert failure_reason("update deadline (120s) passed during the transfer") == "timeout"
    assert failure_reason("a trainer worker died during the transfer") == "worker"
    assert failure_reason("something else entirely") == "other"
