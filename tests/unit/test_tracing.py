"""--otlp-traces-endpoint: the span per request (a child of the client's traceparent, the engine's
traceparent its own), its attributes and status, the pass-through of a client's trace context
when tracing is off, the protocol choice and the start-up checks."""
from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from infera.server.tracing import RequestTracer, client_trace_headers, otlp_exporter

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
CLIENT_PARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


@pytest.fixture
def traced():
    exporter = InMemorySpanExporter()
    tracer = RequestTracer(None, policy="kv-aware", processor=SimpleSpanProcessor(exporter))
    yield tracer, exporter
    tracer.provider.shutdown()


def test_a_span_continues_the_clients_trace_and_the_engine_gets_the_spans_context(traced):
    tracer, exporter = traced
    span = tracer.start("/v1/chat/completions", {"traceparent": CLIENT_PARENT, "tracestate": "vendor=1"},
                        model="m", tenant="team-a", request_id="rid-1")
    engine = dict(span.headers)
    version, trace_id, parent_id, flags = engine["traceparent"].split("-")
    assert (version, trace_id, flags) == ("00", CLIENT_TRACE, "01")
    assert parent_id != CLIENT_SPAN  # the engine's parent is our span, not the client's
    assert engine["tracestate"] == "vendor=1"
    span.finish(200, {"predicted_hit_blocks": 3, "attempts": 2, "migrations": None}, worker_id="w1")
    span.finish(500)  # once only
    (done,) = exporter.get_finished_spans()
    assert format(done.context.trace_id, "032x") == CLIENT_TRACE
    assert format(done.parent.span_id, "016x") == CLIENT_SPAN
    assert format(done.context.span_id, "016x") == parent_id
    assert done.name == "/v1/chat/completions" and done.kind.name == "SERVER"
    attrs = dict(done.attributes)
    assert attrs == {"http.route": "/v1/chat/completions", "infera.policy": "kv-aware", "gen_ai.request.model": "m",
                     "infera.tenant": "team-a", "infera.request_id": "rid-1", "infera.worker": "w1",
                     "infera.predicted_cached_blocks": 3, "infera.attempts": 2, "http.response.status_code": 200}
    assert done.status.status_code == StatusCode.UNSET


@pytest.mark.parametrize("status, error, code", [
    (503, None, StatusCode.ERROR), (None, "the client disconnected", StatusCode.ERROR), (429, None, StatusCode.UNSET),
])
def test_failures_set_the_span_status(traced, status, error, code):
    tracer, exporter = traced
    tracer.start("/v1/completions", {}).finish(status, None, worker_id="none", error=error)
    (done,) = exporter.get_finished_spans()
    assert done.status.status_code == code
    assert "infera.worker" not in done.attributes  # "none": no worker served it
    assert done.parent is None  # no client traceparent: a new trace


def test_without_a_client_trace_the_engine_still_gets_ours(traced):
    tracer, _ = traced
    span = tracer.start("/v1/completions", {})
    (name, value), = span.headers
    assert name == "traceparent" and value.split("-")[1] == format(span.span.get_span_context().trace_id, "032x")


@pytest.mark.parametrize("headers, forwarded", [
    ({}, ()),
    ({"traceparent": CLIENT_PARENT}, (("traceparent", CLIENT_PARENT),)),
    ({"traceparent": CLIENT_PARENT, "tracestate": "a=b"}, (("traceparent", CLIENT_PARENT), ("tracestate", "a=b"))),
    ({"tracestate": "a=b"}, ()),  # a state without a parent means nothing
])
def test_tracing_off_passes_the_clients_context_through(headers, forwarded):
    assert client_trace_headers(headers) == forwarded


def test_the_protocol_comes_from_the_standard_variable():
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

    assert isinstance(otlp_exporter("http://127.0.0.1:4317", {}), Grpc)
    assert isinstance(otlp_exporter("http://127.0.0.1:4318/v1/traces",
                                    {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}), Http)
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        otlp_exporter("x", {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"})


def test_flag_env_and_startup_checks(capsys):
    from infera.gaie.cli import parse_args as parse_epp_args
    from infera.server.cli import parse_args

    etcd = ["--etcd-endpoint", "127.0.0.1:2379"]
    assert parse_args(etcd, environ={}).otlp_traces_endpoint is None  # off by default
    env = {"INFERA_OTLP_TRACES_ENDPOINT": "http://c:4317"}
    assert parse_args(etcd, environ=env).otlp_traces_endpoint == "http://c:4317"
    flagged = parse_args([*etcd, "--otlp-traces-endpoint", "http://d:4317"], environ=env)
    assert flagged.otlp_traces_endpoint == "http://d:4317"  # flag > env
    with pytest.raises(SystemExit):
        parse_args(etcd, environ={**env, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "carrier-pigeon"})
    assert "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='carrier-pigeon'" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # Envoy traces the gateway hop; the picker has no HTTP request to trace
        parse_epp_args([*etcd, "--otlp-traces-endpoint", "http://c:4317"], environ={})
