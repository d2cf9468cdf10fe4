"""docker-compose.yml and the Dockerfile checked against the CLI, without docker.

Every container command must be one `reshard` accepts, the addresses the services
hand each other must name the right service and port, and the credentials they use
(TLS and tokens by default) must be the files the `certs` service writes."""

from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import re
import shlex
from pathlib import Path

import pytest
import yaml

from reshard import certs as certs_cmd
from reshard.cli import build_parser
from reshard.cli import main as cli_main
from reshard.common.control.rpc import parse_address
from reshard.common.control.security import _ENV_KEYS, AuthInterceptor, Security

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
WILDCARD_OR_LOOPBACK = {"0.0.0.0", "::", "", "127.0.0.1", "localhost", "::1"}
SERVERS = ("inference", "trainer")
PATH_FLAGS = ("tls_cert", "tls_key", "tls_ca", "token_file", "tokens_dir")  # the credential flags that name files
PRIVATE = tuple(f for f in certs_cmd.FILES if f.endswith(("-key.pem", ".token")))


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
    """Every reshard service's command, parsed by the CLI (the monitoring profile's are not reshard's)."""
    return {name: parse_command(name, svc.get("command")) for name, svc in services.items() if name not in MONITORING}


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


def volume_mounts(service: str, svc: dict) -> dict[str, tuple[str, bool]]:
    """A service's volumes: container path -> (source, read-only), short (`src:/dst[:ro]`) or long syntax."""
    out = {}
    for v in svc.get("volumes", []):
        if isinstance(v, str):
            parts = v.split(":")
            assert len(parts) in (2, 3), f"service {service!r}: volume {v!r} is not SOURCE:TARGET[:MODE]"
            out[parts[1].rstrip("/")] = (parts[0], len(parts) == 3 and "ro" in parts[2].split(","))
        else:
            out[v["target"].rstrip("/")] = (v.get("source", ""), bool(v.get("read_only")))
    return out


def in_volume(service: str, svc: dict, path: str) -> tuple[str, str]:
    """(volume source, path inside the volume) of a path in the service's container; a test failure
    when no volume of the service holds it (the container would not find the file)."""
    for target, (source, _) in sorted(volume_mounts(service, svc).items(), key=lambda kv: -len(kv[0])):
        if path == target or path.startswith(target + "/"):
            return source, path[len(target):].lstrip("/")
    pytest.fail(f"service {service!r}: {path} lies in none of its volumes {sorted(volume_mounts(service, svc))}")


@pytest.fixture(scope="module")
def clients(services, parsed) -> dict:
    """Every command that calls a service, by name: update and the health checks (each runs in its
    service's container) -> (service, namespace)."""
    out = {"update": ("update", parsed["update"])}
    for name in SERVERS:
        out[f"{name} healthcheck"] = (name, parse_command(f"{name} healthcheck", healthcheck_argv(name, services[name])))
    return out


@pytest.fixture(scope="module")
def certs_out(services, parsed) -> tuple[str, str]:
    """(volume, folder inside it) where the certs service writes."""
    return in_volume("certs", services["certs"], parsed["certs"].out)


MONITORING = {"prometheus", "grafana"}


def test_monitoring_profile(services):
    """`--profile monitoring`: Prometheus and Grafana, only with that profile, reading the repository's
    scrape config, alert rules and dashboard; both controllers serve metrics where the config scrapes."""
    import yaml

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for name in MONITORING:
        assert services[name].get("profiles") == ["monitoring"], name
    mounts = [v.split(":")[0] for v in services["prometheus"]["volumes"]] + [v.split(":")[0] for v in services["grafana"]["volumes"]]
    for src in mounts:
        if src.startswith("./"):
            assert os.path.exists(os.path.join(root, src)), src
    scrape = yaml.safe_load(open(os.path.join(root, "deploy", "prometheus", "prometheus.yml")))
    targets = scrape["scrape_configs"][0]["static_configs"][0]["targets"]
    for name in ("trainer", "inference"):
        cmd = services[name]["command"]
        port = cmd[cmd.index("--metrics-listen") + 1].rpartition(":")[2]
        assert f"{name}:{port}" in targets, (name, targets)


def test_three_services(services):
    assert {"certs", "inference", "trainer", "update"} <= set(services)


def test_every_command_is_a_list_the_cli_accepts(services, parsed):
    assert set(parsed) == set(services) - MONITORING
    assert parsed["certs"].command == "certs"
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


def dependencies(svc: dict) -> dict[str, str]:
    """A service's depends_on: name -> condition (the list form means service_started)."""
    dep = svc.get("depends_on", {})
    if isinstance(dep, list):
        return {d: "service_started" for d in dep}
    return {d: c.get("condition", "service_started") for d, c in dep.items()}


def test_startup_order(services):
    # certs -> inference -> trainer -> update: the credentials exist before any service reads them,
    # and each service is up before the next one calls it.
    assert dependencies(services["certs"]) == {}
    assert dependencies(services["inference"]) == {"certs": "service_completed_successfully"}
    assert dependencies(services["trainer"]) == {"certs": "service_completed_successfully", "inference": "service_healthy"}
    assert dependencies(services["update"]) == {"trainer": "service_healthy"}


def test_every_service_reading_credentials_starts_after_certs(services, certs_out):
    def after(name: str) -> set[str]:
        return {d for d0 in dependencies(services[name]) for d in {d0} | after(d0)}

    for name, svc in services.items():
        if name != "certs" and any(src == certs_out[0] for src, _ in volume_mounts(name, svc).values()):
            assert "certs" in after(name), f"service {name!r} mounts the certs volume but may start before certs"


def test_certs_service_issues_once_for_every_name_the_services_are_called_by(compose, services, parsed, clients, certs_out):
    ns, svc = parsed["certs"], services["certs"]
    assert ns.keep_existing and not ns.force, "certs must keep an existing set (same CA and tokens across restarts)"
    assert svc.get("restart") == "no"
    volume, _ = certs_out
    assert volume in (compose.get("volumes") or {}), f"the certs volume {volume!r} is not a named volume"
    assert not volume_mounts("certs", svc)[ns.out.rstrip("/")][1], "certs cannot write a read-only mount"
    called = {parse_address(parsed["trainer"].inference[0])[0], parse_address(parsed["update"].trainer)[0]}
    called |= {parse_address(c.trainer or c.inference)[0] for name, (_, c) in clients.items() if name != "update"}
    assert called <= set(ns.host), f"the server certificate is not issued for {sorted(called - set(ns.host))}"
    assert {"trainer", "inference", "localhost", "127.0.0.1"} <= set(ns.host)


def test_services_serve_tls_with_tokens(parsed):
    for name in SERVERS:
        ns = parsed[name]
        assert ns.tls_cert and ns.tls_key and ns.tokens_dir, f"service {name!r} must serve TLS and check tokens"
        assert ns.tls_ca, f"service {name!r} needs --tls-ca to verify the services it calls (and its workers)"
        assert not ns.insecure
        assert Path(ns.tls_cert).name == "server.pem" and Path(ns.tls_key).name == "server-key.pem"


def test_no_insecure_anywhere(compose):
    def strings(x):
        if isinstance(x, dict):
            for k, v in x.items():
                yield str(k)
                yield from strings(v)
        elif isinstance(x, list):
            for v in x:
                yield from strings(v)
        elif x is not None:
            yield str(x)

    for s in strings(compose):
        assert "--insecure" not in s and "RESHARD_INSECURE" not in s, f"the compose file runs insecure: {s!r}"


def test_clients_use_tls_and_the_operator_token(clients):
    for name, (_, ns) in clients.items():
        assert ns.tls_ca, f"{name}: no --tls-ca (plaintext to a TLS service)"
        assert ns.token_file and Path(ns.token_file).name == "operator.token", f"{name}: needs the operator token"


def test_credential_files_are_the_ones_certs_writes_in_a_volume_the_service_mounts(services, parsed, clients, certs_out):
    volume, folder = certs_out
    users = [(name, name, parsed[name]) for name in services if name != "certs" and name in parsed]
    users += [(name, svc, ns) for name, (svc, ns) in clients.items() if name != "update"]
    for name, service, ns in users:
        for flag in PATH_FLAGS:
            path = getattr(ns, flag, None)
            if not path:
                continue
            source, rel = in_volume(service, services[service], path)
            assert source == volume, f"{name}: --{flag.replace('_', '-')} {path} is not in the certs volume"
            if flag == "tokens_dir":
                assert rel.rstrip("/") == folder, f"{name}: --tokens-dir {path} is not the folder certs writes"
            else:
                assert str(Path(rel).parent) == (folder or ".") and Path(rel).name in certs_cmd.FILES, \
                    f"{name}: --{flag.replace('_', '-')} {path} is not a file `reshard certs` writes " \
                    f"({', '.join(certs_cmd.FILES)})"
        if service != "certs" and any(getattr(ns, f, None) for f in PATH_FLAGS):
            assert all(ro for src, ro in volume_mounts(service, services[service]).values() if src == volume), \
                f"service {service!r} should mount the certs volume read-only"


def test_the_commands_the_comments_show_are_accepted():
    # `docker compose exec SERVICE reshard ARGS`, `docker compose run --rm SERVICE ARGS` (the image's
    # entrypoint is reshard) and `reshard ARGS` lines in the comments: an operator copies them.
    shown = []
    for line in COMPOSE.read_text().splitlines():
        m = re.match(r"#\s+(?:docker compose (?:exec \w+ reshard|run --rm \w+)|reshard) ([a-z].*)$", line)
        if m:
            shown.append(m.group(1).split("  #")[0])
    assert len(shown) >= 4, shown  # the status examples and the in-place rotation
    for cmd in shown:
        parse_command(f"comment `{cmd}`", shlex.split(cmd))


def container_path(tmp: Path, certs_out: tuple[str, str], service: str, svc: dict, path: str) -> str:
    """Where a container path in the certs volume lies once `reshard certs` wrote its folder into tmp."""
    return os.path.normpath(tmp / os.path.relpath(in_volume(service, svc, path)[1] or ".", certs_out[1] or "."))


def run_certs(argv: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    rc = cli_main(argv)
    return rc, capsys.readouterr().err


def test_the_certs_command_issues_private_files_and_keeps_them(tmp_path, services, parsed, capsys):
    """The certs service's own command, run for real into a folder (nothing else starts): every file,
    keys and tokens 0600, a server certificate for every --host with server and client use; a second
    run keeps them byte for byte; a partial set is refused, never completed."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.x509.oid import ExtendedKeyUsageOID

    argv = list(services["certs"]["command"])
    argv[argv.index("--out") + 1] = str(tmp_path)
    rc, err = run_certs(argv, capsys)
    assert rc == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(certs_cmd.FILES)
    for f in certs_cmd.FILES:
        mode = (tmp_path / f).stat().st_mode & 0o777
        if f in PRIVATE:
            assert mode == 0o600, f"{f} has mode {mode:o}"
        else:
            assert mode & 0o022 == 0, f"{f} has mode {mode:o}"
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.pem").read_bytes())
    server = x509.load_pem_x509_certificate((tmp_path / "server.pem").read_bytes())
    server.verify_directly_issued_by(ca)
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    names = {*san.get_values_for_type(x509.DNSName), *(str(i) for i in san.get_values_for_type(x509.IPAddress))}
    assert set(parsed["certs"].host) <= names
    eku = set(server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= eku  # the trainer's client certificate too

    before = {f: (tmp_path / f).read_bytes() for f in certs_cmd.FILES}
    rc, err = run_certs(argv, capsys)  # a restart
    assert rc == 0, err
    assert {f: (tmp_path / f).read_bytes() for f in certs_cmd.FILES} == before

    (tmp_path / "peer.token").unlink()  # a partial set: refused, nothing written
    rc, err = run_certs(argv, capsys)
    assert rc == 2 and "peer.token" in err and "partial" in err
    assert not (tmp_path / "peer.token").exists()
    assert {f: (tmp_path / f).read_bytes() for f in certs_cmd.FILES if f != "peer.token"} == \
        {f: v for f, v in before.items() if f != "peer.token"}

    (tmp_path / "operator.token").chmod(0o644)
    forced = [a for a in argv if a != "--keep-existing"] + ["--force"]
    rc, err = run_certs(forced, capsys)  # the documented rotation in place
    assert rc == 0, err
    assert (tmp_path / "peer.token").exists() and (tmp_path / "ca.pem").read_bytes() != before["ca.pem"]
    assert all((tmp_path / f).stat().st_mode & 0o777 == 0o600 for f in PRIVATE)

    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):  # one or the other
        build_parser().parse_args([*argv, "--force"])


def test_certs_issues_one_certificate_per_role_and_keeps_an_older_set_with_a_warning(tmp_path, capsys):
    """Each client certificate carries its role as a URI SAN (reshard-role:ROLE), server.pem the
    peer's (the trainer controller presents it to inference). A complete set an older version wrote
    (a role-less client.pem instead of the role certificates) is kept by --keep-existing with a
    warning (it still serves TLS and tokens; with --mtls its certificates grant nothing), replaced
    whole by --force."""
    x509 = pytest.importorskip("cryptography.x509")
    from reshard.common.control.security import ROLE_URI

    assert run_certs(["certs", "--out", str(tmp_path)], capsys)[0] == 0

    def roles(f: str) -> set[str]:
        cert = x509.load_pem_x509_certificate((tmp_path / f).read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        return {u[len(ROLE_URI):] for u in san.get_values_for_type(x509.UniformResourceIdentifier) if u.startswith(ROLE_URI)}

    assert {f: roles(f) for f in ("server.pem", "operator.pem", "admin.pem", "worker.pem")} == \
        {"server.pem": {"peer"}, "operator.pem": {"operator"}, "admin.pem": {"admin"}, "worker.pem": {"worker"}}
    for r in certs_cmd.CLIENT_ROLES:  # the older set: client.pem in place of the role certificates
        (tmp_path / f"{r}.pem").rename(tmp_path / "client.pem")
        (tmp_path / f"{r}-key.pem").rename(tmp_path / "client-key.pem")
    kept = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    rc, err = run_certs(["certs", "--out", str(tmp_path), "--keep-existing"], capsys)
    assert rc == 0 and "older reshard" in err and "carry no role" in err, err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == kept
    (tmp_path / "peer.token").unlink()  # an older set, partial: refused like any
    assert run_certs(["certs", "--out", str(tmp_path), "--keep-existing"], capsys)[0] == 2
    rc, err = run_certs(["certs", "--out", str(tmp_path)], capsys)
    assert rc == 2 and "client.pem" in err
    assert run_certs(["certs", "--out", str(tmp_path), "--force"], capsys)[0] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(certs_cmd.FILES)  # client.pem gone with its CA


def test_certs_keeps_a_set_issued_for_other_names_but_says_so(tmp_path, capsys):
    pytest.importorskip("cryptography")
    assert run_certs(["certs", "--out", str(tmp_path), "--host", "localhost"], capsys)[0] == 0
    rc, err = run_certs(["certs", "--out", str(tmp_path), "--keep-existing", "--host", "localhost", "--host", "trainer"], capsys)
    assert rc == 0 and "not valid for trainer" in err


def test_the_services_credentials_fit_together(tmp_path, services, parsed, clients, certs_out, monkeypatch, capsys):
    """With the files `reshard certs` writes, the credentials each container builds from its flags:
    the servers may listen off loopback, the trainer sends inference a peer token inference accepts,
    and update and the health checks send an operator token both services accept."""
    pytest.importorskip("cryptography")
    for k in _ENV_KEYS:
        monkeypatch.delenv(k, raising=False)
    argv = list(services["certs"]["command"])
    argv[argv.index("--out") + 1] = str(tmp_path)
    assert run_certs(argv, capsys)[0] == 0
    token = {f.split(".")[0]: (tmp_path / f).read_text().strip() for f in certs_cmd.FILES if f.endswith(".token")}

    def security(service: str, ns) -> Security:
        kw = {"cert": "tls_cert", "key": "tls_key", "ca": "tls_ca", "token_file": "token_file", "tokens_dir": "tokens_dir"}
        return Security.from_env(**{k: container_path(tmp_path, certs_out, service, services[service], getattr(ns, a))
                                    for k, a in kw.items() if getattr(ns, a, None)})

    sec = {name: security(name, parsed[name]) for name in SERVERS}
    for name in SERVERS:
        sec[name].check_listen(parse_address(parsed[name].listen)[0], name)  # no --insecure needed
    assert sec["trainer"].token("peer") == token["peer"]
    assert "peer" in AuthInterceptor(sec["inference"].tokens).roles_of(sec["trainer"].token("peer"))
    for name, (service, ns) in clients.items():
        client = security(service, ns)
        sent = client.token("operator")
        assert sent == token["operator"], name
        for server in SERVERS:
            assert "operator" in AuthInterceptor(sec[server].tokens).roles_of(sent), (name, server)


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
    # the project with the tls extra (cryptography: the compose file's `reshard certs`), and nccl on request
    assert 'pip install ".[tls]"' in runs, "the project is not installed with its tls extra"
    assert 'pip install ".[nccl,tls]"' in runs
    # torch comes first, then the project, then the switch to a non-root user
    order = [i for i, (w, r) in enumerate(ins) if w == "RUN" and "TORCH_SPEC" in r] + \
            [i for i, (w, r) in enumerate(ins) if w == "RUN" and 'pip install ".[' in r] + \
            [i for i, (w, _) in enumerate(ins) if w == "USER"]
    assert len(order) == 3 and order == sorted(order)
    assert by["USER"][-1] not in ("root", "0")


def _package_dirs() -> set[str]:
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return set(cfg["tool"]["setuptools"]["package-dir"].values())


def test_dockerfile_copies_every_package_folder_before_installing():
    """`pip install .` in the image needs every folder pyproject.toml maps into the package (a
    folder added later and left out of the COPY lines breaks the build)."""
    ins = dockerfile_instructions()
    install = next(i for i, (w, r) in enumerate(ins) if w == "RUN" and 'pip install ".[' in r)
    copied = {r.split()[0].rstrip("/") for w, r in ins[:install] if w == "COPY"}
    missing = _package_dirs() - copied
    assert not missing, f"the Dockerfile does not copy {sorted(missing)} before `pip install .`"


def test_the_makefile_compiles_every_package_folder():
    text = (ROOT / "Makefile").read_text()
    dirs = set(re.search(r"^PKG_DIRS := (.+)$", text, re.M).group(1).split())
    assert dirs == _package_dirs()


def test_dockerfile_prepares_the_certs_folder_for_its_user(parsed):
    # A new named volume takes the owner of the image's folder at its mount point; without one the
    # folder would be root's and `reshard certs`, running as the image's user, could not write it.
    user = [r for w, r in dockerfile_instructions() if w == "USER"][-1]
    out = parsed["certs"].out.rstrip("/")
    runs = [r for w, r in dockerfile_instructions() if w == "RUN" and out in r.split()]
    assert any(re.search(rf"install -d (.* )?-o {user}\b", r) or re.search(rf"chown (-R )?{user}\b", r) for r in runs), \
        f"the Dockerfile does not create {out} owned by {user}"
