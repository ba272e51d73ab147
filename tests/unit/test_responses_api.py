"""The Responses API's pure parts: the router's store (bytes bound, LRU, TTL), the expansion of a
follow-up, the chat messages a request renders to (vLLM's construct_input_messages), the door's
checks, the completed event read from a stream split anywhere, and the store's flags."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from infera.api import responses as r
from infera.api.errors import ApiError
from infera.server.cli import parse_args
from infera.server.responses_store import ResponsesStore, decode_entry, encode_entry


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run(coro):
    return asyncio.run(coro)


def _size(rid: str, value: bytes) -> int:
    return ResponsesStore._size(rid, value)


def test_store_put_get_delete_and_bytes():
    store = ResponsesStore(max_bytes=10_000, ttl_s=60, clock=Clock())
    assert run(store.put("resp_a", b"x" * 100)) and run(store.get("resp_a")) == b"x" * 100
    assert store.bytes == _size("resp_a", b"x" * 100)
    assert run(store.put("resp_a", b"y" * 10)) and store.bytes == _size("resp_a", b"y" * 10)  # replaced, not added
    assert run(store.delete("resp_a")) and store.bytes == 0 and run(store.get("resp_a")) is None
    assert not run(store.delete("resp_a"))


def test_store_evicts_least_recently_used_past_the_bound():
    one = _size("resp_0", b"v" * 100)
    store = ResponsesStore(max_bytes=3 * one, ttl_s=60, clock=Clock())
    for i in range(3):
        run(store.put(f"resp_{i}", b"v" * 100))
    assert run(store.get("resp_0")) is not None  # now the most recently used
    run(store.put("resp_3", b"v" * 100))
    assert run(store.get("resp_1")) is None  # the least recently used went
    assert [run(store.get(f"resp_{i}")) is not None for i in (0, 2, 3)] == [True] * 3
    assert store.bytes <= store.max_bytes and len(store) == 3


@pytest.mark.parametrize(
    "max_bytes, value, kept",
    [
        (0, b"", False),  # 0: none kept
        (200, b"v" * 50, True),
        (200, b"v" * 500, False),  # bigger than the whole bound: not kept, nothing evicted for it
    ],
)
def test_store_entry_sizes(max_bytes, value, kept):
    store = ResponsesStore(max_bytes=max_bytes, ttl_s=60, clock=Clock())
    assert run(store.put("resp_x", value)) is kept
    assert (run(store.get("resp_x")) is not None) is kept


def test_store_ttl_expires_and_sweeps():
    clock = Clock()
    store = ResponsesStore(max_bytes=10_000, ttl_s=100, clock=clock)
    run(store.put("old", b"1"))
    clock.now += 60
    run(store.put("new", b"2"))
    clock.now += 50  # old is past its ttl, new is not
    assert run(store.get("old")) is None and run(store.get("new")) == b"2"
    assert not run(store.delete("old"))
    run(store.put("other", b"3"))
    clock.now += 200  # both past: a put sweeps expired entries wherever they sit in the LRU order
    run(store.put("last", b"4"))
    assert len(store) == 1 and store.bytes == _size("last", b"4")


def test_entry_round_trip_and_garbage():
    value = encode_entry([{"role": "user", "content": "hi"}], {"id": "resp_1", "output": []})
    assert decode_entry(value) == ([{"role": "user", "content": "hi"}], {"id": "resp_1", "output": []})
    for bad in (b"", b"[]", b'{"input": 1, "response": {}}', b"{"):
        assert decode_entry(bad) is None


MSG = {
    "id": "msg_1",
    "type": "message",
    "role": "assistant",
    "status": "completed",
    "content": [{"type": "output_text", "text": "Hello.", "annotations": []}],
}
CALL = {"id": "fc_1", "type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
REASONING = {"id": "rs_1", "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]}


@pytest.mark.parametrize(
    "request_input, prior_input, prior_output, expected",
    [
        (
            "two",
            [{"role": "user", "content": "one"}],
            [MSG],
            [{"role": "user", "content": "one"}, MSG, {"role": "user", "content": "two"}],
        ),
        (
            [{"role": "user", "content": [{"type": "input_text", "text": "two"}]}],
            [],
            [REASONING, MSG],
            [MSG, {"role": "user", "content": [{"type": "input_text", "text": "two"}]}],
        ),  # reasoning not carried
        (
            [{"type": "function_call_output", "call_id": "call_1", "output": "42"}],
            [{"role": "user", "content": "q"}],
            [CALL],
            [
                {"role": "user", "content": "q"},
                CALL,
                {"type": "function_call_output", "call_id": "call_1", "output": "42"},
            ],
        ),
    ],
)
def test_expand(request_input, prior_input, prior_output, expected):
    request = {"model": "m", "input": request_input, "previous_response_id": "resp_1", "instructions": "now"}
    expanded = r.expand(request, prior_input, prior_output)
    assert expanded["input"] == expected and "previous_response_id" not in expanded
    assert expanded["instructions"] == "now" and request["previous_response_id"] == "resp_1"  # the original kept


@pytest.mark.parametrize(
    "instructions, given, expected",
    [
        (None, "hi", [{"role": "user", "content": "hi"}]),
        ("sys", "hi", [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]),
        (
            "",
            [{"role": "user", "content": [{"type": "input_text", "text": "a"}]}],
            [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
        ),
        (
            None,
            [{"role": "user", "content": "q"}, MSG],
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": "Hello."}],
        ),
        (None, [{"role": "assistant", "content": "plain"}], [{"role": "assistant", "content": "plain"}]),
        (
            None,
            [CALL, {"type": "function_call_output", "call_id": "call_1", "output": "42"}],
            [
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                },
                {"role": "tool", "content": "42", "tool_call_id": "call_1"},
            ],
        ),
        (None, [REASONING, MSG], [{"role": "assistant", "content": "Hello."}]),
    ],
)
def test_chat_messages(instructions, given, expected):
    assert r.chat_messages(instructions, given) == expected


def test_chat_messages_refuses_an_unknown_item():
    with pytest.raises(ApiError) as err:
        r.chat_messages(None, [{"type": "web_search_call"}])
    assert err.value.status == 400


@pytest.mark.parametrize(
    "body, param",
    [
        (b"", None),
        (b"[1]", None),
        (b'{"input": "x"}', "model"),
        (b'{"model": "m"}', "input"),
        (b'{"model": "m", "input": 3}', "input"),
        (b'{"model": "m", "input": [1]}', "input"),
        (b'{"model": "m", "input": "x", "previous_response_id": 5}', "previous_response_id"),
        (b'{"model": "m", "input": "x", "instructions": ["a"]}', "instructions"),
        (b'{"model": "m", "input": "x", "background": true}', "background"),
    ],
)
def test_decode_request_refuses(body, param):
    with pytest.raises(ApiError) as err:
        r.decode_request(body)
    assert err.value.status == 400 and err.value.param == param


def test_chat_body_tools_and_salt():
    body = r.chat_body(
        {
            "model": "m",
            "input": "x",
            "cache_salt": "s",
            "tools": [{"type": "function", "name": "f", "parameters": {}}, {"type": "web_search"}],
        }
    )
    assert body == {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "cache_salt": "s",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    }
    assert "tools" not in r.chat_body({"model": "m", "input": "x", "tools": [{"type": "web_search"}]})


def _stream(response: dict) -> bytes:
    frames = [
        b"event: response.created\ndata: " + msgspec.json.encode({"type": "response.created"}) + b"\n\n",
        b'event: response.output_text.delta\ndata: {"delta": "event: response.completed"}\n\n',
        b"event: response.completed\ndata: "
        + msgspec.json.encode({"type": "response.completed", "response": response})
        + b"\n\n",
    ]
    return b"".join(frames)


@pytest.mark.parametrize("piece", [1, 7, 64, 100_000])
def test_completed_event_split_anywhere(piece):
    response = {"id": "resp_1", "object": "response", "output": [MSG]}
    data = _stream(response)
    seen = r.CompletedEvent(max_bytes=10_000)
    for at in range(0, len(data), piece):
        seen.feed(data[at : at + piece])
    assert seen.response() == response


def test_completed_event_too_big_or_absent():
    big = r.CompletedEvent(max_bytes=10)
    big.feed(_stream({"id": "resp_1", "output": [{"text": "x" * 10_000}]}))
    assert big.response() is None
    none = r.CompletedEvent(max_bytes=10_000)
    none.feed(b"event: response.created\ndata: {}\n\n")
    assert none.response() is None


@pytest.mark.parametrize(
    "argv, environ, expected",
    [
        ([], {}, (64 * 1024 * 1024, 3600.0)),
        ([], {"INFERA_RESPONSES_STORE_MAX_BYTES": "1Mi", "INFERA_RESPONSES_STORE_TTL": "30"}, (1024 * 1024, 30.0)),
        (
            ["--responses-store-max-bytes", "0", "--responses-store-ttl", "5"],
            {"INFERA_RESPONSES_STORE_MAX_BYTES": "1Mi"},
            (0, 5.0),
        ),
    ],
)
def test_store_flags(argv, environ, expected):
    args = parse_args(["--etcd-endpoint", "unused:1", *argv], environ=environ)
    assert (args.responses_store_max_bytes, args.responses_store_ttl) == expected


def test_router_error_event():
    from infera.api.errors import sse_error_event

    out = r.router_error_event(sse_error_event("worker w1 went away", 502, "upstream_lost"), 7)
    assert out.startswith(b"event: error\ndata: ") and out.endswith(b"\n\n")
    assert msgspec.json.decode(out.split(b"data: ", 1)[1]) == {
        "type": "error",
        "code": "upstream_lost",
        "message": "worker w1 went away",
        "param": None,
        "sequence_number": 7,
    }
    for engine_chunk in (
        b'event: response.created\ndata: {"error": 1}\n\n',
        b"data: [DONE]\n\n",
        b'data: {"error" nonsense\n\n',
    ):
        assert r.router_error_event(engine_chunk, 0) is None
