"""The C accelerator (infera.kv._native) against its Python twins: the same values from the same
inputs, on edge cases and on seeded random streams. Skipped where the accelerator is not built or
is turned off; ``tests/unit/test_native_guard.py`` (never skipped) fails under
``INFERA_NATIVE_REQUIRED=1`` (``make test``) when it is missing."""
from __future__ import annotations

import json
import random
from array import array

import pytest
import xxhash

from infera.kv import hashing
from infera.kv.events import Cleared, EventBatch, Removed, Stored
from infera.kv.index import FULL_ATTENTION_KINDS, NativeKvIndex, PyKvIndex
from infera.kv.native import native, why_not
from infera.kv.tokenizer import _PIECE_RE_ASCII, BuiltinTokenizer, NUM_RESERVED_IDS


pytestmark = pytest.mark.skipif(native is None, reason=f"C accelerator: {why_not}")


# --- block hashes ------------------------------------------------------------------------------

@pytest.mark.parametrize("block_size", [1, 2, 3, 16, 32, 64, 65, 128, 257])
def test_block_hashes_equal_python_for_every_input_kind(block_size):
    rng = random.Random(block_size)
    for n in (0, 1, block_size - 1, block_size, 7 * block_size + 3):
        tokens = [rng.randrange(0, 2**32) for _ in range(n)]
        for parent in (0, 1, 2**63 + 5, 2**64 - 1):
            want = hashing._py_block_hashes(tokens, block_size, parent)
            for form in (tokens, tuple(tokens), array("I", tokens), memoryview(array("I", tokens))):
                assert native.block_hashes(form, block_size, parent) == want


@pytest.mark.parametrize("block_size", [1, 16, 100])
def test_block_hash_array_is_the_same_chain(block_size):
    tokens = list(range(7, 7 + 3 * block_size + 2))
    for parent in (0, 99):
        want = hashing._py_block_hashes(tokens, block_size, parent)
        got = hashing.block_hash_array(tokens, block_size, parent)
        assert got.typecode == "Q" and list(got) == want
        assert native.block_hash_bytes(tokens, block_size, parent) == array("Q", want).tobytes()


@pytest.mark.parametrize("tokens, error", [([-1], OverflowError), ([2**32], OverflowError), (["7"], TypeError),
                                           ([1.0], TypeError)])
def test_block_hashes_refuse_what_array_refuses(tokens, error):
    with pytest.raises(error):
        native.block_hashes(tokens * 4, 4)
    with pytest.raises(error):
        hashing._py_block_hashes(tokens * 4, 4)


def test_block_hashes_read_only_full_blocks():
    # a bad id in the partial last block is never read, by either version
    assert native.block_hashes([1, 2, 3, 4, -1], 4) == hashing._py_block_hashes([1, 2, 3, 4, -1], 4)
    assert native.block_hashes([1, 2], 0) == [] == hashing._py_block_hashes([1, 2], 0)


def test_prefix_keys_are_the_streaming_xxh3_128_digests():
    rng = random.Random(5)
    for length in (0, 63, 64, 64 * 9 + 17):
        data = bytes(rng.randrange(256) for _ in range(length))
        digest, want = xxhash.xxh3_128(), []
        for end in range(64, length + 1, 64):
            digest.update(data[end - 64:end])
            want.append(b"tag" + digest.digest())
        assert native.prefix_keys(data, 64, b"tag") == want
    with pytest.raises(ValueError):
        native.prefix_keys(b"abc", 0, b"")


# --- the built-in tokenizer ------------------------------------------------------------------------

def _regex_ids(text: str) -> list[int]:
    return [xxhash.xxh3_64_intdigest(p) % 50_000 + NUM_RESERVED_IDS for p in _PIECE_RE_ASCII.findall(text.encode())]


@pytest.mark.parametrize("text", [
    "", " ", "  ", "a", " a", "  a", "it's", "they'll've", "'s", "''s", "'", "' s", "x'", "'ll", "'l", "'ve'",
    "a1b22", " 1", "  1", "__x", " __", "!!", " !!", "a!'s", "\n", " \n", "\n x", "\t\t\ty", "a \t", "end  ",
    "\x00\x07\x7f", "\x0b\x0c", "mixed CASE words, punctuation... and 12 numbers_here",
])
def test_encode_builtin_is_the_regex_on_edge_cases(text):
    assert native.encode_builtin(text) == _regex_ids(text)


def test_encode_builtin_is_the_regex_on_random_ascii():
    rng = random.Random(7)
    alphabet = "ab ZQ09_'!.,-\t\n\r\x0b\x0c\x00\x7f" + "'s'll've're" + "    "
    for _ in range(20_000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 40)))
        assert native.encode_builtin(text) == _regex_ids(text), repr(text)


@pytest.mark.parametrize("text", ["café", "a\x1cb", "\x1f", "日本"])
def test_encode_builtin_leaves_other_text_to_the_str_pattern(text):
    assert native.encode_builtin(text) is None


def test_builtin_tokenizer_ids_do_not_depend_on_the_accelerator(monkeypatch):
    text = "System: you are helpful.\n\nUser's question: what's 2+2? It's__ fine\x1c ok café " * 50
    with_native = BuiltinTokenizer().encode(text)
    monkeypatch.setattr("infera.kv.tokenizer.native", None)
    assert BuiltinTokenizer().encode(text) == with_native


# --- the index: random event streams through both implementations -------------------------------

BS = 4


class Engine:
    """A toy engine with a prefix cache: stores and evicts blocks, with engine hashes of one kind
    (ints, signed ints or bytes), sometimes publishing odd events (misaligned, bad tokens, unknown
    parents, lower tiers, clears) to exercise every path."""

    def __init__(self, rng: random.Random, kind: str, tiers: bool = True) -> None:
        self.rng = rng
        self.kind = kind
        self.tiers = tiers  # False: a GPU-only engine that never clears (the payload fast path's case)
        self.held: list = []  # engine hashes held on the GPU
        self.lower: dict[str, list] = {}  # tier -> engine hashes held there
        self.next = 0

    def ehash(self):
        self.next += 1
        base = self.rng.getrandbits(64)
        if self.kind == "signed":
            return base - 2**63
        if self.kind == "bytes":
            return base.to_bytes(8, "little") * 4
        return base

    def events(self, tokens_pool: list[list[int]]) -> list:
        rng = self.rng
        out = []
        for _ in range(rng.randrange(1, 6)):
            r = rng.random()
            if r < 0.5:
                seq = rng.choice(tokens_pool)
                start = rng.randrange(0, 4)
                nblocks = rng.randrange(1, 6)
                toks = seq[start * BS:(start + nblocks) * BS]
                if not toks:
                    continue
                offloaded = [h for hs in self.lower.values() for h in hs]
                r2 = rng.random()
                if start == 0:
                    parent = None
                elif self.held and r2 < 0.8:
                    parent = rng.choice(self.held)
                elif offloaded and r2 < 0.95:
                    parent = rng.choice(offloaded)  # loaded back from a lower tier
                else:
                    parent = self.ehash()  # unknown: dropped
                hashes = [self.ehash() for _ in range(len(toks) // BS)]
                if rng.random() < 0.05:
                    hashes = hashes[:-1] or [self.ehash(), self.ehash()]  # misaligned
                if rng.random() < 0.03:
                    toks = toks[:-1] + [-5]  # a bad token id
                if rng.random() < 0.05:
                    toks = toks + toks[:2]  # a partial block after the full ones
                medium = rng.choice([None] * 8 + ["GPU", "gpu"] + (["CPU", "cpu_pinned", "DISK"] if self.tiers else []))
                kind = rng.choice([None] * 8 + sorted(FULL_ATTENTION_KINDS) + ["sliding_window"])
                bs = BS if rng.random() < 0.97 else 2 * BS
                out.append(Stored(hashes, parent, toks, bs, kind, medium))
                if medium is None or medium.upper() == "GPU":
                    self.held.extend(hashes)
                else:
                    self.lower.setdefault(medium.upper(), []).extend(hashes)
            elif r < 0.9 and self.held:
                k = rng.randrange(1, 4)
                gone = [self.held.pop(rng.randrange(len(self.held))) for _ in range(min(k, len(self.held)))]
                if rng.random() < 0.1:
                    gone.append(self.ehash())  # unknown: a no-op
                out.append(Removed(gone, rng.choice([None] * 8 + ["GPU"])))
            elif r < 0.9 and self.lower:
                tier = rng.choice(sorted(self.lower))
                held = self.lower[tier]
                gone = [held.pop(rng.randrange(len(held))) for _ in range(min(2, len(held)))]
                out.append(Removed(gone + [self.ehash()], rng.choice([tier, tier.lower()])))
            elif r < 0.92 and self.tiers:
                medium = rng.choice([None, None, "GPU", "CPU"])
                out.append(Cleared(medium))
                if medium in (None, "GPU"):
                    self.held.clear()
                if medium is None:
                    self.lower.clear()
                elif medium == "CPU":
                    self.lower.pop("CPU", None)
        return out


def _same(py: PyKvIndex, nat: NativeKvIndex, keys: list[str], probes: list[list[int]]) -> None:
    assert len(py) == len(nat)
    assert sorted(py.keys()) == sorted(nat.keys())
    for k in keys:
        assert py.has_target(k) == nat.has_target(k)
        assert py.block_count(k) == nat.block_count(k), k
        assert py.mapped_count(k) == nat.mapped_count(k), k
        assert py.tier_block_counts(k) == nat.tier_block_counts(k), k
        assert py.lower_block_count(k) == nat.lower_block_count(k), k
        ps, ns = py.stats(k), nat.stats(k)
        if ps is not None:
            for field in ("stored_events", "stored_blocks", "removed_events", "removed_blocks", "dropped_events",
                          "skipped_events", "misaligned_events", "cleared", "lower_events", "lower_stored_blocks",
                          "lower_removed_blocks", "lower_cleared", "resets", "batches", "last_batch_ts"):
                assert getattr(ps, field) == getattr(ns, field), (k, field)
    with_unknown = keys + ["nobody"]
    assert py.block_counts(with_unknown) == nat.block_counts(with_unknown) == [py.block_count(k) for k in with_unknown]
    for hashes in probes:
        as_array = array("Q", hashes)  # how the policy carries chains: read in place by the C walks
        assert py.match(hashes, keys) == nat.match(hashes, keys) == nat.match(as_array, keys)
        assert py.first_unheld(hashes) == nat.first_unheld(as_array)
        assert [py.match_one(hashes, k) for k in keys] == [nat.match_one(as_array, k) for k in keys]
        assert [py.match_one(hashes, k) for k in keys] == [nat.match_one(hashes, k) for k in keys]
        assert py.first_unheld(hashes) == nat.first_unheld(hashes)
        assert py.first_unheld(hashes, 2) == nat.first_unheld(hashes, 2)
        assert [[py.holds(k, h) for h in hashes] for k in keys] == [[nat.holds(k, h) for h in hashes] for k in keys]
        starts = py.match(hashes, keys)
        assert py.match_lower(hashes, keys, starts) == nat.match_lower(hashes, keys, starts)


@pytest.mark.parametrize("seed", range(12))
def test_index_implementations_agree_on_random_streams(seed):
    rng = random.Random(seed)
    n_targets = rng.choice([3, 5, 70])  # 70: more than 64 bits, several words a holder entry
    keys = [f"w{i}" for i in range(n_targets)]
    pool = [[rng.randrange(0, 60) for _ in range(10 * BS)] for _ in range(6)]  # few distinct prefixes
    probes = [hashing.block_hashes(p, BS) for p in pool] + [[]]
    engines = {k: Engine(rng, rng.choice(["int", "int", "signed", "bytes"])) for k in keys}
    py, nat = PyKvIndex(), NativeKvIndex()
    for k in keys:
        py.add_target(k, BS)
        nat.add_target(k, BS)
    ts = 0.0
    for step in range(300 if n_targets < 10 else 120):
        k = rng.choice(keys)
        r = rng.random()
        if r < 0.02:
            py.reset(k)
            nat.reset(k)
            engines[k].held.clear()
        elif r < 0.04:
            assert py.remove_target(k) == nat.remove_target(k)
            engines[k].held.clear()
        elif r < 0.06:
            bs = rng.choice([BS, BS, 2 * BS])
            py.add_target(k, bs)
            nat.add_target(k, bs)
            if py.block_size(k) != BS:  # a block size change forgets the view
                py.add_target(k, BS)
                nat.add_target(k, BS)
                engines[k].held.clear()
        else:
            ts += rng.choice([1.0, 0.5, -0.25])
            batch = EventBatch(ts, engines[k].events(pool))
            assert py.apply(k, batch) == nat.apply(k, batch)
        if step % 10 == 0:
            _same(py, nat, keys, probes)
    _same(py, nat, keys, probes)


def test_native_index_keeps_no_stale_bits_for_a_list_of_keys():
    """``match``/``block_counts`` remember the bits of the last list of keys: a target removed or
    added since, or the same list changed in place, must not reuse them."""
    nat = NativeKvIndex()
    for k in ("a", "b"):
        nat.add_target(k, BS)
    hashes = hashing.block_hashes(list(range(3 * BS)), BS)
    nat.apply("b", EventBatch(1.0, [Stored(block_hashes=[11, 12, 13], parent=None, token_ids=list(range(3 * BS)),
                                           block_size=BS)]))
    keys = ["a", "b"]
    assert nat.match(hashes, keys) == [0, 3] and nat.block_counts(keys) == [0, 3]
    keys[0], keys[1] = "b", "a"  # changed in place
    assert nat.match(hashes, keys) == [3, 0] and nat.block_counts(keys) == [3, 0]
    nat.remove_target("b")
    assert nat.match(hashes, keys) == [0, 0] and nat.block_counts(keys) == [0, 0]
    nat.add_target("c", BS)  # takes b's freed bit: must not inherit its view
    nat.add_target("b", BS)
    assert nat.match(hashes, ["c", "b"]) == [0, 0] and nat.block_counts(["c", "b"]) == [0, 0]
    assert nat._view.counts([-1, 99]) == [0, 0]


def test_native_view_with_the_largest_bit_words():
    nat = NativeKvIndex()
    keys = [f"t{i}" for i in range(130)]  # three words per holder entry
    for k in keys:
        nat.add_target(k, BS)
    toks = list(range(8 * BS))
    for i, k in enumerate(keys):
        n = i % 9
        if n:
            nat.apply(k, EventBatch(1.0, [Stored(list(range(1000 * i, 1000 * i + n)), None, toks[:n * BS], BS)]))
    want = [i % 9 for i in range(130)]
    assert nat.match(hashing.block_hashes(toks, BS), keys) == want
    for k in keys[::3]:
        nat.remove_target(k)
    assert nat.match(hashing.block_hashes(toks, BS), keys) == [0 if i % 3 == 0 else i % 9 for i in range(130)]


# --- the index: payloads applied from their bytes ---------------------------------------------------

from pathlib import Path  # noqa: E402

import msgspec  # noqa: E402

from infera.kv.events import KvEventDecodeError, decoder_for, encode_batch  # noqa: E402

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "kv_events"


def _like_the_bridge(idx, key: str, payload: bytes, engine: str = "vllm") -> tuple[int, float] | None:
    """What KvEventsBridge does with a payload: the index's fast path, else decode and apply."""
    done = idx.apply_payload(key, payload)
    if done is not None:
        return done
    try:
        batch = decoder_for(engine)(payload)
    except KvEventDecodeError:
        return None
    return idx.apply(key, batch), batch.ts


@pytest.mark.parametrize("fixture, engine, bs", [
    *[(f"vllm_seq00{i}", "vllm", 32) for i in range(7)],
    ("vllm_bytes_seq000", "vllm", 32), ("vllm_bytes_seq001", "vllm", 32),
    *[(f, "sglang", 16) for f in ("sglang_stored", "sglang_stored_child", "sglang_bigram", "sglang_removed_cleared",
                                   "sglang_salted", "sglang_metadata", "sglang_0_5_15", "sglang_0_4_10", "sglang_old")],
    ("atom_0_1_5", "atom", 16), ("atom_map", "atom", 16), ("sim_map", "sim", 16), ("vllm_legacy_array", "vllm", 16),
])
def test_fixture_payloads_apply_alike(fixture, engine, bs):
    payload = (FIX / f"{fixture}.msgpack").read_bytes()
    py, nat = PyKvIndex(), NativeKvIndex()
    for idx in (py, nat):
        idx.add_target("w", bs)
    if fixture.startswith("vllm_seq") and fixture != "vllm_seq000":  # the history before it, for parents
        for i in range(int(fixture[-1])):
            earlier = (FIX / f"vllm_seq00{i}.msgpack").read_bytes()
            _like_the_bridge(nat, "w", earlier)
            py.apply("w", decoder_for("vllm")(earlier))
    want = py.apply("w", decoder_for(engine)(payload))
    got = _like_the_bridge(nat, "w", payload, engine)
    assert got is not None and got[0] == want
    _same(py, nat, ["w"], [])


def test_the_fast_path_takes_the_steady_state_payloads():
    nat = NativeKvIndex()
    nat.add_target("w", 32)
    for i in range(6):  # vLLM's stores and one-block removals; seq006 ends in a clear (decoded instead)
        assert nat.apply_payload("w", (FIX / f"vllm_seq00{i}.msgpack").read_bytes()) is not None, i
    assert nat.apply_payload("w", (FIX / "vllm_seq006.msgpack").read_bytes()) is None
    assert nat.apply_payload("nobody", b"\x92\xcb" + bytes(8) + b"\x90") == (0, 0.0)


def _enc(obj) -> bytes:
    return msgspec.msgpack.encode(obj)


STORE = {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None,
         "token_ids": list(range(8)), "block_size": 4}


@pytest.mark.parametrize("name, payload, fast", [
    ("plain", _enc([1.5, [STORE]]), True),
    ("int-ts", _enc([7, [STORE]]), True),
    ("rank", _enc([1.5, [STORE], 3]), True),
    ("nil-rank", _enc([1.5, [STORE], None]), True),
    ("extra-keys", _enc([1.5, [{**STORE, "lora_id": None, "lora_name": "x", "group_idx": 0,
                               "extra": {"a": [1, 2.5, b"z", [None, True]]}}]]), True),
    ("full-kind", _enc([1.5, [{**STORE, "kv_cache_spec_kind": "full_attention"}]]), True),
    ("sliding-kind", _enc([1.5, [{**STORE, "kv_cache_spec_kind": "sliding_window"}]]), True),
    ("gpu", _enc([1.5, [{**STORE, "medium": "GPU"}]]), True),
    ("gpu-lower-case", _enc([1.5, [{**STORE, "medium": "gpu"}]]), True),
    ("bytes-hashes", _enc([1.5, [{**STORE, "block_hashes": [b"a" * 32, b"b" * 32]}]]), True),
    ("signed-hashes", _enc([1.5, [{**STORE, "block_hashes": [-1, -(2**63)]}]]), True),
    ("misaligned", _enc([1.5, [{**STORE, "block_hashes": [11]}]]), True),
    ("unknown-parent", _enc([1.5, [{**STORE, "parent_block_hash": 999}]]), True),
    ("other-block-size", _enc([1.5, [{**STORE, "block_size": 8}]]), True),
    ("store-then-remove", _enc([1.5, [STORE, {"type": "BlockRemoved", "block_hashes": [12, 13]}]]), True),
    ("removal-with-kind-key", _enc([1.5, [STORE, {"type": "BlockRemoved", "block_hashes": [12],
                                                  "kv_cache_spec_kind": "mamba"}]]), True),
    ("cpu-tier", _enc([1.5, [{**STORE, "medium": "CPU"}]]), False),
    ("clear", _enc([1.5, [STORE, {"type": "AllBlocksCleared"}]]), False),
    ("bigram", _enc([1.5, [{**STORE, "token_ids": [[1, 2]] * 8}]]), False),
    ("negative-token", _enc([1.5, [{**STORE, "token_ids": [-1] + list(range(7))}]]), False),
    ("wide-token", _enc([1.5, [{**STORE, "token_ids": [2**32] + list(range(7))}]]), False),
    ("str-hash", _enc([1.5, [{**STORE, "block_hashes": ["a", "b"]}]]), False),
    ("unknown-type", _enc([1.5, [{"type": "BlockTransferred", "block_hashes": [1]}]]), False),
    ("no-parent-key", _enc([1.5, [{k: v for k, v in STORE.items() if k != "parent_block_hash"}]]), False),
    ("array-form", _enc([1.5, [["BlockStored", [11, 12], None, list(range(8)), 4]]]), False),
    ("not-a-batch", _enc({"ts": 1.5}), False),
    ("trailing-bytes", _enc([1.5, [STORE]]) + b"\xc0", False),
    ("truncated", _enc([1.5, [STORE]])[:-3], False),
    ("empty", b"", False),
])
def test_payload_cases_apply_alike(name, payload, fast):
    py, nat = PyKvIndex(), NativeKvIndex()
    for idx in (py, nat):
        idx.add_target("w", 4)
        idx.apply("w", EventBatch(0.5, [Stored([13], None, list(range(100, 104)), 4)]))  # something to remove
    assert (nat.apply_payload("w", payload) is not None) == fast
    nat2 = NativeKvIndex()
    nat2.add_target("w", 4)
    nat2.apply("w", EventBatch(0.5, [Stored([13], None, list(range(100, 104)), 4)]))
    got = _like_the_bridge(nat2, "w", payload)
    try:
        batch = decoder_for("vllm")(payload)
    except KvEventDecodeError:
        assert got is None
    else:
        assert got == (py.apply("w", batch), batch.ts)
    _same(py, nat2, ["w"], [hashing.block_hashes(list(range(8)), 4)])


@pytest.mark.parametrize("seed", range(6))
def test_random_payloads_and_their_corruptions_apply_alike(seed):
    rng = random.Random(1000 + seed)
    keys = ["a", "b", "c"]
    pool = [[rng.randrange(0, 60) for _ in range(10 * BS)] for _ in range(6)]
    probes = [hashing.block_hashes(p, BS) for p in pool]
    engines = {k: Engine(rng, rng.choice(["int", "signed", "bytes"]), tiers=k == "c") for k in keys}
    py, nat = PyKvIndex(), NativeKvIndex()
    for k in keys:
        py.add_target(k, BS)
        nat.add_target(k, BS)
    fast = 0
    for step in range(400):
        k = rng.choice(keys)
        payload = encode_batch(EventBatch(float(step), engines[k].events(pool), rng.choice([None, 0, 1])))
        if rng.random() < 0.1:  # corrupted on the wire: a flipped byte, or cut short
            b = bytearray(payload)
            if rng.random() < 0.5:
                b[rng.randrange(len(b))] = rng.randrange(256)
            else:
                del b[rng.randrange(len(b)):]
            payload = bytes(b)
        done = nat.apply_payload(k, payload)
        fast += done is not None
        got = done if done is not None else _like_the_bridge(nat, k, payload)
        try:
            batch = decoder_for("vllm")(payload)
        except KvEventDecodeError:
            assert got is None
        else:
            assert got == (py.apply(k, batch), batch.ts)
        if step % 20 == 0:
            _same(py, nat, keys, probes)
    _same(py, nat, keys, probes)
    assert fast > 150  # most of the GPU-only engines' payloads took the fast path


# --- BlockCounter ----------------------------------------------------------------------------------

from infera.kv.counts import PyBlockCounter  # noqa: E402


def test_block_counter_agrees_with_the_dict_one():
    rng = random.Random(3)
    universe = [rng.getrandbits(64) for _ in range(50)] + [0, 2**64 - 1]
    c, d = native.BlockCounter(), PyBlockCounter()
    for step in range(3000):
        blocks = rng.sample(universe, rng.randrange(0, 12))
        given = array("Q", blocks) if step % 2 else blocks  # a chain (array('Q')) or a list
        if rng.random() < 0.55:
            c.add(given)
            d.add(given)
        else:
            c.remove(given)
            d.remove(given)
        if step % 100 == 0:
            assert sorted(c.items()) == sorted(d.items())
            assert len(c) == len(d) and bool(c) == bool(d)
            probe = rng.sample(universe, 10)
            assert [h in c for h in probe] == [h in d for h in probe]
            assert [c.count(h) for h in probe] == [d.count(h) for h in probe]
            for start in (0, 3, 20):
                assert c.run(probe, start) == d.run(probe, start) == c.run(array("Q", probe), start)
    assert c.run([], 5) == d.run([], 5) == 5


def test_block_counter_ignores_what_is_no_block_hash():
    c = native.BlockCounter()
    c.add([-1, 2**64, "x", 5])
    assert len(c) == 1 and 5 in c and -1 not in c and "x" not in c
    c.remove([-1, "x", 7])
    assert len(c) == 1


# --- chat part keys -----------------------------------------------------------------------------------

import asyncio  # noqa: E402

from infera.api.requests import parse_request  # noqa: E402
from infera.kv.prompt import PromptTokenizer  # noqa: E402
from infera.kv.tokenizer import CHATML_AFFIXES, chatml_parts, normalize_messages  # noqa: E402

CHAT = "/v1/chat/completions"


def _parsed(messages):
    return parse_request(CHAT, json.dumps({"model": "m", "messages": messages}).encode())


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief. " * 300}, {"role": "user", "content": "x"},
     {"role": "assistant", "content": None}, {"role": "user", "content": ""}],
    [{"role": "user", "content": "café – naïve 日本 🙂"}],
    [{"role": "tool", "content": "<|im_end|> looks special"}],
])
def test_chat_part_keys_are_the_rendered_parts_keys(messages):
    parsed = _parsed(messages)
    whole, keys, lengths = native.chat_part_keys(parsed.messages, *CHATML_AFFIXES, b"m", b"k")
    parts = chatml_parts(normalize_messages([{"role": m["role"], "content": m["content"] or ""} for m in messages]))
    assert keys == [xxhash.xxh3_128_digest(p.encode()) + b"m" for p in parts]
    assert lengths == [len(p) for p in parts]
    assert whole == xxhash.xxh3_128_digest(b"".join(keys)) + b"k"


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": [{"type": "text", "text": "parts"}]}],  # a list: rendered in Python
    [{"role": "", "content": "no role"}],
    [{"role": "user", "content": "lone \ud800 surrogate"}],
    [],
])
def test_chat_part_keys_leave_other_messages_to_python(messages):
    # (as dicts: a request body cannot carry a lone surrogate, msgspec refuses it)
    assert native.chat_part_keys(messages, *CHATML_AFFIXES, b"m", b"k") is None


def test_prompt_ids_are_the_same_with_and_without_the_accelerator(monkeypatch):
    rng = random.Random(11)
    words = ["alpha", "beta", "gamma's", "delta", "  ", "\n", "42", "naïve", "x_y", "!?", "<|im_start|>"]
    chats = []
    for _ in range(60):
        msgs = [{"role": "system", "content": " ".join(rng.choice(words) for _ in range(rng.randrange(1, 300)))}]
        for t in range(rng.randrange(1, 4)):
            msgs.append({"role": "user", "content": " ".join(rng.choice(words) for _ in range(rng.randrange(0, 40)))})
            if rng.random() < 0.2:
                msgs.append({"role": "user", "content": [{"type": "text", "text": "listed"}]})
            msgs.append({"role": "assistant", "content": rng.choice([None, "ok", " ".join(words)])})
        chats.append(msgs)

    def ids(pt):
        return [list(asyncio.run(pt.token_ids(CHAT, _parsed(m)))) for m in chats + chats]  # twice: cached

    with_native = ids(PromptTokenizer.from_path(None, prefix_chars=2000))
    monkeypatch.setattr("infera.kv.prompt.native", None)
    monkeypatch.setattr("infera.kv.tokenizer.native", None)
    assert ids(PromptTokenizer.from_path(None, prefix_chars=2000)) == with_native


# --- LandedClaims ---------------------------------------------------------------------------------

from infera.kv.counts import PyLandedClaims  # noqa: E402


@pytest.mark.parametrize("seed", range(4))
def test_landed_claims_agree_with_the_ordered_dict_one(seed):
    rng = random.Random(seed)
    universe = [rng.getrandbits(64) for _ in range(60)]
    c, d = native.LandedClaims(), PyLandedClaims()
    now = 100.0
    for step in range(2000):
        now += rng.random()
        r = rng.random()
        if r < 0.45:
            blocks = rng.sample(universe, rng.randrange(0, 15))
            given = array("Q", blocks) if step % 2 else blocks
            finished = now - rng.random() * 3
            cap = rng.choice([5, 30, 1 << 16])
            c.land(given, finished, now + 2.0, cap)
            d.land(given, finished, now + 2.0, cap)
        elif r < 0.9:
            hashes = rng.sample(universe, 20)
            hit = rng.randrange(0, 5)
            caught_up = now - rng.random() * 4
            assert c.extend(array("Q", hashes), hit, caught_up, now) == d.extend(hashes, hit, caught_up, now)
        else:
            c.expire(now)
            d.expire(now)
        assert list(c) == list(d) and len(c) == len(d)
        probe = rng.choice(universe)
        assert (probe in c) == (probe in d) and c.get(probe) == d.get(probe)
