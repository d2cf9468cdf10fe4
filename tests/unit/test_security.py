"""Credentials and roles (common/control/security.py), without a network."""

import dataclasses

import pytest

from reshard.common.control.security import (
    METHOD_ROLES,
    ROLES,
    AuthInterceptor,
    Security,
    SecurityError,
    certificate_roles,
    is_loopback,
    may_call,
    read_tokens,
    satisfies,
    set_client_roles,
    worker_environ,
)
from reshard.common.layout.wire import layout_from_bytes
from reshard.proto import reshard_pb2 as pb
from reshard.proto import worker_pb2 as wpb


def test_every_rpc_states_its_role():
    methods = {f"/{s.full_name}/{m.name}" for d in (pb.DESCRIPTOR, wpb.DESCRIPTOR)
               for s in d.services_by_name.values() for m in s.methods}
    assert methods == set(METHOD_ROLES)


def test_roles():
    assert satisfies({"admin"}, "operator") and satisfies({"operator"}, "operator")
    assert not satisfies({"operator"}, "admin") and not satisfies({"admin"}, "peer") and not satisfies({"peer"}, "worker")


def test_token_file(tmp_path):
    f = tmp_path / "t"
    f.write_text("# ops\noperator aaaaaaaaaaaaaaaaaaaa\n\nadmin bbbbbbbbbbbbbbbbbbbb  # the admins\npeer cccccccccccccccc\n")
    assert read_tokens(str(f)) == {"operator": ["a" * 20], "admin": ["b" * 20], "peer": ["c" * 16]}
    f.write_text("root aaaaaaaaaaaaaaaaaaaa\n")
    with pytest.raises(SecurityError, match=":1: expected a token, or `role token`"):
        read_tokens(str(f))
    f.write_text("peer short\n")
    with pytest.raises(SecurityError, match="at least 16 characters"):
        read_tokens(str(f))
    with pytest.raises(SecurityError, match="cannot read the token file"):
        read_tokens(str(tmp_path / "missing"))


def test_a_client_sends_the_token_of_the_role_a_call_needs_and_no_other():
    s = Security(tokens=(("operator", "o" * 20), ("admin", "a" * 20)))
    assert s.token("operator") == "o" * 20 and s.token("admin") == "a" * 20
    assert Security(tokens=(("admin", "a" * 20),)).token("operator") == "a" * 20
    assert s.token("peer") == ""  # never another role's token: the server says which role the call needs
    assert Security().token("peer") == ""
    op = Security(tokens=(("operator", "o" * 20),))
    assert op.token_for("/reshard.v1.InferenceService/Dump") == ""  # an operator's token never goes to an admin call
    assert op.token_for("/reshard.v1.InferenceService/GetStatus") == "o" * 20
    assert Security(tokens=(("", "b" * 20),)).token_for("/reshard.v1.InferenceService/Dump") == "b" * 20  # a bare token
    # A controller holds (accepts) every role's token but calls as one: the trainer as a peer.
    every = Security(tokens=tuple((r, r[0] * 20) for r in ROLES))
    trainer = dataclasses.replace(every, client_roles=("peer",))
    assert trainer.token_for("/reshard.v1.InferenceService/GetStatus") == "p" * 20
    assert trainer.token_for("/reshard.v1.InferenceService/BeginUpdate") == "p" * 20
    assert trainer.token_for("/reshard.v1.InferenceService/Dump") == "" and trainer.token("operator") == ""
    assert dataclasses.replace(every, client_roles=()).token_for("/reshard.v1.InferenceService/GetStatus") == ""
    old = set_client_roles(("peer",))  # what serve_controller sets for a trainer controller's process
    try:
        assert every.token_for("/reshard.v1.InferenceService/GetStatus") == "p" * 20
        assert every.token_for("/reshard.v1.TrainerService/GetStatus") == ""
    finally:
        set_client_roles(old)
    assert may_call({"peer"}, "/reshard.v1.InferenceService/GetStatus")
    assert not may_call({"peer"}, "/reshard.v1.TrainerService/GetStatus") and not may_call({"peer"}, "/reshard.v1.InferenceService/Dump")


def test_a_worker_gets_only_the_worker_token_in_its_environment():
    env = {"PATH": "/bin", "RESHARD_TLS_CA": "ca.pem", "RESHARD_TOKEN_ADMIN": "a" * 20, "RESHARD_TOKEN_PEER": "p" * 20,
           "RESHARD_TOKEN_WORKER": "configured" * 2, "RESHARD_TOKEN_FILE": "/x/all.tokens", "RESHARD_TOKENS_DIR": "/x"}
    assert worker_environ(env, "w" * 32) == {"PATH": "/bin", "RESHARD_TLS_CA": "ca.pem", "RESHARD_TOKEN_WORKER": "w" * 32}


def test_server_matches_tokens_to_roles():
    auth = AuthInterceptor((("operator", "o" * 20), ("peer", "p" * 20), ("peer", "q" * 20)))
    assert auth.roles_of("o" * 20) == {"operator"}
    assert auth.roles_of("q" * 20) == {"peer"}
    assert auth.roles_of("o" * 19) == set() and auth.roles_of("") == set()


def test_a_certificates_roles_are_its_reshard_role_uris_only():
    """gRPC's auth context lists a certificate's URI SANs apart (peer_uri): a DNS name, an e-mail
    address or a common name spelled like a role is none."""
    ctx = {"peer_uri": [b"reshard-role:admin", b"reshard-role:root", b"spiffe://x/reshard-role:peer"],
           "peer_dns": [b"reshard-role:peer"], "peer_email": [b"reshard-role:worker@x"],
           "x509_common_name": [b"reshard-role:operator"],
           "x509_subject_alternative_name": [b"reshard-role:admin", b"reshard-role:peer", b"reshard-role:worker@x"]}
    assert certificate_roles(ctx) == {"admin"}
    assert certificate_roles({}) == set() and certificate_roles({"peer_uri": [b"reshard-role:"]}) == set()


def test_roles_come_from_the_token_and_with_mutual_tls_the_certificate():
    """A caller holds its token's roles and, on a server with mutual TLS, its certificate's: a role
    from either lets it in; a certificate without the role is PERMISSION_DENIED, with or without a
    token; an unknown token is UNAUTHENTICATED unless the certificate holds the role."""
    import grpc

    auth = AuthInterceptor((("operator", "o" * 20),), certificates=True)
    dump, status = "/reshard.v1.InferenceService/Dump", "/reshard.v1.InferenceService/GetStatus"
    assert auth.refusal(dump, "", set(), {"admin"}) is None
    assert auth.refusal(status, "", set(), {"admin"}) is None  # an admin may do what an operator may
    assert auth.refusal(status, "o" * 20, {"operator"}, set()) is None
    assert auth.refusal(dump, "x" * 20, set(), {"admin"}) is None
    code, why = auth.refusal(dump, "", set(), {"operator"})
    assert code == grpc.StatusCode.PERMISSION_DENIED and "reshard-role:admin" in why and "holds operator" in why, why
    code, why = auth.refusal(dump, "", set(), set())
    assert code == grpc.StatusCode.PERMISSION_DENIED and "no role" in why and "no token was sent" in why, why
    assert auth.refusal(dump, "o" * 20, {"operator"}, {"peer"})[0] == grpc.StatusCode.PERMISSION_DENIED
    assert auth.refusal(dump, "x" * 20, set(), set())[0] == grpc.StatusCode.UNAUTHENTICATED
    # Without mutual TLS, tokens alone, as before.
    assert auth.refusal(dump, "", set())[0] == grpc.StatusCode.UNAUTHENTICATED
    assert auth.refusal(dump, "o" * 20, {"operator"})[0] == grpc.StatusCode.PERMISSION_DENIED


def test_mutual_tls_checks_roles_on_tls_ports_with_or_without_tokens():
    mtls = Security(cert="c", key="k", ca="a", mtls=True)
    [auth] = mtls.interceptors()
    assert auth.certificates
    assert mtls.interceptors(tls_port=False) == []  # a worker listener's Unix socket: no certificates there
    [auth] = dataclasses.replace(mtls, tokens=(("worker", "w" * 20),)).interceptors(tls_port=False)
    assert not auth.certificates
    assert Security(cert="c", key="k").interceptors() == []  # loopback without credentials: nothing to check
    assert not Security(cert="c", key="k", tokens=(("peer", "p" * 20),)).interceptors()[0].certificates


def test_listen_rule():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.1.2.3")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("example.com")
    Security().check_listen("127.0.0.1", "x")
    with pytest.raises(SecurityError, match="without TLS"):
        Security().check_listen("0.0.0.0", "x")
    with pytest.raises(SecurityError, match="neither tokens"):
        Security(cert="c", key="k").check_listen("10.0.0.1", "x")
    Security(cert="c", key="k", tokens=(("peer", "p" * 20),)).check_listen("10.0.0.1", "x")
    Security(cert="c", key="k", ca="a", mtls=True).check_listen("10.0.0.1", "x")
    Security(insecure=True).check_listen("0.0.0.0", "x")  # allowed, with a warning


def test_inconsistent_flags_are_refused(monkeypatch):
    for k in ("RESHARD_TLS_CERT", "RESHARD_TLS_KEY", "RESHARD_TLS_CA", "RESHARD_MTLS", "RESHARD_TOKEN_FILE"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(SecurityError, match="go together"):
        Security.from_env(cert="c.pem")
    with pytest.raises(SecurityError, match="--mtls needs --tls-ca"):
        Security.from_env(cert="c.pem", key="k.pem", mtls=True)
    monkeypatch.setenv("RESHARD_TOKEN_WORKER", "w" * 20)
    assert Security.from_env().token("worker") == "w" * 20


def test_a_layout_that_inflates_past_the_limit_is_refused_before_it_takes_the_memory():
    """The wire form declares its inflated size: above the limit it is refused before anything is
    inflated; one that lies about its size is stopped at the size it declared."""
    import resource
    import zlib

    from reshard.common.layout.columns import MAX_INFLATED, WIRE_MAGIC
    from reshard.common.layout.core import LayoutError

    z = zlib.compressobj(1)
    zero = bytes(64 << 20)
    stream = b"".join(z.compress(zero) for _ in range(5)) + z.flush()  # 320 MiB of zeros in a few MB
    assert len(stream) < 8 << 20
    honest = WIRE_MAGIC + (320 << 20).to_bytes(8, "little") + stream
    lying = WIRE_MAGIC + (1 << 20).to_bytes(8, "little") + stream
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(LayoutError, match=f"declares {320 << 20} bytes inflated, over the limit of {MAX_INFLATED >> 20} MiB"):
        layout_from_bytes(honest)
    with pytest.raises(LayoutError, match="inflates past the 1048576 bytes it declares"):
        layout_from_bytes(lying)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    print(f"peak RSS grew {grown_mib:.0f} MiB refusing a 320 MiB decompression bomb")
    assert grown_mib < 64, grown_mib  # never the 320 MiB; not even the limit
    with pytest.raises(LayoutError, match="older reshard version"):
        layout_from_bytes(b"RSL2c" + stream)


def test_callers_timeouts_are_clamped_by_the_server():
    from reshard.common.control.rpc import clamp_timeout

    assert clamp_timeout(1e9, 120.0, 120.0) == 120.0  # a timeout_s of 1e9 must not pin the data plane
    assert clamp_timeout(30.0, 120.0, 120.0) == 30.0
    assert clamp_timeout(0.0, 120.0, 120.0) == 120.0 and clamp_timeout(-5.0, 240.0, 86400.0) == 240.0


def test_peer_identities():
    s = Security(cert="c", key="k", ca="a", mtls=True, allow_peers=("trainer-a",))
    assert s.check_peer({"x509_common_name": [b"trainer-a"]}) == ""
    assert s.check_peer({"x509_subject_alternative_name": [b"127.0.0.1", b"trainer-a"]}) == ""
    assert "may not make peer calls" in s.check_peer({"x509_common_name": [b"trainer-b"]})
    assert "(none)" in s.check_peer({})
    assert Security().check_peer({}) == ""  # no list: any caller the CA signed (and the token allows)
    with pytest.raises(SecurityError, match="--allow-peer needs --mtls"):
        Security(allow_peers=("x",)).check()


def test_a_run_folder_others_may_enter_is_refused(tmp_path, monkeypatch):
    """The run folder (worker sockets, run files with the workers' token) must be the user's own
    with mode 0700: one another user made first, or one open to others, is refused by name with the
    fix; a missing one is made 0700 whatever the umask."""
    import os

    from reshard.common.control.supervisor import RunDirError, check_run_dir, run_dir, run_file

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(RunDirError, match=f"run folder {shared} is open to other users \\(mode 0777\\).*chmod 700"):
        check_run_dir(str(shared))
    shared.chmod(0o750)  # group may read: the run file holds the workers' token
    with pytest.raises(RunDirError, match="mode 0750"):
        check_run_dir(str(shared))
    shared.chmod(0o700)
    assert check_run_dir(str(shared)) == str(shared)
    with pytest.raises(RunDirError, match=f"belongs to uid {os.getuid()}, not to this user \\(uid {os.getuid() + 1}\\)"):
        check_run_dir(str(shared), uid=os.getuid() + 1)  # as another user would see ours
    (tmp_path / "file").write_text("")
    with pytest.raises(RunDirError, match="not a directory"):
        check_run_dir(str(tmp_path / "file"))
    old = os.umask(0o022)
    try:
        fresh = tmp_path / "fresh" / "run"
        assert check_run_dir(str(fresh)) == str(fresh)
    finally:
        os.umask(old)
    assert fresh.stat().st_mode & 0o777 == 0o700
    # The fallback used when XDG_RUNTIME_DIR is unset (containers): reshard-UID in the temp dir.
    monkeypatch.delenv("RESHARD_RUN_DIR", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    planted = tmp_path / f"reshard-{os.getuid()}"
    planted.mkdir(mode=0o777)
    planted.chmod(0o777)
    with pytest.raises(RunDirError, match=str(planted)):
        run_file("trainer", "127.0.0.1:1")
    planted.rmdir()
    assert run_file("trainer", "127.0.0.1:1") == str(planted / "trainer-127.0.0.1_1.json")
    assert planted.stat().st_mode & 0o777 == 0o700 and run_dir() == str(planted)
