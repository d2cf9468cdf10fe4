"""Prometheus metrics of a controller (`--metrics-listen HOST:PORT`, off by default).

Two kinds, in a registry of the controller's own (never the process-wide default one):

- events, counted as they happen: each finished update's duration by phase
  (`reshard_update_duration_seconds{phase}`, committed updates) and in all
  (`reshard_update_seconds{outcome}`), updates by outcome and failure reason
  (`reshard_updates_total{outcome,reason}`), bytes moved (`reshard_update_bytes_total{deployment}`),
  the last transfer's throughput, and every gRPC call the controller serves
  (`reshard_grpc_requests_total{method,code}`, `reshard_grpc_request_duration_seconds{method}`);
- state, read from the controller's own status at each scrape: the version each deployment
  serves and its lag behind the trainer in steps, the workers attached, healthy and restarted,
  each rank's extra memory by kind (staging, shadow, snapshot, pool), the update in progress.

Labels have bounded cardinality: phases, outcomes and reasons are fixed sets; `deployment` is an
attached inference controller's address; `rank` is bounded by the world; `method` by the service.

The listener is HTTP (HTTPS with the controller's TLS files) and follows the rule of every
listener: off loopback it needs TLS and tokens (or client certificates); with tokens, a scrape
must carry an operator's or admin's (`Authorization: Bearer TOKEN`; Prometheus's
`authorization` setting). See docs/operations.md."""

from __future__ import annotations

import asyncio
import hmac
import logging
import ssl
import threading
import time
from collections.abc import Awaitable, Callable
from wsgiref.simple_server import WSGIRequestHandler, make_server

import grpc

log = logging.getLogger("reshard.metrics")

PHASES = ("negotiate", "connect", "transfer", "verify", "commit")
REASONS = ("incompatible", "timeout", "worker", "inference", "aborted", "superseded", "internal", "other")
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
SCRAPE_STATUS_S = 5.0


def failure_reason(error: str) -> str:
    """A failed update's reason, from its error, as one of REASONS (a label of bounded cardinality)."""
    e = error.lower()
    for reason, marks in (("incompatible", ("incompatible", "layout", "mismatch", "refused", "matches no")),
                          ("superseded", ("superseded", "newer publish")),
                          ("timeout", ("deadline", "timed out", "timeout", "did not answer")),
                          ("aborted", ("abort",)),
                          ("worker", ("worker", "rank ")),
                          ("inference", ("inference",)),
                          ("internal", ("internal error",))):
        if any(m in e for m in marks):
            return reason
    return "other"


class ControllerMetrics:
    """One controller's metrics: `record(update)` at each finished update, `interceptor()` on its
    gRPC server, `status` (async, the controller's pb.Status) read at each scrape."""

    def __init__(self, role: str, status: Callable[[], Awaitable], loop: asyncio.AbstractEventLoop,
                 restarts: Callable[[], int] = lambda: 0) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.role, self._status, self._loop, self._restarts = role, status, loop, restarts
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.phase = Histogram("reshard_update_duration_seconds", "Duration of each phase of a committed update",
                               ["phase"], registry=r, buckets=BUCKETS)
        self.total = Histogram("reshard_update_seconds", "Duration of an update, first phase to outcome", ["outcome"],
                               registry=r, buckets=BUCKETS)
        self.updates = Counter("reshard_updates", "Updates by outcome (committed, failed) and failure reason",
                               ["outcome", "reason"], registry=r)
        self.bytes = Counter("reshard_update_bytes", "Bytes moved by committed updates", ["deployment"], registry=r)
        self.throughput = Gauge("reshard_transfer_throughput_bytes_per_second",
                                "The last committed update's bytes over its transfer phase", ["deployment"], registry=r)
        self.requests = Counter("reshard_grpc_requests", "gRPC calls served, by method and status code",
                                ["method", "code"], registry=r)
        self.latency = Histogram("reshard_grpc_request_duration_seconds", "gRPC calls served, by method", ["method"],
                                 registry=r, buckets=BUCKETS)
        for outcome in ("committed", "failed"):
            self.total.labels(outcome)
        self.updates.labels("committed", "")
        r.register(_StatusCollector(self))
        self._server = None

    # -- events ---------------------------------------------------------------------------
    def record(self, rec, deployment: str = "") -> None:
        """A finished update (pb.UpdateRecord)."""
        dep = deployment or rec.deployment or "local"
        if rec.ok:
            self.updates.labels("committed", "").inc()
            self.total.labels("committed").observe(rec.seconds)
            for ph in PHASES:
                if ph in rec.phase_seconds:
                    self.phase.labels(ph).observe(rec.phase_seconds[ph])
            self.bytes.labels(dep).inc(rec.bytes)
            if rec.transfer_seconds > 0:
                self.throughput.labels(dep).set(rec.bytes / rec.transfer_seconds)
        else:
            self.updates.labels("failed", failure_reason(rec.error)).inc()
            self.total.labels("failed").observe(rec.seconds)

    def interceptor(self) -> grpc.aio.ServerInterceptor:
        return _Interceptor(self)

    # -- the listener -----------------------------------------------------------------------
    def serve(self, listen: str, security) -> int:
        """Start the HTTP(S) listener on HOST:PORT (a thread); returns its port."""
        from prometheus_client import make_wsgi_app

        from reshard.common.control.rpc import parse_address

        host, port = parse_address(listen, "metrics listen address")
        security.check_listen(host, f"metrics listen address {listen}")
        tokens = [t for role, t in security.tokens if role in ("operator", "admin", "")]
        app = make_wsgi_app(self.registry)

        def guarded(environ, start_response):
            if tokens:
                got = environ.get("HTTP_AUTHORIZATION", "")
                token = got[len("Bearer "):] if got.startswith("Bearer ") else ""
                if not any(hmac.compare_digest(token.encode(), t.encode()) for t in tokens):
                    start_response("401 Unauthorized", [("Content-Type", "text/plain"),
                                                        ("WWW-Authenticate", 'Bearer realm="reshard"')])
                    return [b"an operator's token is needed (Authorization: Bearer TOKEN)\n"]
            return app(environ, start_response)

        from prometheus_client.exposition import ThreadingWSGIServer

        server = make_server(host, port, guarded, server_class=ThreadingWSGIServer, handler_class=_Quiet)
        if security.cert:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(security.cert, security.key)
            if security.mtls:
                ctx.verify_mode = ssl.CERT_REQUIRED
                ctx.load_verify_locations(security.ca)
            server.socket = ctx.wrap_socket(server.socket, server_side=True)
        threading.Thread(target=server.serve_forever, name=f"reshard-{self.role}-metrics", daemon=True).start()
        self._server = server
        return server.server_port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def status(self):
        """The controller's status, read on its event loop (from the scrape's thread)."""
        return asyncio.run_coroutine_threadsafe(self._status(), self._loop).result(SCRAPE_STATUS_S)


class _Quiet(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
        pass


class _StatusCollector:
    """Gauges read from the controller's status at each scrape."""

    def __init__(self, m: ControllerMetrics) -> None:
        self.m = m

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        try:
            st = self.m.status()
        except Exception as e:  # noqa: BLE001 - a scrape must not fail for it
            log.warning("metrics: the controller's status could not be read: %s", e)
            return
        up = GaugeMetricFamily("reshard_controller_up", "1: the controller answered this scrape", labels=["role"])
        up.add_metric([self.m.role], 1)
        yield up
        if self.m.role == "trainer":
            pub = st.version.step if st.has_version else -1
            yield GaugeMetricFamily("reshard_published_step", "The newest step the trainer published (-1: none)", value=pub)
            served = GaugeMetricFamily("reshard_deployment_step", "The step each deployment serves (-1: none known)",
                                       labels=["deployment"])
            lag = GaugeMetricFamily("reshard_deployment_lag_steps",
                                    "Steps each deployment serves behind the trainer's newest published step",
                                    labels=["deployment"])
            for d in st.deployments:
                step = d.committed.step if d.has_committed else -1
                served.add_metric([d.address], step)
                if pub >= 0:
                    lag.add_metric([d.address], pub - step if step >= 0 else pub + 1)
            yield served
            yield lag
        else:
            yield GaugeMetricFamily("reshard_served_step", "The step this deployment serves (-1: none)",
                                    value=st.version.step if st.has_version else -1)
        yield GaugeMetricFamily("reshard_update_in_progress", "1 while an update is in flight",
                                value=1 if st.update_in_progress else 0)
        prog = GaugeMetricFamily("reshard_update_progress_bytes", "Bytes of the update in flight", labels=["kind"])
        prog.add_metric(["done"], st.progress.bytes_done)
        prog.add_metric(["total"], st.progress.bytes_total)
        yield prog
        workers = GaugeMetricFamily("reshard_workers", "Workers by state (READY, BUSY, STARTING, DEAD, ...)",
                                    labels=["role", "state"])
        counts: dict[str, int] = {}
        for w in st.workers:
            counts[w.state] = counts.get(w.state, 0) + 1
        for state in sorted(set(counts) | {"READY", "DEAD"}):
            workers.add_metric([self.m.role, state], counts.get(state, 0))
        yield workers
        yield GaugeMetricFamily("reshard_workers_expected", "The world this controller serves", value=len(st.workers))
        restarts = CounterMetricFamily("reshard_worker_restarts", "Standalone worker processes the supervisor restarted",
                                       labels=["role"])
        restarts.add_metric([self.m.role], self.m._restarts())
        yield restarts
        mem = GaugeMetricFamily("reshard_rank_memory_bytes",
                                "Extra memory a rank holds for updates, by kind (staging, shadow, snapshot, pool, ...)",
                                labels=["role", "rank", "kind"])
        for w in st.workers:
            for kind, n in sorted(w.memory.items()):
                mem.add_metric([self.m.role, str(w.rank), kind], n)
        yield mem


class _Interceptor(grpc.aio.ServerInterceptor):
    """Counts and times every call by method and status code."""

    def __init__(self, m: ControllerMetrics) -> None:
        self.m = m

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        method, inner, m = details.method, handler.unary_unary, self.m

        async def timed(request, context):
            t0 = time.perf_counter()
            code = "OK"
            try:
                return await inner(request, context)
            except BaseException:
                code = context.code().name if context.code() is not None else "UNKNOWN"
                raise
            finally:
                if code == "OK" and context.code() not in (None, grpc.StatusCode.OK):
                    code = context.code().name
                m.requests.labels(method, code).inc()
                m.latency.labels(method).observe(time.perf_counter() - t0)

        return grpc.unary_unary_rpc_method_handler(timed, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)
