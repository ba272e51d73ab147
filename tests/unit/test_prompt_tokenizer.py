import asyncio
import json

import pytest

from infera.api.requests import parse_request
from infera.kv.prompt import PromptTokenizer, resolve_tokenizer_path
from infera.kv.tokenizer import BuiltinTokenizer
from tests.e2e.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tok") / "m"))


def chat(messages):
    body = json.dumps({"model": "m", "messages": messages}).encode()
    return parse_request("/v1/chat/completions", body)


def tokens(pt, parsed, route="/v1/chat/completions"):
    return asyncio.run(pt.tokens(route, parsed))


@pytest.mark.parametrize("which", ["builtin", "hf"])
def test_growing_conversation_equals_whole_prompt_encoding_and_reuses_pieces(which, tiny_dir):
    pt = PromptTokenizer.from_path(tiny_dir if which == "hf" else None)
    system = " ".join(f"rule{i}: be precise, def f{i}(x): return x*{i}" for i in range(200))
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "first"}]
    for turn in range(20):
        ids = tokens(pt, chat(msgs))
        assert ids == pt.tokenizer.encode(pt.tokenizer.render_chat(msgs), add_special_tokens=False)
        msgs = msgs + [{"role": "assistant", "content": f"reply {turn}"}, {"role": "user", "content": f"q{turn}"}]
    assert pt.segment_hits > 20 and pt._splitter is not None


def text(prompt):
    body = json.dumps({"model": "m", "prompt": prompt}).encode()
    return parse_request("/v1/completions", body)


LISTED = [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}]  # not a plain chat


@pytest.mark.parametrize("route, parsed", [("/v1/completions", text("hello")), ("/v1/chat/completions", chat(LISTED))])
def test_repeated_prompt_is_a_cache_hit(route, parsed):
    pt = PromptTokenizer.from_path(None)
    first = tokens(pt, parsed, route)
    assert tokens(pt, parsed, route) == first and (pt.hits, pt.misses) == (1, 1)


def test_a_lookup_miss_hands_its_key_to_token_ids(monkeypatch):
    pt = PromptTokenizer.from_path(None)
    parsed = chat(LISTED)
    route = "/v1/chat/completions"
    cached, keyed = pt.lookup(route, parsed)
    assert cached is None and keyed[0] is not None
    calls = []
    real = pt._key_and_work
    monkeypatch.setattr(pt, "_key_and_work", lambda *a: calls.append(a) or real(*a))
    ids = asyncio.run(pt.token_ids(route, parsed, keyed=keyed))
    assert calls == [] and (pt.hits, pt.misses) == (0, 1)  # keyed once, counted as one miss
    again, _ = pt.lookup(route, parsed)
    assert again is ids and pt.lookup(route, parsed)[0] is ids and pt.hits == 2


def test_a_plain_chat_is_assembled_from_its_cached_messages(monkeypatch):
    """With the C accelerator, a plain chat (string contents, the built-in ChatML) is keyed a
    message at a time: ``lookup`` answers it at once from its messages' cached ids, encoding the
    short new ones; a long new message is left to ``token_ids`` (a step at a time, up to the
    horizon), which then needs no second keying. A long prompt is cached by its parts only, a
    short one whole as well (a repeat is then one lookup)."""
    pt = PromptTokenizer.from_path(None)
    if pt._chatml is None:
        pytest.skip("needs the C accelerator (chat_part_keys)")
    route = "/v1/chat/completions"
    system = {"role": "system", "content": " ".join(f"rule{i}" for i in range(1000))}
    msgs = [system, {"role": "user", "content": "first"}]
    ids, keyed = pt.lookup(route, chat(msgs))
    assert ids is None and keyed[1][0] == "chat_parts"  # a long new message
    tokens(pt, chat(msgs))
    ids, keyed = pt.lookup(route, chat(msgs))
    assert list(ids) == pt.tokenizer.encode(pt.tokenizer.render_chat(msgs))
    hits = pt.segment_hits
    msgs = msgs + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "second"}]
    ids, _ = pt.lookup(route, chat(msgs))
    assert list(ids) == pt.tokenizer.encode(pt.tokenizer.render_chat(msgs))
    assert pt.segment_hits == hits + 3  # the system prompt, the first turn, the generation prompt
    long_turn = msgs + [{"role": "user", "content": "word " * 600}]
    cached, keyed = pt.lookup(route, chat(long_turn))
    assert cached is None
    calls = []
    real = pt._key_and_work
    monkeypatch.setattr(pt, "_key_and_work", lambda *a: calls.append(a) or real(*a))
    ids = asyncio.run(pt.token_ids(route, chat(long_turn), keyed=keyed))
    assert calls == [] and list(ids) == pt.tokenizer.encode(pt.tokenizer.render_chat(long_turn))
    assert pt.hits == 0 and len(pt.cache) == 6  # six distinct parts, no long prompt whole
    short = [{"role": "user", "content": "hi"}]
    first, _ = pt.lookup(route, chat(short))
    again, _ = pt.lookup(route, chat(short))
    assert again is first and pt.hits == 1  # a short one is cached whole too
