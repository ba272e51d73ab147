"""Bounded routing tokenization: the prefix cap keeps every hashed block the whole prompt's, the
caches stay within their byte budget, and big prompts never hold the event loop."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import random
import string
import time
import tracemalloc
from array import array

import pytest

from infera.api.requests import parse_request
from infera.kv.hashing import block_hashes
from infera.kv import prompt as prompt_module
from infera.kv.prompt import ByteLRU, PromptTokenizer, _cut_ids
from infera.kv.tokenizer import BuiltinTokenizer, normalize_messages, prefix_cut
from infera.router.kv_aware import hash_stepwise
from infera.server.cli import parse_args
from tests.e2e.tiny_model import build_tiny_model

CHAT, COMP = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tok") / "m"))


def words(n_chars: int, seed: int = 0, alphabet: str = string.ascii_lowercase) -> str:
    rng = random.Random(seed)
    out, size = [], 0
    while size < n_chars:
        w = "".join(rng.choices(alphabet, k=rng.randint(1, 9)))
        sep = rng.choice([" ", " ", " ", "\n", ", ", ". ", "  ", "\t"])
        out.append(w + sep)
        size += len(w) + len(sep)
    return "".join(out)[:n_chars]


def chat(content: str, system: str = "You are terse."):
    body = json.dumps({"model": "m", "messages": [{"role": "system", "content": system},
                                                   {"role": "user", "content": content}]}).encode()
    return parse_request(CHAT, body)


def completion(prompt):
    return parse_request(COMP, json.dumps({"model": "m", "prompt": prompt}).encode())


def ids_of(pt: PromptTokenizer, parsed, route=CHAT) -> list[int]:
    return asyncio.run(pt.tokens(route, parsed))


# -- the prefix cap ---------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["builtin", "hf"])
@pytest.mark.parametrize("cap", [97, 1000, 4096, 20000])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("tail", [None, 0])
def test_capped_prompt_hashes_are_a_prefix_of_the_full_prompts(which, cap, seed, tail, tiny_dir, monkeypatch):
    """``tail=0``: without dropping the last ids, the word-boundary cut alone is exact for these
    tokenizers (a cut inside a word is not)."""
    if tail is not None:
        monkeypatch.setattr(prompt_module, "_CUT_TAIL_TOKENS", tail)
    path = tiny_dir if which == "hf" else None
    full = PromptTokenizer.from_path(path, prefix_chars=1 << 30)
    capped = PromptTokenizer.from_path(path, prefix_chars=cap)
    content = words(50_000, seed)
    tok = full.tokenizer
    rendered = tok.render_chat(normalize_messages([{"role": "system", "content": "You are terse."},
                                                   {"role": "user", "content": content}]))
    for parsed, route, text in ((chat(content), CHAT, rendered), (completion(content), COMP, content)):
        truncated = capped.truncated
        whole, cut = ids_of(full, parsed, route), ids_of(capped, parsed, route)
        assert capped.truncated == truncated + 1 and len(cut) % 2 == 1
        assert cut == whole[:len(cut)]  # token ids already: every block hash follows
        for bs in (1, 4, 16, 32):
            covered = block_hashes(cut, bs)
            assert covered == block_hashes(whole, bs)[:len(covered)]
        # Not a degenerate prefix: the cut lands within a few words of the cap.
        assert len(cut) >= len(tok.encode(text[:max(0, cap - 100)], add_special_tokens=route == COMP)) - 10


@pytest.mark.parametrize("which", ["builtin", "hf"])
def test_prompts_under_the_cap_are_untouched(which, tiny_dir):
    path = tiny_dir if which == "hf" else None
    content = words(3000, 7)
    a = PromptTokenizer.from_path(path, prefix_chars=1 << 30)
    b = PromptTokenizer.from_path(path, prefix_chars=len(content) + 200)
    assert ids_of(a, chat(content)) == ids_of(b, chat(content)) and b.truncated == 0
    ids = list(range(1, 5000))
    assert ids_of(PromptTokenizer.from_path(path, prefix_chars=1000), completion(ids), COMP) == ids[:1000]


@pytest.mark.parametrize("text, limit, separators, expected", [
    ("hello world again", 100, None, 17),  # fits: whole
    ("hello world again", 13, None, 11),  # cut before " again"'s space...
    ("hello world again", 11, None, 11),  # ...exactly at the space
    ("hello world again", 10, None, 5),  # inside "world": back to the previous boundary
    ("hello, world again", 7, None, 0),  # after punctuation is no boundary (Llama-3 takes the newlines)
    ("x" * 1000, 500, None, 0),  # no boundary at all
    ("ab<|im_end|>" + "x" * 1000, 500, ["<|im_end|>"], 12),  # after a special token
    ("ab" + "x" * 1000 + "<|im_end|>", 1005, ["<|im_end|>"], 0),  # a special token past the cap: no help
    ("a " + "y" * 200_000, 150_000, None, 1),  # far back: found by the windowed regex scan
])
def test_prefix_cut(text, limit, separators, expected):
    assert prefix_cut(text, limit, separators) == expected


def test_cut_ids_drop_a_tail_and_keep_an_odd_count():
    assert _cut_ids(array("I", range(20))).tolist() == list(range(11))
    assert _cut_ids(array("I", range(19))).tolist() == list(range(11))
    assert _cut_ids(array("I", range(5))).tolist() == []


def test_builtin_sliced_scan_matches_the_unsliced_encoding():
    """The built-in tokenizer scans long text in slices cut at word boundaries: same ids."""
    spec = importlib.util.spec_from_file_location("tok_ref", importlib.util.find_spec("infera.kv.tokenizer").origin)
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    ref._ENCODE_SLICE_CHARS = 1 << 40  # one slice: findall over the whole text, as before slicing
    tok, reference = BuiltinTokenizer(), ref.BuiltinTokenizer()
    rng = random.Random(3)
    alphabet = string.ascii_letters + "  \n\t\r.,'_-0123456789é日" + "'s"
    for _ in range(60):
        text = "".join(rng.choice(alphabet) for _ in range(rng.choice([50, 9000, 30000])))
        text = text.replace("Q", "<|im_end|>")
        assert tok.encode(text) == reference.encode(text)
        assert [i for part in tok.iter_encode(text) for i in part] == reference.encode(text)
    assert tok.encode("z" * 40000) == reference.encode("z" * 40000)


def test_stepwise_hashing_matches_block_hashes():
    tokens = array("I", range(100, 100 + 70_001))
    for bs in (1, 16, 64):
        assert list(asyncio.run(hash_stepwise(tokens, bs))) == block_hashes(tokens, bs)


# -- byte-bounded caches ---------------------------------------------------------------------------

def test_byte_lru_accounting_stays_within_the_bound():
    lru = ByteLRU(1 << 20)
    rng = random.Random(0)
    inserted = 0
    for i in range(400):
        value = array("I", range(rng.randint(0, 40_000)))
        key = i.to_bytes(16, "little")
        inserted += ByteLRU.cost(key, value)
        lru.put(key, value)
        assert lru.bytes <= lru.max_bytes
        assert lru.bytes == sum(ByteLRU.cost(k, v) for k, (v, _) in lru._table.items())
    assert inserted > 20 * lru.max_bytes and len(lru) > 1
    lru.put(b"huge", array("I", range(1 << 20)))  # larger than the whole budget: not kept
    assert lru.get(b"huge") is None and lru.bytes <= lru.max_bytes
    lru.resize(1000)
    assert lru.bytes <= 1000


def test_accounted_bytes_cover_what_the_entries_really_take():
    """The accounting is honest: memory actually allocated for entries ≤ what they are charged."""
    for n in (2000, 5600, 22000):  # just after the table doubled: the most an entry takes
        _check_accounted_bytes(n)


def _check_accounted_bytes(n):
    import infera.kv.prompt as prompt_module

    lru = ByteLRU(1 << 30)
    # Only what this file and the cache's module allocate: other threads left by earlier tests
    # (tokenizer pools, servers winding down) allocate too, and tracemalloc traces them all.
    mine = [tracemalloc.Filter(True, __file__), tracemalloc.Filter(True, prompt_module.__file__)]
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot().filter_traces(mine)
        for i in range(n):
            lru.put(i.to_bytes(16, "little") + b"s", array("I", range(i % 50)))
        after = tracemalloc.take_snapshot().filter_traces(mine)
    finally:
        tracemalloc.stop()
    used = sum(d.size_diff for d in after.compare_to(before, "filename"))
    assert lru.bytes // 2 < used <= lru.bytes


@pytest.mark.parametrize("which", ["builtin", "hf"])
def test_prompt_caches_hold_their_budget_with_distinct_big_chats(which, tiny_dir):
    """The issue's case: distinct ~0.7 MB chats (each a whole-prompt entry and segment entries)
    used to add ~10 MB each; now the caches never pass their budget, evicting the oldest."""
    budget = 2 << 20
    pt = PromptTokenizer.from_path(tiny_dir if which == "hf" else None, cache_bytes=budget, prefix_chars=200_000)
    content = words(700_000, 11)
    chats = [chat(f"conversation {i}: " + content[i:]) for i in range(8)]
    for parsed in chats:
        ids_of(pt, parsed)
        assert pt.cache.bytes <= budget
    assert pt.cache.bytes > budget // 4  # in use, not just empty
    ids_of(pt, chats[-1])
    ids_of(pt, chats[0])
    assert (pt.hits, pt.misses) == (1, 9)  # the newest was kept, the oldest evicted
    pt.close()


# -- off the event loop --------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["builtin", "hf"])
def test_a_big_prompt_never_holds_the_loop(which, tiny_dir):
    """While a 1 MiB prompt is tokenized, a ticker on the same loop keeps ticking: the built-in
    tokenizer runs a slice at a time on the loop, a HF one in a thread without the GIL. (Before:
    one call on the loop, 0.1–1.5 s.) Generous bound: CI boxes are noisy."""
    pt = PromptTokenizer.from_path(tiny_dir if which == "hf" else None, cache_bytes=0)
    parsed = chat(words(1 << 20, 5))

    async def main():
        gaps, done = [], asyncio.Event()

        async def ticker():
            while not done.is_set():
                t = time.perf_counter()
                await asyncio.sleep(0.002)
                gaps.append(time.perf_counter() - t)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        started = time.perf_counter()
        ids = await pt.token_ids(CHAT, parsed)
        elapsed = time.perf_counter() - started
        done.set()
        await task
        return ids, gaps, elapsed

    ids, gaps, elapsed = asyncio.run(main())
    assert len(ids) > 1000 and pt.truncated == 1
    # a tick at least every 50 ms of tokenizing (with the C tokenizer the whole prompt may take
    # less than that: then one tick is all there is room for)
    assert len(gaps) >= max(1, int(elapsed / 0.05)), f"the ticker hardly ran in {elapsed * 1000:.0f} ms"
    assert max(gaps) < 0.25, f"the loop was held for {max(gaps) * 1000:.0f} ms"
    pt.close()


# -- flags -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, environ, prefix, cache", [
    ([], {}, 512 * 1024, 64 * 1024 * 1024),
    ([], {"INFERA_ROUTER_PREFIX_CHARS": "1000", "INFERA_ROUTER_TOKENIZER_CACHE_BYTES": "0"}, 1000, 0),
    (["--router-prefix-chars", "2000", "--router-tokenizer-cache-bytes", "4096"],
     {"INFERA_ROUTER_PREFIX_CHARS": "1000"}, 2000, 4096),
])
def test_prefix_and_cache_flags(argv, environ, prefix, cache):
    from infera.server.main import InferaServer
    from tests.integration.conftest import NoDiscovery

    args = parse_args(["--etcd-endpoint", "x:1", *argv], environ=environ)
    assert (args.router_prefix_chars, args.router_tokenizer_cache_bytes) == (prefix, cache)
    server = InferaServer(args, discovery=NoDiscovery())
    prompts = server.tokenizers.prompts_for("m")
    assert (prompts.prefix_chars, prompts.cache.max_bytes) == (prefix, cache)


@pytest.mark.parametrize("argv", [["--router-prefix-chars", "0"], ["--router-tokenizer-cache-bytes", "-1"]])
def test_bad_prefix_and_cache_flags_are_refused(argv):
    with pytest.raises(SystemExit):
        parse_args(["--etcd-endpoint", "x:1", *argv], environ={})


def test_hf_prompt_tokenizer_turns_rayon_off_unless_told(tiny_dir, monkeypatch):
    """A HF tokenizer runs in our threads; its own rayon pool on top starved the loop (see prompt.py)."""
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    PromptTokenizer.from_path(None)
    assert "TOKENIZERS_PARALLELISM" not in os.environ  # nothing to do for the built-in one
    PromptTokenizer.from_path(tiny_dir)
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    PromptTokenizer.from_path(tiny_dir)
    assert os.environ["TOKENIZERS_PARALLELISM"] == "true"  # the operator's setting wins
