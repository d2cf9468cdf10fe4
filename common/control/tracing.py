"""OpenTelemetry traces of updates: one trace per update, a span per phase on both controllers and
on every worker, when OpenTelemetry is installed and configured. Without it, nothing is imported
or allocated past a check.

Where the spans go:

- A process reshard starts (the controllers, the standalone workers) sets up the SDK from the
  standard environment (`configure_from_env`): `OTEL_TRACES_EXPORTER` names an exporter (`otlp`,
  `console`, any that an installed package registers), or `OTEL_EXPORTER_OTLP_ENDPOINT` /
  `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` alone picks `otlp`. `OTEL_SERVICE_NAME`,
  `OTEL_RESOURCE_ATTRIBUTES` and the batch processor's `OTEL_BSP_*` apply as usual;
  `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` turns it off.
- Code embedded in a host (TrainerWorker, InferenceWorker, the vLLM engine) never sets a tracer
  provider: its spans go to the one the host set, if any, and are not made otherwise.

How a trace holds together: the trainer controller opens the update's root span and a span per
phase; the W3C trace context (`traceparent`) goes to the inference controller in the gRPC
metadata of BeginUpdate / FinishUpdate / AbortUpdate, and to every worker in the `trace` field of
each command (worker.proto). The phase the sender is in is the parent of what it asks for.
"""

from __future__ import annotations

import contextvars
import logging
import os
from collections.abc import Iterable, Mapping

log = logging.getLogger("reshard.tracing")

TRACER = "reshard"
_CURRENT: contextvars.ContextVar[object | None] = contextvars.ContextVar("reshard_span", default=None)
_api = None  # opentelemetry.trace once imported; False: not installed


def _trace():
    global _api
    if _api is None:
        try:
            from opentelemetry import trace
        except ImportError:
            _api = False
        else:
            _api = trace
    return _api or None


def _tracer():
    """The tracer, or None when no tracer provider is set (the API alone gives non-recording spans:
    not worth making)."""
    trace = _trace()
    if trace is None:
        return None
    provider = trace.get_tracer_provider()
    if type(provider).__name__ in ("ProxyTracerProvider", "NoOpTracerProvider"):
        return None
    return provider.get_tracer(TRACER)


def enabled() -> bool:
    return _tracer() is not None


def start(name: str, parent=None, attributes: Mapping | None = None):
    """A started span (None when tracing is off). `parent`: a span, a carrier (dict of W3C headers,
    or gRPC metadata pairs), or None for a new trace."""
    tracer = _tracer()
    if tracer is None:
        return None
    ctx = None
    if parent is not None:
        if isinstance(parent, (Mapping, list, tuple)):
            ctx = _extract(parent)
        else:
            ctx = _trace().set_span_in_context(parent)
    return tracer.start_span(name, context=ctx, attributes=_clean(attributes))


def end(span, error: str = "", attributes: Mapping | None = None) -> None:
    """End `span` (None: nothing), as failed with `error` if given."""
    if span is None:
        return
    if attributes:
        span.set_attributes(_clean(attributes))
    if error:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error[:512]))
    span.end()


def _clean(attributes: Mapping | None) -> dict:
    return {k: v for k, v in (attributes or {}).items() if v is not None and v != ""}


def carrier(span) -> dict[str, str]:
    """The W3C headers (`traceparent`, `tracestate`) that make `span` the parent elsewhere ({} without)."""
    if span is None:
        return {}
    from opentelemetry.propagate import inject

    out: dict[str, str] = {}
    inject(out, context=_trace().set_span_in_context(span))
    return out


def metadata(span) -> list[tuple[str, str]]:
    """`carrier(span)` as gRPC metadata."""
    return list(carrier(span).items())


def _extract(headers: Mapping | Iterable):
    from opentelemetry.propagate import extract

    if not isinstance(headers, Mapping):  # gRPC metadata: (key, value) pairs
        headers = {k: v for k, v in headers if isinstance(v, str)}
    return extract(dict(headers))


def has_context(headers: Mapping | Iterable | None) -> bool:
    if not headers:
        return False
    keys = headers.keys() if isinstance(headers, Mapping) else (k for k, _ in headers)
    return "traceparent" in keys


def set_current(span) -> None:
    """The span this task is in: commands sent to workers from here on carry it as their parent."""
    _CURRENT.set(span)


def current():
    return _CURRENT.get()


def configure_from_env(role: str) -> bool:
    """Set up the SDK in a process reshard starts, from the standard OTEL_ variables; True if it did.
    Never called by code embedded in a host."""
    env = os.environ
    name = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" or name == "none":
        return False
    if not name and (env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        name = "otlp"
    if not name:
        return False
    trace = _trace()
    try:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        trace = None
    if trace is None:
        log.warning("OTEL_TRACES_EXPORTER=%s but the OpenTelemetry SDK is not installed: no traces "
                    "(pip install 'reshard[tracing]')", name)
        return False
    from importlib.metadata import entry_points

    exporters = []
    for one in (n.strip() for n in name.split(",") if n.strip() and n.strip() != "none"):
        found = list(entry_points(group="opentelemetry_traces_exporter", name=one))
        if not found:
            log.warning("OTEL_TRACES_EXPORTER names %r, which no installed package provides: no traces to it "
                        "(for otlp: pip install 'reshard[tracing]')", one)
            continue
        try:
            exporters.append(found[0].load()())
        except Exception as e:  # noqa: BLE001 - a broken exporter never stops the service
            log.warning("the %r trace exporter could not start: %s", one, e)
    if not exporters:
        return False
    attrs = {} if env.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: f"reshard-{role}"}
    provider = TracerProvider(resource=Resource.create(attrs))
    for e in exporters:
        provider.add_span_processor(BatchSpanProcessor(e))
    trace.set_tracer_provider(provider)
    log.info("traces on: %s", ", ".join(type(e).__name__ for e in exporters))
    return True
