"""The Anthropic Messages translation (infera/api/anthropic.py): requests, responses, the SSE
stream translator (fed recorded OpenAI chunk sequences, split at every byte), and error shapes."""
from __future__ import annotations

import json

import pytest

from infera.api.anthropic import (StreamTranslator, TranslatedRequest, anthropic_error_body, anthropic_error_type,
                                  count_prompt_tokens, error_message_of, translate_request, translate_response)
from infera.api.errors import ApiError
from infera.kv.tokenizer import load_tokenizer


def _req(**fields) -> dict:
    body = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    body.update(fields)
    return body


def _translate(body: dict, **kw) -> TranslatedRequest:
    return translate_request(json.dumps(body).encode(), **kw)


# -- request translation ----------------------------------------------------------------------------------
REQUESTS = [
    ("plain string content", _req(),
     {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}),
    ("system string", _req(system="be brief"),
     {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}),
    ("system text blocks joined by newline",
     _req(system=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]),
     {"messages": [{"role": "system", "content": "a\nb"}, {"role": "user", "content": "hi"}]}),
    ("user text blocks become one message",
     _req(messages=[{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}]),
     {"messages": [{"role": "user", "content": "x\ny"}]}),
    ("empty user block list",
     _req(messages=[{"role": "user", "content": []}]), {"messages": [{"role": "user", "content": ""}]}),
    ("assistant tool_use and user tool_result",
     _req(messages=[
         {"role": "user", "content": "weather?"},
         {"role": "assistant", "content": [{"type": "text", "text": "checking"},
                                           {"type": "tool_use", "id": "toolu_1", "name": "get", "input": {"c": "P"}}]},
         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                       "content": [{"type": "text", "text": "sunny"}]},
                                      {"type": "text", "text": "thanks"}]}]),
     {"messages": [
         {"role": "user", "content": "weather?"},
         {"role": "assistant", "content": "checking", "tool_calls": [
             {"id": "toolu_1", "type": "function", "function": {"name": "get", "arguments": '{"c":"P"}'}}]},
         {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
         {"role": "user", "content": "thanks"}]}),
    ("assistant with only a tool call has null content",
     _req(messages=[{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]),
     {"messages": [{"role": "assistant", "content": None, "tool_calls": [
         {"id": "t", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}),
    ("thinking blocks are dropped",
     _req(messages=[{"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                                      {"type": "text", "text": "ok"}]}]),
     {"messages": [{"role": "assistant", "content": "ok"}]}),
    ("tools, tool_choice any, parallel off",
     _req(tools=[{"name": "get", "description": "d", "input_schema": {"type": "object"}}, {"name": "n"}],
          tool_choice={"type": "any", "disable_parallel_tool_use": True}),
     {"tools": [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}, "description": "d"}},
                {"type": "function", "function": {"name": "n", "parameters": {}}}],
      "tool_choice": "required", "parallel_tool_calls": False}),
    ("tool_choice tool", _req(tools=[{"name": "f"}], tool_choice={"type": "tool", "name": "f"}),
     {"tool_choice": {"type": "function", "function": {"name": "f"}}}),
    ("tool_choice auto", _req(tools=[{"name": "f"}], tool_choice={"type": "auto"}), {"tool_choice": "auto"}),
    ("tool_choice none", _req(tools=[{"name": "f"}], tool_choice={"type": "none"}), {"tool_choice": "none"}),
    ("tool_choice without tools is dropped", _req(tool_choice={"type": "auto"}), {"tool_choice": None}),
    ("sampling and stops",
     _req(temperature=0.5, top_p=0.9, top_k=5, stop_sequences=["END"], metadata={"user_id": "u1"}),
     {"temperature": 0.5, "top_p": 0.9, "top_k": 5, "stop": ["END"], "user": "u1"}),
    ("stream asks for usage", _req(stream=True),
     {"stream": True, "stream_options": {"include_usage": True}}),
    ("image blocks become image_url parts",
     _req(messages=[{"role": "user", "content": [
         {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
         {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}},
         {"type": "text", "text": "what?"}]}]),
     {"messages": [{"role": "user", "content": [
         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
         {"type": "image_url", "image_url": {"url": "https://x/y.png"}},
         {"type": "text", "text": "what?"}]}]}),
    ("cache_control ephemeral → 5m",
     _req(system=[{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}]),
     {"prompt_cache_retention": "5m"}),
    ("cache_control ttl 1h wins",
     _req(system=[{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}],
          tools=[{"name": "f", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]),
     {"prompt_cache_retention": "1h"}),
    ("engine extras pass, Anthropic-only fields do not",
     _req(ignore_eos=True, thinking={"type": "enabled", "budget_tokens": 100}, service_tier="auto"),
     {"ignore_eos": True, "thinking": None, "service_tier": None}),
]


@pytest.mark.parametrize("body,expected", [r[1:] for r in REQUESTS], ids=[r[0] for r in REQUESTS])
def test_request_translation(body, expected):
    out = _translate(body).body
    for key, value in expected.items():
        assert out.get(key) == value, key


BAD_REQUESTS = [
    ("not json", b"{", "malformed JSON"),
    ("not an object", b"[1]", "JSON object"),
    ("empty", b"", "empty"),
    ("no model", _req(model=""), "'model'"),
    ("no max_tokens", {"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ("max_tokens zero", _req(max_tokens=0), "max_tokens"),
    ("max_tokens bool", _req(max_tokens=True), "max_tokens"),
    ("no messages", _req(messages=[]), "messages"),
    ("system role in messages", _req(messages=[{"role": "system", "content": "x"}]), "role"),
    ("document block", _req(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]),
     "document blocks are not supported"),
    ("image inside tool_result", _req(messages=[{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {}}]}]}]), "only text"),
    ("tool_result without id", _req(messages=[{"role": "user", "content": [{"type": "tool_result"}]}]),
     "tool_use_id"),
    ("unknown block", _req(messages=[{"role": "user", "content": [{"type": "weird"}]}]), "unknown content block"),
    ("server tool", _req(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "server tool"),
    ("bad tool_choice", _req(tools=[{"name": "f"}], tool_choice={"type": "sometimes"}), "tool_choice"),
    ("stop_sequences not strings", _req(stop_sequences=[1]), "stop_sequences"),
    ("temperature string", _req(temperature="hot"), "temperature"),
    ("deep nesting", b'{"a":' + b"[" * 100 + b"]" * 100 + b"}", "nested deeper"),
]


@pytest.mark.parametrize("body,needle", [r[1:] for r in BAD_REQUESTS], ids=[r[0] for r in BAD_REQUESTS])
def test_bad_requests_are_400(body, needle):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(ApiError) as info:
        translate_request(raw)
    assert info.value.status == 400 and needle in info.value.message


def test_count_only_needs_no_max_tokens_and_never_streams():
    t = _translate({"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}, count_only=True)
    assert "max_tokens" not in t.body and not t.stream and "stream" not in t.body


def test_count_prompt_tokens_is_the_chat_template_count():
    tok = load_tokenizer("")
    t = _translate(_req(system="sys", messages=[{"role": "user", "content": "hello there"}]))
    expected = tok.encode_chat([{"role": "system", "content": "sys"}, {"role": "user", "content": "hello there"}])
    assert count_prompt_tokens(tok, t) == len(expected)
    with_tools = _translate(_req(system="sys", messages=[{"role": "user", "content": "hello there"}],
                                 tools=[{"name": "f", "input_schema": {"type": "object"}}]))
    assert count_prompt_tokens(tok, with_tools) > len(expected)


# -- response translation ---------------------------------------------------------------------------------
def _chat(message: dict, finish: str | None = "stop", usage: dict | None = None, **choice) -> dict:
    return {"choices": [{"index": 0, "message": message, "finish_reason": finish, **choice}],
            "usage": usage or {"prompt_tokens": 10, "completion_tokens": 3,
                               "prompt_tokens_details": {"cached_tokens": 4}}}


RESPONSES = [
    ("text, end_turn, cache accounting", _chat({"content": "hello"}), (),
     [{"type": "text", "text": "hello"}], "end_turn", None,
     {"input_tokens": 6, "output_tokens": 3, "cache_read_input_tokens": 4, "cache_creation_input_tokens": 0}),
    ("length → max_tokens", _chat({"content": "x"}, "length"), (), [{"type": "text", "text": "x"}], "max_tokens",
     None, None),
    ("stop sequence (vLLM stop_reason)", _chat({"content": "x"}, "stop", stop_reason="END"), ("END",),
     [{"type": "text", "text": "x"}], "stop_sequence", "END", None),
    ("stop sequence (SGLang matched_stop)", _chat({"content": "x"}, "stop", matched_stop="END"), ("END",),
     [{"type": "text", "text": "x"}], "stop_sequence", "END", None),
    ("a matched stop that is no stop sequence (EOS id)", _chat({"content": "x"}, "stop", stop_reason=2), ("END",),
     [{"type": "text", "text": "x"}], "end_turn", None, None),
    ("tool calls", _chat({"content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]}, "tool_calls"), (),
     [{"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 1}},
      {"type": "tool_use", "id": "c2", "name": "g", "input": {}}], "tool_use", None, None),
    ("forced tool call finishing with stop", _chat({"content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, "stop"), (),
     [{"type": "tool_use", "id": "c1", "name": "f", "input": {}}], "tool_use", None, None),
    ("empty output keeps one empty text block", _chat({"content": ""}, "length"), (),
     [{"type": "text", "text": ""}], "max_tokens", None, None),
    ("content_filter → end_turn", _chat({"content": "x"}, "content_filter"), (), [{"type": "text", "text": "x"}],
     "end_turn", None, None),
]


@pytest.mark.parametrize("answer,stops,content,stop_reason,stop_sequence,usage", [r[1:] for r in RESPONSES],
                         ids=[r[0] for r in RESPONSES])
def test_response_translation(answer, stops, content, stop_reason, stop_sequence, usage):
    req = TranslatedRequest({}, "client-model", False, stops)
    msg = translate_response(answer, req, "msg_1")
    assert (msg["id"], msg["type"], msg["role"], msg["model"]) == ("msg_1", "message", "assistant", "client-model")
    assert msg["content"] == content
    assert (msg["stop_reason"], msg["stop_sequence"]) == (stop_reason, stop_sequence)
    if usage is not None:
        assert msg["usage"] == usage


def test_missing_tool_call_id_gets_a_toolu_id():
    msg = translate_response(_chat({"tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                                   "tool_calls"), TranslatedRequest({}, "m", False), "msg_1")
    assert msg["content"][0]["id"].startswith("toolu_")


# -- stream translation -----------------------------------------------------------------------------------
def _sse(*chunks: dict | str) -> bytes:
    return b"".join(b"data: " + (c.encode() if isinstance(c, str) else json.dumps(c).encode()) + b"\n\n"
                    for c in chunks)


def _delta(**delta) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


def _finish(reason: str, **extra) -> dict:
    return {"choices": [{"index": 0, "delta": {}, "finish_reason": reason, **extra}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 5,
                                  "prompt_tokens_details": {"cached_tokens": 8}}}


def _tool(index: int, *, id: str | None = None, name: str | None = None, args: str = "") -> dict:
    call: dict = {"index": index, "function": {"arguments": args}}
    if id:
        call["id"], call["type"] = id, "function"
    if name:
        call["function"]["name"] = name
    return _delta(tool_calls=[call])


def _parse(out: bytes) -> list[tuple[str, dict]]:
    events = []
    for frame in out.decode().split("\n\n"):
        if not frame:
            continue
        kind_line, data_line = frame.split("\n")
        assert kind_line.startswith("event: ") and data_line.startswith("data: ")
        kind, data = kind_line[7:], json.loads(data_line[6:])
        assert data["type"] == kind
        events.append((kind, data))
    return events


def _run(stream: bytes, stops: tuple[str, ...] = (), step: int | None = None) -> list[tuple[str, dict]]:
    """Feed the whole stream, or ``step`` bytes at a time; the events must be the same."""
    t = StreamTranslator("client-model", "msg_1", stops)
    if step is None:
        out = t.feed(stream) + t.finish()
    else:
        out = b"".join(t.feed(stream[i:i + step]) for i in range(0, len(stream), step)) + t.finish()
    return _parse(out)


TEXT_STREAM = _sse(_delta(role="assistant", content=""), _delta(content="Hel"), _delta(content="lo"),
                   _finish("stop"), USAGE, "[DONE]")
TOOL_STREAM = _sse(_delta(role="assistant", content=""), _delta(content="Let me check."),
                   _tool(0, id="call_a", name="get_weather"), _tool(0, args='{"ci'), _tool(0, args='ty": "Pa'),
                   _tool(0, args='ris"}'), _tool(1, id="call_b", name="get_time", args='{"tz":'),
                   _tool(1, args=' "CET"}'), _finish("tool_calls"), USAGE, "[DONE]")


def _summary(events):
    return [k if k not in ("content_block_start", "content_block_stop") else f"{k}:{d['index']}" for k, d in events]


@pytest.mark.parametrize("step", [None, 1, 7])
def test_text_stream(step):
    events = _run(TEXT_STREAM, step=step)
    assert _summary(events) == ["message_start", "ping", "content_block_start:0", "content_block_delta",
                                "content_block_delta", "content_block_stop:0", "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert (start["id"], start["model"], start["content"], start["stop_reason"]) == ("msg_1", "client-model", [], None)
    assert events[2][1]["content_block"] == {"type": "text", "text": ""}
    assert "".join(d["delta"]["text"] for k, d in events if k == "content_block_delta") == "Hello"
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 5 and delta["usage"]["input_tokens"] == 4
    assert delta["usage"]["cache_read_input_tokens"] == 8


@pytest.mark.parametrize("step", [None, 1, 5])
def test_tool_stream_fragments(step):
    events = _run(TOOL_STREAM, step=step)
    assert _summary(events) == [
        "message_start", "ping", "content_block_start:0", "content_block_delta", "content_block_stop:0",
        "content_block_start:1", "content_block_delta", "content_block_delta", "content_block_delta",
        "content_block_stop:1", "content_block_start:2", "content_block_delta", "content_block_delta",
        "content_block_stop:2", "message_delta", "message_stop"]
    assert events[5][1]["content_block"] == {"type": "tool_use", "id": "call_a", "name": "get_weather", "input": {}}
    args = "".join(d["delta"]["partial_json"] for k, d in events
                   if k == "content_block_delta" and d["index"] == 1)
    assert json.loads(args) == {"city": "Paris"}
    assert all(d["delta"]["type"] == "input_json_delta" for k, d in events if k == "content_block_delta"
               and d["index"] in (1, 2))
    assert json.loads("".join(d["delta"]["partial_json"] for k, d in events
                              if k == "content_block_delta" and d["index"] == 2)) == {"tz": "CET"}
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_tool_name_arriving_after_first_fragment():
    stream = _sse(_delta(role="assistant"), _tool(0, id="c", args='{"a"'), _tool(0, name="f", args=": 1}"),
                  _finish("tool_calls"), "[DONE]")
    events = _run(stream)
    starts = [d for k, d in events if k == "content_block_start"]
    assert starts == [{"type": "content_block_start", "index": 0,
                       "content_block": {"type": "tool_use", "id": "c", "name": "f", "input": {}}}]
    assert "".join(d["delta"]["partial_json"] for k, d in events if k == "content_block_delta") == '{"a": 1}'


def test_stop_sequence_in_stream():
    stream = _sse(_delta(content="a"), _finish("stop", stop_reason="END"), "[DONE]")
    delta = [d for k, d in _run(stream, ("END",)) if k == "message_delta"][0]
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}


def test_length_without_output_still_has_a_block():
    events = _run(_sse(_delta(role="assistant", content=""), _finish("length"), "[DONE]"))
    assert _summary(events) == ["message_start", "ping", "content_block_start:0", "content_block_stop:0",
                                "message_delta", "message_stop"]
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"


def test_crlf_keepalives_and_garbage_are_ignored():
    raw = (b": keep-alive\r\n\r\n" + _sse(_delta(content="x")).replace(b"\n", b"\r\n")
           + b"data: {not json\n\n" + _sse(_finish("stop"), "[DONE]"))
    assert _summary(_run(raw)) == ["message_start", "ping", "content_block_start:0", "content_block_delta",
                                   "content_block_stop:0", "message_delta", "message_stop"]


def test_end_without_done_closes_the_message():
    events = _run(_sse(_delta(content="x"), _finish("stop")).rstrip(b"\n"))  # no [DONE], last frame unterminated
    assert [k for k, _ in events][-2:] == ["message_delta", "message_stop"]


def test_nothing_before_done_emits_nothing():
    assert _run(_sse("[DONE]")) == []


def test_midstream_error_becomes_an_error_event():
    router_error = {"error": {"message": "worker w failed mid-stream", "type": "server_error", "param": None,
                              "code": "worker_failed_midstream"}}
    t = StreamTranslator("m", "msg_1")
    out = t.feed(_sse(_delta(content="x"), router_error, _delta(content="never")))
    events = _parse(out + t.finish())
    assert events[-1] == ("error", {"type": "error", "error": {"type": "api_error",
                                                               "message": "worker w failed mid-stream"}})
    assert "message_stop" not in [k for k, _ in events] and t.done


def test_error_frame_with_status_code():
    t = StreamTranslator("m", "msg_1")
    events = _parse(t.feed(_sse({"error": {"message": "busy", "code": 503}})))
    assert events == [("error", {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}})]


# -- error shapes -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("status,kind", [(400, "invalid_request_error"), (401, "authentication_error"),
                                         (403, "permission_error"), (404, "not_found_error"),
                                         (413, "request_too_large"), (422, "invalid_request_error"),
                                         (429, "rate_limit_error"), (500, "api_error"), (502, "api_error"),
                                         (503, "overloaded_error"), (504, "api_error"), (529, "overloaded_error")])
def test_error_types(status, kind):
    assert anthropic_error_type(status) == kind
    assert json.loads(anthropic_error_body(status, "why")) == {"type": "error", "error": {"type": kind,
                                                                                          "message": "why"}}


@pytest.mark.parametrize("body,message", [
    (b'{"error": {"message": "bad sampling", "type": "BadRequestError", "code": 400}}', "bad sampling"),
    (b'{"error": "worker w unreachable"}', "worker w unreachable"),
    (b'{"detail": "Not Found"}', "Not Found"),
    (b"plain text failure", "plain text failure"),
    (b"", "worker answered HTTP 500"),
])
def test_error_message_of(body, message):
    assert error_message_of(body, 500) == message
