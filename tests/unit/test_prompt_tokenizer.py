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


def test_repeated_prompt_is_a_cache_hit():
    pt = PromptTokenizer.from_path(None)
    parsed = chat([{"role": "user", "content": "hello"}])
    first = tokens(pt, parsed)
    assert tokens(pt, parsed) == first and (pt.hits, pt.misses) == (1, 1)


def test_a_lookup_miss_hands_its_key_to_token_ids(monkeypatch):
    pt = PromptTokenizer.from_path(None)
    parsed = chat([{"role": "user", "content": "hello there"}])
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


def test_a_mismatch_turns_piecewise_encoding_off():
    class Quirky(BuiltinTokenizer):
        def encode(self, text, add_special_tokens=False):
            ids = super().encode(text, add_special_tokens)
            return ids + [7] if len(text) > 40 else ids  # not splittable: whole != pieces

    pt = PromptTokenizer(Quirky())
    msgs = [{"role": "user", "content": "x" * 60}]
    ids = tokens(pt, chat(msgs))
    assert pt._splitter is None
    assert ids == pt.tokenizer.encode(pt.tokenizer.render_chat(msgs))


def test_completions_prompts():
    pt = PromptTokenizer.from_path(None)
    ids = tokens(pt, parse_request("/v1/completions", b'{"model":"m","prompt":[5,6,7]}'), "/v1/completions")
    assert ids == [5, 6, 7]
    assert tokens(pt, parse_request("/v1/completions", b'{"model":"m","prompt":["a","b"]}'), "/v1/completions") == []
    text = tokens(pt, parse_request("/v1/completions", b'{"model":"m","prompt":["hello world"]}'), "/v1/completions")
    assert text == pt.tokenizer.encode("hello world", add_special_tokens=True)


def test_resolve_tokenizer_path(tiny_dir, tmp_path):
    assert resolve_tokenizer_path(tiny_dir) == tiny_dir
    assert resolve_tokenizer_path(tiny_dir + "/tokenizer.json") == tiny_dir
    with pytest.raises(ValueError, match="no tokenizer.json"):
        resolve_tokenizer_path(str(tmp_path))
    with pytest.raises(ValueError):
        resolve_tokenizer_path("org/not-a-local-model")
