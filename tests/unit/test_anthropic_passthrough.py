"""Anthropic passthrough, pure parts: which worker is sent the client's own request, the body it is
sent (salted as the routing hashed it), and what the server reads back from an engine's own
Anthropic replies (errors, usage, the router's mid-stream error frame)."""
from __future__ import annotations

import json

import pytest

from infera.api import anthropic as _anthropic
from infera.api import anthropic_passthrough as pt
from infera.api.errors import sse_error_event
from infera.discovery.record import WorkerRecord
from infera.router.dispatch import reported_cached_tokens
from infera.server.api_keys import ApiKey
from infera.server.app_anthropic import (PASSTHROUGH_STATE, AnthropicModes, _request_salt, passthrough_bodies,
                                         serves_messages)

MODEL = "m"


def _request(**extra) -> _anthropic.TranslatedRequest:
    body = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], **extra}
    return _anthropic.translate_request(json.dumps(body).encode())


def _worker(wid: str, *, anthropic: bool, mode: str = "mixed") -> WorkerRecord:
    return WorkerRecord(worker_id=wid, url=f"http://{wid}", model_name=MODEL, anthropic_messages=anthropic,
                        disagg_mode=mode)


@pytest.mark.parametrize("anthropic,mode,expected", [
    (True, "mixed", True),
    (False, "mixed", False),
    (True, "prefill", False),  # a PD leg's body is built from the chat form
    (True, "decode", False),
])
def test_serves_messages(anthropic, mode, expected):
    assert serves_messages(_worker("w", anthropic=anthropic, mode=mode)) is expected


def test_translated_request_keeps_the_clients_request():
    translated = _request(thinking={"type": "enabled", "budget_tokens": 1024}, stream=True)
    assert translated.source["thinking"] == {"type": "enabled", "budget_tokens": 1024}  # not forwarded to chat
    assert "thinking" not in translated.body and translated.source["stream"] is True


@pytest.mark.parametrize("given,salt,expected", [
    (None, None, None),  # no salt anywhere: none sent
    (None, "s1", "s1"),  # the routing's salt is written in
    ("client", None, "client"),  # the client's own, as sent
    ("client", "tenant", "tenant"),  # an isolated tenant's replaces it (the chat body carries the same)
])
def test_passthrough_body_salt(given, salt, expected):
    source = {"model": MODEL, "messages": [], **({"cache_salt": given} if given else {})}
    body = json.loads(pt.passthrough_body(source, salt))
    assert body.get("cache_salt") == expected
    assert source.get("cache_salt") == given  # the client's request is not changed in place


def test_body_for_per_worker_and_last_worker_recorded():
    translated = _request(top_k=3)
    state: dict = {}
    body_for = passthrough_bodies(translated, "salty", state)
    speaks, plain = _worker("a", anthropic=True), _worker("b", anthropic=False)
    route, body = body_for(speaks)
    assert route == "/v1/messages" and state[PASSTHROUGH_STATE] == "a"
    sent = json.loads(body)
    assert sent == {**translated.source, "cache_salt": "salty"}
    assert body_for(plain) is None and PASSTHROUGH_STATE not in state  # failover to a translating worker
    again = body_for(_worker("c", anthropic=True))
    assert again[1] is body and state[PASSTHROUGH_STATE] == "c"  # built once


@pytest.mark.parametrize("isolated,client_salt,expected", [
    (False, None, None),
    (False, "mine", "mine"),  # the translation forwards it as an engine extra: routing hashes under it
    (False, "", None),  # not usable: the engine answers for it, the routing stays unsalted
    (True, None, "tenant"),
    (True, "mine", "tenant"),
])
def test_request_salt(isolated, client_salt, expected):
    key = ApiKey(tenant="t", digest=b"d", models=None, salt_key=b"k" if isolated else None)
    extra = {} if client_salt is None else {"cache_salt": client_salt}
    translated = _request(**extra)
    salt = _request_salt(translated, key)
    if expected == "tenant":
        assert salt == key.cache_salt(None) and translated.body["cache_salt"] == salt
    else:
        assert salt == expected


@pytest.mark.parametrize("body,expected", [
    (b'{"type":"error","error":{"type":"BadRequestError","message":"no"}}', True),
    (b'{"error":{"message":"no","type":"BadRequestError"}}', False),
    (b'{"detail":"Not Found"}', False),
    (b'{"type":"error","error":"no"}', False),
    (b"not json", False),
    (None, False),
])
def test_is_anthropic_error(body, expected):
    assert pt.is_anthropic_error(body) is expected


def test_error_reply_body_keeps_the_engines_own_and_converts_the_rest():
    own = b'{"type":"error","error":{"type":"BadRequestError","message":"max_tokens too big"}}'
    assert pt.error_reply_body(400, own) is own
    converted = json.loads(pt.error_reply_body(404, b'{"detail":"Not Found"}'))
    assert converted == {"type": "error", "error": {"type": "not_found_error", "message": "Not Found"}}
    assert json.loads(pt.error_reply_body(500, b"boom"))["error"] == {"type": "api_error", "message": "boom"}


UNARY = (b'{"id":"chatcmpl-1","type":"message","content":[{"type":"text","text":"usage \\"usage\\""}],'
         b'"usage":{"input_tokens":3,"output_tokens":4,"cache_read_input_tokens":32}}')
STREAM = (b'event: message_start\ndata: {"type":"message_start","message":{"id":"x","usage":{"input_tokens":35,'
          b'"output_tokens":0}}}\n\nevent: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
          b'"delta":{"type":"text_delta","text":"a"}}\n\nevent: message_delta\ndata: {"type":"message_delta",'
          b'"delta":{"stop_reason":"max_tokens"},"usage":{"input_tokens":3,"output_tokens":2,'
          b'"cache_read_input_tokens":32}}\n\nevent: message_stop\ndata: {"type":"message_stop"}\n\n')


@pytest.mark.parametrize("data,expected", [
    (UNARY, 39),
    (STREAM, 37),  # the last usage: message_delta's
    (b'{"usage":{"input_tokens":1,"output_tokens":true}}', 1),  # a bool is no count
    (b'{"usage":{"input_tokens":1,"cache_creation_input_tokens":5,"output_tokens":2}}', 8),
    (b'{"content":[]}', None),
    (b"", None),
    (None, None),
])
def test_usage_tokens(data, expected):
    assert pt.usage_tokens(data) == expected


@pytest.mark.parametrize("data,expected", [
    (UNARY, 32),
    (STREAM, 32),
    (b'{"usage":{"prompt_tokens_details":{"cached_tokens":16}}}', 16),  # the chat shape, as before
    (b'{"usage":{"input_tokens":3,"output_tokens":1}}', None),  # vLLM without prompt-tokens details
])
def test_router_reads_cached_tokens_from_anthropic_usage(data, expected):
    assert reported_cached_tokens(data) == expected


def test_meter_counts_the_last_usage_else_deltas():
    meter = pt.PassthroughMeter()
    for i in range(0, len(STREAM), 7):  # split anywhere
        meter.feed(STREAM[i:i + 7])
    assert meter.tokens() == 37
    bare = pt.PassthroughMeter()
    bare.feed(b'event: content_block_delta\ndata: {}\n\nevent: content_block_delta\ndata: {}\n\n')
    assert bare.tokens() == 2


def test_router_error_frame_becomes_an_anthropic_error_event():
    frame = sse_error_event("the worker failed mid-stream", 502, "worker_failed_midstream")
    event = pt.router_error_event(frame)
    assert event is not None and event.startswith(b"event: error\ndata: ")
    data = json.loads(event.split(b"data: ", 1)[1])
    assert data == {"type": "error", "error": {"type": "api_error", "message": "the worker failed mid-stream"}}
    assert pt.router_error_event(b'event: error\ndata: {"type":"error","error":{"type":"x","message":"y"}}\n\n') is None
    assert pt.router_error_event(STREAM) is None
    assert pt.router_error_event(b'data: {"error" broken') is None  # not ours after all: relayed as it is


def test_modes_counter_on_a_registry():
    from prometheus_client import CollectorRegistry, generate_latest
    registry = CollectorRegistry(auto_describe=False)
    modes = AnthropicModes(registry)
    modes.count("passthrough")
    modes.count("passthrough")
    modes.count("translated")
    text = generate_latest(registry).decode()
    assert 'infera_anthropic_messages_total{mode="passthrough"} 2.0' in text
    assert 'infera_anthropic_messages_total{mode="translated"} 1.0' in text
