"""TLS, bearer tokens by role, and the listen rule, on real services in real processes
(common/control/security.py)."""

import collections
import json
import os
import re
import subprocess
import time
import types

import grpc
import pytest
from google.protobuf.message_factory import GetMessageClass

from reshard.common.control.security import METHOD_ROLES, may_call
from reshard.common.control.supervisor import module_command
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


@pytest.fixture(scope="module")
def secure(pki, tmp_path_factory):
    """Both services with TLS and tokens (every role's in one file), 2 -> 2 tiny workers; the
    inference deadline of an update is 6 s, then 3 s for the trainer's FinishUpdate (the clamp test
    waits them out)."""
    d = tmp_path_factory.mktemp("secure")
    env = dict(os.environ, RESHARD_TLS_CERT=str(pki / "cert.pem"), RESHARD_TLS_KEY=str(pki / "key.pem"),
               RESHARD_TLS_CA=str(pki / "ca.pem"), RESHARD_TOKEN_FILE=str(pki / "services.tokens"))
    inf, tr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    inf_log, tr_log = d / "inference.log", d / "trainer.log"
    procs = []
    try:
        with open(inf_log, "w") as log:
            procs.append(_start(["inference", "--listen", inf, "--workers", "2", "--model", "tiny", "--update-timeout", "6",
                                 "--rpc-timeout", "3"],
                                env, log))
        with open(tr_log, "w") as log:
            procs.append(_start(["trainer", "--listen", tr, "--workers", "2", "--model", "tiny", "--inference", inf,
                                 "--run", "sec"], env, log))
        _wait_serving(inf, pki, TOKENS["operator"], inf_log)
        _wait_serving(tr, pki, TOKENS["operator"], tr_log)
        yield types.SimpleNamespace(inf=inf, tr=tr, inf_log=inf_log, tr_log=tr_log, pids=[p.pid for p in procs], pki=pki)
    finally:
        stop_processes(procs)


def _call(addr, pki, stub_cls, method, req, token=None, streaming=False, timeout=10):
    md = [("authorization", f"Bearer {token}")] if token else None
    with grpc.secure_channel(addr, _creds(pki)) as ch:
        fn = getattr(stub_cls(ch), method)
        try:
            out = fn(req, timeout=timeout, metadata=md)
            if streaming:
                out = list(out)
            return grpc.StatusCode.OK, out
        except grpc.RpcError as e:
            return e.code(), e.details()


def _peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


@pytest.mark.slow  # about 5 s: the quick suite keeps under 5 minutes on 2 cores (the other tests here keep the fixture quick)
def test_tls_and_tokens_end_to_end(secure, tmp_path):
    """Both services with TLS and tokens: an update commits (peer and worker tokens over TLS); each
    RPC asks for its role; no token, an unknown one, a plaintext caller get nothing."""
    pki, inf, tr, inf_log, tr_log = secure.pki, secure.inf, secure.tr, secure.inf_log, secure.tr_log
    # The operator's CLI: TLS from --tls-ca, its token from a file given by flag.
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RESHARD_T")}
    op = ["--tls-ca", str(pki / "ca.pem"), "--token-file", str(pki / "operator.tokens")]
    r = subprocess.run([*module_command("reshard.cli"), "update", "--trainer", tr, "--wait", "--json", *op],
                       env=clean, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr + tr_log.read_text()[-3000:] + inf_log.read_text()[-3000:]
    assert json.loads(r.stdout)["committed"]["run"] == "sec"
    # An operator may not read weights back (its token is not even sent: the call needs an admin's).
    r = subprocess.run([*module_command("reshard.cli"), "dump", "--inference", inf, "--tensor", "lm_head.weight",
                        "--out", str(tmp_path / "x.pt"), *op], env=clean, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "UNAUTHENTICATED" in r.stderr and "admin role" in r.stderr, r.stderr

    def call(stub_cls, method, req, token=None, streaming=False):
        return _call(inf if stub_cls is rgrpc.InferenceServiceStub else tr, pki, stub_cls, method, req, token, streaming)

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
    worker_addr = call(T, "GetStatus", pb.StatusRequest(), TOKENS["admin"])[1].worker_address
    assert worker_addr.startswith("unix:"), worker_addr
    for method, role in METHOD_ROLES.items():
        service, name = method.rsplit("/", 1)
        addr = inf if "Inference" in service else tr if "Trainer" in service else worker_addr
        desc = next(d.services_by_name[service.split(".")[-1]] for d in (pb.DESCRIPTOR, wpb.DESCRIPTOR)
                    if service[1:] in [x.full_name for x in d.services_by_name.values()])
        m = desc.methods_by_name[name]
        req_cls, rep_cls = GetMessageClass(m.input_type), GetMessageClass(m.output_type)
        wrong_roles = [r for r in TOKENS if not may_call({r}, method)]
        for token, want in [(None, grpc.StatusCode.UNAUTHENTICATED), ("z" * 32, grpc.StatusCode.UNAUTHENTICATED)] + \
                [(TOKENS[r], grpc.StatusCode.PERMISSION_DENIED) for r in wrong_roles]:
            md = [("authorization", f"Bearer {token}")] if token else None
            with (grpc.insecure_channel(addr) if addr.startswith("unix:") else grpc.secure_channel(addr, _creds(pki))) as ch:
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


def _attach(addr, pki, token, hello):
    """A worker stream's first message, as a rogue would send it; (status, details)."""
    md = [("authorization", f"Bearer {token}")] if token else None
    with (grpc.insecure_channel(addr) if addr.startswith("unix:") else grpc.secure_channel(addr, _creds(pki))) as ch:
        fn = ch.stream_stream("/reshard.worker.v1.WorkerControl/Attach", request_serializer=wpb.WorkerMessage.SerializeToString,
                              response_deserializer=wpb.ControllerMessage.FromString)
        try:
            for _ in fn(iter([wpb.WorkerMessage(hello=hello)]), timeout=10, metadata=md):
                break
            return grpc.StatusCode.OK, ""
        except grpc.RpcError as e:
            return e.code(), e.details()


def test_the_worker_protocol_has_its_own_listener_and_refuses_forged_hellos(secure):
    """Workers attach on the controller's worker listener (a Unix socket by default), never on the
    public port; a hello needs the worker token, and one for a rank whose worker lives is refused."""
    T = rgrpc.TrainerServiceStub
    st = _call(secure.tr, secure.pki, T, "GetStatus", pb.StatusRequest(), TOKENS["admin"])[1]
    before = sorted((w.rank, w.pid, w.state) for w in st.workers)
    waddr = st.worker_address
    forged = wpb.Hello(rank=0, world=2, pid=4242, role="trainer", model="tiny")
    assert _attach(secure.tr, secure.pki, TOKENS["worker"], forged)[0] == grpc.StatusCode.UNIMPLEMENTED
    assert _attach(waddr, secure.pki, None, forged)[0] == grpc.StatusCode.UNAUTHENTICATED
    assert _attach(waddr, secure.pki, TOKENS["admin"], forged)[0] == grpc.StatusCode.PERMISSION_DENIED
    code, details = _attach(waddr, secure.pki, TOKENS["worker"], forged)
    assert code == grpc.StatusCode.ALREADY_EXISTS and "held by" in details, (code, details)
    st = _call(secure.tr, secure.pki, T, "GetStatus", pb.StatusRequest(), TOKENS["admin"])[1]
    assert sorted((w.rank, w.pid, w.state) for w in st.workers) == before and {w.state for w in st.workers} == {"READY"}


def _listening(port: int) -> set[str]:
    """The local addresses a TCP port listens on (from /proc/net/tcp), as dotted IPv4 or 'v6'."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, p = local.rsplit(":", 1)
                if state == "0A" and int(p, 16) == port:
                    out.add(".".join(str(int(addr[i:i + 2], 16)) for i in (6, 4, 2, 0)) if len(addr) == 8 else "v6")
    return out


@pytest.mark.slow  # 3-5 s: the quick suite's margin under 5 minutes on slower machines
def test_the_session_store_admits_only_holders_of_the_session_secret(secure):
    """The trainer's rendezvous store listens on the controller's address only, and a session's
    keys live under a secret that travels only on the authenticated control plane: a process that
    reaches the store joins nothing, and the next update commits bit-exact."""
    import datetime

    import torch
    from torch.distributed import PrefixStore, TCPStore
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    from reshard.common.models.presets import model_config
    from reshard.tools.synth import tensor_value

    m = re.search(r"session store on ([0-9.]+):([0-9]+)", secure.tr_log.read_text())
    assert m, secure.tr_log.read_text()[-2000:]
    host, port = m.group(1), int(m.group(2))
    assert _listening(port) == {"127.0.0.1"}, _listening(port)
    store = TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=5))
    for guess in ("reshard", "reshard/0", "reshard/s"):
        store.set(f"{guess}/0", b"rogue")  # what it can write lands beside the sessions, never in one
        with pytest.raises(RuntimeError):
            ProcessGroupGloo(PrefixStore(guess, store), 0, 4, datetime.timedelta(seconds=1))
    del store
    op = ["--tls-ca", str(secure.pki / "ca.pem"), "--token-file", str(secure.pki / "operator.tokens")]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RESHARD_T")}
    r = subprocess.run([*module_command("reshard.cli"), "update", "--trainer", secure.tr, "--wait", "--json", *op],
                       env=clean, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr + secure.tr_log.read_text()[-3000:]
    step = json.loads(r.stdout)["committed"]["step"]
    code, chunks = _call(secure.inf, secure.pki, rgrpc.InferenceServiceStub, "Dump", pb.DumpRequest(tensor="lm_head.weight"),
                         TOKENS["admin"], True)
    assert code == grpc.StatusCode.OK
    got = torch.frombuffer(bytearray(b"".join(c.data for c in chunks)), dtype=torch.bfloat16).view(list(chunks[0].shape))
    spec = model_config("tiny").tensors()["lm_head.weight"]
    assert chunks[0].version.step == int(step)
    assert torch.equal(got, tensor_value(0, "lm_head.weight", int(step), spec.shape, torch.bfloat16))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _raw(addr, pki, method, body: bytes, token, timeout=10):
    """One call with a request body as given (no serializer): (status, details)."""
    md = [("authorization", f"Bearer {token}")] if token else None
    with grpc.secure_channel(addr, _creds(pki), options=[("grpc.max_send_message_length", 512 << 20)]) as ch:
        try:
            ch.unary_unary(method)(body, timeout=timeout, metadata=md)
            return grpc.StatusCode.OK, ""
        except grpc.RpcError as e:
            return e.code(), e.details()


def test_oversized_and_malformed_requests_and_layout_bombs_are_refused(secure):
    """Each method's size limit, a body that does not parse, and a layout that declares 320 MiB
    inflated: refused with a clear status before they take memory (the controller's peak RSS is
    printed), and the deployment keeps serving."""
    import zlib

    from reshard.common.layout.columns import WIRE_MAGIC

    inf_pid = _controller_pid(secure, "inference")
    rss0 = _peak_rss_mib(inf_pid)
    big = b"\x9a\x06" + _varint(100_000) + bytes(100_000)  # an unknown field 99 of 100 kB: over GetStatus's 64 KiB
    code, details = _raw(secure.inf, secure.pki, "/reshard.v1.InferenceService/GetStatus", big, TOKENS["operator"])
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit of 65536 bytes" in details, (code, details)
    code, details = _raw(secure.tr, secure.pki, "/reshard.v1.TrainerService/TriggerUpdate",
                         pb.TriggerUpdateRequest(tensors=["x" * 1000] * 2000).SerializeToString(), TOKENS["operator"])
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
    code, details = _raw(secure.inf, secure.pki, "/reshard.v1.InferenceService/GetStatus", b"\xff\xff\xff", TOKENS["operator"])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "does not parse" in details, (code, details)
    z = zlib.compressobj(1)
    stream = b"".join(z.compress(bytes(64 << 20)) for _ in range(5)) + z.flush()
    served = _call(secure.inf, secure.pki, rgrpc.InferenceServiceStub, "GetStatus", pb.StatusRequest(), TOKENS["operator"])[1]
    # An epoch granted to this caller (the fixture's trainer is fenced out from here: no later test pushes with it).
    lay = _call(secure.inf, secure.pki, rgrpc.InferenceServiceStub, "GetLayout", pb.GetLayoutRequest(acquire_epoch=True),
                TOKENS["peer"])[1]
    bomb = pb.BeginUpdateRequest(update_id="bomb", version=pb.Version(run="sec", step=served.version.step + 1000),
                                 src_layout=WIRE_MAGIC + (320 << 20).to_bytes(8, "little") + stream, plan_digest="0",
                                 session=pb.Session(id="s", key="k" * 32, transport="gloo", store_host="127.0.0.1",
                                                    store_port=1, src_world=2, dst_world=lay.workers), epoch=lay.epoch)
    code, details = _call(secure.inf, secure.pki, rgrpc.InferenceServiceStub, "BeginUpdate", bomb, TOKENS["peer"])
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "over the limit" in details, (code, details)
    rss1 = _peak_rss_mib(inf_pid)
    print(f"inference controller peak RSS {rss0:.0f} -> {rss1:.0f} MiB across an oversized request, a malformed one and "
          f"a {len(stream) >> 20} MiB layout that declares 320 MiB")
    assert rss1 - rss0 < 64
    after = _call(secure.inf, secure.pki, rgrpc.InferenceServiceStub, "GetStatus", pb.StatusRequest(), TOKENS["operator"])[1]
    assert after.serving_state == "SERVING" and after.version == served.version


def test_unauthenticated_requests_are_refused_before_they_are_read(secure):
    """Requests sent at once to the inference controller: four of 100 MiB and four of 60 MiB without a
    token, two of 100 MiB with the peer token. Those without a token are refused without being read
    (UNAUTHENTICATED; or RESOURCE_EXHAUSTED from the length declared, over the 64 MiB transport
    limit), those with one RESOURCE_EXHAUSTED from their declared length; the controller's peak
    resident memory does not grow by the size of any of them (with the old 256 MiB limit, and the
    request read before the token check, it grew by gigabytes). The trainer's limit is 1 MiB."""
    import concurrent.futures

    pid = _controller_pid(secure, "inference")
    rss0 = _peak_rss_mib(pid)
    begin = "/reshard.v1.InferenceService/BeginUpdate"
    over, under = bytes(100 << 20), bytes(60 << 20)
    sends = [(secure.inf, begin, over, None)] * 4 + [(secure.inf, begin, under, None)] * 4 + \
            [(secure.inf, begin, over, TOKENS["peer"])] * 2 + \
            [(secure.tr, "/reshard.v1.TrainerService/TriggerUpdate", bytes(2 << 20), TOKENS["operator"])]
    with concurrent.futures.ThreadPoolExecutor(len(sends)) as pool:
        got = list(pool.map(lambda a: _raw(a[0], secure.pki, a[1], a[2], a[3], timeout=60), sends))
    rss1 = _peak_rss_mib(pid)
    print(f"inference controller peak RSS {rss0:.0f} -> {rss1:.0f} MiB across 4 x 100 MiB and 4 x 60 MiB unauthenticated "
          f"requests and 2 x 100 MiB authenticated ones: {[c.name for c, _ in got]}")
    refused = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert all(c in refused for c, _ in got[:4]), got[:4]
    assert all(c == grpc.StatusCode.UNAUTHENTICATED for c, _ in got[4:8]), got[4:8]
    assert all(c == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in d for c, d in got[8:]), got[8:]
    assert rss1 - rss0 < 48, (rss0, rss1)
    st = _call(secure.inf, secure.pki, rgrpc.InferenceServiceStub, "GetStatus", pb.StatusRequest(), TOKENS["operator"])[1]
    assert st.serving_state == "SERVING"


def _controller_pid(secure, role: str) -> int:
    """The controller's own pid: the process group leader started by the fixture."""
    return secure.pids[0 if role == "inference" else 1]


# The public RPCs: (address attribute, method, the role whose token is sent).
PUBLIC = [(("inf" if m.startswith("/reshard.v1.Inference") else "tr"), m, role) for m, role in METHOD_ROLES.items() if "/reshard.v1." in m]


def _strategy_of(desc, depth: int = 0):
    """Requests of a proto message type with any field missing or set to a hostile value: huge and
    negative numbers, NaN, long strings, unknown names, random bytes, versions going backwards."""
    from google.protobuf.descriptor import FieldDescriptor as F
    from hypothesis import strategies as st

    def scalar(f):
        if f.type == F.TYPE_STRING:
            return st.text(max_size=40) | st.sampled_from(["lm_head.weight", "*", "model.layers.*", "sec", "127.0.0.1:1", ""]) \
                | st.integers(1000, 100_000).map(lambda n: "x" * n)
        if f.type == F.TYPE_BYTES:
            return st.binary(max_size=300) | st.binary(max_size=64).map(lambda b: b"RSL3c" + b)
        if f.type in (F.TYPE_INT64, F.TYPE_SINT64, F.TYPE_SFIXED64):
            return st.integers(-(1 << 63), (1 << 63) - 1) | st.sampled_from([0, -1, 1, 1 << 62])
        if f.type in (F.TYPE_INT32, F.TYPE_SINT32, F.TYPE_SFIXED32):
            return st.integers(-(1 << 31), (1 << 31) - 1) | st.sampled_from([0, -1, 1, 2, 3])
        if f.type in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
            return st.floats(allow_nan=True, allow_infinity=True, width=32 if f.type == F.TYPE_FLOAT else 64) \
                | st.sampled_from([1e9, -1.0, 0.0])
        if f.type == F.TYPE_BOOL:
            return st.booleans()
        if f.type == F.TYPE_MESSAGE:
            return _strategy_of(f.message_type, depth + 1) if depth < 2 else st.nothing()
        return st.nothing()

    def repeated(f) -> bool:
        return f.is_repeated if hasattr(f, "is_repeated") else f.label == F.LABEL_REPEATED

    def field(f):
        v = scalar(f)
        return st.lists(v, max_size=4) if repeated(f) else v

    cls = GetMessageClass(desc)

    def build(values: dict):
        msg = cls()
        for name, v in values.items():
            f = desc.fields_by_name[name]
            if v is None:
                continue
            if repeated(f):
                target = getattr(msg, name)
                for x in v:
                    target.add().CopyFrom(x) if f.type == F.TYPE_MESSAGE else target.append(x)
            elif f.type == F.TYPE_MESSAGE:
                getattr(msg, name).CopyFrom(v)
            else:
                setattr(msg, name, v)
        return msg

    return st.fixed_dictionaries({f.name: st.none() | field(f) for f in desc.fields}).map(build)


def test_malformed_requests_get_a_clear_status_and_the_services_stay_healthy(secure):
    """Requests generated from the proto messages (and bodies that are not the message at all), sent
    with a token that may make the call: each is answered with a status that says what is wrong
    (never UNKNOWN or INTERNAL), and both services serve afterwards."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    methods = {}
    for where, method, role in PUBLIC:
        service, name = method.rsplit("/", 1)
        m = pb.DESCRIPTOR.services_by_name[service.split(".")[-1]].methods_by_name[name]
        methods[method] = (where, role, m)
    answered = []

    def send(method, body: bytes):
        where, role, m = methods[method]
        md = [("authorization", f"Bearer {TOKENS['admin' if role == 'operator' else role]}")]
        wait = method.endswith("WaitForVersion")
        with grpc.secure_channel(getattr(secure, where), _creds(secure.pki)) as ch:
            try:
                if m.server_streaming:
                    list(ch.unary_stream(method)(body, timeout=20, metadata=md))
                else:
                    ch.unary_unary(method)(body, timeout=2 if wait else 20, metadata=md)
                return grpc.StatusCode.OK, ""
            except grpc.RpcError as e:
                if wait and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    return grpc.StatusCode.OK, ""  # a wait for a version that never comes: the caller's deadline ends it
                return e.code(), e.details()

    requests = st.sampled_from(sorted(methods)).flatmap(
        lambda method: st.tuples(st.just(method), st.one_of(
            _strategy_of(methods[method][2].input_type).map(lambda r: r.SerializeToString()),
            st.binary(min_size=1, max_size=200))))  # wrong wire types, truncated fields, garbage

    @settings(max_examples=48, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(requests)
    def one(req):
        method, body = req
        code, details = send(method, body)
        answered.append((method, code))
        assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNIMPLEMENTED), \
            (method, body[:80], code, details)
        assert code == grpc.StatusCode.OK or details, (method, code)

    one()
    print(f"{len(answered)} malformed requests over {len({m for m, _ in answered})} methods: "
          + ", ".join(f"{c.name} {n}" for c, n in sorted(collections.Counter(c for _, c in answered).items(), key=str)))
    assert len(answered) >= 40 and len({m for m, _ in answered}) >= 8
    T, I = rgrpc.TrainerServiceStub, rgrpc.InferenceServiceStub
    for addr, S in ((secure.tr, T), (secure.inf, I)):
        with grpc.secure_channel(addr, _creds(secure.pki)) as ch:
            assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1
    st_tr = _call(secure.tr, secure.pki, T, "GetStatus", pb.StatusRequest(), TOKENS["admin"])[1]
    for d in st_tr.deployments:  # whatever a generated AttachInference added goes again
        if d.address != secure.inf:
            _call(secure.tr, secure.pki, T, "DetachInference", pb.AttachRequest(address=d.address), TOKENS["admin"])
    st_inf = _call(secure.inf, secure.pki, I, "GetStatus", pb.StatusRequest(), TOKENS["admin"])[1]
    assert st_inf.serving_state == "SERVING" and {w.state for w in st_inf.workers} == {"READY"}


def test_mutual_tls_refuses_other_cas_and_names_the_trainers_that_may_push(tmp_path):
    """An inference service with --mtls --allow-peer trainer-a (no workers needed): a client
    certificate from another CA, or none, gets no connection; a trainer-b certificate with the peer
    token gets PERMISSION_DENIED on the peer calls; trainer-a's gets through."""
    trustme = pytest.importorskip("trustme")
    ca, other = trustme.CA(), trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    pems = {}
    for who, issuer in (("inference", ca), ("trainer-a", ca), ("trainer-b", ca), ("foreign", other)):
        c = issuer.issue_cert(who, "127.0.0.1", "localhost")
        pems[who] = (c.private_key_pem.bytes(), c.cert_chain_pems[0].bytes())
    (tmp_path / "key.pem").write_bytes(pems["inference"][0])
    (tmp_path / "cert.pem").write_bytes(pems["inference"][1])
    (tmp_path / "tokens").write_text("".join(f"{r} {t}\n" for r, t in TOKENS.items()))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESHARD_T")}
    inf = f"127.0.0.1:{free_port()}"
    log_path = tmp_path / "inference.log"
    with open(log_path, "w") as log:
        p = _start(["inference", "--listen", inf, "--workers", "1", "--model", "tiny", "--external-workers",
                    "--tls-cert", str(tmp_path / "cert.pem"), "--tls-key", str(tmp_path / "key.pem"),
                    "--tls-ca", str(tmp_path / "ca.pem"), "--mtls", "--allow-peer", "trainer-a",
                    "--token-file", str(tmp_path / "tokens")], env, log)
    root = (tmp_path / "ca.pem").read_bytes()

    def call(who, method, req, token):
        creds = grpc.ssl_channel_credentials(root, *pems[who]) if who else grpc.ssl_channel_credentials(root)
        with grpc.secure_channel(inf, creds) as ch:
            try:
                getattr(rgrpc.InferenceServiceStub(ch), method)(req, timeout=5, metadata=[("authorization", f"Bearer {token}")])
                return grpc.StatusCode.OK, ""
            except grpc.RpcError as e:
                return e.code(), e.details()

    try:
        t0 = time.monotonic()
        while call("trainer-a", "GetStatus", pb.StatusRequest(), TOKENS["operator"])[0] != grpc.StatusCode.OK:
            assert p.poll() is None and time.monotonic() - t0 < 60, log_path.read_text()[-3000:]
            time.sleep(0.2)
        for who in ("foreign", None):  # another CA's certificate, or none: no TLS session at all
            assert call(who, "GetStatus", pb.StatusRequest(), TOKENS["operator"])[0] == grpc.StatusCode.UNAVAILABLE
        abort = pb.AbortUpdateRequest(update_id="none", reason="test")
        code, details = call("trainer-b", "AbortUpdate", abort, TOKENS["peer"])
        assert code == grpc.StatusCode.PERMISSION_DENIED and "may not make peer calls here" in details, (code, details)
        assert call("trainer-a", "AbortUpdate", abort, TOKENS["peer"])[0] == grpc.StatusCode.OK
    finally:
        stop_processes([p])


def _issue(ca, cn: str, *roles: str) -> tuple[bytes, bytes]:
    """(key, certificate) PEMs from trustme's `ca` for `cn`, valid for 127.0.0.1 and localhost as a
    server and a client, carrying each of `roles` as `reshard certs` does (a URI SAN
    reshard-role:ROLE; trustme writes no URIs)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_key = serialization.load_pem_private_key(ca.private_key_pem.bytes(), None)
    issuer = x509.load_pem_x509_certificate(ca.cert_pem.bytes()).subject
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    sans = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost"),
            *(x509.UniformResourceIdentifier(f"reshard-role:{r}") for r in roles)]
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
            .issuer_name(issuer).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    return (key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()), cert.public_bytes(pem))


@pytest.mark.slow  # two controllers' starts and an update: about 11 s
def test_with_mutual_tls_and_no_tokens_each_certificate_holds_only_its_role(tmp_path):
    """Both services with --mtls and no tokens, on the files `reshard certs` writes, the trainer's
    worker listener on TCP: an operator's update commits end to end (the trainer pushes with
    server.pem, the peer's); each certificate may make its role's calls only: every other RPC of
    every service and the worker listener is PERMISSION_DENIED without its request being read
    (a 60 MiB one leaves the controller's memory as it was), and nothing changes. Before, any
    certificate the CA signed could dump weights, attach a deployment and push weights."""
    d = tmp_path / "certs"
    r = subprocess.run([*module_command("reshard.cli"), "certs", "--out", str(d)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESHARD_T")}
    tls = ["--tls-cert", str(d / "server.pem"), "--tls-key", str(d / "server-key.pem"), "--tls-ca", str(d / "ca.pem"), "--mtls"]
    inf, tr, wl = (f"127.0.0.1:{free_port()}" for _ in range(3))
    log_path = tmp_path / "services.log"
    root = (d / "ca.pem").read_bytes()
    certs = {who: grpc.ssl_channel_credentials(root, (d / f"{f}-key.pem").read_bytes(), (d / f"{f}.pem").read_bytes())
             for who, f in (("operator", "operator"), ("admin", "admin"), ("peer", "server"), ("worker", "worker"))}

    def call(who, method, req, raw=False):
        """`method` with `who`'s certificate and no token: (status, reply or replies, or details)."""
        service, name = method.rsplit("/", 1)
        addr = inf if "Inference" in service else tr if "Trainer" in service else wl
        m = next(x.services_by_name[service.split(".")[-1]] for x in (pb.DESCRIPTOR, wpb.DESCRIPTOR)
                 if service[1:] in [s.full_name for s in x.services_by_name.values()]).methods_by_name[name]
        with grpc.secure_channel(addr, certs[who], options=[("grpc.max_send_message_length", 128 << 20)]) as ch:
            kind = {(False, False): ch.unary_unary, (False, True): ch.unary_stream,
                    (True, True): ch.stream_stream}[m.client_streaming, m.server_streaming]
            fn = kind(method) if raw else kind(method, request_serializer=type(req).SerializeToString,
                                                  response_deserializer=GetMessageClass(m.output_type).FromString)
            try:
                out = fn(iter([req]) if m.client_streaming else req, timeout=10)
                if m.server_streaming:
                    out = list(out)
                return grpc.StatusCode.OK, out
            except grpc.RpcError as e:
                return e.code(), e.details()

    procs = []
    try:
        with open(log_path, "w") as log:
            procs.append(_start(["inference", "--listen", inf, "--workers", "1", "--model", "tiny", *tls], env, log))
            procs.append(_start(["trainer", "--listen", tr, "--workers", "1", "--model", "tiny", "--inference", inf,
                                 "--run", "roles", "--worker-listen", wl, *tls], env, log))
        status = "/reshard.v1.TrainerService/GetStatus"
        t0 = time.monotonic()
        while True:
            code, st = call("operator", status, pb.StatusRequest())
            if code == grpc.StatusCode.OK and st.serving_state == "SERVING":
                break
            assert all(p.poll() is None for p in procs) and time.monotonic() - t0 < 60, (code, log_path.read_text()[-3000:])
            time.sleep(0.2)
        op = ["--tls-ca", str(d / "ca.pem"), "--tls-cert", str(d / "operator.pem"), "--tls-key", str(d / "operator-key.pem")]
        r = subprocess.run([*module_command("reshard.cli"), "update", "--trainer", tr, "--wait", "--json", "--timeout", "60",
                            *op], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr + log_path.read_text()[-3000:]
        assert json.loads(r.stdout)["committed"]["run"] == "roles"

        def state():
            return [(s.version, list(s.deployments), [(w.rank, w.pid, w.version) for w in s.workers]) for s in
                    (call("admin", m, pb.StatusRequest())[1] for m in ("/reshard.v1.InferenceService/GetStatus", status))]

        before = state()
        # The review's finding: the operator's certificate read the weights, attached a deployment, began an update.
        forged = pb.BeginUpdateRequest(update_id="forged", version=pb.Version(run="evil", step=99), src_fingerprint="f",
                                       session=pb.Session(id="s"))
        for method, req in (("/reshard.v1.InferenceService/Dump", pb.DumpRequest(tensor="lm_head.weight")),
                            ("/reshard.v1.TrainerService/AttachInference", pb.AttachRequest(address="10.0.0.1:1")),
                            ("/reshard.v1.InferenceService/BeginUpdate", forged)):
            code, details = call("operator", method, req)
            assert code == grpc.StatusCode.PERMISSION_DENIED, (method, code, details)
        code, chunks = call("admin", "/reshard.v1.InferenceService/Dump", pb.DumpRequest(tensor="lm_head.weight"))
        assert code == grpc.StatusCode.OK and chunks[0].version.run == "roles", (code, chunks)
        assert call("peer", "/reshard.v1.InferenceService/AbortUpdate", pb.AbortUpdateRequest(update_id="none"))[0] == \
            grpc.StatusCode.OK
        hello = wpb.WorkerMessage(hello=wpb.Hello(rank=0, world=1, pid=4242, role="trainer", model="tiny"))
        code, details = call("worker", "/reshard.worker.v1.WorkerControl/Attach", hello)
        assert code == grpc.StatusCode.ALREADY_EXISTS, (code, details)  # let in: the rank is held by its live worker
        # Every RPC, from every certificate whose role may not make it: refused, whatever the request.
        refused = 0
        for method in METHOD_ROLES:
            service, name = method.rsplit("/", 1)
            m = next(x.services_by_name[service.split(".")[-1]] for x in (pb.DESCRIPTOR, wpb.DESCRIPTOR)
                     if service[1:] in [s.full_name for s in x.services_by_name.values()]).methods_by_name[name]
            for who in certs:
                if may_call({who}, method):
                    continue
                code, details = call(who, method, GetMessageClass(m.input_type)())
                assert code == grpc.StatusCode.PERMISSION_DENIED and f"needs the {METHOD_ROLES[method]} role" in details, \
                    (method, who, code, details)
                refused += 1
        assert refused >= 2 * len(METHOD_ROLES), refused
        pid = procs[0].pid
        rss0 = _peak_rss_mib(pid)
        begin = "/reshard.v1.InferenceService/BeginUpdate"
        assert call("operator", begin, b"\xff" * 64, raw=True)[0] == grpc.StatusCode.PERMISSION_DENIED  # never parsed
        code, details = call("operator", begin, bytes(60 << 20), raw=True)
        rss1 = _peak_rss_mib(pid)
        print(f"inference controller peak RSS {rss0:.0f} -> {rss1:.0f} MiB across a 60 MiB request from the operator's "
              "certificate")
        assert code == grpc.StatusCode.PERMISSION_DENIED and rss1 - rss0 < 48, (code, details, rss0, rss1)
        assert state() == before
    finally:
        stop_processes(procs)


def _capture_server():
    """A gRPC server that answers nothing (UNIMPLEMENTED) and records each call's method and
    bearer token: any address a controller or a client may be pointed at (an attached one, say)."""
    from concurrent import futures

    seen = []

    class Capture(grpc.GenericRpcHandler):
        def service(self, details):
            md = dict(details.invocation_metadata or ())
            seen.append((details.method, md.get("authorization", "")))
            return None

    server = grpc.server(futures.ThreadPoolExecutor(4), handlers=[Capture()])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}", seen


@pytest.mark.slow  # the quick suite's time: 4-6 s
def test_each_process_sends_and_passes_on_only_its_own_roles_token(pki, tmp_path):
    """A trainer controller that holds every role's token (its --tokens-dir, as docker-compose runs
    it, and a token file) calls inference with the peer token only, even for a call an operator's
    token would do (GetStatus); its standalone workers' environment holds the worker token made for
    them and no other credential; an operator's CLI never sends its token to a call that needs
    another role. The inference address is a recorder of what is sent."""
    d = tmp_path / "tokens"
    d.mkdir()
    for role, t in TOKENS.items():
        (d / f"{role}.token").write_text(t + "\n")
    server, capture, seen = _capture_server()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESHARD_T")}
    tr = f"127.0.0.1:{free_port()}"
    log_path = tmp_path / "trainer.log"
    with open(log_path, "w") as log:
        p = _start(["trainer", "--listen", tr, "--workers", "1", "--model", "tiny", "--inference", capture, "--run", "leak",
                    "--tokens-dir", str(d)], dict(env, RESHARD_TOKEN_FILE=str(pki / "services.tokens"),
                                                  RESHARD_TOKEN_ADMIN=TOKENS["admin"]), log)
    try:
        t0 = time.monotonic()
        while True:
            try:
                with grpc.insecure_channel(tr) as ch:
                    st = rgrpc.TrainerServiceStub(ch).GetStatus(pb.StatusRequest(), timeout=5,
                                                                metadata=[("authorization", f"Bearer {TOKENS['operator']}")])
                if st.workers and st.workers[0].state == "READY" and any(m.endswith("/GetStatus") for m, _ in seen):
                    break
            except grpc.RpcError:
                pass
            assert p.poll() is None and time.monotonic() - t0 < 60, log_path.read_text()[-3000:]
            time.sleep(0.2)
        r = subprocess.run([*module_command("reshard.cli"), "update", "--trainer", tr, "--json", "--timeout", "5",
                            "--token-file", str(d / "operator.token")], env=env, capture_output=True, text=True, timeout=60)
        from_trainer = list(seen)
        assert {m.rsplit("/", 1)[1] for m, _ in from_trainer} >= {"GetStatus", "GetLayout"}, (from_trainer, r.stderr)
        assert {a for _, a in from_trainer} == {f"Bearer {TOKENS['peer']}"}, from_trainer
        environ = open(f"/proc/{st.workers[0].pid}/environ", "rb").read().decode().split("\0")
        creds = dict(v.split("=", 1) for v in environ if v.startswith("RESHARD_TOKEN"))
        assert list(creds) == ["RESHARD_TOKEN_WORKER"] and creds["RESHARD_TOKEN_WORKER"] not in TOKENS.values(), creds
        seen.clear()
        only_operator = tmp_path / "op.tokens"
        only_operator.write_text(f"operator {TOKENS['operator']}\n")
        r = subprocess.run([*module_command("reshard.cli"), "dump", "--inference", capture, "--tensor", "lm_head.weight",
                            "--out", str(tmp_path / "x.pt"), "--token-file", str(only_operator)],
                           env=env, capture_output=True, text=True, timeout=60)
        dumps = [a for m, a in seen if m == "/reshard.v1.InferenceService/Dump"]
        assert r.returncode != 0 and dumps == [""], (seen, r.stderr)  # an operator's token never goes to an admin's call
    finally:
        stop_processes([p])
        server.stop(0)


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
    its certificate gets in; a certificate from another CA, or none, does not."""
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
        mine = ["--tls-cert", str(d / "operator.pem"), "--tls-key", str(d / "operator-key.pem")]
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
    """--mtls --allow-peer NAME, no tokens: a trainer whose client certificate (with the peer role)
    does not carry NAME cannot push (PERMISSION_DENIED, nothing served changes); the named one can.
    The operator triggers with its own certificate."""
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    for who, roles in (("inference", ()), ("trainer-a", ("peer",)), ("trainer-b", ("peer",)), ("operator", ("operator",))):
        key, cert = _issue(ca, who, *roles)
        (tmp_path / f"{who}-key.pem").write_bytes(key)
        (tmp_path / f"{who}.pem").write_bytes(cert)
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
                creds = grpc.ssl_channel_credentials((tmp_path / "ca.pem").read_bytes(),
                                                     (tmp_path / "operator-key.pem").read_bytes(),
                                                     (tmp_path / "operator.pem").read_bytes())
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
                                    "--timeout", "60"], env=env_of("operator"), capture_output=True, text=True, timeout=120)
                if who == "trainer-b":
                    assert r.returncode != 0 and "may not make peer calls here" in r.stdout + r.stderr, r.stdout + r.stderr
                    stop_processes([procs.pop()])
                else:
                    assert r.returncode == 0, r.stderr + log_path.read_text()[-3000:]
                    assert json.loads(r.stdout)["committed"]["run"] == "trainer-a"
    finally:
        stop_processes(procs)


@pytest.mark.slow  # over 6 s: the quick suite keeps under 5 minutes on 2 cores
def test_a_callers_huge_timeout_is_clamped_by_the_server(secure):
    """A peer's BeginUpdate with timeout_s=1e9 whose sources never connect: the inference
    controller's own deadline (--update-timeout 6, then --rpc-timeout 3 for a FinishUpdate) ends it, and the deployment serves what it
    served. (Last in this module: its epoch fences the fixture's trainer out.)"""
    import datetime

    from torch.distributed import TCPStore

    I = rgrpc.InferenceServiceStub
    store = TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    lay = _call(secure.inf, secure.pki, I, "GetLayout", pb.GetLayoutRequest(acquire_epoch=True), TOKENS["peer"])[1]
    served = _call(secure.inf, secure.pki, I, "GetStatus", pb.StatusRequest(), TOKENS["operator"])[1].version
    req = pb.BeginUpdateRequest(update_id="clamp-0", version=pb.Version(run=served.run, step=served.step + 1000),
                                src_layout=lay.layout, plan_digest="?", timeout_s=1e9, epoch=lay.epoch,
                                session=pb.Session(id="clamp", store_host="127.0.0.1", store_port=store.port, src_world=lay.workers,
                                                   dst_world=lay.workers, transport="gloo", key="k" * 32))
    code, details = _call(secure.inf, secure.pki, I, "BeginUpdate", req, TOKENS["peer"])
    m = re.search(r"inference (\w+)", details)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and m, (code, details)
    req.update_id, req.plan_digest = "clamp-1", m.group(1)  # a peer that plans as inference does
    t0 = time.monotonic()
    code, details = _call(secure.inf, secure.pki, I, "BeginUpdate", req, TOKENS["peer"])
    assert code == grpc.StatusCode.OK, (code, details)
    while True:
        st = _call(secure.inf, secure.pki, I, "GetStatus", pb.StatusRequest(), TOKENS["operator"])[1]
        if not st.update_in_progress:
            break
        assert time.monotonic() - t0 < 30, st
        time.sleep(0.2)
    took = time.monotonic() - t0
    print(f"an update asked for timeout_s=1e9 ended after {took:.1f}s (the server's deadline: 6 s, then 3 s for the "
          f"trainer's FinishUpdate): {st.last_error}")
    assert took < 6 + 3 + 6 and st.serving_state == "SERVING" and st.version == served
    log = secure.inf_log.read_text()
    assert "failed after 6." in log and "k" * 32 not in log  # the data plane gave up at 6 s; its secret is not logged


def test_a_controller_refuses_a_run_folder_another_user_could_have_planted(tmp_path):
    """Without XDG_RUNTIME_DIR (containers) the run folder is reshard-UID in the temp dir: one that
    is already there open to others (another local user made it first, and could have planted a run
    file or a socket) stops the controller before it listens, naming the folder and the fix."""
    planted = tmp_path / f"reshard-{os.getuid()}"
    planted.mkdir()
    planted.chmod(0o777)
    (planted / "forged.json").write_text(json.dumps({"worker_token": "w" * 32, "workers": {}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RESHARD_T", "RESHARD_RUN_DIR", "XDG_RUNTIME_DIR"))}
    env["TMPDIR"] = str(tmp_path)
    port = free_port()
    r = subprocess.run([*module_command("reshard.cli"), "inference", "--listen", f"127.0.0.1:{port}", "--workers", "1",
                        "--model", "tiny"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr[-3000:]
    assert f"the run folder {planted} is open to other users (mode 0777)" in r.stderr and "chmod 700" in r.stderr, r.stderr
    assert not _listening(port)
