"""--otlp-traces-endpoint end to end: a real OTLP/gRPC receiver (the collector's own service
definition, in process) gets one span per request from the server's batch exporter; the sim engine
receives the span's traceparent; a client's traceparent is the span's parent. Tracing off: the
client's traceparent reaches the engine unchanged, and no span is made."""
from __future__ import annotations

import grpc
import openai
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from infera.discovery.record import BUILTIN_TOKENIZER, WorkerRecord
from infera.engine.sim.server import SimServer, parse_args
from tests.conftest import wait_for

pytestmark = pytest.mark.integration

MODEL = "sim-model"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
CLIENT_PARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace collector's receiving end: every span exported to it."""

    def __init__(self) -> None:
        self.spans: list = []

    async def Export(self, request, context):
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend(scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
async def receiver():
    collector = Receiver()
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield collector, f"http://127.0.0.1:{port}"
    await server.stop(0)


@pytest.fixture
async def sim():
    """A sim that remembers the trace context of every request it got."""
    server = SimServer(parse_args(["--model", MODEL, "--host", "127.0.0.1", "--port", "0", "--speedup", "1000"]))
    server.traceparents = []

    @web.middleware
    async def remember(request, handler):
        if request.method == "POST":
            server.traceparents.append(request.headers.get("traceparent"))
        return await handler(request)

    server.app.middlewares.append(remember)
    async with server:
        yield server


async def router(fed_server, sim, *flags):
    server, base = await fed_server(*flags)
    server.fleet.upsert(WorkerRecord(worker_id="sim-0", url=sim.url, model_name=MODEL, tokenizer=BUILTIN_TOKENIZER))
    return server, openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


def attrs(span) -> dict:
    out = {}
    for kv in span.attributes:
        v = kv.value
        out[kv.key] = v.string_value if v.HasField("string_value") else v.int_value
    return out


async def test_one_span_per_request_joined_by_the_engine(fed_server, sim, receiver, monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # the batch exporter's interval (ms), read at start
    collector, endpoint = receiver
    server, client = await router(fed_server, sim, "--otlp-traces-endpoint", endpoint)
    await client.chat.completions.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "hi"}],
                                         extra_headers={"traceparent": CLIENT_PARENT})
    stream = await client.completions.create(model=MODEL, prompt="hello", max_tokens=3, stream=True)
    assert [c async for c in stream]
    await wait_for(lambda: len(collector.spans) == 2, 10, message="both spans exported")
    unary, streamed = sorted(collector.spans, key=lambda s: s.name)  # /v1/chat/... < /v1/completions
    # the unary request continued the client's trace; the engine's parent is the router's span
    assert unary.trace_id.hex() == CLIENT_TRACE and unary.parent_span_id.hex() == CLIENT_SPAN
    first, second = sim.traceparents
    assert first == f"00-{CLIENT_TRACE}-{unary.span_id.hex()}-01"
    # the streamed one started a trace of its own, which the engine joined too
    # (its flags: sampled, and 0x02 when the SDK made the trace id at random, W3C trace context level 2)
    assert not streamed.parent_span_id
    assert second.rsplit("-", 1)[0] == f"00-{streamed.trace_id.hex()}-{streamed.span_id.hex()}"
    for span, route in ((unary, "/v1/chat/completions"), (streamed, "/v1/completions")):
        a = attrs(span)
        assert span.name == route and a["gen_ai.request.model"] == MODEL and a["infera.worker"] == "sim-0"
        assert a["infera.policy"] == "round-robin" and a["http.response.status_code"] == 200
        assert a["infera.attempts"] == 1
    await client.close()


async def test_tracing_off_passes_the_clients_traceparent_and_makes_no_span(fed_server, sim, receiver):
    collector, _ = receiver
    server, client = await router(fed_server, sim)
    assert server.tracer is None
    await client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}],
                                         extra_headers={"traceparent": CLIENT_PARENT})
    await client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert sim.traceparents == [CLIENT_PARENT, None]
    assert collector.spans == []
    await client.close()
