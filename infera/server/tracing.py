"""Request tracing (``--otlp-traces-endpoint``): one OpenTelemetry span per request, exported over
OTLP, with the W3C ``traceparent`` forwarded to the engine so that its own spans (vLLM's
``--otlp-traces-endpoint``) join the trace.

Off by default and then free: no OpenTelemetry import, no span, one attribute check per request.
A client's own ``traceparent``/``tracestate`` still reach the engine unchanged (a header lookup),
so engine spans join the client's trace even without ours.

On: the span (kind SERVER, named after the route) is a child of the client's ``traceparent`` when
it sends one, and carries the model, tenant, policy, the worker that served (and the prefill of a
PD pair), the predicted cached blocks, the attempts and stream migrations, and the reply's status;
a 5xx or a broken stream sets the span's status to ERROR. The engine gets the span's own context
as its ``traceparent``. Spans are batched and exported on the SDK's thread, never on the loop.
The OTLP protocol is the standard ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` (``grpc``, the default as
in vLLM, or ``http/protobuf``); other standard ``OTEL_EXPORTER_OTLP_*`` variables (headers, TLS)
apply as the exporters read them.
"""
from __future__ import annotations

import asyncio
import os
from typing import Any, Mapping

TRACE_HEADERS = ("traceparent", "tracestate")
PROTOCOLS = ("grpc", "http/protobuf")
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"


def client_trace_headers(headers: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """A client's own trace context, passed to the engine as is (tracing off)."""
    parent = headers.get("traceparent")
    if parent is None:
        return ()
    state = headers.get("tracestate")
    return (("traceparent", parent),) if state is None else (("traceparent", parent), ("tracestate", state))


def otlp_exporter(endpoint: str, environ: Mapping[str, str] | None = None) -> Any:
    protocol = (environ if environ is not None else os.environ).get(PROTOCOL_ENV, "grpc")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        raise ValueError(f"{PROTOCOL_ENV}={protocol!r}: expected one of {', '.join(PROTOCOLS)}")
    return OTLPSpanExporter(endpoint=endpoint)


class RequestSpan:
    """One request's span: ``headers`` go to the engine; ``finish`` ends it once."""

    __slots__ = ("span", "headers", "_ended")

    def __init__(self, span: Any, headers: tuple[tuple[str, str], ...]) -> None:
        self.span, self.headers, self._ended = span, headers, False

    def set(self, name: str, value: Any) -> None:
        if value is not None:
            self.span.set_attribute(name, value)

    def finish(self, status: int | None, state: Mapping[str, Any] | None = None, *,
               worker_id: str | None = None, error: str | None = None) -> None:
        if self._ended:
            return
        self._ended = True
        from opentelemetry.trace import Status, StatusCode

        span = self.span
        if worker_id is not None and worker_id != "none":
            span.set_attribute("infera.worker", worker_id)
        if state:
            for key, attr in (("predicted_hit_blocks", "infera.predicted_cached_blocks"),
                              ("attempts", "infera.attempts"), ("migrations", "infera.migrations"),
                              ("prefill_worker", "infera.prefill_worker")):
                value = state.get(key)
                if value is not None:
                    span.set_attribute(attr, value)
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        if error is not None or (status is not None and status >= 500):
            span.set_status(Status(StatusCode.ERROR, error or f"HTTP {status}"))
        span.end()


class RequestTracer:
    """The server's tracer provider (built only when tracing is on). ``processor``: a span
    processor to use instead of the OTLP batch exporter (tests)."""

    def __init__(self, endpoint: str | None, *, service_name: str = "infera-server", policy: str = "",
                 processor: Any = None, environ: Mapping[str, str] | None = None) -> None:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._trace = trace
        self.policy = policy
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        if processor is None:
            processor = BatchSpanProcessor(otlp_exporter(endpoint or "", environ))
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("infera.server")
        self.propagator = TraceContextTextMapPropagator()
        self._server_kind = trace.SpanKind.SERVER

    def start(self, route: str, headers: Mapping[str, str], *, model: str | None = None,
              tenant: str | None = None, request_id: str | None = None) -> RequestSpan:
        parent = self.propagator.extract(headers) if "traceparent" in headers else None
        span = self.tracer.start_span(route, context=parent, kind=self._server_kind)
        span.set_attribute("http.route", route)
        span.set_attribute("infera.policy", self.policy)
        for name, value in (("gen_ai.request.model", model), ("infera.tenant", tenant),
                            ("infera.request_id", request_id)):
            if value is not None:
                span.set_attribute(name, value)
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=self._trace.set_span_in_context(span))
        return RequestSpan(span, tuple(carrier.items()))

    async def shutdown(self) -> None:
        """Flush what is batched (the SDK blocks: on a thread, not the loop)."""
        await asyncio.to_thread(self.provider.shutdown)
