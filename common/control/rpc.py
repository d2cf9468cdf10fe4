"""gRPC plumbing shared by the services: servers with health and reflection,
channels, addresses, deadlines, and running our own processes on uvloop."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger("reshard.rpc")

MAX_MESSAGE_BYTES = 256 << 20  # layouts of large models; raised on purpose
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # A restarted peer is reached within 2 s: gRPC's reconnect backoff otherwise grows to 2 minutes,
    # and until it ends every call fails at once with the old "connection refused".
    ("grpc.max_reconnect_backoff_ms", 2_000),
]
# The longest a channel's next connection attempt can be away (the backoff above, with gRPC's 20%
# jitter): a call that opens an exchange with a peer waits this long for a connection
# (`wait_for_ready`), so a peer that came up during the backoff is reached, and a dead one still fails
# within seconds.
RECONNECT_S = dict(CHANNEL_OPTIONS)["grpc.max_reconnect_backoff_ms"] / 1000 * 1.2
SERVER_OPTIONS = CHANNEL_OPTIONS + [
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.so_reuseport", 0),
]


@dataclasses.dataclass(kw_only=True, slots=True)
class Deadlines:
    rpc_s: float = 10.0
    """Deadline of ordinary control-plane calls."""
    update_s: float = 120.0
    """Deadline of one whole update (NEGOTIATE to COMMIT); the data plane's timeout never exceeds it."""
    worker_s: float = 5.0
    """A worker silent this long (no heartbeat: frozen, or its host stalled) fails the update in flight."""

    def __post_init__(self) -> None:
        if self.rpc_s <= 0 or self.update_s <= 0 or self.worker_s <= 0:
            raise ValueError("deadlines must be positive seconds")


def clamp_timeout(requested: float, default: float, limit: float) -> float:
    """A caller's timeout, bounded by the server's: `default` when it gives none (or a
    non-positive one), never more than `limit`."""
    return min(requested if requested > 0 else default, limit)


def parse_address(addr: str, what: str = "address") -> tuple[str, int]:
    """'HOST:PORT' -> (host, port), with an error a user can act on."""
    if addr.startswith("unix:"):
        raise ValueError(f"{what} {addr!r} must be HOST:PORT here (a Unix socket is only for the worker protocol)")
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"malformed {what} {addr!r}: expected HOST:PORT, e.g. 127.0.0.1:50051")
    return host.strip("[]"), int(port)


UNIX_PATH_MAX = 107  # sun_path holds 108 bytes with the terminating NUL


def parse_target(addr: str, what: str = "address") -> tuple[str, int]:
    """'HOST:PORT' -> (host, port), or 'unix:/ABS/PATH' -> ('unix', 0): where a worker reaches
    its controller's worker listener."""
    if addr.startswith("unix:"):
        path = addr[len("unix:"):]
        if not path.startswith("/") or len(path.encode()) > UNIX_PATH_MAX:
            raise ValueError(f"malformed {what} {addr!r}: expected unix:/ABSOLUTE/PATH of at most "
                             f"{UNIX_PATH_MAX} bytes, or HOST:PORT")
        return "unix", 0
    return parse_address(addr, what)


def channel(addr: str, security=None) -> grpc.aio.Channel:
    """A channel to one of our services, with this process's credentials (common/control/security.py)."""
    from reshard.common.control.security import current

    parse_target(addr)
    return (security or current()).channel(addr, CHANNEL_OPTIONS)


async def start_server(listen: str, register: Callable[[grpc.aio.Server], list[str]], *, worker_tokens=None,
                       what: str = "listen address", services: list[str] | None = None, interceptors=(),
                       ) -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    """Start a grpc.aio server with health and reflection; returns (server, health, port).
    `worker_tokens` (a list of tokens, possibly empty) makes it the worker listener: only the
    worker role's tokens are accepted there, and a `unix:` path is allowed. `services` (the full
    names `register` adds; None: any of ours) set the transport's receive limit: the largest request
    their methods take (security.receive_limit), refused by gRPC before it is buffered. `interceptors`
    run first (the metrics': every call counted, refused ones too)."""
    from reshard.common.control.security import LimitInterceptor, current, receive_limit

    host, _ = parse_target(listen, what) if worker_tokens is not None else parse_address(listen, what)
    sec = current()
    if worker_tokens is not None:
        sec = sec.for_workers(worker_tokens)
    if host != "unix":
        sec.check_listen(host, f"{what} {listen}")
    # Authentication first (a refused call's request is never read), then each method's size limit.
    # With mutual TLS, a caller's roles are also those its client certificate carries.
    options = [*(o for o in SERVER_OPTIONS if o[0] != "grpc.max_receive_message_length"),
               ("grpc.max_receive_message_length", receive_limit(services))]
    server = grpc.aio.server(options=options, interceptors=[*interceptors, *sec.interceptors(tls_port=host != "unix"),
                                                            LimitInterceptor()])
    names = register(server)
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    reflection.enable_server_reflection(names + [health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    if host == "unix":
        path = listen[len("unix:"):]
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a socket a dead controller left (a live one at this path holds our public port)
        port = server.add_insecure_port(listen)  # the folder's permissions and the worker token guard it
    else:
        port = sec.add_port(server, listen)
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    await server.start()
    for n in names + [""]:
        await hs.set(n, health_pb2.HealthCheckResponse.SERVING)
    return server, hs, port


async def stop_server(server: grpc.aio.Server, hs: health.aio.HealthServicer, grace: float = 2.0) -> None:
    await hs.enter_graceful_shutdown()  # NOT_SERVING first
    await server.stop(grace)


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover - uvloop is a dependency; Windows lacks it
        return asyncio.new_event_loop()


def run_main(main: Callable[[asyncio.Event], Awaitable[int | None]]) -> int:
    """Run one of our own processes on uvloop until SIGTERM/SIGINT sets the stop event."""
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        return loop.run_until_complete(main(stop)) or 0
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()


def keep_task(tasks: set[asyncio.Task], coro) -> asyncio.Task:
    """A task on the running loop, held in `tasks` until it ends (asyncio keeps only weak references)."""
    task = asyncio.get_running_loop().create_task(coro)
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    return task


def status_error(e: grpc.aio.AioRpcError | grpc.RpcError) -> str:
    try:
        return f"{e.code().name}: {e.details()}"
    except Exception:  # noqa: BLE001 - any RpcError subclass
        return str(e)
