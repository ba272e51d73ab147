"""Tokenization, chat templates and output text of the simulated engine."""
from __future__ import annotations

import json

import pytest
import xxhash

from infera.kv.tokenizer import (
    BUILTIN_SPECIAL_TOKENS,
    IMAGE_MARKER,
    NUM_RESERVED_IDS,
    OUTPUT_WORDS,
    BuiltinTokenizer,
    ChatTemplateError,
    HFTokenizer,
    content_to_text,
    load_tokenizer,
    split_pieces,
)


@pytest.mark.parametrize("text", [
    "Hello, world!",
    "  leading and trailing  ",
    "tabs\tand\nnewlines\n\n  indented",
    "it's we'll they've",
    "snake_case __dunder__ x1 2024-01-02 3.14",
    "ünïcödé 中文 emoji 🙂 <|im_start|>",
    "",
])
def test_pieces_cover_the_whole_text(text):
    assert "".join(split_pieces(text)) == text


def test_builtin_ids_are_deterministic_hashes():
    tok = BuiltinTokenizer()
    ids = tok.encode("Hello world, hello!")
    assert ids == BuiltinTokenizer().encode("Hello world, hello!")
    assert ids == [xxhash.xxh3_64_intdigest(p.encode()) % 50_000 + 100 for p in ["Hello", " world", ",", " hello", "!"]]
    assert all(NUM_RESERVED_IDS <= i < NUM_RESERVED_IDS + 50_000 for i in ids)


def test_builtin_special_tokens_use_reserved_ids():
    tok = BuiltinTokenizer()
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == BUILTIN_SPECIAL_TOKENS["<|im_start|>"] and ids[-1] == BUILTIN_SPECIAL_TOKENS["<|im_end|>"]
    assert all(i >= NUM_RESERVED_IDS for i in ids[1:-1])


def test_builtin_chat_format():
    tok = BuiltinTokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.render_chat(messages) == text
    assert tok.encode_chat(messages) == tok.encode(text)


@pytest.mark.parametrize("content,expected", [
    ("plain", "plain"),
    (None, ""),
    ([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "a\nb"),
    ([{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
     f"look\n{IMAGE_MARKER}"),
])
def test_content_parts(content, expected):
    assert content_to_text(content) == expected


@pytest.mark.parametrize("messages", [
    [],
    "hi",
    [{"content": "no role"}],
    [{"role": "user", "content": 5}],
    [{"role": "user", "content": [{"type": "weird"}]}],
    [{"role": "user", "content": [{"type": "text"}]}],
])
def test_bad_messages_raise(messages):
    with pytest.raises(ChatTemplateError):
        BuiltinTokenizer().encode_chat(messages)


def test_output_vocab_round_trips_through_builtin_tokenizer():
    tok = BuiltinTokenizer()
    ids = tok.output_token_ids
    assert len(ids) == len(set(ids)) == len(OUTPUT_WORDS)
    for token_id in ids:
        text = tok.output_text(token_id)
        assert text.startswith(" ") and text[1:] in OUTPUT_WORDS
        # Re-tokenizing generated text gives back the same ids (multi-turn prefix caching works).
        assert tok.encode(text) == [token_id]
    assert tok.decode_output(ids[:3]) == "".join(tok.output_text(i) for i in ids[:3])


def make_hf_dir(tmp_path, chat_template: str | None, words=("hello", "world", "user", "assistant", ":")):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2}
    for w in words:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path, vocab


def test_hf_tokenizer_dir_with_chat_template(tmp_path):
    template = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {{ eos_token }} "
                "{% endfor %}{% if add_generation_prompt %}assistant :{% endif %}")
    model_dir, vocab = make_hf_dir(tmp_path, template)
    tok = load_tokenizer(str(model_dir))
    assert isinstance(tok, HFTokenizer)
    rendered = tok.render_chat([{"role": "user", "content": "hello world"}])
    assert rendered == "<s>user : hello world </s> assistant :"
    ids = tok.encode_chat([{"role": "user", "content": "hello world"}])
    v = vocab
    assert ids == [v["<s>"], v["user"], v[":"], v["hello"], v["world"], v["</s>"], v["assistant"], v[":"]]
    assert tok.encode_chat([{"role": "user", "content": "hello world"}]) == ids  # deterministic
    assert tok.encode("hello nope") == [v["hello"], v["[UNK]"]]
    # Output ids stay distinct even though every word is [UNK] in this vocabulary.
    assert len(set(tok.output_token_ids)) == len(tok.output_token_ids) == len(OUTPUT_WORDS)


def test_hf_template_errors_become_chat_template_errors(tmp_path):
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}x"
    model_dir, _ = make_hf_dir(tmp_path, template)
    tok = load_tokenizer(str(model_dir))
    with pytest.raises(ChatTemplateError, match="first must be user"):
        tok.encode_chat([{"role": "assistant", "content": "hi"}])


def test_hf_dir_without_template_falls_back_to_chatml(tmp_path):
    model_dir, _ = make_hf_dir(tmp_path, None)
    tok = load_tokenizer(str(model_dir))
    assert tok.render_chat([{"role": "user", "content": "hi"}]).startswith("<|im_start|>user\nhi")


def test_model_name_or_dir_without_tokenizer_is_builtin(tmp_path):
    assert isinstance(load_tokenizer("meta-llama/Llama-3-8B"), BuiltinTokenizer)
    assert isinstance(load_tokenizer(str(tmp_path)), BuiltinTokenizer)


# -- the ASCII fast path gives the str pattern's ids ---------------------------------------------------
from hypothesis import given, settings, strategies as st  # noqa: E402
import itertools  # noqa: E402
import re  # noqa: E402
import xxhash  # noqa: E402

from infera.kv.tokenizer import _PIECE_RE, BUILTIN_SPECIAL_TOKENS, BuiltinTokenizer, NUM_RESERVED_IDS  # noqa: E402


def _str_path_ids(text: str) -> list[int]:
    """The ids by the str pattern alone (what the tokenizer did before the ASCII fast path), after
    the split at literal special tokens that comes before either path. (Hypothesis draws string
    constants from the code under test, so a text like '<|im_start|>' does come up.)"""
    ids: list[int] = []
    for chunk in re.split("(" + "|".join(re.escape(t) for t in BUILTIN_SPECIAL_TOKENS) + ")", text):
        if chunk in BUILTIN_SPECIAL_TOKENS:
            ids.append(BUILTIN_SPECIAL_TOKENS[chunk])
        else:
            ids += [xxhash.xxh3_64_intdigest(p.encode("utf-8")) % 50_000 + NUM_RESERVED_IDS
                    for p in _PIECE_RE.findall(chunk)]
    return ids


_ASCII_EDGES = "a Z0_'\t\n\r\x0b\x0c\x1c\x1f\x00!-s"


def test_ascii_fast_path_matches_the_str_pattern_on_every_short_string_of_edge_characters():
    tok = BuiltinTokenizer()
    for n in (1, 2, 3):
        for chars in itertools.product(_ASCII_EDGES, repeat=n):
            text = "".join(chars)
            assert tok.encode(text) == _str_path_ids(text), repr(text)


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=st.characters(max_codepoint=127), max_size=200))
def test_ascii_fast_path_matches_the_str_pattern_on_any_ascii_text(text):
    assert BuiltinTokenizer().encode(text) == _str_path_ids(text)


# Any text, with literal special tokens (and pieces of them) mixed in: the reference splits at them
# as encode() does, so no drawn text needs skipping.
_SPECIAL_BITS = [*BUILTIN_SPECIAL_TOKENS, "<|", "|>", "<|im_start", "im_end|>"]
mixed_text = st.lists(st.one_of(st.text(max_size=30), st.sampled_from(_SPECIAL_BITS)), max_size=8).map("".join)


@settings(max_examples=200, deadline=None)
@given(mixed_text)
def test_mixed_text_matches_the_str_pattern(text):
    assert BuiltinTokenizer().encode(text) == _str_path_ids(text)


@pytest.mark.parametrize("text", ["<|im_start|>", "a<|im_end|>b c", "<|endoftext|><|im_start|>x", "<|im_start", "<<|im_end|>>"])
def test_ascii_fast_path_matches_the_str_pattern_around_literal_special_tokens(text):
    assert BuiltinTokenizer().encode(text) == _str_path_ids(text)
