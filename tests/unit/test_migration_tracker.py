"""StreamTracker on real vLLM 0.32 streams: what it records, what the client sees, and how a
broken stream is continued (exact from token ids, or from text)."""
from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from infera.router.migration import (CHAT, COMPLETIONS, StreamTracker, poison_reason,
                                     request_for_migration)

FIXTURES = Path(__file__).parent.parent / "fixtures" / "migration"
CHAT_SSE = (FIXTURES / "vllm-0.32.0-chat-return_token_ids.sse").read_bytes()
CMPL_SSE = (FIXTURES / "vllm-0.32.0-completions-return_token_ids.sse").read_bytes()
CONT_SSE = (FIXTURES / "vllm-0.32.0-completions-token-prompt-return_token_ids.sse").read_bytes()

CHAT_REQ = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 6,
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
CMPL_REQ = {"model": "tiny", "prompt": "hello there", "max_tokens": 6, "stream": True, "temperature": 0}


def events(sse: bytes) -> list[bytes]:
    return [e + b"\n\n" for e in sse.split(b"\n\n") if e]


def payloads(out: bytes) -> list[dict]:
    return [json.loads(e[6:]) for e in out.split(b"\n\n") if e.startswith(b"data: {")]


def feed_all(tracker: StreamTracker, chunks: list[bytes]) -> bytes:
    return b"".join(tracker.feed(c) for c in chunks)


def test_the_router_asks_vllm_format_engines_for_ids_only():
    body, strip = request_for_migration(CHAT, CHAT_REQ, "vllm")
    assert body["return_token_ids"] is True and strip and "return_token_ids" not in CHAT_REQ
    assert request_for_migration(CHAT, CHAT_REQ, "sglang") == (CHAT_REQ, False)
    asked = {**CHAT_REQ, "return_token_ids": True}
    assert request_for_migration(CHAT, asked, "vllm") == (asked, False)  # the client's own: kept


def test_chat_stream_is_recorded_and_ids_are_stripped():
    t = StreamTracker(CHAT, CHAT_REQ, strip_ids=True)
    out = feed_all(t, events(CHAT_SSE))
    assert t.prompt_ids == [1, 2363, 201, 280, 78, 290, 1632, 2, 201, 1, 1262, 3907, 201]
    assert t.output_ids == [3674, 1378] * 3 and t.ids_complete
    assert "".join(t.text) == " kubernetesys" * 3
    assert t.done and t.finished and t.can_migrate() == "finished"
    assert b"token_ids" not in out and b"prompt_text" not in out
    assert out.endswith(b"data: [DONE]\n\n")
    assert [p["choices"][0]["delta"] for p in payloads(out)[:2]] == [{"role": "assistant", "content": ""},
                                                                      {"content": " kubernetes"}]


def test_a_client_that_asked_for_ids_gets_them_verbatim():
    t = StreamTracker(CHAT, {**CHAT_REQ, "return_token_ids": True}, strip_ids=False)
    assert feed_all(t, events(CHAT_SSE)) == CHAT_SSE


@pytest.mark.parametrize("step", [1, 5, 64, 333])
def test_events_split_anywhere_give_the_same_stream(step):
    whole = StreamTracker(CHAT, CHAT_REQ, strip_ids=True)
    expected = feed_all(whole, [CHAT_SSE])
    t = StreamTracker(CHAT, CHAT_REQ, strip_ids=True)
    assert feed_all(t, [CHAT_SSE[i:i + step] for i in range(0, len(CHAT_SSE), step)]) == expected
    assert t.output_ids == whole.output_ids


def test_exact_continuation_of_a_chat_stream():
    t = StreamTracker(CHAT, CHAT_REQ, strip_ids=True)
    first = feed_all(t, events(CHAT_SSE)[:4])  # role chunk + 3 tokens, then the worker dies
    assert t.can_migrate() is None and t.produced == 3
    route, body = t.continuation("vllm")
    req = msgspec.json.decode(body)
    assert route == COMPLETIONS
    assert req["prompt"] == t.prompt_ids + [3674, 1378, 3674]
    assert req["max_tokens"] == 3 and req["return_token_ids"] and req["stream"]
    assert "messages" not in req and req["temperature"] == 0
    t.commit()
    rest = feed_all(t, events(CONT_SSE))
    chunks = payloads(first + rest)
    assert {c["id"] for c in chunks} == {"chatcmpl-8823a9db9993a17e"}  # one stream to the client
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert all("text" not in ch and "token_ids" not in ch and "prompt_token_ids" not in ch
               for c in chunks for ch in c["choices"])
    cont_text = [json.loads(e[6:])["choices"][0]["text"] for e in events(CONT_SSE) if e.startswith(b"data: {")
                 and json.loads(e[6:])["choices"]]
    assert [c["choices"][0]["delta"].get("content") for c in chunks[4:] if c["choices"]] == [x or None for x in cont_text]
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens"] == 13 and usage["completion_tokens"] == 3 + 6
    assert usage["total_tokens"] == 13 + 9
    assert rest.endswith(b"data: [DONE]\n\n") and t.done


def test_exact_continuation_of_a_completions_stream():
    t = StreamTracker(COMPLETIONS, CMPL_REQ, strip_ids=True)
    feed_all(t, events(CMPL_SSE)[:2])
    route, body = t.continuation("sim")
    req = msgspec.json.decode(body)
    assert route == COMPLETIONS and req["prompt"] == t.prompt_ids + t.output_ids and req["max_tokens"] == 4


@pytest.mark.parametrize("engine,continue_final", [("sglang", True), ("atom", False)])
def test_text_continuation_of_chat_where_no_ids_exist(engine, continue_final):
    t = StreamTracker(CHAT, CHAT_REQ, strip_ids=False)
    no_ids = CHAT_SSE.replace(b',"token_ids":[3674]', b"").replace(b',"token_ids":[1378]', b"")
    feed_all(t, events(no_ids)[:3])
    assert not t.ids_complete and t.produced == 2
    route, body = t.continuation(engine)
    req = msgspec.json.decode(body)
    assert route == CHAT
    assert req["messages"][-1] == {"role": "assistant", "content": " kubernetesys"}
    assert req["max_tokens"] == 4
    assert req.get("continue_final_message", False) is continue_final
    assert req.get("add_generation_prompt", True) is not continue_final


def test_tools_force_the_text_path_even_with_ids():
    t = StreamTracker(CHAT, {**CHAT_REQ, "tools": [{"type": "function", "function": {"name": "f"}}]}, strip_ids=True)
    feed_all(t, events(CHAT_SSE)[:3])
    route, body = t.continuation("vllm")
    assert route == CHAT and "tools" in msgspec.json.decode(body)


def test_text_continuation_of_completions():
    t = StreamTracker(COMPLETIONS, CMPL_REQ, strip_ids=False)
    no_ids = b"".join(e for e in events(CMPL_SSE))
    no_ids = no_ids.replace(b'"token_ids":', b'"x":')
    feed_all(t, events(no_ids)[:2])
    route, body = t.continuation("atom")
    req = msgspec.json.decode(body)
    assert route == COMPLETIONS and req["prompt"] == "hello there" + "".join(t.text)


@pytest.mark.parametrize("route,request_,sse,reason", [
    (CHAT, {**CHAT_REQ, "n": 2}, b"", "n_above_1"),
    (COMPLETIONS, {**CMPL_REQ, "best_of": 3}, b"", "n_above_1"),
    (COMPLETIONS, {**CMPL_REQ, "prompt": ["a", "b"]}, b"", "batch_prompt"),
    (COMPLETIONS, {**CMPL_REQ, "echo": True}, b"", "echo"),
    (CHAT, CHAT_REQ, b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"id":"x"}]}}]}\n\n', "tool_calls"),
    (CHAT, CHAT_REQ, b'data: {"choices":[{"index":0,"delta":{"reasoning_content":"hm"}}]}\n\n', "reasoning"),
    (CHAT, CHAT_REQ, b'data: {"choices":[{"index":0,"delta":{}},{"index":1,"delta":{}}]}\n\n', "several_choices"),
    (CHAT, CHAT_REQ, b'data: {"error":{"message":"boom"}}\n\n', "engine_error"),
    (CHAT, CHAT_REQ, b"data: {not json\n\n", "malformed_event"),
    (CHAT, CHAT_REQ, b"data: " + b"[" * 5000 + b"\n\n", "malformed_event"),  # msgspec: RecursionError
])
def test_streams_that_cannot_move(route, request_, sse, reason):
    t = StreamTracker(route, request_, strip_ids=False)
    t.feed(sse)
    assert t.can_migrate() == reason


def test_assert_poison_reason_of_plain_requests_is_none():
    assert poison_reason(CHAT, CHAT_REQ) is None and poison_reason(COMPLETIONS, {**CMPL_REQ, "prompt": [1, 2]}) is None


# -- by content, on the simulator: the client's stream across a move is the unbroken stream -------------------

SIM_REQ = {"model": "sim", "messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 40,
           "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


@pytest.fixture
async def sim():
    import aiohttp

    from infera.engine.sim.server import SimServer, parse_args

    async with SimServer(parse_args(["--model", "sim", "--host", "127.0.0.1", "--port", "0", "--speedup", "1000"])) as s:
        async with aiohttp.ClientSession(s.url) as http:
            yield http


async def post_sse(http, route: str, body: dict | bytes) -> bytes:
    kw = {"data": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    async with http.post(route, **kw) as r:
        assert r.status == 200, await r.text()
        return await r.read()


def client_view(out: bytes) -> tuple[str, list[int], int]:
    """What the client read: the text, the token ids (when it asked for them), completion tokens."""
    chunks = payloads(out)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    ids = [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids") or []]
    return text, ids, chunks[-1]["usage"]["completion_tokens"]


@pytest.mark.parametrize("client_ids", [False, True])
@pytest.mark.parametrize("torn", [False, True])
async def test_after_an_exact_move_at_any_token_the_client_reads_the_unbroken_stream(sim, client_ids, torn):
    request = {**SIM_REQ, "return_token_ids": True} if client_ids else SIM_REQ
    whole = StreamTracker(CHAT, request, strip_ids=False)
    ref_text, ref_ids, _ = client_view(feed_all(whole, [await post_sse(sim, CHAT, {**SIM_REQ, "return_token_ids": True})]))
    assert len(whole.output_ids) == len(ref_ids) == 40 and ref_text
    for cut in (1, 2, 13, 39):
        body, strip = request_for_migration(CHAT, request, "sim")
        t = StreamTracker(CHAT, request, strip_ids=strip)
        evs = events(await post_sse(sim, CHAT, body))
        first = feed_all(t, evs[:1 + cut] + ([evs[1 + cut][:25]] if torn else []))  # role chunk + cut tokens
        assert t.produced == cut and t.can_migrate() is None
        route, cont = t.continuation("sim")
        t.commit()
        out = first + feed_all(t, [await post_sse(sim, route, cont)])
        text, ids, completion = client_view(out)
        assert (text, completion) == (ref_text, 40), cut
        assert ids == (ref_ids if client_ids else []), cut
        assert t.done and t.output_ids == whole.output_ids


async def test_a_seam_that_repeats_or_drops_a_token_is_caught_by_content_not_by_count(sim):
    """The check above has teeth: a continuation sent from a context with a token repeated or
    dropped gives the client as many tokens as the unbroken stream, but other text."""
    whole = StreamTracker(CHAT, SIM_REQ, strip_ids=True)
    ref_text, _, _ = client_view(feed_all(whole, [await post_sse(sim, CHAT, {**SIM_REQ, "return_token_ids": True})]))
    for mangle in (lambda ids: ids + ids[-1:], lambda ids: ids[:-1]):
        body, strip = request_for_migration(CHAT, SIM_REQ, "sim")
        t = StreamTracker(CHAT, SIM_REQ, strip_ids=strip)
        first = feed_all(t, events(await post_sse(sim, CHAT, body))[:11])
        route, cont = t.continuation("sim")
        t.commit()
        req = msgspec.json.decode(cont)
        req["prompt"] = t.prompt_ids + mangle(t.output_ids)
        text, _, completion = client_view(first + feed_all(t, [await post_sse(sim, route, req)]))
        assert completion == 40 and text.count(" ") == ref_text.count(" ")  # the count is right...
        assert text != ref_text  # ...the content is not
