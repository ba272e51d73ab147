"""The KV index bounded by bytes (issue 30 item 3): past ``max_bytes`` the coldest blocks go, in the
C view and in the Python twin alike (the same blocks), the model's bytes track what the C tables
allocate, an eviction round is amortised over the blocks it evicts, and the flag parses
(flag > env > default)."""
from __future__ import annotations

import random

import pytest

from infera.kv.bound import (BLOCK_BYTES, ENTRY_BYTES, HOLDER_BYTES, default_max_bytes, model_bytes,
                             parse_size)
from infera.kv.events import Cleared, EventBatch, Removed, Stored
from infera.kv.hashing import block_hashes
from infera.kv.index import NativeKvIndex, PyKvIndex
from infera.kv.native import native

BS = 4
needs_native = pytest.mark.skipif(native is None, reason="the C accelerator is not built")


def _kinds() -> list[type]:
    return [PyKvIndex] + ([NativeKvIndex] if native is not None else [])


def _chain(base: int, n: int) -> list[int]:
    """Tokens of ``n`` blocks, distinct per ``base``."""
    return [base * 1_000_003 + i for i in range(n * BS)]


def _store(idx, key: str, tokens: list[int], first_eh: int) -> None:
    n = len(tokens) // BS
    idx.apply(key, EventBatch(0.0, [Stored(list(range(first_eh, first_eh + n)), None, tokens, BS)]))


# --- the model, the flag ----------------------------------------------------------------------


@pytest.mark.parametrize(("text", "want"), [
    ("0", 0), ("4096", 4096), ("512Mi", 512 << 20), ("4G", 4 << 30), ("4GiB", 4 << 30), ("64k", 64 << 10),
    ("1.5K", 1536), ("10B", 10),
])
def test_sizes_parse(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("text", ["", "x", "-1", "4Q", "512i", "4 G B"])
def test_bad_sizes_are_refused(text):
    import argparse
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(text)


def test_default_is_an_eighth_of_memtotal(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16384000 kB\nMemFree:  1 kB\n")
    assert default_max_bytes(str(meminfo)) == 16384000 * 1024 // 8
    assert default_max_bytes(str(tmp_path / "missing")) == (32 << 30) // 8


def test_flag_beats_env_beats_default():
    from infera.gaie.cli import build_parser as gaie_parser
    from infera.server.cli import build_parser

    assert build_parser({}).parse_args([]).kv_index_max_bytes == default_max_bytes()
    env = {"INFERA_KV_INDEX_MAX_BYTES": "1G"}
    assert build_parser(env).parse_args([]).kv_index_max_bytes == 1 << 30
    assert build_parser(env).parse_args(["--kv-index-max-bytes", "512Mi"]).kv_index_max_bytes == 512 << 20
    assert build_parser({}).parse_args(["--kv-index-max-bytes", "0"]).kv_index_max_bytes == 0
    with pytest.raises(SystemExit):
        build_parser({"INFERA_KV_INDEX_MAX_BYTES": "lots"}).parse_args([])
    # the Gateway picker builds the same routing stack: it takes the flag too
    assert gaie_parser(env).parse_args(["--kv-index-max-bytes", "2G"]).kv_index_max_bytes == 2 << 30


@needs_native
@pytest.mark.parametrize("shared", [False, True])
def test_the_model_tracks_what_the_c_tables_allocate(shared):
    """The model's bytes are within -20%/+35% of GpuView.memory_bytes() for 300 targets, blocks
    distinct or held by all (a bound in model bytes bounds the tables' real bytes)."""
    idx = NativeKvIndex()
    keys = [f"w{t}" for t in range(300)]
    for k in keys:
        idx.add_target(k, BS)
    base = idx.memory_bytes()
    for t, k in enumerate(keys):
        _store(idx, k, _chain(0 if shared else t + 1, 200), 1)
    real = idx.memory_bytes() - base
    held = idx.bound_stats().bytes_held
    assert held == model_bytes(len(idx), sum(idx.block_counts(keys)))
    assert 0.8 * real <= held <= 1.35 * real, (held, real)


# --- eviction at the bound ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", _kinds())
def test_cold_blocks_go_first_and_the_bound_holds(kind):
    """Three conversations stored in turn on two targets; the first is matched again (warm), so the
    second is the coldest: it goes, the warm one stays whole, the bytes end under the bound."""
    cold_enough = model_bytes(3 * 150, 3 * 150 * 2)  # what three chains on two targets hold
    idx = kind(max_bytes=cold_enough - 2 * (BLOCK_BYTES + 2 * ENTRY_BYTES + HOLDER_BYTES) * 40)
    for k in ("a", "b"):
        idx.add_target(k, BS)
    a, b, c = _chain(1, 150), _chain(2, 150), _chain(3, 150)
    for k in ("a", "b"):
        _store(idx, k, a, 1_000)
    for k in ("a", "b"):
        _store(idx, k, b, 2_000)
    ha, hb, hc = (block_hashes(x, BS) for x in (a, b, c))
    assert idx.match(ha, ["a", "b"]) == [150, 150]  # a is warm again
    assert idx.bound_stats().evicted_blocks == 0
    for k in ("a", "b"):
        _store(idx, k, c, 3_000)
    st = idx.bound_stats()
    assert st.evicted_blocks > 0 and st.rounds >= 1
    assert st.bytes_held <= st.max_bytes
    assert idx.match(ha, ["a", "b"]) == [150, 150]  # warm: kept
    assert idx.match(hc, ["a", "b"]) == [150, 150]  # newest: kept
    assert idx.match(hb, ["a", "b"]) == [0, 0]  # the coldest: gone (whole, not a random half)
    assert st.evicted_entries == 2 * st.evicted_blocks
    assert idx.evicted_entries("a") == idx.evicted_entries("b") == st.evicted_entries // 2
    assert idx.stats("a").evicted_entries == idx.evicted_entries("a")
    # the engine-hash map entries of the evicted blocks were swept: removals of them are no-ops
    assert idx.mapped_count("a") <= idx.block_count("a") + idx.block_count("a") // 4 + 64
    idx.apply("a", EventBatch(0.0, [Removed(list(range(2_000, 2_150)), None)]))
    assert idx.block_count("a") == 300 and idx.match(ha, ["a"]) == [150]


@pytest.mark.parametrize("kind", _kinds())
def test_unbounded_never_evicts(kind):
    idx = kind()
    idx.add_target("a", BS)
    for i in range(20):
        _store(idx, "a", _chain(i + 1, 100), 1_000 * (i + 1))
    st = idx.bound_stats()
    assert st.max_bytes == 0 and st.evicted_entries == 0 and idx.block_count("a") == 2_000
    assert st.bytes_held == model_bytes(2_000, 2_000)


@pytest.mark.parametrize("kind", _kinds())
def test_a_round_is_amortised_over_a_twentieth_of_the_bound(kind):
    """A stream of small batches at the bound: each eviction round frees at least 5% of the bound
    (so its passes over the table are paid by that many evictions), and the bytes stay under it."""
    bound = model_bytes(2_000, 2_000)
    idx = kind(max_bytes=bound)
    idx.add_target("a", BS)
    for i in range(1_500):
        _store(idx, "a", _chain(i + 1, 8), 10 * i)
        assert idx.bound_stats().bytes_held <= bound
    st = idx.bound_stats()
    assert st.rounds >= 1
    freed_per_round = (BLOCK_BYTES + ENTRY_BYTES) * st.evicted_blocks / st.rounds
    assert freed_per_round >= bound / 20
    assert idx.mapped_count("a") <= idx.block_count("a") * 5 // 4 + 64


# --- the C view and the Python twin evict the same blocks ---------------------------------------------


def _same(py: PyKvIndex, nat: NativeKvIndex, prompts: list[list[int]]) -> None:
    keys = py.keys()
    assert nat.keys() == keys
    assert len(nat) == len(py)
    assert nat.block_counts(keys) == py.block_counts(keys)
    assert [nat.mapped_count(k) for k in keys] == [py.mapped_count(k) for k in keys]
    assert [nat.evicted_entries(k) for k in keys] == [py.evicted_entries(k) for k in keys]
    assert nat.bound_stats() == py.bound_stats()
    for prompt in prompts[:4]:
        hs = block_hashes(prompt, BS)
        assert nat.first_unheld(hs) == py.first_unheld(hs)


@needs_native
@pytest.mark.parametrize("seed", range(6))
def test_random_streams_evict_alike(seed):
    """Random stores (chains continued from random parents), removals, matches, clears, resets and
    targets coming and going, under a bound small enough to evict every few batches: after every step
    the twin and the C view hold the same blocks, maps, counts and bound statistics."""
    rng = random.Random(seed)
    bound = model_bytes(rng.choice([60, 150, 400]), rng.choice([120, 300, 800]))
    py, nat = PyKvIndex(max_bytes=bound), NativeKvIndex(max_bytes=bound)
    idxs = (py, nat)
    keys = [f"w{t}" for t in range(rng.choice([3, 9, 70]))]
    for k in keys:
        for idx in idxs:
            idx.add_target(k, BS)
    prompts = [[rng.randrange(50_000) for _ in range(BS * rng.randint(4, 60))] for _ in range(40)]
    stored: dict[str, list[tuple[int, list[int]]]] = {k: [] for k in keys}  # engine hashes per key
    next_eh = 1
    for _step in range(400):
        k = rng.choice(keys)
        op = rng.random()
        if op < 0.55:
            prompt = rng.choice(prompts)
            n = len(prompt) // BS
            cut = rng.randint(1, n)
            ehs = list(range(next_eh, next_eh + cut))
            next_eh += cut
            events = [Stored(ehs, None, prompt[:cut * BS], BS)]
            stored[k].append((ehs[0], ehs))
            if cut > 1 and rng.random() < 0.4:  # the tail again, chained from its parent
                events.append(Stored([next_eh], ehs[cut - 2], prompt[(cut - 1) * BS:cut * BS], BS))
                next_eh += 1
            got = [idx.apply(k, EventBatch(0.0, events)) for idx in idxs]
        elif op < 0.7 and stored[k]:
            _, ehs = rng.choice(stored[k])
            drop = rng.sample(ehs, rng.randint(1, len(ehs)))
            got = [idx.apply(k, EventBatch(0.0, [Removed(drop, None)])) for idx in idxs]
        elif op < 0.9:
            hs = block_hashes(rng.choice(prompts), BS)
            cands = rng.sample(keys, rng.randint(1, len(keys)))
            got = [idx.match(hs, cands) for idx in idxs]
            got += [idx.match_one(hs, cands[0]) for idx in idxs]
            assert got[2] == got[3]
            got = got[:2]
        elif op < 0.92:
            got = [idx.apply(k, EventBatch(0.0, [Cleared()])) for idx in idxs]
            stored[k] = []
        elif op < 0.95:
            for idx in idxs:
                idx.reset(k)
            stored[k] = []
            got = [0, 0]
        else:
            for idx in idxs:
                idx.remove_target(k)
                idx.add_target(k, BS)
            stored[k] = []
            got = [0, 0]
        assert got[0] == got[1], (_step, op, got)
        _same(py, nat, prompts)
        st = py.bound_stats()
        assert st.bytes_held <= bound + model_bytes(61, 61)  # a batch may pass it until its end
    assert py.bound_stats().evicted_blocks > 0, "the bound was never reached: the test says nothing"


@needs_native
def test_the_payload_path_evicts_as_the_decoded_path():
    """apply_payload (a batch straight from its msgpack bytes) ticks and trims like apply()."""
    import msgspec

    bound = model_bytes(500, 500)
    py, nat = PyKvIndex(max_bytes=bound), NativeKvIndex(max_bytes=bound)
    for idx in (py, nat):
        idx.add_target("a", BS)
    enc = msgspec.msgpack.Encoder()
    for i in range(60):
        tokens = _chain(i + 1, 20)
        ehs = list(range(100 * i, 100 * i + 20))
        payload = enc.encode([float(i), [{"type": "BlockStored", "block_hashes": ehs, "parent_block_hash": None,
                                          "token_ids": tokens, "block_size": BS, "lora_id": None}]])
        done = nat.apply_payload("a", payload)
        if done is None:  # this build does not take the form: the decoded path is the same code
            nat.apply("a", EventBatch(float(i), [Stored(ehs, None, tokens, BS)]))
        py.apply("a", EventBatch(float(i), [Stored(ehs, None, tokens, BS)]))
        _same(py, nat, [])
    assert nat.bound_stats().evicted_blocks > 0
