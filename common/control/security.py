"""Who may call what: TLS on every gRPC server and channel, bearer tokens by role, and the
rule that nothing answers unauthenticated callers off loopback.

Roles (each RPC needs one; `METHOD_ROLES`):

- `operator`: trigger an update, wait for it, read status.
- `admin`: attach and detach deployments, dump weights; an admin token also does what an
  operator's does.
- `peer`: the controller-to-controller calls (layouts, begin/finish/abort an update).
- `worker`: a worker's stream to its controller.

Tokens are read from a file (`--token-file`, or RESHARD_TOKEN_FILE: lines of `role token`,
`#` comments) or from RESHARD_TOKEN_OPERATOR / _ADMIN / _PEER / _WORKER, never from the
command line. A server that holds tokens checks every call's `authorization: Bearer` header
against them in constant time; a client sends, for each call, the token of the role that call
needs. TLS (`--tls-cert`, `--tls-key`, `--tls-ca`, or RESHARD_TLS_CERT / _KEY / _CA) uses grpc's
own credentials; `--mtls` (RESHARD_MTLS=1) makes a server require client certificates signed by
its CA. With mutual TLS a client certificate carries roles too: each URI SAN `reshard-role:ROLE`
(`reshard certs` writes one certificate per role), and a caller holds its token's roles and its
certificate's; a certificate without one holds none. Plaintext is for loopback: a server asked to
listen elsewhere without TLS, or with TLS but neither tokens nor client certificates, refuses to
start unless `--insecure` is given (and then says so at every start)."""

from __future__ import annotations

import dataclasses
import hmac
import inspect
import ipaddress
import logging
import os

import grpc

log = logging.getLogger("reshard.security")

ROLES = ("operator", "admin", "peer", "worker")
ENV_FILES = {"cert": "RESHARD_TLS_CERT", "key": "RESHARD_TLS_KEY", "ca": "RESHARD_TLS_CA"}

METHOD_ROLES = {
    "/reshard.v1.TrainerService/TriggerUpdate": "operator",
    "/reshard.v1.TrainerService/WaitForVersion": "operator",
    "/reshard.v1.TrainerService/GetStatus": "operator",
    "/reshard.v1.TrainerService/AttachInference": "admin",
    "/reshard.v1.TrainerService/DetachInference": "admin",
    "/reshard.v1.InferenceService/GetLayout": "peer",
    "/reshard.v1.InferenceService/BeginUpdate": "peer",
    "/reshard.v1.InferenceService/FinishUpdate": "peer",
    "/reshard.v1.InferenceService/AbortUpdate": "peer",
    "/reshard.v1.InferenceService/GetStatus": "operator",
    "/reshard.v1.InferenceService/Dump": "admin",
    "/reshard.worker.v1.WorkerControl/Attach": "worker",
}
# Roles that may also make a call besides METHOD_ROLES' (and an admin where an operator may): the
# trainer controller reads inference's status with the one credential it holds, the peer's.
ALSO_ROLES = {"/reshard.v1.InferenceService/GetStatus": ("peer",)}
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")  # liveness and the schema: no weights
ROLE_URI = "reshard-role:"  # a client certificate's role: a URI SAN reshard-role:ROLE

_MIB = 1 << 20
# The largest request each method takes, in serialized bytes. A bigger one is refused with
# RESOURCE_EXHAUSTED before it is parsed. gRPC has no per-method receive limit: each server's
# transport limit (`receive_limit`) is the largest of its methods', and gRPC refuses a message over
# it from the length its frame declares, before buffering it; a smaller method's limit is checked
# once the message is read. The largest control message measured is 1.4 MB (DeepSeek-V3, 128 -> 128
# ranks, docs/design.md): 64 MiB leaves a wide margin.
METHOD_LIMITS = {
    "/reshard.v1.TrainerService/TriggerUpdate": _MIB,  # tensor name patterns
    "/reshard.v1.InferenceService/BeginUpdate": 64 * _MIB,  # the source layout (columns, compressed)
    "/reshard.v1.InferenceService/FinishUpdate": 64 * _MIB,  # 4 to 8 bytes of checksum per piece
    "/reshard.worker.v1.WorkerControl/Attach": 64 * _MIB,  # a rank's layout; a rank's checksums
}
DEFAULT_LIMIT = 64 << 10  # every other request: an address, a version, a tensor name


def receive_limit(services=None) -> int:
    """The transport's receive limit of a server that serves `services` (full names; None: all of
    ours): the largest request any of their methods takes."""
    return max(METHOD_LIMITS.get(m, DEFAULT_LIMIT) for m in METHOD_ROLES
               if services is None or m[1:].rsplit("/", 1)[0] in services)


class SecurityError(ValueError):
    """A configuration that would expose weights, or one that cannot be read."""


def satisfies(held: set[str], needed: str) -> bool:
    return needed in held or (needed == "operator" and "admin" in held)


def callers(method: str) -> tuple[str, ...]:
    """The roles that may make `method`'s call, in the order a client prefers to send them."""
    needed = METHOD_ROLES.get(method)
    if needed is None:
        return ()
    return (needed, *(("admin",) if needed == "operator" else ()), *ALSO_ROLES.get(method, ()))


def may_call(held: set[str], method: str) -> bool:
    return any(r in held for r in callers(method))


def certificate_roles(auth_context: dict) -> set[str]:
    """The roles a client certificate carries (gRPC's auth context of a call): its URI SANs
    `reshard-role:ROLE`. gRPC lists a certificate's URIs (`peer_uri`) apart from its DNS names and
    e-mail addresses, so no other kind of name, nor its common name, can pose as a role."""
    uris = (v.decode(errors="replace") if isinstance(v, bytes) else str(v) for v in auth_context.get("peer_uri", ()))
    return {u[len(ROLE_URI):] for u in uris if u.startswith(ROLE_URI) and u[len(ROLE_URI):] in ROLES}


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def read_tokens(path: str) -> dict[str, list[str]]:
    """A token file: one `role token` per line, or a single bare token (a client's file, as
    `reshard certs` writes them: its role is the server's to know, keyed ""); blank lines and
    `#` comments are skipped."""
    tokens: dict[str, list[str]] = {}
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise SecurityError(f"cannot read the token file {path}: {e.strerror}") from None
    for n, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) == 1:
            parts = ["", parts[0]]
        elif len(parts) != 2 or parts[0] not in ROLES:
            raise SecurityError(f"{path}:{n}: expected a token, or `role token` with a role among {', '.join(ROLES)}")
        if len(parts[1]) < 16:
            raise SecurityError(f"{path}:{n}: a token must have at least 16 characters")
        tokens.setdefault(parts[0], []).append(parts[1])
    return tokens


def read_tokens_dir(path: str) -> list[tuple[str, str]]:
    """The tokens a server accepts, one file per role: DIR/operator.token, admin.token, peer.token,
    worker.token (those present)."""
    if not os.path.isdir(path):
        raise SecurityError(f"--tokens-dir {path} is not a directory")
    out = []
    for role in ROLES:
        f = os.path.join(path, f"{role}.token")
        if os.path.exists(f):
            out += [(role, t) for ts in read_tokens(f).values() for t in ts]
    if not out:
        raise SecurityError(f"--tokens-dir {path} holds none of {', '.join(r + '.token' for r in ROLES)}")
    return out


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise SecurityError(f"cannot read the TLS {what} {path}: {e.strerror}") from None


@dataclasses.dataclass(frozen=True)
class Security:
    """One process's credentials: its TLS files and the tokens it accepts (as a server) and
    sends (as a client)."""

    cert: str = ""
    key: str = ""
    ca: str = ""
    mtls: bool = False
    insecure: bool = False
    token_file: str = ""
    tokens: tuple[tuple[str, str], ...] = ()  # (role, token)
    allow_peers: tuple[str, ...] = ()  # with mutual TLS: the certificate names (CN or SAN) a peer call may come from
    client_roles: tuple[str, ...] | None = None  # the roles whose tokens it sends as a client (None: any it holds)

    @classmethod
    def from_env(cls, **override) -> "Security":
        """Credentials from RESHARD_TLS_* / RESHARD_MTLS / RESHARD_TOKEN_FILE / RESHARD_TOKEN_<ROLE>,
        with `override` (a command's flags, where given) taking precedence."""
        env = {k: os.environ.get(v, "") for k, v in ENV_FILES.items()}
        kw = {"cert": env["cert"], "key": env["key"], "ca": env["ca"], "mtls": os.environ.get("RESHARD_MTLS", "") == "1",
              "token_file": os.environ.get("RESHARD_TOKEN_FILE", ""), "insecure": os.environ.get("RESHARD_INSECURE", "") == "1",
              "allow_peers": tuple(p for p in os.environ.get("RESHARD_ALLOW_PEERS", "").split(",") if p.strip())}
        kw.update({k: v for k, v in override.items() if v})
        tokens = [(role, t) for role, ts in (read_tokens(kw["token_file"]).items() if kw["token_file"] else ()) for t in ts]
        tokens_dir = kw.pop("tokens_dir", "") or os.environ.get("RESHARD_TOKENS_DIR", "")
        if tokens_dir:
            tokens += read_tokens_dir(tokens_dir)
        tokens += [(role, os.environ[f"RESHARD_TOKEN_{role.upper()}"]) for role in ROLES
                   if os.environ.get(f"RESHARD_TOKEN_{role.upper()}")]
        s = cls(tokens=tuple(tokens), **kw)
        s.check()
        return s

    def check(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise SecurityError("--tls-cert and --tls-key go together")
        if self.mtls and not (self.ca and self.cert):
            raise SecurityError("--mtls needs --tls-ca (the CA that signs client certificates) and a server certificate")
        if self.allow_peers and not self.mtls:
            raise SecurityError("--allow-peer needs --mtls: a peer's identity is the name in its client certificate")

    def check_peer(self, auth_context: dict) -> str:
        """'' when a peer call with this gRPC auth context may proceed; else why not."""
        if not self.allow_peers:
            return ""
        names = [v.decode(errors="replace") if isinstance(v, bytes) else str(v)
                 for k in ("x509_common_name", "x509_subject_alternative_name") for v in auth_context.get(k, ())]
        if any(n in self.allow_peers for n in names):
            return ""
        return (f"certificate {', '.join(names) or '(none)'} may not make peer calls here; "
                f"allowed: {', '.join(self.allow_peers)} (--allow-peer)")

    @property
    def tls(self) -> bool:
        return bool(self.cert or self.ca)

    def for_workers(self, worker_tokens) -> "Security":
        """The credentials of a controller's worker listener: its TLS, and its tokens plus those in
        `worker_tokens` (a secret made for its own workers). Only the worker role may attach there
        (METHOD_ROLES); other roles' tokens are known so that a refusal says which role it lacks."""
        tokens = tuple(dict.fromkeys([*self.tokens, *(("worker", t) for t in worker_tokens)]))
        return dataclasses.replace(self, tokens=tokens, allow_peers=())

    def token(self, role: str) -> str:
        """The token this process sends for a call that needs `role`: one of that role (an admin's
        for an operator's call) among its client roles, else a bare token (a client's file as
        `reshard certs` writes it: its role is the server's to know); never one of another role
        ('' when it holds none: the server then says which role the call needs)."""
        return self._first((role, "admin") if role == "operator" else (role,))

    def token_for(self, method: str) -> str:
        """The token this process sends with a call of `method`: one of a role that may make it."""
        return self._first(callers(method))

    def _first(self, roles) -> str:
        mine = self.client_roles if self.client_roles is not None else _client_roles
        for want in roles:
            if mine is not None and want not in mine:
                continue
            for r, t in self.tokens:
                if r == want:
                    return t
        if mine is None:
            return next((t for r, t in self.tokens if r == ""), "")
        return ""

    # -- servers ------------------------------------------------------------------------
    def check_listen(self, host: str, what: str, warn: bool = True) -> None:
        """Refuse a listen address that would answer unauthenticated callers off loopback (with
        --insecure, allow it and warn, unless `warn` is False: the server warns when it starts)."""
        if is_loopback(host):
            return
        if not self.cert:
            problem = "without TLS (--tls-cert, --tls-key)"
        elif not self.tokens and not self.mtls:
            problem = "with TLS but neither tokens (--token-file) nor client certificates (--mtls)"
        else:
            return
        if self.insecure:
            if warn:
                log.warning("%s listens on %s %s (--insecure): anyone who reaches it can read and replace the weights",
                            what, host, problem)
            return
        raise SecurityError(f"refusing to listen on {host} {problem}: anyone who reaches it could read or replace the "
                            "weights; configure them, listen on loopback, or pass --insecure on a network you trust")

    def add_port(self, server: grpc.aio.Server, listen: str) -> int:
        if not self.cert:
            return server.add_insecure_port(listen)
        creds = grpc.ssl_server_credentials([(_read(self.key, "key"), _read(self.cert, "certificate"))],
                                            root_certificates=_read(self.ca, "CA") if self.mtls else None,
                                            require_client_auth=self.mtls)
        return server.add_secure_port(listen, creds)

    def interceptors(self, tls_port: bool = True) -> list:
        """The server interceptor that checks each call's roles: those of its token, and with mutual
        TLS on a TLS port (`tls_port`; a worker listener's Unix socket is not one) those of its
        client certificate. None when this server holds neither tokens nor client certificates."""
        certificates = self.mtls and bool(self.cert) and tls_port
        return [AuthInterceptor(self.tokens, certificates)] if self.tokens or certificates else []

    # -- clients ------------------------------------------------------------------------
    def channel(self, addr: str, options) -> grpc.aio.Channel:
        interceptors = [k(self) for k in (_UnaryUnaryToken, _UnaryStreamToken, _StreamUnaryToken, _StreamStreamToken)] \
            if self.tokens else None
        if not self.tls or addr.startswith("unix:"):  # a worker listener's Unix socket is plaintext: its folder is private
            return grpc.aio.insecure_channel(addr, options=options, interceptors=interceptors)
        creds = grpc.ssl_channel_credentials(root_certificates=_read(self.ca, "CA") if self.ca else None,
                                             private_key=_read(self.key, "key") if self.key else None,
                                             certificate_chain=_read(self.cert, "certificate") if self.cert else None)
        return grpc.aio.secure_channel(addr, creds, options=options, interceptors=interceptors)


_client_roles: tuple[str, ...] | None = None  # this process's, as a client (set_client_roles)


def set_client_roles(roles: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """The roles whose tokens this process sends as a client, whatever else it holds (None: any).
    A controller accepts every role's token but calls as one role only: the trainer controller as
    a peer, the inference controller as none. Returns the previous setting."""
    global _client_roles
    old, _client_roles = _client_roles, (tuple(roles) if roles is not None else None)
    return old


TOKEN_ENV_PREFIX = "RESHARD_TOKEN"  # RESHARD_TOKEN_<ROLE>, RESHARD_TOKEN_FILE, RESHARD_TOKENS_DIR


def worker_environ(environ, worker_token: str) -> dict[str, str]:
    """The environment of a standalone worker: its controller's, less every credential variable
    (each role's token, the token file and folder), plus RESHARD_TOKEN_WORKER, the one credential
    a worker needs."""
    env = {k: v for k, v in environ.items() if not k.startswith(TOKEN_ENV_PREFIX)}
    if worker_token:
        env["RESHARD_TOKEN_WORKER"] = worker_token
    return env


_ENV_KEYS = (*ENV_FILES.values(), "RESHARD_MTLS", "RESHARD_TOKEN_FILE", "RESHARD_TOKENS_DIR", "RESHARD_INSECURE",
             "RESHARD_ALLOW_PEERS",
             *(f"RESHARD_TOKEN_{r.upper()}" for r in ROLES))
_current: tuple[tuple, Security] | None = None


def current() -> Security:
    """This process's credentials from its environment (read again when the environment changes)."""
    global _current
    key = tuple(os.environ.get(k, "") for k in _ENV_KEYS)
    if _current is None or _current[0] != key:
        _current = (key, Security.from_env())
    return _current[1]


FLAG_ENV = {"tls_cert": "RESHARD_TLS_CERT", "tls_key": "RESHARD_TLS_KEY", "tls_ca": "RESHARD_TLS_CA",
            "token_file": "RESHARD_TOKEN_FILE", "tokens_dir": "RESHARD_TOKENS_DIR"}


def _bearer(metadata) -> str:
    for k, v in metadata or ():
        if k == "authorization":
            v = v.decode() if isinstance(v, bytes) else v
            return v[7:].strip() if v.lower().startswith("bearer ") else ""
    return ""


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks each call against the role its method needs (METHOD_ROLES). A caller holds the roles of
    its bearer token and, with `certificates` (mutual TLS), those its client certificate carries
    (`certificate_roles`). A call refused runs nothing and its request is never read: without a
    credential, or with a token the server does not know, UNAUTHENTICATED; with credentials that
    lack the role (a client certificate authenticates its caller), PERMISSION_DENIED."""

    def __init__(self, tokens: tuple[tuple[str, str], ...], certificates: bool = False) -> None:
        self._tokens = [(role, t.encode()) for role, t in tokens]
        self.certificates = certificates

    def roles_of(self, token: str) -> set[str]:
        got = token.encode()
        held = set()
        for role, t in self._tokens:  # every comparison runs, in constant time
            if hmac.compare_digest(got, t):
                held.add(role)
        return held

    async def intercept_service(self, continuation, details):
        method = details.method
        if method.startswith(OPEN_PREFIXES):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None
        if method not in METHOD_ROLES:
            return _refuse(handler, grpc.StatusCode.PERMISSION_DENIED, f"{method} is not open to any role")
        token = _bearer(details.invocation_metadata)
        by_token = self.roles_of(token) if token else set()
        if may_call(by_token, method):
            return handler
        if not self.certificates:
            return _refuse(handler, *self.refusal(method, token, by_token))
        # The client certificate is in the call's auth context, which only a handler sees.
        return _admitted(handler, lambda context: self.refusal(
            method, token, by_token, certificate_roles(context.auth_context())))

    def refusal(self, method: str, token: str, by_token: set[str], by_certificate: set[str] | None = None):
        """(status, message) refusing `method` to a caller with these credentials, or None when
        they may make it. `by_certificate` None: the server takes no roles from certificates."""
        if may_call(by_token | (by_certificate or set()), method):
            return None
        needed = METHOD_ROLES[method]
        if token and not by_token:
            return grpc.StatusCode.UNAUTHENTICATED, "the bearer token is not known here"
        if by_certificate is None:
            if not token:
                return (grpc.StatusCode.UNAUTHENTICATED,
                        f"{method} needs a bearer token of the {needed} role (authorization metadata)")
            return (grpc.StatusCode.PERMISSION_DENIED,
                    f"{method} needs the {needed} role; the token holds {', '.join(sorted(by_token))}")
        sent = f"its token holds {', '.join(sorted(by_token))}" if token else "no token was sent"
        return (grpc.StatusCode.PERMISSION_DENIED,
                f"{method} needs the {needed} role (a client certificate with the URI SAN {ROLE_URI}{needed}, or a "
                f"bearer token of the role); the caller's certificate holds {', '.join(sorted(by_certificate)) or 'no role'} "
                f"and {sent}")


class _Refused:
    """What a request that may not be parsed becomes: the handler aborts with its status."""

    __slots__ = ("code", "message")

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        self.code, self.message = code, message


class LimitInterceptor(grpc.aio.ServerInterceptor):
    """Each method's request size limit (METHOD_LIMITS), and a clear INVALID_ARGUMENT for a request
    that does not parse (grpc's own answer is INTERNAL)."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        return _limited(handler, details.method, METHOD_LIMITS.get(details.method, DEFAULT_LIMIT))


def _limited(handler, method: str, limit: int):
    deserialize = handler.request_deserializer

    def checked(data: bytes):
        if len(data) > limit:
            return _Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"{method}: a request of {len(data)} bytes is over this method's limit of {limit} bytes")
        try:
            return deserialize(data) if deserialize else data
        except Exception as e:  # noqa: BLE001 - whatever the parser says, the caller sent it
            return _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: the request does not parse ({e})")

    async def requests(it, context):
        async for r in it:
            if isinstance(r, _Refused):
                await context.abort(r.code, r.message)
            yield r

    def wrap(behavior, request_streaming: bool, response_streaming: bool):
        async def first(request, context):
            if request_streaming:
                return requests(request, context)
            if isinstance(request, _Refused):
                await context.abort(request.code, request.message)
            return request

        if response_streaming and inspect.isasyncgenfunction(behavior):
            async def gen(request, context):
                async for r in behavior(await first(request, context), context):
                    yield r
            return gen

        async def call(request, context):
            return await behavior(await first(request, context), context)
        return call

    rs, ss = handler.request_streaming, handler.response_streaming
    behavior = {(True, True): handler.stream_stream, (True, False): handler.stream_unary,
                (False, True): handler.unary_stream, (False, False): handler.unary_unary}[rs, ss]
    return _handler_like(handler, wrap(behavior, rs, ss), checked)


def _refuse(handler, code: grpc.StatusCode, message: str):
    """A handler that aborts with `code` without reading the request: a refused caller's message is
    never received whole, let alone parsed (a handler that takes a single request would be given it
    only once it had all arrived). The wire is the same for every kind of call, so a handler that
    takes a stream of requests answers a unary call as well."""
    async def refuse(requests, context):
        await context.abort(code, message)
        yield  # pragma: no cover - never reached: abort raises

    return grpc.stream_stream_rpc_method_handler(refuse, request_deserializer=None,
                                                 response_serializer=handler.response_serializer)


def _admitted(handler, refusal):
    """`handler`, run only once `refusal(context)` (a (status, message) or None) lets its call in;
    a refused call is aborted before its request is read. gRPC reads a single request whole before
    it calls a handler that takes one, so the returned handler takes a stream of requests (the
    wire is the same), checks, and only then reads: the one request of a unary method, or passes
    the stream on."""
    rs, ss = handler.request_streaming, handler.response_streaming
    behavior = {(True, True): handler.stream_stream, (True, False): handler.stream_unary,
                (False, True): handler.unary_stream, (False, False): handler.unary_unary}[rs, ss]

    async def admit(requests, context):
        refused = refusal(context)
        if refused:
            await context.abort(*refused)
        if rs:
            return requests
        async for request in requests:
            return request
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a unary call without its request")

    if ss and inspect.isasyncgenfunction(behavior):
        async def gen(requests, context):
            async for r in behavior(await admit(requests, context), context):
                yield r
        wrapped = gen
    else:
        async def call(requests, context):
            return await behavior(await admit(requests, context), context)
        wrapped = call
    make = grpc.stream_stream_rpc_method_handler if ss else grpc.stream_unary_rpc_method_handler
    return make(wrapped, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)


def _handler_like(handler, behavior, request_deserializer):
    """A method handler of `handler`'s kind (streaming requests, responses) running `behavior`."""
    make = {(True, True): grpc.stream_stream_rpc_method_handler, (True, False): grpc.stream_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler, (False, False): grpc.unary_unary_rpc_method_handler}
    return make[handler.request_streaming, handler.response_streaming](
        behavior, request_deserializer=request_deserializer, response_serializer=handler.response_serializer)


class _BearerToken:
    """Adds the token of the role each call needs (METHOD_ROLES) to its metadata."""

    def __init__(self, security: Security) -> None:
        self.security = security

    def _details(self, d):
        method = d.method.decode() if isinstance(d.method, bytes) else d.method
        token = self.security.token_for(method)
        if not token:
            return d
        md = grpc.aio.Metadata(*(tuple(d.metadata) if d.metadata else ()), ("authorization", f"Bearer {token}"))
        return grpc.aio.ClientCallDetails(d.method, d.timeout, md, d.credentials, d.wait_for_ready)


# grpc.aio files each interceptor under one kind of call only: one class per kind.
class _UnaryUnaryToken(_BearerToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _UnaryStreamToken(_BearerToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _StreamUnaryToken(_BearerToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


class _StreamStreamToken(_BearerToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)
