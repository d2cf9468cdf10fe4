"""Prometheus metrics on both real controllers (`--metrics-listen`), read the way Prometheus reads
them (an HTTP GET of /metrics, parsed by prometheus_client's own parser), after two committed
updates and one refused update: the figures must agree with what `status --json` says. Then the
operator's live view of the same (`reshard status --watch`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from .cluster import Cluster, cli, free_port

pytestmark = pytest.mark.integration


def scrape(port: int, token: str = "") -> dict:
    """{(metric sample name, frozenset of labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    want = frozenset(labels.items())
    got = [v for (n, ls), v in samples.items() if n == name and want <= ls]
    assert got, f"no sample {name} {labels} among {sorted({n for n, _ in samples})}"
    return sum(got)


@pytest.mark.slow  # quick suite under 300 s on 2 cores (CI runs it with the slow ones)
def test_metrics_after_two_committed_updates_and_one_refused():
    mi, mt = free_port(), free_port()
    c = Cluster("tiny", inference_workers=2, trainer_workers=2,
                inference_args=("--metrics-listen", f"127.0.0.1:{mi}"), trainer_args=("--metrics-listen", f"127.0.0.1:{mt}"))
    try:
        for _ in range(2):
            rc, out, err = c.update()
            assert rc == 0 and out and out["ok"], (rc, out, err)
        rc, out, err = c.update("--tensors", "no.such.tensor")  # refused: the pattern matches nothing
        assert rc != 0 and out and not out["ok"] and "matches no canonical tensor" in out["error"], (rc, out, err)
        tr_st, inf_st = c.status("trainer"), c.status("inference")
        t, i = scrape(mt), scrape(mi)
        # Phases of the two committed updates (each phase once per update), on the trainer
        for phase in ("negotiate", "connect", "transfer", "verify", "commit"):
            assert value(t, "reshard_update_duration_seconds_count", phase=phase) == 2, phase
        assert value(t, "reshard_updates_total", outcome="committed") == 2
        assert value(t, "reshard_updates_total", outcome="failed", reason="incompatible") == 1
        assert value(t, "reshard_update_seconds_count", outcome="failed") == 1
        # Bytes moved: what the update records (and `reshard demo`) report
        committed = [h for h in tr_st["history"] if h["ok"]]
        assert len(committed) == 2
        assert value(t, "reshard_update_bytes_total", deployment=c.inf) == sum(int(h["bytes"]) for h in committed)
        assert value(t, "reshard_transfer_throughput_bytes_per_second", deployment=c.inf) > 0
        # The version each deployment serves: what status says, on both controllers. The refused update
        # took a step that never reached inference: the deployment lags the trainer by that one.
        step, published = int(inf_st["version"]["step"]), int(tr_st["version"]["step"])
        assert step == 2 and value(i, "reshard_served_step") == step
        assert value(t, "reshard_deployment_step", deployment=c.inf) == step
        assert value(t, "reshard_published_step") == published == 3
        assert value(t, "reshard_deployment_lag_steps", deployment=c.inf) == published - step == 1
        # Workers, and each rank's extra memory as the workers report it (shadow staging: the shadow copy)
        assert value(t, "reshard_workers", role="trainer", state="READY") == 2
        assert value(i, "reshard_workers", role="inference", state="READY") == 2
        shadow = {int(w["rank"]): int(w["memory"]["shadow"]) for w in inf_st["workers"]}
        for rank, n in shadow.items():
            assert n > 0 and value(i, "reshard_rank_memory_bytes", rank=str(rank), kind="shadow") == n
        # Inference counts its side of the two commits; control-plane calls by method and code
        assert value(i, "reshard_updates_total", outcome="committed") == 2
        assert value(i, "reshard_grpc_requests_total", method="/reshard.v1.InferenceService/FinishUpdate", code="OK") == 2
        assert value(t, "reshard_grpc_requests_total", method="/reshard.v1.TrainerService/GetStatus", code="OK") >= 1
        assert value(t, "reshard_grpc_request_duration_seconds_count", method="/reshard.v1.TrainerService/TriggerUpdate") >= 3
        # The operator's live view: refreshed blocks (not a terminal: one after another), the lag per deployment
        r = cli("status", "--trainer", c.tr, "--watch", "0.1", "--count", "3", timeout=60)
        assert r.returncode == 0, r.stderr
        assert r.stdout.count(f"reshard status {c.tr} at ") == 3, r.stdout
        assert r.stdout.count(f"deployment {c.inf}: committed run1:2, 1 steps behind") == 3, r.stdout
        assert "\x1b[" not in r.stdout  # no terminal control codes into a pipe
    finally:
        c.close()


@pytest.mark.slow  # the quick suite stays under 5 minutes on 2 cores; CI runs it with the slow tests
def test_metrics_listener_is_refused_off_loopback_without_protection_and_needs_a_token(tmp_path):
    r = cli("inference", "--listen", f"127.0.0.1:{free_port()}", "--workers", "1", "--model", "tiny",
            "--metrics-listen", f"0.0.0.0:{free_port()}", timeout=60)
    assert r.returncode == 2 and "--metrics-listen" in r.stderr and "refusing to listen on 0.0.0.0" in r.stderr, r.stderr
    tokens = tmp_path / "tokens"
    tokens.write_text("operator operator-secret-0123\npeer peer-secret-0123456\nworker worker-secret-01234\n")
    m = free_port()
    inf = f"127.0.0.1:{free_port()}"
    p = subprocess.Popen([sys.executable, "-m", "reshard.cli", "inference", "--listen", inf, "--workers", "1", "--model", "tiny",
                          "--metrics-listen", f"127.0.0.1:{m}"], env=dict(os.environ, RESHARD_TOKEN_FILE=str(tokens)),
                         stdout=subprocess.DEVNULL, stderr=open(tmp_path / "inference.log", "w"), start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                scrape(m, "nope")
                raise AssertionError("a scrape with a wrong token was answered")
            except urllib.error.HTTPError as e:
                assert e.code == 401
                break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline and p.poll() is None, \
                    f"the metrics listener never came up: {(tmp_path / 'inference.log').read_text()[-2000:]}"
                time.sleep(0.2)
        with pytest.raises(urllib.error.HTTPError, match="401"):
            scrape(m, "peer-secret-0123456")  # a peer's token reads no metrics: an operator's (or admin's) does
        assert value(scrape(m, "operator-secret-0123"), "reshard_controller_up", role="inference") == 1
    finally:
        p.terminate()
        p.wait(20)
