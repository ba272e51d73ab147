"""parse_cache_hints (reference §3.9): every encoding of a cache hint, table-driven, on plain dict
bodies (OpenAI and Anthropic) and on the parsed OpenAI request the router keeps."""
from __future__ import annotations

import msgspec
import pytest
import xxhash

from infera.api.anthropic import translate_request
from infera.api.cache_hints import LONG, NONE, SHORT, parse_cache_hints
from infera.api.requests import parse_request


def text(t: str = "x", **cc) -> dict:
    block = {"type": "text", "text": t}
    if cc:
        block["cache_control"] = cc
    return block


def anthropic(*, system=None, tools=None, content=None) -> dict:
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": content or [text()]}]}
    if system is not None:
        body["system"] = system
    if tools is not None:
        body["tools"] = tools
    return body


def openai(**fields) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


# (name, body, retention, explicit)
CASES = [
    ("no hint", openai(), NONE, False),
    # OpenAI prompt_cache_retention, any case and blanks
    ("24h", openai(prompt_cache_retention="24h"), LONG, True),
    ("1h", openai(prompt_cache_retention="1h"), LONG, True),
    ("long", openai(prompt_cache_retention=" LONG "), LONG, True),
    ("5m", openai(prompt_cache_retention="5m"), SHORT, True),
    ("short", openai(prompt_cache_retention="short"), SHORT, True),
    ("none", openai(prompt_cache_retention="none"), NONE, True),
    ("off", openai(prompt_cache_retention="off"), NONE, True),
    ("disabled", openai(prompt_cache_retention="Disabled"), NONE, True),
    ("unknown value ignored", openai(prompt_cache_retention="2w"), NONE, False),
    ("not a string ignored", openai(prompt_cache_retention=5), NONE, False),
    # prompt_cache_key alone is a short hint; with a retention, the retention says how long
    ("key alone", openai(prompt_cache_key="conv-1"), SHORT, True),
    ("blank key is no key", openai(prompt_cache_key="   "), NONE, False),
    ("key + none", openai(prompt_cache_key="conv-1", prompt_cache_retention="none"), NONE, True),
    ("key + long", openai(prompt_cache_key="conv-1", prompt_cache_retention="24h"), LONG, True),
    ("key + unknown", openai(prompt_cache_key="conv-1", prompt_cache_retention="2w"), SHORT, True),
    ("session_id alone sets no retention", openai(session_id="s"), NONE, False),
    # Anthropic cache_control, wherever it may stand
    ("system ephemeral", anthropic(system=[text(type="ephemeral")]), SHORT, True),
    ("system 1h", anthropic(system=[text(type="ephemeral", ttl="1h")]), LONG, True),
    ("message 1hr", anthropic(content=[text(type="ephemeral", ttl="1hr")]), LONG, True),
    ("message 60m", anthropic(content=[text(type="ephemeral", ttl="60m")]), LONG, True),
    ("message 3600s", anthropic(content=[text(type="ephemeral", ttl="3600s")]), LONG, True),
    ("message long", anthropic(content=[text(type="ephemeral", ttl="long")]), LONG, True),
    ("message 5m", anthropic(content=[text(type="ephemeral", ttl="5m")]), SHORT, True),
    ("message 5min", anthropic(content=[text(type="ephemeral", ttl="5min")]), SHORT, True),
    ("message 300s", anthropic(content=[text(type="ephemeral", ttl="300s")]), SHORT, True),
    ("message short", anthropic(content=[text(type="ephemeral", ttl="short")]), SHORT, True),
    ("unknown ttl ignored", anthropic(content=[text(type="ephemeral", ttl="2d")]), NONE, False),
    ("other type ignored", anthropic(content=[text(type="persistent", ttl="1h")]), NONE, False),
    ("not an object ignored", anthropic(content=[{"type": "text", "text": "x", "cache_control": "1h"}]), NONE, False),
    ("tool 1h", anthropic(tools=[{"name": "f", "input_schema": {}, "cache_control": {"type": "ephemeral",
                                                                                  "ttl": "1h"}}]), LONG, True),
    ("thinking blocks cannot be cached",
     anthropic(content=[{"type": "thinking", "thinking": "t", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
                        {"type": "redacted_thinking", "data": "d", "cache_control": {"type": "ephemeral"}}]),
     NONE, False),
    ("the longest marker wins", anthropic(system=[text(type="ephemeral")],
                                          content=[text(type="ephemeral", ttl="1h"), text(type="ephemeral")]),
     LONG, True),
    # both encodings in one body: the longest wins (none < short < long)
    ("openai none + marker short", {**anthropic(content=[text(type="ephemeral")]), "prompt_cache_retention": "none"},
     SHORT, True),
    ("openai long + marker short", {**anthropic(content=[text(type="ephemeral")]), "prompt_cache_retention": "1h"},
     LONG, True),
    ("OpenAI content part marker", openai(messages=[{"role": "user", "content": [text(type="ephemeral", ttl="1h")]}]),
     LONG, True),
    # odd shapes give no hint and never raise
    ("messages not a list", {"messages": 5, "system": 7, "tools": "x"}, NONE, False),
    ("message not an object", {"messages": [3, None, "s"]}, NONE, False),
    ("content not blocks", {"messages": [{"role": "user", "content": 3}]}, NONE, False),
]


@pytest.mark.parametrize("name, body, retention, explicit", CASES, ids=[c[0] for c in CASES])
def test_retention_table(name, body, retention, explicit):
    hints = parse_cache_hints(body)
    assert (hints.retention, hints.explicit) == (retention, explicit)


@pytest.mark.parametrize("body, session", [
    (openai(prompt_cache_key=" conv-1 "), "conv-1"),
    (openai(session_id=" s-1 "), "s-1"),
    (openai(prompt_cache_key="k", session_id="s"), "k"),
    (openai(prompt_cache_key="  ", session_id="s"), "s"),
    (openai(), None),
])
def test_session_id(body, session):
    assert parse_cache_hints(body).session_id == session


def key(ref: str) -> int:
    return xxhash.xxh3_64_intdigest(ref.encode())


@pytest.mark.parametrize("body, multimodal, keys", [
    (openai(), False, []),
    (openai(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": " http://a/1.png "}},
                                                   {"type": "text", "text": "x"},
                                                   {"type": "image_url", "image_url": "http://a/2.png"}]}]),
     True, [key("http://a/1.png"), key("http://a/2.png")]),
    (openai(messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "QUJD"}}]}]),
     True, [key("QUJD")]),
    # Anthropic images by source, system blocks first (document order)
    ({"system": [{"type": "image", "source": {"type": "url", "url": "http://s"}}],
      "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "AAA"}}]}]},
     True, [key("http://s"), key("AAA")]),
    ({"messages": [{"role": "user", "content": [{"type": "document", "url": "http://d"}]}]}, True, [key("http://d")]),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, True, []),
    (openai(images=["http://i"]), True, [key("http://i")]),
    (openai(images=[]), False, []),
    (openai(audio={"voice": "x"}), True, []),
])
def test_multimodal_and_image_keys(body, multimodal, keys):
    hints = parse_cache_hints(body)
    assert (hints.multimodal, hints.image_keys) == (multimodal, keys)


@pytest.mark.parametrize("fields, retention, explicit", [
    ({}, NONE, False),
    ({"prompt_cache_retention": "24h"}, LONG, True),
    ({"prompt_cache_key": "k"}, SHORT, True),
    ({"prompt_cache_retention": "off", "prompt_cache_key": "k"}, NONE, True),
])
def test_the_parsed_request_reads_the_same(fields, retention, explicit):
    body = openai(**fields)
    parsed = parse_request("/v1/chat/completions", msgspec.json.encode(body))
    hints = parse_cache_hints(parsed)
    assert (hints.retention, hints.explicit) == (retention, explicit) == (
        parse_cache_hints(body).retention, parse_cache_hints(body).explicit)


def test_a_parsed_content_part_marker_counts():
    body = openai(messages=[{"role": "user", "content": [text(type="ephemeral", ttl="1h")]}])
    assert parse_cache_hints(parse_request("/v1/chat/completions", msgspec.json.encode(body))).retention == LONG


@pytest.mark.parametrize("ttl, retention", [(None, SHORT), ("5m", SHORT), ("1h", LONG)])
def test_anthropic_markers_arrive_translated(ttl, retention):
    """An Anthropic request reaches the router as its OpenAI translation: the marker became
    prompt_cache_retention, which gives the same retention as the marker itself."""
    cc = {"type": "ephemeral", **({"ttl": ttl} if ttl else {})}
    raw = anthropic(system=[text(**cc)])
    chat = translate_request(msgspec.json.encode(raw)).body
    parsed = parse_request("/v1/chat/completions", msgspec.json.encode(chat))
    assert parse_cache_hints(parsed).retention == parse_cache_hints(raw).retention == retention
