"""TLS, bearer tokens by role, and the listen rule, on real services in real processes
(common/security.py)."""

import json
import os
import subprocess
import time

import grpc
import pytest
from google.protobuf.message_factory import GetMessageClass

from reshard.common.security import METHOD_ROLES, satisfies
from reshard.common.supervisor import module_command
from reshard.proto import reshard_pb2 as pb
from reshard.proto import reshard_pb2_grpc as rgrpc
from reshard.proto import worker_pb2 as wpb

from .cluster import free_port, stop_processes

pytestmark = pytest.mark.integration

TOKENS = {"operator": "op-" + "o" * 29, "admin": "ad-" + "a" * 29, "peer": "pe-" + "p" * 29, "worker": "wo-" + "w" * 29}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, one certificate for the services on 127.0.0.1, and token files."""
    trustme = pytest.importorskip("trustme")
    d = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    cert.private_key_pem.write_to_path(str(d / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(d / "cert.pem"))
    (d / "services.tokens").write_text("".join(f"{r} {t}\n" for r, t in TOKENS.items()))
    (d / "operator.tokens").write_text(f"# an operator's file\noperator {TOKENS['operator']}\n")
    return d


def _start(args, env, log):
    return subprocess.Popen([*module_command("reshard.cli"), *args], env=env, stdout=subprocess.DEVNULL, stderr=log,
                            start_new_session=True)


def _creds(pki):
    return grpc.ssl_channel_credentials(root_certificates=(pki / "ca.pem").read_bytes())


def _wait_serving(addr, pki, token, log_path, timeout=60):
    t0 = time.monotonic()
    while True:
        try:
            with grpc.secure_channel(addr, _creds(pki)) as ch:
                stub = rgrpc.TrainerServiceStub(ch) if "trainer" in log_path.name else rgrpc.InferenceServiceStub(ch)
                st = stub.GetStatus(pb.StatusRequest(), timeout=5, metadata=[("authorization", f"Bearer {token}")])
                if st.serving_state == "SERVING":
                    return
        except grpc.RpcError:
            pass
        assert time.monotonic() - t0 < timeout, log_path.read_text()[-3000:]
        time.sleep(0.2)


def test_tls_and_tokens_end_to_end(pki, tmp_path):
    """Both services with TLS and tokens: an update commits (peer and worker tokens over TLS); each
    RPC asks for its role; no token, an unknown one, a plaintext caller get nothing."""
    env = dict(os.environ, RESHARD_TLS_CERT=str(pki / "cert.pem"), RESHARD_TLS_KEY=str(pki / "key.pem"),
               RESHARD_TLS_CA=str(pki / "ca.pem"), RESHARD_TOKEN_FILE=str(pki / "services.tokens"))
    inf, tr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    inf_log, tr_log = tmp_path / "inference.log", tmp_path / "trainer.log"
    procs = []
    try:
        with open(inf_log, "w") as log:
            procs.append(_start(["inference", "--listen", inf, "--workers", "2", "--model", "tiny"], env, log))
        with open(tr_log, "w") as log:
            procs.append(_start(["trainer", "--listen", tr, "--workers", "2", "--model", "tiny", "--inference", inf,
                                 "--run", "sec"], env, log))
        _wait_serving(inf, pki, TOKENS["operator"], inf_log)
        _wait_serving(tr, pki, TOKENS["operator"], tr_log)

        # The operator's CLI: TLS from --tls-ca, its token from a file given by flag.
        clean = {k: v for k, v in os.environ.items() if not k.startswith("RESHARD_T")}
        op = ["--tls-ca", str(pki / "ca.pem"), "--token-file", str(pki / "operator.tokens")]
        r = subprocess.run([*module_command("reshard.cli"), "update", "--trainer", tr, "--wait", "--json", *op],
                           env=clean, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr + tr_log.read_text()[-3000:] + inf_log.read_text()[-3000:]
        assert json.loads(r.stdout)["committed"]["run"] == "sec"
        # An operator may not read weights back.
        r = subprocess.run([*module_command("reshard.cli"), "dump", "--inference", inf, "--tensor", "lm_head.weight",
                            "--out", str(tmp_path / "x.pt"), *op], env=clean, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "PERMISSION_DENIED" in r.stderr and "admin" in r.stderr, r.stderr

        def call(stub_cls, method, req, token=None, streaming=False):
            md = [("authorization", f"Bearer {token}")] if token else None
            with grpc.secure_channel(inf if stub_cls is rgrpc.InferenceServiceStub else tr, _creds(pki)) as ch:
                fn = getattr(stub_cls(ch), method)
                try:
                    out = fn(req, timeout=10, metadata=md)
                    if streaming:
                        out = list(out)
                    return grpc.StatusCode.OK, out
                except grpc.RpcError as e:
                    return e.code(), e.details()

        I, T = rgrpc.InferenceServiceStub, rgrpc.TrainerServiceStub
        assert call(I, "GetStatus", pb.StatusRequest())[0] == grpc.StatusCode.UNAUTHENTICATED
        assert call(I, "GetStatus", pb.StatusRequest(), "x" * 32)[0] == grpc.StatusCode.UNAUTHENTICATED
        assert call(I, "GetStatus", pb.StatusRequest(), TOKENS["admin"])[0] == grpc.StatusCode.OK  # admin covers operator
        assert call(I, "Dump", pb.DumpRequest(tensor="lm_head.weight"), TOKENS["operator"], True)[0] == grpc.StatusCode.PERMISSION_DENIED
        code, chunks = call(I, "Dump", pb.DumpRequest(tensor="lm_head.weight"), TOKENS["admin"], True)
        assert code == grpc.StatusCode.OK and chunks[0].version.run == "sec"
        # A forged update from someone without the peer token changes nothing.
        begin = pb.BeginUpdateRequest(update_id="forged", version=pb.Version(run="evil", step=99), src_fingerprint="f",
                                      session=pb.Session(id="s"))
        assert call(I, "BeginUpdate", begin, TOKENS["admin"])[0] == grpc.StatusCode.PERMISSION_DENIED
        assert call(T, "AttachInference", pb.AttachRequest(address="10.0.0.1:1"), TOKENS["operator"])[0] == grpc.StatusCode.PERMISSION_DENIED
        # Every RPC of every service, with no token, an unknown one, and each role that may not call it.
        before = {a: call(S, "GetStatus", pb.StatusRequest(), TOKENS["admin"])[1] for a, S in ((inf, I), (tr, T))}
        refused = 0
        for method, role in METHOD_ROLES.items():
            service, name = method.rsplit("/", 1)
            addr = inf if "Inference" in service else tr
            desc = next(d.services_by_name[service.split(".")[-1]] for d in (pb.DESCRIPTOR, wpb.DESCRIPTOR)
                        if service[1:] in [x.full_name for x in d.services_by_name.values()])
            m = desc.methods_by_name[name]
            req_cls, rep_cls = GetMessageClass(m.input_type), GetMessageClass(m.output_type)
            wrong_roles = [r for r in TOKENS if not satisfies({r}, role)]
            for token, want in [(None, grpc.StatusCode.UNAUTHENTICATED), ("z" * 32, grpc.StatusCode.UNAUTHENTICATED)] + \
                    [(TOKENS[r], grpc.StatusCode.PERMISSION_DENIED) for r in wrong_roles]:
                md = [("authorization", f"Bearer {token}")] if token else None
                with grpc.secure_channel(addr, _creds(pki)) as ch:
                    kind = (m.client_streaming, m.server_streaming)
                    fn = {(False, False): ch.unary_unary, (False, True): ch.unary_stream,
                          (True, True): ch.stream_stream}[kind](method, request_serializer=req_cls.SerializeToString,
                                                                 response_deserializer=rep_cls.FromString)
                    arg = iter([req_cls()]) if m.client_streaming else req_cls()
                    with pytest.raises(grpc.RpcError) as e:
                        out = fn(arg, timeout=10, metadata=md)
                        if m.server_streaming:
                            list(out)
                    assert e.value.code() == want, (method, token and token[:3], e.value.code(), e.value.details())
                    refused += 1
        assert refused >= 3 * len(METHOD_ROLES)
        for a, S in ((inf, I), (tr, T)):  # nothing changed: versions, deployments, workers
            after = call(S, "GetStatus", pb.StatusRequest(), TOKENS["admin"])[1]
            assert (after.version, list(after.deployments), [(w.rank, w.pid, w.version) for w in after.workers]) == \
                (before[a].version, list(before[a].deployments), [(w.rank, w.pid, w.version) for w in before[a].workers])
        st = call(I, "GetStatus", pb.StatusRequest(), TOKENS["operator"])[1]
        assert st.version.run == "sec" and st.serving_state == "SERVING"
        # Health stays open (container probes), weights do not.
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.secure_channel(inf, _creds(pki)) as ch:
            assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1
        # Plaintext to a TLS port gets nothing.
        with grpc.insecure_channel(inf) as ch:
            with pytest.raises(grpc.RpcError) as e:
                rgrpc.InferenceServiceStub(ch).GetStatus(pb.StatusRequest(), timeout=3,
                                                         metadata=[("authorization", f"Bearer {TOKENS['admin']}")])
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        stop_processes(procs)


@pytest.mark.slow  # about 15 s of CLI starts
def test_off_loopback_needs_tls_and_authentication(pki, tmp_path):
    """Plaintext off loopback, or TLS without tokens or client certificates, is refused before
    anything starts; --insecure starts it, with a warning."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESHARD_T")}
    base = [*module_command("reshard.cli"), "inference", "--listen", f"0.0.0.0:{free_port()}", "--workers", "1",
            "--model", "tiny"]
    r = subprocess.run(base, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "refusing to listen on 0.0.0.0 without TLS" in r.stderr, r.stderr
    tls = ["--tls-cert", str(pki / "cert.pem"), "--tls-key", str(pki / "key.pem")]
    r = subprocess.run(base + tls, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "neither tokens" in r.stderr, r.stderr
    r = subprocess.run(base + ["--tls-cert", str(pki / "cert.pem")], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--tls-cert and --tls-key go together" in r.stderr, r.stderr
    log_path = tmp_path / "insecure.log"
    with open(log_path, "w") as log:
        p = subprocess.Popen(base + ["--insecure"], env=env, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    try:
        t0 = time.monotonic()
        while "listening on" not in log_path.read_text():
            assert p.poll() is None and time.monotonic() - t0 < 60, log_path.read_text()[-2000:]
            time.sleep(0.1)
        assert "(--insecure): anyone who reaches it can read and replace the weights" in log_path.read_text()
    finally:
        stop_processes([p])


@pytest.mark.slow  # about 20 s
def test_mutual_tls_with_reshard_certs(pki, tmp_path):
    """`reshard certs` output runs a service with mutual TLS and tokens: the operator's CLI with
    the client certificate gets in; a certificate from another CA, or none, does not."""
    d = tmp_path / "certs"
    r = subprocess.run([*module_command("reshard.cli"), "certs", "--out", str(d)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESHARD_T")}
    inf = f"127.0.0.1:{free_port()}"
    log_path = tmp_path / "inference.log"
    with open(log_path, "w") as log:
        p = _start(["inference", "--listen", inf, "--workers", "1", "--model", "tiny", "--tls-cert", str(d / "server.pem"),
                    "--tls-key", str(d / "server-key.pem"), "--tls-ca", str(d / "ca.pem"), "--mtls",
                    "--tokens-dir", str(d)], env, log)
    try:
        status = [*module_command("reshard.cli"), "status", "--inference", inf, "--json", "--tls-ca", str(d / "ca.pem"),
                  "--token-file", str(d / "operator.token")]
        mine = ["--tls-cert", str(d / "client.pem"), "--tls-key", str(d / "client-key.pem")]
        t0 = time.monotonic()
        while True:
            r = subprocess.run(status + mine, env=env, capture_output=True, text=True, timeout=60)
            if r.returncode == 0 and json.loads(r.stdout)["serving_state"] == "SERVING":
                break
            assert time.monotonic() - t0 < 60, r.stderr + log_path.read_text()[-3000:]
            time.sleep(0.3)
        foreign = ["--tls-cert", str(pki / "cert.pem"), "--tls-key", str(pki / "key.pem")]  # signed by another CA
        for creds in (foreign, []):
            r = subprocess.run(status + creds, env=env, capture_output=True, text=True, timeout=60)
            assert r.returncode == 2 and "UNAVAILABLE" in r.stderr, r.stderr
    finally:
        stop_processes([p])


@pytest.mark.slow  # two deployments' starts: about 30 s
def test_an_inference_controller_takes_updates_only_from_the_trainers_it_names(tmp_path):
    """--mtls --allow-peer NAME: a trainer whose client certificate does not carry NAME cannot
    push (PERMISSION_DENIED, nothing served changes); the named one can."""
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    for who in ("inference", "trainer-a", "trainer-b"):
        c = ca.issue_cert(who, "127.0.0.1", "localhost")
        c.private_key_pem.write_to_path(str(tmp_path / f"{who}-key.pem"))
        c.cert_chain_pems[0].write_to_path(str(tmp_path / f"{who}.pem"))
    base = {k: v for k, v in os.environ.items() if not k.startswith("RESHARD_T")}
    env_of = lambda who: dict(base, RESHARD_TLS_CERT=str(tmp_path / f"{who}.pem"), RESHARD_TLS_KEY=str(tmp_path / f"{who}-key.pem"),  # noqa: E731
                              RESHARD_TLS_CA=str(tmp_path / "ca.pem"), RESHARD_MTLS="1")
    inf = f"127.0.0.1:{free_port()}"
    log_path = tmp_path / "services.log"
    procs = []
    try:
        with open(log_path, "w") as log:
            procs.append(_start(["inference", "--listen", inf, "--workers", "1", "--model", "tiny", "--allow-peer", "trainer-a"],
                                env_of("inference"), log))
            for who in ("trainer-b", "trainer-a"):
                tr = f"127.0.0.1:{free_port()}"
                procs.append(_start(["trainer", "--listen", tr, "--workers", "1", "--model", "tiny", "--inference", inf,
                                     "--run", who], env_of(who), log))
                creds = grpc.ssl_channel_credentials((tmp_path / "ca.pem").read_bytes(), (tmp_path / f"{who}-key.pem").read_bytes(),
                                                     (tmp_path / f"{who}.pem").read_bytes())
                t0 = time.monotonic()
                while True:  # the trainer answers before it is asked to update
                    try:
                        with grpc.secure_channel(tr, creds) as ch:
                            rgrpc.TrainerServiceStub(ch).GetStatus(pb.StatusRequest(), timeout=5)
                        break
                    except grpc.RpcError:
                        assert time.monotonic() - t0 < 60, log_path.read_text()[-3000:]
                        time.sleep(0.2)
                r = subprocess.run([*module_command("reshard.cli"), "update", "--trainer", tr, "--wait", "--json",
                                    "--timeout", "60"], env=env_of(who), capture_output=True, text=True, timeout=120)
                if who == "trainer-b":
                    assert r.returncode != 0 and "may not make peer calls here" in r.stdout + r.stderr, r.stdout + r.stderr
                    stop_processes([procs.pop()])
                else:
                    assert r.returncode == 0, r.stderr + log_path.read_text()[-3000:]
                    assert json.loads(r.stdout)["committed"]["run"] == "trainer-a"
    finally:
        stop_processes(procs)
