"""docker-compose.yml and the Dockerfile checked against the CLI, without docker.

Every container command must be one `reshard` accepts, and the addresses the services
hand each other must name the right service and port."""

from __future__ import annotations

import ast
import contextlib
import io
import json
import re
from pathlib import Path

import pytest
import yaml

from reshard.cli import build_parser
from reshard.common.rpc import parse_address

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
WILDCARD_OR_LOOPBACK = {"0.0.0.0", "::", "", "127.0.0.1", "localhost", "::1"}


def parse_command(service: str, command):
    """The argparse namespace of a container command, or a test failure that names the service."""
    if not isinstance(command, list) or not command or not all(isinstance(c, str) for c in command):
        pytest.fail(f"service {service!r}: command must be a non-empty YAML list of strings, got {command!r}")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(command)
    except SystemExit as e:
        pytest.fail(f"service {service!r}: `reshard {' '.join(command)}` is rejected by the CLI "
                    f"(exit {e.code}): {err.getvalue().strip()}")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


@pytest.fixture(scope="module")
def parsed(services) -> dict:
    return {name: parse_command(name, svc.get("command")) for name, svc in services.items()}


def healthcheck_argv(service: str, svc: dict) -> list[str]:
    """The `reshard ...` argv a healthcheck runs: directly (CMD reshard ...) or inside a `python -c` snippet."""
    hc = svc.get("healthcheck")
    assert hc and hc.get("test"), f"service {service!r} has no healthcheck"
    test = hc["test"]
    assert isinstance(test, list) and test[0] == "CMD", f"service {service!r}: healthcheck test should be an exec-form list"
    if test[1] == "reshard":
        return test[2:]
    assert test[1:3] == ["python", "-c"], f"service {service!r}: unexpected healthcheck {test!r}"
    tree = ast.parse(test[3])  # the snippet must at least be valid Python
    for node in ast.walk(tree):
        if isinstance(node, ast.List) and node.elts and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
            argv = [e.value for e in node.elts]
            if argv[0] == "reshard":
                return argv[1:]
    pytest.fail(f"service {service!r}: healthcheck snippet runs no `reshard` command")


def test_three_services(services):
    assert {"inference", "trainer", "update"} <= set(services)


def test_every_command_is_a_list_the_cli_accepts(services, parsed):
    assert set(parsed) == set(services)
    assert parsed["inference"].command == "inference"
    assert parsed["trainer"].command == "trainer"
    assert parsed["update"].command == "update"


def test_a_bad_command_is_rejected():
    with pytest.raises(pytest.fail.Exception, match=r"service 'bad'.*--bogus"):
        parse_command("bad", ["inference", "--bogus"])
    with pytest.raises(pytest.fail.Exception, match="unrecognized arguments: --bogus"):
        parse_command("bad", ["inference", "--listen", "0.0.0.0:50052", "--bogus"])
    with pytest.raises(pytest.fail.Exception, match="malformed trainer address"):
        parse_command("bad", ["update", "--trainer", "trainer"])
    with pytest.raises(pytest.fail.Exception, match="service 'bad'"):
        parse_command("bad", ["trainer", "--listen", "0.0.0.0:50051", "--inference", "nohost"])  # no port
    with pytest.raises(pytest.fail.Exception, match="list of strings"):
        parse_command("bad", "inference --listen 0.0.0.0:50052")
    with pytest.raises(pytest.fail.Exception, match="list of strings"):
        parse_command("bad", ["inference", "--workers", 4])


def test_demo_shape(parsed):
    inf, tr = parsed["inference"], parsed["trainer"]
    assert (inf.workers, inf.model) == (4, "small")
    assert (tr.workers, tr.model) == (2, "small")
    assert parsed["update"].wait


def test_trainer_points_at_the_inference_service(services, parsed):
    assert len(parsed["trainer"].inference) == 1
    host, port = parse_address(parsed["trainer"].inference[0])
    assert host == "inference" and host in services
    assert port == parse_address(parsed["inference"].listen)[1]


def test_update_points_at_the_trainer_service(services, parsed):
    host, port = parse_address(parsed["update"].trainer)
    assert host == "trainer" and host in services
    assert port == parse_address(parsed["trainer"].listen)[1]


def test_trainer_rendezvous_host_is_reachable_from_inference(services, parsed):
    # trainer_svc hands inference workers --store-host (default: the host of its --listen address,
    # a wildcard or loopback becoming 127.0.0.1) as the TCPStore rendezvous host: it must be a name
    # the inference containers can reach, the trainer's own.
    host = parsed["trainer"].store_host or parse_address(parsed["trainer"].listen)[0]
    assert host not in WILDCARD_OR_LOOPBACK, f"trainer store host {host!r} is unreachable from other containers"
    assert host in ("trainer", services["trainer"].get("hostname"))


def test_inference_healthcheck(parsed, services):
    argv = healthcheck_argv("inference", services["inference"])
    ns = parse_command("inference healthcheck", argv)
    assert ns.command == "status" and ns.inference
    assert parse_address(ns.inference)[1] == parse_address(parsed["inference"].listen)[1]


def test_trainer_healthcheck(parsed, services):
    assert "healthcheck" in services["trainer"]
    ns = parse_command("trainer healthcheck", healthcheck_argv("trainer", services["trainer"]))
    assert ns.command == "status" and ns.trainer
    assert parse_address(ns.trainer)[1] == parse_address(parsed["trainer"].listen)[1]


def test_startup_order(services):
    inf_dep = services["trainer"]["depends_on"]
    assert "inference" in inf_dep
    if isinstance(inf_dep, dict):
        assert inf_dep["inference"].get("condition") == "service_healthy"
    assert "trainer" in services["update"]["depends_on"]


def test_update_runs_once_by_default(services):
    upd = services["update"]
    assert upd.get("restart") == "no"
    assert "profiles" not in upd


def test_no_registry_hosts_written():
    for f in (COMPOSE, DOCKERFILE):
        text = f.read_text()
        assert "://" not in text, f"{f.name} names a URL"
        assert not re.search(r"\b[\w-]+\.(org|com|io|net|dev)\b", text), f"{f.name} names a host"


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile():
    ins = dockerfile_instructions()
    by = {}
    for word, rest in ins:
        by.setdefault(word, []).append(rest)
    assert by["FROM"] == ["python:3.11-slim"]
    assert json.loads(by["ENTRYPOINT"][-1]) == ["reshard"]
    args = {a.split("=", 1)[0] for a in by["ARG"]}
    assert {"TORCH_SPEC", "PIP_EXTRA_ARGS", "WITH_NCCL"} <= args
    runs = " ; ".join(by["RUN"])
    assert re.search(r"pip install \$\{?PIP_EXTRA_ARGS\}? \"?\$\{?TORCH_SPEC", runs), "torch is not installed from TORCH_SPEC"
    assert re.search(r"pip install \.(\s|;|$)", runs), "the project is not installed (pip install .)"
    assert 'pip install ".[nccl]"' in runs
    # torch comes first, then the project, then the switch to a non-root user
    order = [i for i, (w, r) in enumerate(ins) if w == "RUN" and "TORCH_SPEC" in r] + \
            [i for i, (w, r) in enumerate(ins) if w == "RUN" and "pip install ." in r] + \
            [i for i, (w, _) in enumerate(ins) if w == "USER"]
    assert len(order) == 3 and order == sorted(order)
    assert by["USER"][-1] not in ("root", "0")
