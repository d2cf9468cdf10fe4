"""The command line's own logic: JSON output of protobuf messages and argument checks (no services)."""

import json
import re

import pytest

from reshard.cli import build_parser, check_service_args, main, message_to_dict
from reshard.common.models.presets import MODELS
from reshard.proto import reshard_pb2 as pb

BIG = 2**53 + 1  # not exact as a float: a number parsed through one would differ


def test_message_to_dict_prints_64_bit_integers_as_numbers():
    st = pb.Status(role="inference", model="tiny", has_version=True, version=pb.Version(run="r", step=BIG),
                   requests_served=7, progress=pb.UpdateProgress(bytes_done=1, bytes_total=2, version=pb.Version(step=3)))
    st.history.add(version=pb.Version(run="r", step=1), ok=True, seconds=0.5, bytes=BIG, requests_during=4, tensors=2)
    st.history.add(version=pb.Version(run="r", step=2), ok=False, error="boom")
    w = st.workers.add(rank=0, pid=1234, version=pb.Version(step=9), requests_served=5)
    w.requests_by_version["r:1"] = BIG
    w.memory["staging"] = 1 << 40
    st.deployments.add(address="a:1", committed=pb.Version(run="r", step=6), has_committed=True)

    d = json.loads(json.dumps(message_to_dict(st)))
    assert d["version"] == {"run": "r", "step": BIG}
    assert d["requests_served"] == 7 and d["requests_during_updates"] == 0  # absent ones too, as 0
    p = d["progress"]
    assert (p["bytes_done"], p["bytes_total"], p["version"], p["phase"]) == (1, 2, {"run": "", "step": 3}, "")
    assert [h["version"]["step"] for h in d["history"]] == [1, 2]
    assert d["history"][0]["bytes"] == BIG and d["history"][0]["tensors"] == 2 and d["history"][1]["bytes"] == 0
    assert d["history"][0]["seconds"] == 0.5 and d["history"][1]["error"] == "boom"
    [wd] = d["workers"]
    assert wd["pid"] == 1234 and wd["version"]["step"] == 9 and wd["requests_served"] == 5
    assert wd["requests_by_version"] == {"r:1": BIG} and wd["memory"] == {"staging": 1 << 40}
    assert d["deployments"][0]["committed"]["step"] == 6 and "committed" not in d  # unset messages stay out
    assert d["model"] == "tiny" and d["has_version"] is True


def test_message_to_dict_nested_repeated():
    st = pb.Status(history=[pb.UpdateRecord(version=pb.Version(run="r", step=2**62), bytes=-1, control_bytes=2**40)])
    [rec] = message_to_dict(st)["history"]
    assert rec["version"] == {"run": "r", "step": 2**62} and rec["bytes"] == -1 and rec["control_bytes"] == 2**40
    out = pb.UpdateOutcome(ok=True, committed=pb.Version(run="r", step=4), record=pb.UpdateRecord(bytes=10))
    d = message_to_dict(out)
    assert d["committed"] == {"run": "r", "step": 4} and d["record"]["bytes"] == 10 and d["deployments"] == []


def service_args(*argv: str):
    a = build_parser().parse_args(list(argv))
    check_service_args(a)
    return a


@pytest.mark.parametrize("command", ["inference", "trainer"])
def test_model_is_a_label_with_external_workers(command):
    a = service_args(command, "--listen", "127.0.0.1:1", "--model", "my-engine/Qwen3-8B", "--external-workers")
    assert a.model == "my-engine/Qwen3-8B"
    a = service_args(command, "--listen", "127.0.0.1:1", "--model", "tiny", "--workers", "3")
    assert a.model == "tiny" and a.workers == 3


@pytest.mark.parametrize("command", ["inference", "trainer"])
def test_model_must_be_built_in_for_standalone_workers(command, capsys):
    with pytest.raises(ValueError, match="--external-workers") as e:
        service_args(command, "--listen", "127.0.0.1:1", "--model", "my-engine")
    assert "'my-engine'" in str(e.value) and all(m in str(e.value) for m in MODELS)
    assert main([command, "--listen", "127.0.0.1:1", "--model", "my-engine"]) == 2  # before anything starts
    err = capsys.readouterr().err
    assert "is not a built-in model" in err and "kimi-k2" in err


def test_service_args_other_checks():
    assert service_args("trainer", "--listen", "127.0.0.1:1", "--layout", "framework=megatron,tp=2,pp=2").workers == 4
    with pytest.raises(ValueError, match="has 4 ranks but --workers is 2"):
        service_args("trainer", "--listen", "127.0.0.1:1", "--layout", "framework=megatron,tp=2,pp=2", "--workers", "2")
    with pytest.raises(ValueError, match="at least 1"):
        service_args("inference", "--listen", "127.0.0.1:1", "--workers", "0")
    with pytest.raises(ValueError, match=r"--transfer-method 'bogus' is not installed: reshard, serialized"):
        service_args("trainer", "--listen", "127.0.0.1:1", "--transfer-method", "bogus")
    assert service_args("trainer", "--listen", "127.0.0.1:1", "--transfer-method", "serialized").transfer_method == "serialized"


def test_the_client_commands_do_not_import_torch():
    """`reshard status`, `update`, `attach`, `detach` (and so the container health check) start
    without torch: each, run against a port nobody serves, fails fast with torch never imported."""
    import subprocess

    from reshard.common.control.supervisor import module_command

    code = ("import sys\nfrom reshard.cli import main\n"
            "for argv in ([\"status\", \"--trainer\", \"127.0.0.1:1\"], [\"update\", \"--trainer\", \"127.0.0.1:1\"],\n"
            "             [\"attach\", \"--trainer\", \"127.0.0.1:1\", \"--inference\", \"127.0.0.1:2\"],\n"
            "             [\"detach\", \"--trainer\", \"127.0.0.1:1\", \"--inference\", \"127.0.0.1:2\"]):\n"
            "    assert main(argv + [\"--timeout\", \"0.5\"]) != 0\n"
            "print(sorted(m for m in ('torch', 'reshard.tools.synth', 'reshard.common.dataplane.engine') if m in sys.modules))\n")
    r = subprocess.run([*module_command("reshard.cli")[:-2], "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]", r.stdout


def test_a_service_refuses_bad_settings_at_start_naming_them():
    """Issue 28, item 9: a bad --bucket-bytes (or RESHARD_* variable) failed every update later
    (an internal error on the trainer, UNKNOWN on inference); now the service does not start, and
    says which setting to change."""
    import os
    import subprocess
    import sys

    cases = [(["trainer", "--listen", "127.0.0.1:0", "--bucket-bytes", "100"], {}, "--bucket-bytes"),
             (["trainer", "--listen", "127.0.0.1:0", "--bucket-bytes", str(1 << 40)], {}, "--bucket-bytes"),
             (["inference", "--listen", "127.0.0.1:0"], {"RESHARD_ORPHAN_GRACE_S": "soon"}, "RESHARD_ORPHAN_GRACE_S"),
             (["inference", "--listen", "127.0.0.1:0"], {"RESHARD_STAGING_LIMIT_BYTES": "-1"}, "RESHARD_STAGING_LIMIT_BYTES"),
             (["inference", "--listen", "127.0.0.1:0"], {"RESHARD_LOG_LEVEL": "loud"}, "RESHARD_LOG_LEVEL")]
    for args, env, name in cases:
        r = subprocess.run([sys.executable, "-m", "reshard.cli", *args], env=dict(os.environ, **env),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and name in r.stderr and "Traceback" not in r.stderr, (args, env, r.stderr)


def test_staging_and_its_deprecated_name(caplog, capsys):
    """`reshard inference --staging` (default shadow); `--mode`, its earlier name, is still taken with a
    warning, hidden from --help; the two disagreeing is refused."""
    assert service_args("inference", "--listen", "127.0.0.1:1", "--model", "tiny").staging == "shadow"
    assert service_args("inference", "--listen", "127.0.0.1:1", "--model", "tiny", "--staging", "inplace").staging == "inplace"
    with caplog.at_level("WARNING", logger="reshard"):
        a = service_args("inference", "--listen", "127.0.0.1:1", "--model", "tiny", "--mode", "inplace")
    assert a.staging == "inplace" and "--mode is deprecated: use --staging inplace" in caplog.text
    with pytest.raises(ValueError, match="--staging shadow and --mode inplace"):
        service_args("inference", "--listen", "127.0.0.1:1", "--model", "tiny", "--staging", "shadow", "--mode", "inplace")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["inference", "--help"])
    helptext = capsys.readouterr().out
    assert "--staging" in helptext and not re.search(r"--mode\b", helptext)
