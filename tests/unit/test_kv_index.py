"""KvIndex: the router's per-target cache view (re-hashing, engine→router maps, bitmask matching).

Every test runs on both implementations, the Python one and the C accelerator's
(``PyKvIndex``, ``NativeKvIndex``): the same events must give the same view, maps and counters."""
from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest

from infera.kv.events import Cleared, EventBatch, Removed, Stored, decoder_for
from infera.kv.hashing import block_hashes
from infera.kv import index as index_mod
from infera.kv.index import FULL_ATTENTION_KINDS, NativeKvIndex, PyKvIndex
from infera.kv.native import native

IMPLS = [PyKvIndex] + ([NativeKvIndex] if native is not None else [])
KvIndex = PyKvIndex  # each test's implementation: set by the ``impl`` fixture


@pytest.fixture(autouse=True, params=IMPLS, ids=lambda c: c.__name__)
def impl(request, monkeypatch):
    monkeypatch.setitem(globals(), "KvIndex", request.param)
    return request.param


def emap_of(idx, key: str, engine_hash):
    """The router hash ``key``'s map gives ``engine_hash`` (None: not mapped), in either implementation."""
    t = idx._targets[key]
    return idx._view.emap_get(t.bit, engine_hash) if isinstance(idx, NativeKvIndex) else t.emap.get(engine_hash)


def no_holder_has_bit(idx, bit: int, hashes) -> bool:
    if isinstance(idx, NativeKvIndex):
        return idx._view.first_unheld(hashes) == 0 or not any(idx._view.match(hashes, [bit]))
    return all(v & (1 << bit) == 0 for v in idx._holders.values())

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "kv_events"
BS = 4
rng = random.Random(1234)
TOK = [rng.randrange(1, 50_000) for _ in range(64 * BS)]  # one token stream; blocks are slices of it
RH = block_hashes(TOK, BS)  # router hashes of every full block of TOK


def blocks(i: int, j: int) -> list[int]:
    """Tokens of blocks i..j-1 of TOK."""
    return TOK[i * BS:j * BS]


def eh(i: int, salt: int = 0) -> int:
    """A fake engine hash for block i (opaque to the index)."""
    return 10_000 + i + 1000 * salt


def st(i: int, j: int, parent: int | None = None, *, salt: int = 0, spec_kind=None, bs: int = BS, extra: int = 0,
       hashes=None) -> Stored:
    """BlockStored of blocks i..j-1, engine hashes eh(i..j-1); parent = engine hash of block i-1."""
    if parent is None and i > 0:
        parent = eh(i - 1, salt)
    hs = [eh(k, salt) for k in range(i, j)] if hashes is None else hashes
    return Stored(hs, parent, blocks(i, j) + TOK[j * BS:j * BS + extra], bs, spec_kind)


def rm(*idx: int, salt: int = 0) -> Removed:
    return Removed([eh(k, salt) for k in idx])


def batch(*events) -> EventBatch:
    return EventBatch(1.0, list(events))


# --- table: one target, a list of batches -> view, map and counters ---------------------------

CASES = [
    # name, batches, blocks in view (indexes into RH), mapped engine hashes, applied total, stats subset
    ("store", [[st(0, 3)]], [0, 1, 2], 3, 3, {"stored_events": 1, "stored_blocks": 3}),
    ("store-trailing-partial-block", [[st(0, 2, extra=3)]], [0, 1], 2, 2, {}),
    ("chain-across-batches", [[st(0, 2)], [st(2, 3)], [st(3, 5)]], [0, 1, 2, 3, 4], 5, 5, {"batches": 3}),
    ("chain-in-one-batch", [[st(0, 2), st(2, 4)]], [0, 1, 2, 3], 4, 4, {}),
    ("unknown-parent-dropped", [[st(0, 2)], [st(3, 4)]], [0, 1], 2, 2, {"dropped_events": 1}),
    ("drop-then-later-ok", [[st(1, 2, parent=eh(0))], [st(0, 1), st(1, 2)]], [0, 1], 2, 2, {"dropped_events": 1}),
    ("remove", [[st(0, 3)], [rm(1), rm(2)]], [0], 1, 5, {"removed_events": 2, "removed_blocks": 2}),
    ("remove-unknown-hash-noop", [[st(0, 2)], [rm(7), Removed([b"\x00" * 32])]], [0, 1], 2, 2, {"removed_blocks": 0}),
    ("remove-then-restore", [[st(0, 2)], [rm(1)], [st(1, 2)]], [0, 1], 2, 4, {}),
    ("remove-multi-hash-event", [[st(0, 4)], [Removed([eh(0), eh(3)])]], [1, 2], 2, 6, {"removed_blocks": 2}),
    ("store-remove-same-batch", [[st(0, 3), rm(2)]], [0, 1], 2, 4, {}),
    ("clear", [[st(0, 3)], [Cleared()]], [], 0, 3, {"cleared": 1}),
    ("clear-then-store-same-batch", [[st(0, 3), Cleared(), st(0, 1, salt=1)]], [0], 1, 4, {"cleared": 1}),
    ("clear-forgets-parents", [[st(0, 2)], [Cleared(), st(2, 3)]], [], 0, 2, {"dropped_events": 1}),
    ("misaligned-more-hashes", [[st(0, 2, hashes=[eh(0), eh(1), eh(2)])]], [0, 1], 0, 2, {"misaligned_events": 1}),
    ("misaligned-fewer-hashes", [[st(0, 3, hashes=[eh(0)])]], [0, 1, 2], 0, 3, {"misaligned_events": 1}),
    ("misaligned-not-removable", [[st(0, 2, hashes=[eh(0)])], [rm(0)]], [0, 1], 0, 2, {"removed_blocks": 0}),
    ("misaligned-no-parent", [[st(0, 2, hashes=[eh(0)])], [st(2, 3)]], [0, 1], 0, 2, {"dropped_events": 1}),
    ("misaligned-then-clear", [[st(0, 2, hashes=[eh(0)]), Stored([1, 2, 3], None, blocks(4, 6), BS)], [Cleared()]],
     [], 0, 2 + 2, {"cleared": 1, "misaligned_events": 2}),
    ("too-short-for-a-block", [[Stored([eh(0)], None, TOK[:BS - 1], BS)]], [], 0, 0, {"misaligned_events": 1}),
    ("spec-kind-sliding-skipped", [[st(0, 2, spec_kind="sliding_window")]], [], 0, 0, {"skipped_events": 1}),
    ("spec-kind-mamba-skipped", [[st(0, 2, spec_kind="mamba")]], [], 0, 0, {"skipped_events": 1}),
    *[(f"spec-kind-{k}", [[st(0, 2, spec_kind=k)]], [0, 1], 2, 2, {"skipped_events": 0})
      for k in sorted(FULL_ATTENTION_KINDS)],
    ("spec-kind-absent", [[st(0, 2, spec_kind=None)]], [0, 1], 2, 2, {"skipped_events": 0}),
    ("re-announce-idempotent", [[st(0, 3)], [st(0, 3)]], [0, 1, 2], 3, 6, {"stored_events": 2}),
    ("bytes-engine-hashes", [[Stored([b"a" * 32, b"b" * 32], None, blocks(0, 2), BS)],
                             [Stored([b"c" * 32], b"b" * 32, blocks(2, 3), BS)], [Removed([b"a" * 32])]],
     [1, 2], 2, 4, {}),
    ("negative-token-dropped", [[Stored([eh(0)], None, [-1] * BS, BS)]], [], 0, 0, {"dropped_events": 1}),
    ("two-engine-hashes-one-router-hash", [[st(0, 2), st(0, 2, salt=1)], [rm(1)]], [0], 3, 5, {}),  # set semantics
]


@pytest.mark.parametrize("name, batches, view, mapped, applied, stats", CASES, ids=[c[0] for c in CASES])
def test_apply_table(name, batches, view, mapped, applied, stats):
    idx = KvIndex()
    idx.add_target("w", BS)
    total = sum(idx.apply("w", batch(*evs)) for evs in batches)
    assert total == applied
    held = [i for i, h in enumerate(RH) if idx.holds("w", h)]
    assert held == view
    assert idx.block_count("w") == len(view)
    assert idx.mapped_count("w") == mapped
    assert len(idx) == len(view)  # only one target: every held hash is ours
    s = idx.stats("w")
    for k, v in stats.items():
        assert getattr(s, k) == v, k
    assert s.last_apply > 0


def test_apply_unknown_key_is_ignored():
    idx = KvIndex()
    assert idx.apply("nobody", batch(st(0, 2))) == 0
    assert len(idx) == 0 and not idx.has_target("nobody")


def test_block_size_mismatch_logs_once_and_hashes_with_registered_size(caplog):
    idx = KvIndex()
    idx.add_target("w", BS)
    with caplog.at_level(logging.WARNING, logger="infera.kv.index"):
        idx.apply("w", batch(st(0, 2, bs=BS * 2)))
        idx.apply("w", batch(st(2, 3, bs=BS * 2)))
    assert len([r for r in caplog.records if "block_size" in r.getMessage()]) == 1
    assert idx.match(RH, ["w"]) == [3]


# --- matching ----------------------------------------------------------------------------------

@pytest.fixture
def fleet() -> KvIndex:
    """Targets holding prefixes of different lengths of TOK (and one holding a non-prefix)."""
    idx = KvIndex()
    lengths = {"a": 0, "b": 1, "c": 5, "d": 5, "e#dp0": 20, "e#dp1": 64}
    for k, n in lengths.items():
        idx.add_target(k, BS)
        if n:
            idx.apply(k, batch(st(0, n)))
    idx.add_target("gap", BS)  # blocks 0-2 and 4-9: prefix length 3
    idx.apply("gap", batch(st(0, 10)))
    idx.apply("gap", batch(rm(3)))
    idx.add_target("tail", BS)  # blocks 1.. only (block 0 evicted): prefix length 0
    idx.apply("tail", batch(st(0, 8), rm(0)))
    return idx


@pytest.mark.parametrize("hashes, keys, want", [
    (RH, ["a", "b", "c", "d", "e#dp0", "e#dp1", "gap", "tail"], [0, 1, 5, 5, 20, 64, 3, 0]),
    (RH, ["e#dp1", "c"], [64, 5]),
    (RH[:4], ["b", "c", "e#dp1", "gap"], [1, 4, 4, 3]),  # hashes shorter than the views
    (RH, ["zzz", "c", "zzz"], [0, 5, 0]),  # unregistered keys -> 0
    (RH, ["c", "c"], [5, 5]),  # duplicate keys
    ([], ["a", "c", "e#dp1"], [0, 0, 0]),  # empty hashes
    (RH, [], []),
    ([12345] + RH, ["c", "e#dp1"], [0, 0]),  # first block unknown
    (block_hashes([TOK[0] + 1] + TOK[1:], BS), ["c", "tail", "e#dp1"], [0, 0, 0]),  # block 0 differs: so do all
    (RH[1:], ["c", "tail"], [4, 7]),  # match compares hash lists as given (tail lost block 0)
    (block_hashes(TOK[:8 * BS] + [7] * (4 * BS), BS), ["c", "e#dp0", "e#dp1", "gap"], [5, 8, 8, 3]),  # diverges at 8
])
def test_match(fleet, hashes, keys, want):
    assert fleet.match(hashes, keys) == want
    assert [fleet.match_one(hashes, k) for k in keys] == want


def test_match_agrees_with_per_target_walk_on_random_views():
    r = random.Random(99)
    idx = KvIndex()
    keys = [f"w{i}" for i in range(40)]  # > 30 bits: multi-digit Python ints
    for k in keys:
        idx.add_target(k, BS)
        n = r.randrange(0, 64)
        if n:
            idx.apply(k, batch(st(0, n)))
        for _ in range(r.randrange(0, 3)):
            idx.apply(k, batch(rm(r.randrange(0, 64))))
    for _ in range(50):
        sample = r.sample(keys + ["ghost"], r.randrange(1, 20))
        got = idx.match(RH, sample)
        for k, g in zip(sample, got):
            n = 0
            while n < len(RH) and idx.holds(k, RH[n]):
                n += 1
            assert g == n


def test_shared_blocks_have_one_entry_with_several_bits():
    idx = KvIndex()
    for k in ("x", "y"):
        idx.add_target(k, BS)
        idx.apply(k, batch(st(0, 4)))
    assert len(idx) == 4
    idx.apply("x", batch(rm(0, 1, 2, 3)))
    assert len(idx) == 4 and idx.block_count("x") == 0 and idx.block_count("y") == 4
    assert idx.match(RH, ["x", "y"]) == [0, 4]
    idx.apply("y", batch(Cleared()))
    assert len(idx) == 0


# --- targets: bits, reset, removal ---------------------------------------------------------

def test_bit_reuse_after_remove_target():
    idx = KvIndex()
    for k in ("a", "b", "c"):
        idx.add_target(k, BS)
        idx.apply(k, batch(st(0, 6)))
    bit_b = idx._targets["b"].bit
    assert idx.remove_target("b") is True
    assert idx.remove_target("b") is False
    assert not idx.has_target("b") and idx.block_count("b") == 0
    idx.add_target("d", BS)
    assert idx._targets["d"].bit == bit_b  # freed bit reused (lowest first)
    assert idx.match(RH, ["a", "c", "d", "b"]) == [6, 6, 0, 0]  # no stale blocks inherited
    assert idx.stats("d").stored_events == 0
    idx.add_target("e", BS)
    assert idx._targets["e"].bit == 3
    for k in ("a", "c"):
        idx.remove_target(k)
    idx.add_target("f", BS)
    assert idx._targets["f"].bit == 0
    assert no_holder_has_bit(idx, idx._targets["f"].bit, RH) and idx.block_count("f") == 0


def test_remove_target_after_misaligned_events_scans_out_its_bits():
    idx = KvIndex()
    idx.add_target("a", BS)
    idx.add_target("b", BS)
    idx.apply("a", batch(st(0, 3, hashes=[1])))  # misaligned: unmapped view entries
    idx.apply("b", batch(st(0, 2)))
    idx.remove_target("a")
    assert len(idx) == 2 and idx.match(RH, ["b"]) == [2]
    idx.remove_target("b")
    assert len(idx) == 0 and idx.match(RH, ["a", "b"]) == [0, 0]


def test_reset_clears_view_and_map_but_keeps_target():
    idx = KvIndex()
    idx.add_target("w#dp1", BS)
    idx.apply("w#dp1", batch(st(0, 4)))
    idx.reset("w#dp1")
    assert idx.has_target("w#dp1")
    assert idx.block_count("w#dp1") == 0 and idx.mapped_count("w#dp1") == 0 and len(idx) == 0
    assert idx.stats("w#dp1").resets == 1
    idx.apply("w#dp1", batch(st(4, 5)))  # its parent was forgotten
    assert idx.stats("w#dp1").dropped_events == 1
    idx.apply("w#dp1", batch(st(0, 2)))
    assert idx.match(RH, ["w#dp1"]) == [2]
    idx.reset("unknown")  # no-op


def test_add_target_again():
    idx = KvIndex()
    idx.add_target("w", BS)
    idx.apply("w", batch(st(0, 3)))
    idx.add_target("w", BS)  # same size: keeps the view
    assert idx.block_count("w") == 3 and idx.block_size("w") == BS
    idx.add_target("w", 2 * BS)  # new size: old hashes are meaningless
    assert idx.block_count("w") == 0 and idx.block_size("w") == 2 * BS and len(idx) == 0
    with pytest.raises(ValueError):
        idx.add_target("z", 0)
    assert sorted(idx.keys()) == ["w"] and list(idx) == ["w"] and "w" in idx


# --- real engine events ------------------------------------------------------------------------

def _replay_fixture(prefix: str) -> tuple[KvIndex, dict, list[EventBatch]]:
    exp = json.loads((FIX / f"{prefix}_expected.json").read_text())
    dec = decoder_for("vllm")
    batches = [dec((FIX / b["file"]).read_bytes()) for b in exp["batches"]]
    idx = KvIndex()
    idx.add_target("w", exp["block_size"])
    return idx, exp, batches


@pytest.mark.parametrize("prefix", ["vllm", "vllm_bytes"])
def test_real_vllm_rehash_equals_router_hashes_of_the_token_stream(prefix):
    idx, exp, batches = _replay_fixture(prefix)
    bs = exp["block_size"]
    prompt = exp["prompts"]["A"]
    first, second = batches[0].events[0], batches[1].events[0]
    assert second.parent == first.block_hashes[-1]  # vLLM chains the decode block to batch 0
    stream = first.token_ids + second.token_ids  # the engine's view of prompt + generated tokens
    assert stream[:len(prompt)] == prompt
    want = block_hashes(stream, bs)
    assert len(want) == len(first.block_hashes) + 1
    assert idx.apply("w", batches[0]) == len(first.block_hashes)
    assert idx.apply("w", batches[1]) == 1
    assert [emap_of(idx, "w", h) for h in first.block_hashes + second.block_hashes] == want
    assert all(idx.holds("w", h) for h in want)
    assert idx.match(want, ["w"]) == [len(want)]
    assert idx.match(block_hashes(prompt, bs), ["w"]) == [len(prompt) // bs]  # what routing would ask


def test_real_vllm_full_session_with_evictions_and_clear():
    idx, exp, batches = _replay_fixture("vllm")
    bs = exp["block_size"]
    p = {k: block_hashes(v, bs) for k, v in exp["prompts"].items()}
    removed_total = 0
    for b, raw in zip(batches, exp["batches"]):
        n_removed = sum(len(e["block_hashes"]) for e in raw["events"] if e["type"] == "BlockRemoved")
        n_stored = sum(len(e["block_hashes"]) for e in raw["events"] if e["type"] == "BlockStored")
        assert idx.apply("w", b) == n_removed + n_stored  # every removed hash was known
        removed_total += n_removed
        if raw["file"] == "vllm_seq003.msgpack":
            assert idx.match(p["B"], ["w"]) == [len(p["B"])]
            assert idx.match(p["A"], ["w"]) == [len(p["A"])]
    s = idx.stats("w")
    assert s.dropped_events == 0 and s.misaligned_events == 0 and s.cleared == 1
    assert s.removed_blocks == removed_total > 0
    # after the reset only prompt E's blocks remain
    assert idx.match(p["E"], ["w"]) == [len(p["E"])]
    assert idx.match(p["A"], ["w"]) == [0] and idx.match(p["D"], ["w"]) == [0]
    assert idx.block_count("w") == len(p["E"]) == idx.mapped_count("w")


def test_real_vllm_view_tracks_engine_pool_before_clear():
    """Replaying up to the reset: view size = stored - removed, and never above the 63-block pool."""
    idx, exp, batches = _replay_fixture("vllm")
    for b in batches:
        if any(type(e) is Cleared for e in b.events):
            break
        idx.apply("w", b)
        assert idx.block_count("w") <= 63
    assert idx.block_count("w") == idx.mapped_count("w")
    bs = exp["block_size"]
    d = block_hashes(exp["prompts"]["D"], bs)
    assert idx.match(d, ["w"]) == [len(d)]  # the newest prompt survived the evictions


def test_sglang_fixtures_chain_and_bigrams():
    dec = decoder_for("sglang")
    idx = KvIndex()
    idx.add_target("s#dp1", 16)
    idx.add_target("s#dp0", 16)
    b1 = dec((FIX / "sglang_stored.msgpack").read_bytes())
    b2 = dec((FIX / "sglang_stored_child.msgpack").read_bytes())
    assert idx.apply("s#dp1", b1) == 2 and idx.apply("s#dp1", b2) == 1
    stream = b1.events[0].token_ids + b2.events[0].token_ids
    assert idx.match(block_hashes(stream, 16), ["s#dp1", "s#dp0"]) == [3, 0]
    big = dec((FIX / "sglang_bigram.msgpack").read_bytes())
    assert idx.apply("s#dp0", big) == 2
    assert idx.match(block_hashes(big.events[0].token_ids, 16), ["s#dp0"]) == [2]
    # GPU removal of the child (1) + the CPU_PINNED removals, which are not the GPU view's
    assert idx.apply("s#dp1", dec((FIX / "sglang_removed_cleared.msgpack").read_bytes())) == 1
    assert idx.block_count("s#dp1") == 0 and idx.block_count("s#dp0") == 2  # the batch ends in a clear


def test_events_made_until_follows_the_newest_batch_timestamp():
    idx = KvIndex()
    assert idx.events_made_until("w") == 0.0
    idx.add_target("w", 4)
    idx.apply("w", EventBatch(50.0, []))
    idx.apply("w", EventBatch(49.0, []))  # a replayed older batch does not move it back
    assert idx.events_made_until("w") == 50.0


# --- storage tiers: only the GPU tier is the view ----------------------------------------------

def st_on(medium, i: int, j: int, parent: int | None = None, **kw) -> Stored:
    ev = st(i, j, parent, **kw)
    ev.medium = medium
    return ev


def rm_on(medium, *idx: int) -> Removed:
    return Removed([eh(k) for k in idx], medium)


# Lower-tier names the engines send (vLLM 0.32, SGLang 0.5.23, ATOM v0.1.5) and vLLM's Mooncake
# store connector's lower-case "cpu".
LOWER = ["CPU", "STORAGE", "CPU_PINNED", "DISK", "EXTERNAL", "REMOTE", "cpu"]

TIER_CASES = [
    # name, batches, GPU view (RH indexes), lower tiers {tier: RH indexes}, stats subset
    ("gpu-explicit", [[st_on("GPU", 0, 3)]], [0, 1, 2], {}, {"stored_blocks": 3, "lower_events": 0}),
    ("gpu-lower-case", [[st_on("gpu", 0, 2)], [rm_on("Gpu", 1)]], [0], {}, {"removed_blocks": 1}),
    ("gpu-none", [[st_on(None, 0, 2)], [rm_on(None, 0)]], [1], {}, {"removed_blocks": 1}),
    *[(f"removed-on-{m}-keeps-gpu", [[st(0, 3)], [rm_on(m, 0, 1, 2)]], [0, 1, 2], {},
       {"removed_events": 0, "removed_blocks": 0, "lower_events": 1, "lower_removed_blocks": 0}) for m in LOWER],
    *[(f"stored-on-{m}-not-in-gpu", [[st_on(m, 0, 3)]], [], {m.upper(): [0, 1, 2]},
       {"stored_events": 0, "stored_blocks": 0, "lower_stored_blocks": 3}) for m in LOWER],
    ("offload-then-gpu-evict", [[st(0, 3)], [st_on("CPU", 0, 3)], [rm(0, 1, 2)]], [], {"CPU": [0, 1, 2]},
     {"removed_blocks": 3}),
    ("gpu-store-parent-found-on-lower-tier", [[st(0, 3), st_on("CPU", 0, 3), rm(0, 1, 2)], [st(3, 4)]], [3],
     {"CPU": [0, 1, 2]}, {"dropped_events": 0}),
    ("lower-store-parent-on-gpu", [[st(0, 2), st_on("DISK", 2, 3)]], [0, 1], {"DISK": [2]}, {}),
    ("lower-store-parent-same-tier", [[st_on("CPU", 0, 2)], [st_on("CPU", 2, 4)]], [], {"CPU": [0, 1, 2, 3]}, {}),
    ("lower-store-parent-other-tier", [[st_on("CPU_PINNED", 0, 2)], [st_on("DISK", 2, 3)]], [],
     {"CPU_PINNED": [0, 1], "DISK": [2]}, {}),
    ("lower-store-unknown-parent", [[st_on("CPU", 2, 3)]], [], {}, {"dropped_events": 1, "lower_stored_blocks": 0}),
    ("lower-store-misaligned", [[st_on("CPU", 0, 2, hashes=[eh(0)])]], [], {}, {"misaligned_events": 1}),
    ("lower-store-sliding-window-skipped", [[st_on("CPU", 0, 2, spec_kind="sliding_window")]], [], {},
     {"skipped_events": 1, "lower_events": 0}),
    ("lower-remove", [[st_on("CPU", 0, 3)], [rm_on("CPU", 1), rm_on("DISK", 2)]], [], {"CPU": [0, 2]},
     {"lower_removed_blocks": 1, "lower_events": 3}),
    ("gpu-remove-leaves-lower", [[st(0, 2), st_on("CPU", 0, 2)], [rm(0)]], [1], {"CPU": [0, 1]}, {}),
    ("lower-remove-leaves-gpu", [[st(0, 2), st_on("CPU", 0, 2)], [rm_on("CPU", 0)]], [0, 1], {"CPU": [1]}, {}),
    ("clear-scoped-lower-keeps-gpu", [[st(0, 2), st_on("CPU", 0, 2), st_on("DISK", 0, 1)], [Cleared("CPU")]],
     [0, 1], {"DISK": [0]}, {"cleared": 0, "lower_cleared": 1}),
    ("clear-scoped-unknown-tier", [[st(0, 2)], [Cleared("DISK")]], [0, 1], {}, {"cleared": 0, "lower_cleared": 1}),
    ("clear-scoped-gpu-keeps-lower", [[st(0, 2), st_on("CPU", 0, 2)], [Cleared("GPU")]], [], {"CPU": [0, 1]},
     {"cleared": 1}),
    ("clear-unscoped-drops-every-tier", [[st(0, 2), st_on("CPU", 0, 2)], [Cleared()]], [], {}, {"cleared": 1}),
    ("mixed-batch", [[st(0, 4), st_on("CPU", 0, 2), rm_on("CPU", 9), rm(3), st_on("DISK", 3, 4)]], [0, 1, 2],
     {"CPU": [0, 1], "DISK": [3]}, {"lower_events": 3, "stored_blocks": 4, "removed_blocks": 1}),
]


@pytest.mark.parametrize("name, batches, view, tiers, stats", TIER_CASES, ids=[c[0] for c in TIER_CASES])
def test_apply_tiers(name, batches, view, tiers, stats):
    idx = KvIndex()
    idx.add_target("w", BS)
    for evs in batches:
        idx.apply("w", batch(*evs))
    assert [i for i, h in enumerate(RH) if idx.holds("w", h)] == view
    assert idx.block_count("w") == len(view) == len(idx)
    prefix = next(i for i in range(len(RH) + 1) if i not in view)  # leading blocks 0, 1, ... held
    assert idx.match(RH, ["w"]) == [prefix]
    assert idx.tier_block_counts("w") == {t: len(v) for t, v in tiers.items()}
    lower = idx._targets["w"].lower or {}
    assert {t: sorted(RH.index(h) for h in m.values()) for t, m in lower.items() if m} == tiers  # router hashes
    s = idx.stats("w")
    for k, v in stats.items():
        assert getattr(s, k) == v, k


@pytest.mark.parametrize("medium", ["GPU", None])
def test_gpu_events_never_build_lower_tier_state(medium):
    """The common case pays nothing for tiers: no per-target tier map is ever created."""
    idx = KvIndex()
    idx.add_target("w", BS)
    idx.apply("w", batch(st_on(medium, 0, 4), rm_on(medium, 3), Cleared(medium), st_on(medium, 0, 2)))
    assert idx._targets["w"].lower is None and idx.tier_block_counts("w") == {}
    assert idx.block_count("w") == 2


def test_reset_remove_and_block_size_change_drop_lower_tiers():
    idx = KvIndex()
    for how in ("reset", "remove", "resize"):
        idx.add_target("w", BS)
        idx.apply("w", batch(st(0, 2), st_on("CPU", 0, 2)))
        assert idx.tier_block_counts("w") == {"CPU": 2}
        if how == "reset":
            idx.reset("w")
        elif how == "remove":
            idx.remove_target("w")
            idx.add_target("w", BS)
        else:
            idx.add_target("w", 2 * BS)
        assert idx.tier_block_counts("w") == {} and idx.block_count("w") == 0, how
        idx.remove_target("w")
    assert idx.tier_block_counts("nobody") == {}


def test_sglang_hicache_fixture_cpu_pinned_removal_keeps_the_gpu_view():
    """SGLang 0.5.23 bytes: BlockRemoved(GPU) of the child, BlockRemoved(CPU_PINNED) of the two
    parents (HiCache evicting its host copies), AllBlocksCleared: applied one event at a time."""
    dec = decoder_for("sglang")
    idx = KvIndex()
    idx.add_target("s", 16)
    b1 = dec((FIX / "sglang_stored.msgpack").read_bytes())
    b2 = dec((FIX / "sglang_stored_child.msgpack").read_bytes())
    idx.apply("s", b1)
    idx.apply("s", b2)
    want = block_hashes(b1.events[0].token_ids + b2.events[0].token_ids, 16)
    rc = dec((FIX / "sglang_removed_cleared.msgpack").read_bytes())
    assert [(type(e).__name__, e.medium) for e in rc.events] == [
        ("Removed", "GPU"), ("Removed", "CPU_PINNED"), ("Cleared", None)]
    gpu_rm, cpu_rm, clear = rc.events
    assert idx.apply("s", EventBatch(rc.ts, [gpu_rm])) == 1
    assert idx.match(want, ["s"]) == [2]
    assert idx.apply("s", EventBatch(rc.ts, [cpu_rm])) == 0
    assert idx.match(want, ["s"]) == [2] and idx.block_count("s") == 2  # host eviction: GPU copies stay
    assert idx.stats("s").lower_events == 1
    idx.apply("s", EventBatch(rc.ts, [clear]))
    assert idx.block_count("s") == 0


def test_sglang_0_5_15_fixture_cpu_pinned_removal_and_unlabelled_medium():
    """SGLang 0.5.15 arrays: medium GPU / None stores, CPU_PINNED and None removals."""
    dec = decoder_for("sglang")
    b = dec((FIX / "sglang_0_5_15.msgpack").read_bytes())
    (s_gpu, s_none, r_cpu, r_none) = b.events
    assert (s_gpu.medium, s_none.medium, r_cpu.medium, r_none.medium) == ("GPU", None, "CPU_PINNED", None)
    idx = KvIndex()
    idx.add_target("s", s_gpu.block_size)
    idx.apply("s", EventBatch(b.ts, [s_gpu, r_cpu]))
    assert idx.block_count("s") == 2  # the CPU_PINNED removal of the first block left the GPU view whole
    idx.apply("s", EventBatch(b.ts, [r_none]))
    assert idx.block_count("s") == 1  # an unlabelled removal is the GPU tier's


def test_atom_fixture_remote_store_and_cpu_scoped_clear():
    """ATOM v0.1.5 bytes: GPU store of 2 blocks, REMOTE store of a child, GPU removal of the second
    block, AllBlocksCleared(medium="CPU"), then an unscoped AllBlocksCleared."""
    dec = decoder_for("atom")
    b = dec((FIX / "atom_0_1_5.msgpack").read_bytes())
    assert [(type(e).__name__, e.medium) for e in b.events] == [
        ("Stored", "GPU"), ("Stored", "REMOTE"), ("Removed", "GPU"), ("Cleared", "CPU"), ("Cleared", None)]
    s_gpu, s_remote, r_gpu, clear_cpu, clear_all = b.events
    idx = KvIndex()
    idx.add_target("a", s_gpu.block_size)
    want = block_hashes(s_gpu.token_ids + s_remote.token_ids, s_gpu.block_size)
    assert idx.apply("a", EventBatch(b.ts, [s_gpu, s_remote])) == 2
    assert idx.match(want, ["a"]) == [2]  # the REMOTE block is not in the GPU view
    assert idx.tier_block_counts("a") == {"REMOTE": 1}
    assert list(idx._targets["a"].lower["REMOTE"].values()) == want[2:]  # chained from the GPU parent
    idx.apply("a", EventBatch(b.ts, [r_gpu]))
    assert idx.match(want, ["a"]) == [1]
    idx.apply("a", EventBatch(b.ts, [clear_cpu]))
    assert idx.match(want, ["a"]) == [1] and idx.tier_block_counts("a") == {"REMOTE": 1}  # CPU-only clear
    assert idx.stats("a").cleared == 0 and idx.stats("a").lower_cleared == 1
    idx.apply("a", EventBatch(b.ts, [clear_all]))
    assert idx.block_count("a") == 0 and idx.tier_block_counts("a") == {}
