"""`--log-format json` (RESHARD_LOG_FORMAT=json): both real controllers and their standalone workers
log one JSON object per line, and every line logged while an update is in flight names its update
id, version and (on the trainer) deployment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from .cluster import cli, free_port, stop_processes

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # slow: two services for one log check (CI runs it)


def test_json_logs_name_the_update_on_every_line_of_it(tmp_path):
    inf, tr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    env = dict(os.environ, RESHARD_LOG_FORMAT="json", RESHARD_LOG_LEVEL="INFO")
    logs = {n: tmp_path / f"{n}.log" for n in ("inference", "trainer")}
    procs = [subprocess.Popen([sys.executable, "-m", "reshard.cli", "inference", "--listen", inf, "--workers", "1",
                               "--model", "tiny"], env=env, stderr=open(logs["inference"], "w"), start_new_session=True),
             subprocess.Popen([sys.executable, "-m", "reshard.cli", "--log-format", "json", "trainer", "--listen", tr,
                               "--workers", "1", "--model", "tiny", "--inference", inf, "--run", "js"],
                              env=dict(os.environ), stderr=open(logs["trainer"], "w"), start_new_session=True)]
    try:
        deadline = time.monotonic() + 90
        while True:
            r = cli("update", "--trainer", tr, "--wait", "--json", timeout=60)
            if r.returncode == 0:
                break
            assert time.monotonic() < deadline, r.stderr
            time.sleep(0.5)
        out = json.loads(r.stdout)
        version = f"{out['committed']['run']}:{out['committed']['step']}"
    finally:
        stop_processes(procs)
    for side, path in logs.items():
        lines = [x for x in path.read_text().splitlines() if x.strip()]
        objs = []
        for x in lines:
            if x.startswith("["):  # a C++ library's own line (gloo, torch): not Python logging
                continue
            objs.append(json.loads(x))  # every logged line is one JSON object
        assert objs, side
        for o in objs:
            assert {"time", "level", "logger", "message", "role"} <= set(o), o
        tagged = [o for o in objs if o.get("version") == version]
        assert tagged, f"{side}: no line names update {version}: {[o['message'] for o in objs][-10:]}"
        assert len({o["update_id"] for o in tagged}) == 1
        if side == "trainer":
            done = [o for o in tagged if "committed" in o["message"]]
            assert done and done[0]["deployment"] == inf, tagged
        else:  # the worker's lines too (a standalone worker follows RESHARD_LOG_FORMAT)
            assert any(o["role"].startswith("inference-worker") for o in objs), {o["role"] for o in objs}
