"""The kv-aware hot path's caches and shortcuts (bench/kv_path.py measures them): the block-hash
prefix cache, the tokenization horizon, the pick's layout cache, the index's C-speed scan and the
built-in tokenizer's exact pieces. Each must leave every pick exactly as it was."""
from __future__ import annotations

import asyncio
import json
import random
from array import array

import msgspec
import pytest

from infera.api.requests import parse_request
from infera.discovery.fleet import Fleet
from infera.discovery.record import WorkerRecord
from infera.engine.sim.cache import KVCache
from infera.engine.sim.kv_events import KvEventPublisher, KvEventsConfig
from infera.kv import prompt as prompt_module
from infera.kv.hashing import block_hash_array, block_hashes
from infera.kv.index import KvIndex
from infera.kv.prompt import PromptTokenizer
from infera.kv.tokenizer import BuiltinTokenizer
from infera.router.kv_aware import HASH_CACHE_STEP, BlockHashCache, KvAwarePolicy
from infera.router.policy import RoutedRequest
from infera.server.kv import KvEventsBridge

CHAT = "/v1/chat/completions"
BS = 16


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join("".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(2, 8))) for _ in range(n))


# -- BlockHashCache ---------------------------------------------------------------------------------

def test_hash_cache_equals_block_hashes_and_reuses_shared_prefixes():
    cache = BlockHashCache()
    rng = random.Random(0)
    shared = [rng.randrange(1 << 32) for _ in range(4000)]
    for i in range(150):
        tokens = shared[:rng.randrange(0, 4000)] + [rng.randrange(1 << 32) for _ in range(rng.randrange(0, 3000))]
        for seq in (tokens, array("I", tokens)):
            for bs in (1, 4, 16, 32):
                assert list(cache.hashes(seq, bs)) == block_hashes(seq, bs), (i, bs)
    assert cache.hits > 100 and cache.blocks_reused > cache.blocks_hashed


def test_hash_cache_accounting_hits_and_the_reused_step():
    cache = BlockHashCache()
    system = list(range(1000, 1000 + 40 * BS))  # 40 blocks shared
    first = system + list(range(5000, 5000 + 5 * BS))
    second = system + list(range(9000, 9000 + 7 * BS))
    assert list(cache.hashes(first, BS)) == block_hashes(first, BS)
    assert (cache.hits, cache.misses, cache.blocks_hashed) == (0, 1, 45)
    assert list(cache.hashes(second, BS)) == block_hashes(second, BS)
    # steps of 16 blocks were stored at 16 and 32 (powers of two) and 32 is the longest shared one
    assert (cache.hits, cache.misses) == (1, 1)
    assert cache.blocks_reused == 2 * HASH_CACHE_STEP and cache.blocks_hashed == 45 + 47 - 32


@pytest.mark.parametrize("budget", [0, 20_000, 200_000])
def test_hash_cache_stays_within_its_byte_budget(budget):
    cache = BlockHashCache(budget)
    rng = random.Random(budget)
    for i in range(200):
        tokens = [rng.randrange(1 << 32) for _ in range(rng.randrange(0, 5000))]
        assert list(cache.hashes(tokens, BS)) == block_hashes(tokens, BS)
        assert cache.lru.bytes <= budget
    assert (len(cache.lru) == 0) == (budget == 0)


def test_short_prompts_are_not_cached():
    cache = BlockHashCache()
    assert list(cache.hashes(list(range(HASH_CACHE_STEP * BS - 1)), BS)) == block_hashes(list(range(255)), BS)
    assert len(cache.lru) == 0 and cache.misses == 0


# -- KvIndex.first_unheld ----------------------------------------------------------------------------

def test_first_unheld():
    index = KvIndex()
    index.add_target("a", 4)
    index.add_target("b", 4)
    hashes = block_hashes(list(range(40)), 4)
    from infera.kv.events import EventBatch, Stored
    index.apply("a", EventBatch(1.0, [Stored([1, 2, 3], None, list(range(12)), 4)]))
    index.apply("b", EventBatch(1.0, [Stored([9, 8, 7, 6, 5], None, list(range(20)), 4)]))
    assert index.first_unheld(hashes) == 5
    assert index.first_unheld(hashes, 2) == 5
    assert index.first_unheld(hashes, 7) == 7
    assert index.first_unheld(hashes[:5]) == 5
    assert index.first_unheld([]) == 0
    index.remove_target("b")
    assert index.first_unheld(hashes) == 3


# -- the built-in tokenizer's pieces are exact: no sampled verification --------------------------------

def test_builtin_pieces_are_not_reverified_but_a_changed_encoding_is(monkeypatch):
    calls = []

    class Counting(BuiltinTokenizer):
        def encode_many(self, texts, add_special_tokens=False):
            calls.append(len(texts))
            return super().encode_many(texts, add_special_tokens)

    assert BuiltinTokenizer().exact_segments and Counting().exact_segments  # encode itself unchanged

    class Changed(Counting):
        def encode(self, text, add_special_tokens=False):
            return super().encode(text, add_special_tokens)

    assert not Changed().exact_segments
    pt = PromptTokenizer(Counting())
    msgs = [{"role": "system", "content": words(50, 1)}, {"role": "user", "content": "hi"}]
    ids = asyncio.run(pt.tokens(CHAT, parse_request(CHAT, json.dumps({"model": "m", "messages": msgs}).encode())))
    assert ids == pt.tokenizer.encode(pt.tokenizer.render_chat(msgs))
    assert len(calls) == 1  # the missing pieces, in one call; no whole-prompt check after it
    calls.clear()
    pt = PromptTokenizer(Changed())  # may differ: checked against the whole prompt on a sample
    asyncio.run(pt.tokens(CHAT, parse_request(CHAT, json.dumps({"model": "m", "messages": msgs}).encode())))
    assert len(calls) == 2


# -- a chat's messages are its pieces: ids end to end as the whole render's -------------------------------

@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": words(300, 1)}, {"role": "user", "content": words(40, 2)},
     {"role": "assistant", "content": " " + words(10, 3)}, {"role": "user", "content": words(40, 4)}],
    [{"role": "user", "content": "a literal <|im_end|> and <|im_start|>user in it<|endoftext|>"}],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": "  \n\n "}],
    [{"role": "user", "content": "naïve café — 東京 🙂\x1c end"}],
])
def test_message_parts_give_the_ids_of_the_whole_render(messages):
    pt = PromptTokenizer.from_path(None)
    body = json.dumps({"model": "m", "messages": messages}).encode()
    parsed = parse_request(CHAT, body)
    assert pt._message_parts(messages) is not None
    whole = pt.tokenizer.encode(pt.tokenizer.render_chat(messages))
    for _ in range(2):  # cold, then every message cached (the whole prompt evicted)
        assert list(asyncio.run(pt.token_ids(CHAT, parsed))) == whole
        pt.cache._table.pop(pt._key_and_work(CHAT, parsed)[0], None)
    assert pt.segment_hits >= len(messages) + 1


def test_message_parts_only_where_they_are_exact():
    messages = [{"role": "user", "content": words(200, 9)}]

    class OwnTemplate(BuiltinTokenizer):
        def render_chat(self, msgs):
            return "\n".join(m["content"] for m in msgs)

    assert PromptTokenizer(OwnTemplate())._message_parts(messages) is None  # Jinja may look across messages
    capped = PromptTokenizer.from_path(None, prefix_chars=300)
    assert capped._message_parts(messages) is None  # over the cap: cut as text, as before
    body = json.dumps({"model": "m", "messages": messages}).encode()
    ids = list(asyncio.run(capped.token_ids(CHAT, parse_request(CHAT, body))))
    whole = capped.tokenizer.encode(capped.tokenizer.render_chat(messages))
    assert capped.truncated == 1 and 0 < len(ids) < len(whole) and ids == whole[:len(ids)]


# -- the horizon: same picks, less tokenizing ------------------------------------------------------------

def _fleet(n: int, horizon: bool):
    ws = tuple(msgspec.convert({"worker_id": f"w{i}", "model_name": "m", "url": f"http://h:{i}", "engine": "sim",
                                "kv_block_size": BS, "kv_events_endpoint": f"tcp://127.0.0.1:{i + 1}"}, WorkerRecord)
               for i in range(n))
    index = KvIndex()
    bridge = KvEventsBridge(Fleet(), index)
    for w in ws:
        bridge._on_fleet_change(w.worker_id, w)
    prompts = PromptTokenizer.from_path(None)
    policy = KvAwarePolicy(index, prompts, overlap_weight=16.0, observer=bridge, horizon=horizon)
    engines = {}
    for i, w in enumerate(ws):
        cache = KVCache(BS, 400)
        pub = KvEventPublisher(KvEventsConfig.from_dict({"enable_kv_cache_events": True, "publisher": "zmq"}),
                               block_size=BS, seed=i)
        pub.attach(cache)
        engines[w.worker_id] = (cache, pub)
    return ws, bridge, policy, prompts, engines


def _conversations(seed: int, n: int) -> list[list[dict]]:
    """Requests in play order: conversations of 1-3 turns over 4 system prompts, some with a long
    document, interleaved two at a time."""
    rng = random.Random(seed)
    systems = [words(300, 100 + g) for g in range(4)]
    out: list[list[dict]] = []
    convs = []
    for c in range(n):
        msgs = [{"role": "system", "content": systems[rng.randrange(4)]}]
        turns = []
        for t in range(rng.randint(1, 3)):
            content = words(rng.choice([20, 60, 400]), 1000 * c + t)
            turns.append(msgs + [{"role": "user", "content": content}])
            msgs = turns[-1] + [{"role": "assistant", "content": " " + words(10, 7000 * c + t)}]
        convs.append(turns)
    while convs:
        for turns in convs[:2]:
            out.append(turns.pop(0))
        convs = [t for t in convs if t]
    return out


def _play(horizon: bool, requests: list[list[dict]]):
    ws, bridge, policy, prompts, engines = _fleet(3, horizon)
    whole = PromptTokenizer.from_path(None)
    tok = whole.tokenizer
    log = []
    for i, msgs in enumerate(requests):
        body = json.dumps({"model": "m", "messages": msgs}).encode()
        parsed = parse_request(CHAT, body)
        req = RoutedRequest(route=CHAT, body=body, parsed=parsed, model="m", stream=True, request_id=str(i))
        asyncio.run(policy.prepare(req))
        w = policy.pick(ws, req)
        policy.on_started(w, req)
        log.append((w.worker_id, req.state["predicted_hit_blocks"]))
        full = list(asyncio.run(whole.token_ids(CHAT, parsed)))
        cache, pub = engines[w.worker_id]
        assert cache.allocate(i, full) is not None
        reply = tok.encode(" " + words(10, 0))[:8]
        for t in reply:
            cache.append_token(i, t)
        cache.free(i)
        seq = pub.flush()
        req.state["served"] = True
        policy.on_finished(w, req)
        if seq is not None:
            bridge._on_batch(w.worker_id, seq, pub.buffered()[-1][1])
        log[-1] += (req.state["charge"][0] if "charge" in req.state else None,)
    return log, policy, prompts


def test_the_horizon_leaves_every_pick_as_it_was():
    requests = _conversations(3, 40)
    with_horizon, policy, prompts = _play(True, requests)
    without, _, plain = _play(False, requests)
    assert [(w, hit) for w, hit, _ in with_horizon] == [(w, hit) for w, hit, _ in without]
    assert prompts.horizon_cuts > 10 and prompts.horizon_chars_skipped > 10_000  # it did stop early
    assert plain.horizon_cuts == 0
    assert not policy.unhashed and not policy.active  # every estimate released with its request


def test_a_cut_prompt_is_charged_for_its_whole_length_by_estimate():
    ws, bridge, policy, prompts, _ = _fleet(2, True)
    policy._block_sizes.add(BS)  # as after a first pick
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": words(3000, 5)}]
    body = json.dumps({"model": "m", "messages": msgs}).encode()
    req = RoutedRequest(route=CHAT, body=body, parsed=parse_request(CHAT, body), model="m", stream=False,
                        request_id="r")
    asyncio.run(policy.prepare(req))
    w = policy.pick(ws, req)
    full = len(prompts.tokenizer.encode(prompts.tokenizer.render_chat(msgs))) // BS
    assert prompts.horizon_cuts == 1 and len(req.state["tokens"]) < 3 * BS  # nobody holds any of it
    charged = req.state["charge"][0]
    assert 0.7 * full <= charged <= 1.3 * full
    assert prompts.misses == 1 and len(prompts.cache) > 0  # the cut prompt is not cached whole...
    asyncio.run(policy.prepare(RoutedRequest(route=CHAT, body=body, parsed=req.parsed, model="m", stream=False,
                                             request_id="r2")))
    assert prompts.hits == 0  # ...so it is looked at again (its pieces are cached)
    policy.on_started(w, req)
    assert policy.active_blocks(w.worker_id) == len(req.state["blocks"])
    assert req.state["unhashed"] > 0 and policy.unhashed[w.worker_id] == req.state["unhashed"]
    policy.forget(w.worker_id)  # the worker left: its estimate goes with it
    assert w.worker_id not in policy.unhashed
    policy.on_finished(w, req)  # finishing after forget finds nothing to release
    assert w.worker_id not in policy.unhashed


@pytest.mark.parametrize("new_words, cut", [(60, False), (2000, True)])
def test_the_horizon_runs_only_for_a_long_new_text(new_words, cut):
    """A chat turn's new message (a few hundred characters) is encoded whole: the horizon's walks
    through the views would cost more. A new document is cut where no worker can hold it."""
    ws, bridge, policy, prompts, _ = _fleet(2, True)
    policy._block_sizes.add(BS)
    system = {"role": "system", "content": words(300, 7)}

    def prepared(msgs):
        body = json.dumps({"model": "m", "messages": msgs}).encode()
        req = RoutedRequest(route=CHAT, body=body, parsed=parse_request(CHAT, body), model="m", stream=False,
                            request_id="r")
        asyncio.run(policy.prepare(req))
        return req

    prepared([system, {"role": "user", "content": "hi"}])  # the system prompt's ids are cached now
    cuts = prompts.horizon_cuts
    msgs = [system, {"role": "user", "content": words(new_words, 8)}]
    req = prepared(msgs)
    whole = prompts.tokenizer.encode(prompts.tokenizer.render_chat(msgs))
    assert ("chains" in req.state) == cut and prompts.horizon_cuts - cuts == int(cut)
    assert (len(req.state["tokens"]) < len(whole)) if cut else list(req.state["tokens"]) == whole


def test_probed_pieces_are_bounded(monkeypatch):
    monkeypatch.setattr(prompt_module, "_PROBED_CAP", 3)
    ws, bridge, policy, prompts, _ = _fleet(1, True)
    policy._block_sizes.add(BS)
    for i in range(8):
        msgs = [{"role": "user", "content": words(2000, 50 + i)}]
        body = json.dumps({"model": "m", "messages": msgs}).encode()
        req = RoutedRequest(route=CHAT, body=body, parsed=parse_request(CHAT, body), model="m", stream=False,
                            request_id=str(i))
        asyncio.run(policy.prepare(req))
    assert prompts.horizon_cuts == 8 and len(prompts._probed) == 3


# -- the pick's layout cache ---------------------------------------------------------------------------

def test_layout_follows_the_candidates_object():
    ws, bridge, policy, prompts, _ = _fleet(3, True)

    def pick(candidates):
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
        req = RoutedRequest(route=CHAT, body=body, parsed=parse_request(CHAT, body), model="m", stream=False,
                            request_id="r")
        asyncio.run(policy.prepare(req))
        return policy.pick(candidates, req).worker_id

    assert {pick(ws) for _ in range(6)} == {"w0", "w1", "w2"}
    assert policy._layout_of is ws
    fewer = ws[:2]  # the fleet changed (a new tuple): w2 left
    policy.forget("w2")
    assert {pick(fewer) for _ in range(6)} == {"w0", "w1"}
    assert policy._layout_of is fewer
    as_list = list(ws)  # a list may be changed by its owner: never kept
    pick(as_list)
    assert policy._layout_of is fewer


def test_blocks_always_match_the_final_tokens_under_the_prefix_cap():
    """A capped prompt loses its last few ids after the horizon saw them (``_cut_ids``): the pick's
    blocks are those of the ids it keeps, never a block the horizon hashed past them."""
    ws, bridge, policy, _, _ = _fleet(2, True)
    policy._block_sizes.add(BS)
    policy.prompts.configure(prefix_chars=3000)  # over _HORIZON_MIN_CHARS: the horizon runs
    for i in range(6):
        msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": words(900, 300 + i)}]
        body = json.dumps({"model": "m", "messages": msgs}).encode()
        req = RoutedRequest(route=CHAT, body=body, parsed=parse_request(CHAT, body), model="m", stream=False,
                            request_id=str(i))
        asyncio.run(policy.prepare(req))
        policy.pick(ws, req)
        assert list(req.state["blocks"]) == block_hashes(req.state["tokens"], BS)
    assert policy.prompts.truncated == 6 and policy.prompts.horizon_cuts == 6


@pytest.mark.parametrize("chain_tokens, kept", [(48, 40), (48, 47), (32, 47), (16, 100), (64, 64)])
def test_the_pick_hashes_the_kept_tokens_from_the_horizons_chain(chain_tokens, kept):
    """The horizon hashed ``chain_tokens`` ids; the prompt kept ``kept`` (fewer when the prefix cap
    dropped a tail after it): the pick's blocks are exactly those of the kept ids."""
    _, _, policy, _, _ = _fleet(1, True)
    ids = list(range(500, 600))
    req = RoutedRequest(route=CHAT, body=b"", parsed=None, model="m", stream=False, request_id="r",
                        state={"tokens": array("I", ids[:kept]), "chains": {BS: block_hash_array(ids[:chain_tokens], BS)}})
    assert list(policy._hashes(req, BS)) == block_hashes(ids[:kept], BS)


# -- the finish's landed claims start after the pick's view hit ------------------------------------------

@pytest.mark.parametrize("events_meanwhile, claimed_from", [
    ([], 5),                                   # nothing happened: the blocks after the view's 5
    ([("store", 5)], 6),                       # block 5's event came in first: no claim for it
    ([("remove", 1)], 5),                      # block 1 evicted meanwhile: the event says so, no claim
    ([("remove", 1), ("store", 5)], 6),
])
def test_a_finish_claims_only_the_blocks_its_view_did_not_hold(events_meanwhile, claimed_from):
    from infera.kv.events import EventBatch, Removed, Stored
    bs = 4
    index = KvIndex()
    index.add_target("a", bs)
    policy = KvAwarePolicy(index, PromptTokenizer.from_path(None))
    a = WorkerRecord(worker_id="a", url="http://a", model_name="m", kv_block_size=bs)
    prompt = list(range(100, 132))  # 8 blocks
    hashes = block_hashes(prompt, bs)
    index.apply("a", EventBatch(1.0, [Stored([1, 2, 3, 4, 5], None, prompt[:5 * bs], bs)]))  # engine hash i+1
    body = json.dumps({"model": "m", "prompt": prompt}).encode()
    req = RoutedRequest(route="/v1/completions", body=body, parsed=parse_request("/v1/completions", body), model="m",
                        stream=False, request_id="r")
    asyncio.run(policy.prepare(req))
    assert policy.pick([a], req) is a and req.state["view_hit"] == 5
    policy.on_started(a, req)
    for kind, block in events_meanwhile:
        event = (Removed([block + 1]) if kind == "remove"
                 else Stored([block + 1], block, prompt[block * bs:(block + 1) * bs], bs))
        index.apply("a", EventBatch(2.0, [event]))
    req.state["served"] = True
    policy.on_finished(a, req)
    assert list(policy.landed["a"]) == hashes[claimed_from:]
