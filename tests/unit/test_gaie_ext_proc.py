"""The ext_proc exchange, message by message, in both processing modes: what goes back to Envoy,
the body cap, and the in-flight charge released exactly once (reply end, stream end, cancel)."""
from __future__ import annotations

import asyncio
import json

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from grpc_health.v1 import health_pb2

from infera.gaie.ext_proc import STREAMED_CHUNK_BYTES, Exchange, ExternalProcessor, RefusedPicks
from infera.gaie.health import EppHealth
from infera.gaie.picker import EndpointPicker
from tests.unit.test_gaie_picker import stack_with, worker

BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello"}], "stream": True}).encode()


def headers_msg(mode: int, path: str = "/v1/chat/completions", eos: bool = False) -> pb.ProcessingRequest:
    hv = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in
          ((":path", path), (":method", "POST"), ("x-request-id", "rid-1"), ("x-prefill-instance-id", "evil"))]
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hv), end_of_stream=eos),
        protocol_config=pb.ProtocolConfiguration(request_body_mode=mode, response_body_mode=mode))


def body_msg(data: bytes, eos: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=eos))


def reply_headers(status: int = 200, eos: bool = False, extra: dict | None = None) -> pb.ProcessingRequest:
    hv = [base_pb2.HeaderValue(key=k, raw_value=v.encode())
          for k, v in {":status": str(status), **(extra or {})}.items()]
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hv),
                                                                end_of_stream=eos))


def reply_body(data: bytes, eos: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=data, end_of_stream=eos))


def setup(max_body: int = 1 << 20, workers=None):
    stack = stack_with(workers or [worker("w1")], "--router-policy", "round-robin")
    picker = EndpointPicker(stack.router, destination_port=8000)
    return stack, picker, Exchange(picker, max_body)


def mutations(common: pb.CommonResponse) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


def inflight(stack, wid: str = "w1") -> int:
    return stack.metrics.inflight_gauge(wid).value


async def test_buffered_headers_continue_then_one_body_answer_with_the_pick():
    stack, _, ex = setup()
    out = await ex.handle(headers_msg(BUFFERED))
    assert [m.WhichOneof("response") for m in out] == ["request_headers"]
    assert not out[0].request_headers.response.header_mutation.set_headers  # CONTINUE, nothing set yet
    out = await ex.handle(body_msg(CHAT, True))
    assert [m.WhichOneof("response") for m in out] == ["request_body"]
    common = out[0].request_body.response
    assert common.clear_route_cache
    assert mutations(common) == {"x-gateway-destination-endpoint": "10.0.0.1:8000", "x-worker-instance-id": "w1"}
    assert "x-prefill-instance-id" in common.header_mutation.remove_headers
    assert out[0].dynamic_metadata.fields["envoy.lb"].struct_value.fields[
        "x-gateway-destination-endpoint"].string_value == "10.0.0.1:8000"
    assert inflight(stack) == 1
    out = await ex.handle(reply_headers(200))
    assert mutations(out[0].response_headers.response) == {"x-worker-instance-id": "w1"}
    out = await ex.handle(reply_body(b"data: x\n\n", False))
    assert out[0].WhichOneof("response") == "response_body" and not out[0].response_body.response.body_mutation.ListFields()
    assert inflight(stack) == 1
    await ex.handle(reply_body(b"data: [DONE]\n\n", True))
    assert inflight(stack) == 0
    ex.close()  # the stream ends after: nothing more released
    assert inflight(stack) == 0


async def test_full_duplex_holds_the_headers_until_the_body_ends_then_echoes_it():
    stack, _, ex = setup()
    assert await ex.handle(headers_msg(FULL_DUPLEX)) == []
    big = CHAT[:-1] + b', "user": "' + b"u" * (2 * STREAMED_CHUNK_BYTES) + b'"}'
    assert await ex.handle(body_msg(big[:100], False)) == []
    assert await ex.handle(body_msg(big[100:5000], False)) == []
    assert inflight(stack) == 0  # no pick before the body is whole
    out = await ex.handle(body_msg(big[5000:], True))
    kinds = [m.WhichOneof("response") for m in out]
    assert kinds[0] == "request_headers" and set(kinds[1:]) == {"request_body"} and len(kinds) == 4
    common = out[0].request_headers.response
    assert common.clear_route_cache and mutations(common)["x-worker-instance-id"] == "w1"
    pieces = [m.request_body.response.body_mutation.streamed_response for m in out[1:]]
    assert b"".join(p.body for p in pieces) == big
    assert [p.end_of_stream for p in pieces] == [False, False, True]
    assert all(len(p.body) <= STREAMED_CHUNK_BYTES for p in pieces)
    # reply chunks echoed one by one
    await ex.handle(reply_headers(200))
    out = await ex.handle(reply_body(b"chunk-1", False))
    echoed = out[0].response_body.response.body_mutation.streamed_response
    assert (echoed.body, echoed.end_of_stream) == (b"chunk-1", False)
    assert inflight(stack) == 1
    out = await ex.handle(reply_body(b"", True))
    assert out[0].response_body.response.body_mutation.streamed_response.end_of_stream
    assert inflight(stack) == 0


async def test_body_over_the_cap_is_413_in_the_openai_shape():
    stack, _, ex = setup(max_body=1000)
    await ex.handle(headers_msg(FULL_DUPLEX))
    assert await ex.handle(body_msg(b"x" * 600, False)) == []
    out = await ex.handle(body_msg(b"x" * 600, False))
    imm = out[0].immediate_response
    assert imm.status.code == 413
    assert json.loads(imm.body)["error"]["code"] == "request_too_large"
    assert ex.done and inflight(stack) == 0


async def test_no_worker_is_503_and_bad_json_is_400():
    stack, picker, _ = setup()
    stack.fleet.remove("w1")
    ex = Exchange(picker, 1 << 20)
    await ex.handle(headers_msg(BUFFERED))
    imm = (await ex.handle(body_msg(CHAT, True)))[0].immediate_response
    assert imm.status.code == 503 and json.loads(imm.body)["error"]["code"] == "no_active_worker"
    assert {h.header.key: h.header.raw_value for h in imm.headers.set_headers}["retry-after"] == b"1"
    stack.fleet.upsert(worker("w1"))
    ex = Exchange(picker, 1 << 20)
    await ex.handle(headers_msg(FULL_DUPLEX))
    imm = (await ex.handle(body_msg(b"{nope", True)))[0].immediate_response
    assert imm.status.code == 400 and "error" in json.loads(imm.body)


async def test_a_request_without_body_is_refused():
    _, _, ex = setup()
    out = await ex.handle(headers_msg(FULL_DUPLEX, eos=True))
    assert out[0].immediate_response.status.code == 400


async def _stream(messages, stop: asyncio.Event | None = None):
    for m in messages:
        yield m
    if stop is not None:
        await stop.wait()  # the gRPC stream stays open (Envoy waiting) until cancelled


async def test_stream_that_ends_before_the_reply_releases_once():
    stack, picker, _ = setup()
    processor = ExternalProcessor(picker, 1 << 20)
    out = [m async for m in processor.Process(_stream([headers_msg(BUFFERED), body_msg(CHAT, True),
                                                       reply_headers(200)]), None)]
    assert len(out) == 3
    assert inflight(stack) == 0  # Envoy closed the stream mid-reply (client gone): released


async def test_cancelled_stream_releases_once_and_a_served_reply_is_not_released_twice():
    stack, picker, _ = setup(workers=[worker("w1")])
    processor = ExternalProcessor(picker, 1 << 20)
    stop = asyncio.Event()
    got: list = []

    async def consume():
        async for m in processor.Process(_stream([headers_msg(FULL_DUPLEX), body_msg(CHAT, True)], stop), None):
            got.append(m)

    task = asyncio.create_task(consume())
    while len(got) < 2:
        await asyncio.sleep(0.01)
    assert inflight(stack) == 1
    task.cancel()  # the gRPC call is cancelled (Envoy reset the stream)
    try:
        await task
    except asyncio.CancelledError:
        pass
    assert inflight(stack) == 0
    # a full exchange, then the stream end: exactly one release (the gauge would go negative)
    out = [m async for m in processor.Process(_stream([headers_msg(BUFFERED), body_msg(CHAT, True),
                                                       reply_headers(200), reply_body(b"x", True)]), None)]
    assert len(out) == 4 and inflight(stack) == 0


async def test_a_5xx_reply_counts_against_the_worker_in_the_breaker():
    stack, picker, _ = setup()
    for _ in range(3):  # the default threshold
        ex = Exchange(picker, 1 << 20)
        await ex.handle(headers_msg(BUFFERED))
        await ex.handle(body_msg(CHAT, True))
        await ex.handle(reply_headers(503, eos=True))
    assert stack.breaker.state("w1") == "open"


async def test_health_reports_inference_extension_and_the_server():
    health = EppHealth()
    await health.set_serving(True)
    for service in ("inference-extension", ""):
        reply = await health.servicer.Check(health_pb2.HealthCheckRequest(service=service), None)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    await health.set_serving(False)
    reply = await health.servicer.Check(health_pb2.HealthCheckRequest(service="inference-extension"), None)
    assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_a_refused_connection_blames_the_worker_and_the_retry_picks_another():
    stack, picker, _ = setup(workers=[worker("w1"), worker("w2")])
    refused = RefusedPicks()
    first = Exchange(picker, 1 << 20, refused)
    await first.handle(headers_msg(BUFFERED))
    out = await first.handle(body_msg(CHAT, True))
    picked = mutations(out[0].request_body.response)["x-worker-instance-id"]
    await first.handle(reply_headers(503, eos=True, extra={"x-infera-upstream-connect-failure": "10.0.0.1:8000"}))
    assert inflight(stack, picked) == 0
    assert stack.breaker.entry(picked).consecutive_failures == 1
    for _ in range(3):  # Envoy's retries (same x-request-id) never go back to it
        retry = Exchange(picker, 1 << 20, refused)
        await retry.handle(headers_msg(BUFFERED))
        out = await retry.handle(body_msg(CHAT, True))
        assert mutations(out[0].request_body.response)["x-worker-instance-id"] != picked
        retry.close()
    assert refused.get("rid-1") == {picked} and refused.get("other") == frozenset()


def test_refused_picks_expire_and_are_bounded():
    now = [0.0]
    refused = RefusedPicks(ttl_s=10, max_entries=2, clock=lambda: now[0])
    refused.add("a", "w1")
    refused.add("a", "w2")
    assert refused.get("a") == {"w1", "w2"}
    refused.add("b", "w1")
    refused.add("c", "w1")  # over the bound: the oldest goes
    assert refused.get("a") == frozenset() and refused.get("c") == {"w1"}
    now[0] = 11
    assert refused.get("c") == frozenset()


async def test_a_sidecar_that_could_not_reach_the_prefill_gets_a_pair_without_it():
    stack = stack_with([worker("p1", "prefill"), worker("p2", "prefill"), worker("d3", "decode")],
                       "--router-policy", "round-robin")
    picker = EndpointPicker(stack.router, destination_port=8000)
    refused = RefusedPicks()
    first = Exchange(picker, 1 << 20, refused)
    await first.handle(headers_msg(BUFFERED))
    out = await first.handle(body_msg(CHAT, True))
    dead = mutations(out[0].request_body.response)["x-prefill-instance-id"]
    await first.handle(reply_headers(502, extra={"x-infera-upstream-connect-failure": dead}))
    first.close()
    assert stack.breaker.entry(dead).consecutive_failures == 1  # the prefill is blamed, not the decode
    assert stack.breaker.entry("d3") is None or stack.breaker.entry("d3").consecutive_failures == 0
    assert refused.get("rid-1") == {dead}
    for _ in range(2):
        retry = Exchange(picker, 1 << 20, refused)
        await retry.handle(headers_msg(BUFFERED))
        out = await retry.handle(body_msg(CHAT, True))
        named = mutations(out[0].request_body.response)
        assert named["x-prefill-instance-id"] != dead and named["x-worker-instance-id"] == "d3"
        retry.close()
    assert all(inflight(stack, w) == 0 for w in ("p1", "p2", "d3"))
