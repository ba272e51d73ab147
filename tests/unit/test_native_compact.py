"""The native GPU view's compact holder sets (issue 30 item 2): a few ids in the slot, a sorted
array, a bitmap when the holders are many. The view must answer as the Python twin at fleet sizes
where every form is in use (ids past 64, 128, 256), through every transition both ways, and cost
bytes by what it holds, not by the fleet's size."""
from __future__ import annotations

import random

import pytest

from infera.kv.events import Cleared, EventBatch, Removed, Stored
from infera.kv.hashing import block_hashes
from infera.kv.index import NativeKvIndex, PyKvIndex
from infera.kv.native import native

pytestmark = pytest.mark.skipif(native is None, reason="the C accelerator is not built")

BS = 4


def _both() -> tuple[PyKvIndex, NativeKvIndex]:
    return PyKvIndex(), NativeKvIndex()


def _apply(idxs, key, events) -> None:
    got = [idx.apply(key, EventBatch(0.0, list(events))) for idx in idxs]
    assert got[0] == got[1], (key, events, got)


def _same(py: PyKvIndex, nat: NativeKvIndex, prompts: list[list[int]], rng: random.Random) -> None:
    keys = py.keys()
    assert nat.keys() == keys
    assert len(nat) == len(py)
    assert nat.block_counts(keys) == py.block_counts(keys)
    assert [nat.mapped_count(k) for k in keys] == [py.mapped_count(k) for k in keys]
    for prompt in prompts:
        hs = block_hashes(prompt, BS)
        cands = rng.sample(keys, min(len(keys), rng.choice([1, 3, 16, 70, len(keys)]))) if keys else []
        cands = cands + cands[:2] + ["nobody"]  # duplicates and an unknown key
        assert nat.match(hs, cands) == py.match(hs, cands)
        for k in cands[:5]:
            assert nat.match_one(hs, k) == py.match_one(hs, k)
        assert nat.first_unheld(hs) == py.first_unheld(hs)
        for h in hs[:6]:
            for k in cands[:8]:
                assert nat.holds(k, h) == py.holds(k, h)


@pytest.mark.parametrize("n_targets", [70, 300])
def test_random_fleet_agrees_with_the_python_twin(n_targets):
    rng = random.Random(n_targets)
    py, nat = _both()
    idxs = (py, nat)
    keys = [f"w{t}" for t in range(n_targets)]
    for k in keys:
        for idx in idxs:
            idx.add_target(k, BS)
    # a few shared prompts (popular prefixes held by many targets) and the engine hashes each target
    # gave their blocks (per target: the same tokens, its own engine hashes)
    prompts = [[rng.randrange(50_000) for _ in range(BS * rng.randint(3, 24))] for _ in range(6)]
    held: dict[str, list[int]] = {k: [] for k in keys}
    next_hash = [1]

    def store(k: str) -> None:
        p = rng.choice(prompts)
        n = len(p) // BS
        take = rng.randint(1, n)
        ehs = list(range(next_hash[0], next_hash[0] + take))
        next_hash[0] += take
        if rng.random() < 0.05:  # misaligned: enters the view, unmapped (only a reset removes it)
            _apply(idxs, k, [Stored(ehs[:-1] or [ehs[0]], None, p[:take * BS] + [1], BS)])
        else:
            _apply(idxs, k, [Stored(ehs, None, p[:take * BS], BS)])
        held[k].extend(ehs)

    for step in range(1500):
        k = rng.choice(keys)
        r = rng.random()
        if r < 0.55:
            store(k)
        elif r < 0.85 and held[k]:
            gone = rng.sample(held[k], min(len(held[k]), rng.randint(1, 8)))
            _apply(idxs, k, [Removed(gone)])
            held[k] = [h for h in held[k] if h not in set(gone)]
        elif r < 0.9:
            for idx in idxs:
                idx.reset(k)
            held[k] = []
        elif r < 0.93:
            _apply(idxs, k, [Cleared()])
            held[k] = []
        elif r < 0.97:
            for idx in idxs:  # leave and come back: its bit is freed and reused (lowest first)
                idx.remove_target(k)
                idx.add_target(k, BS)
            held[k] = []
        else:
            for idx in idxs:  # another block size drops the view
                idx.add_target(k, BS * 2 if idx.block_size(k) == BS else BS)
                idx.add_target(k, BS)
            held[k] = []
        if step % 100 == 99:
            _same(py, nat, prompts, rng)
    _same(py, nat, prompts, rng)


@pytest.mark.parametrize("order", ["ascending", "descending", "random"])
def test_one_block_through_every_holder_set_form_and_back(order):
    """One block held by 1 … 1,000 targets and released again: inline ids, an array, a bitmap, and
    back; every answer as the twin's at each count, and the bytes back to where they started."""
    n = 1000
    py, nat = _both()
    keys = [f"w{t}" for t in range(n)]
    for k in keys:
        py.add_target(k, BS)
        nat.add_target(k, BS)
    for t, k in enumerate(keys):  # each target's map allocated first (it stays, empty)
        _apply((py, nat), k, [Stored([-1], None, [t + 100] * BS, BS), Removed([-1])])
    tokens = list(range(BS))
    (h,) = block_hashes(tokens, BS)
    base = nat._view.memory_bytes()
    seq = list(range(n))
    if order == "descending":
        seq.reverse()
    elif order == "random":
        random.Random(7).shuffle(seq)
    checkpoints = {1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 34, 64, 65, 100, 500, 999, 1000}
    probe = [keys[i] for i in (0, 1, 63, 64, 65, 127, 128, 500, 998, 999)]
    for count, t in enumerate(seq, 1):
        _apply((py, nat), keys[t], [Stored([t + 1], None, tokens, BS)])
        if count in checkpoints:
            assert [nat.holds(k, h) for k in probe] == [py.holds(k, h) for k in probe]
            assert nat.match([h], probe) == py.match([h], probe)
            assert len(nat) == 1
    assert nat.match([h], keys) == [1] * n
    assert nat._view.memory_bytes() > base
    for count, t in enumerate(seq, 1):
        _apply((py, nat), keys[t], [Removed([t + 1])])
        if count in checkpoints or n - count in checkpoints:
            assert [nat.holds(k, h) for k in probe] == [py.holds(k, h) for k in probe]
            assert nat.match([h], keys) == py.match([h], keys)
            assert len(nat) == len(py)
    assert len(nat) == 0
    assert nat._view.memory_bytes() == base  # every set freed, the table as it was


def test_drop_scan_clears_a_target_from_sets_of_every_form():
    """A misaligned store leaves hashes no map entry names: a reset scans the table, taking the
    target out of inline, array and bitmap sets alike (and deleting the entries it leaves empty)."""
    py, nat = _both()
    keys = [f"w{t}" for t in range(400)]
    for k in keys:
        py.add_target(k, BS)
        nat.add_target(k, BS)
    rng = random.Random(3)
    prompt = [rng.randrange(50_000) for _ in range(BS * 40)]
    for i, k in enumerate(keys):
        n = 1 + i % 40  # block j is held by the targets with i % 40 >= j: 400 down to 10 holders
        _apply((py, nat), k, [Stored(list(range(1, n + 1)), None, prompt[:n * BS], BS)])
    target = keys[399]  # holds all 40 blocks; its bit is past the sixth word
    _apply((py, nat), target, [Stored([7], None, prompt[:2 * BS], BS)])  # misaligned: unmapped
    lone = [rng.randrange(50_000) for _ in range(BS * 3)]
    _apply((py, nat), target, [Stored([1, 2], None, lone, BS)])  # misaligned, held by it alone
    hs = block_hashes(prompt, BS)
    for idx in (py, nat):
        idx.reset(target)
    assert len(nat) == len(py)
    assert nat.match(hs, keys) == py.match(hs, keys)
    assert nat.block_counts(keys) == py.block_counts(keys)
    assert nat.first_unheld(block_hashes(lone, BS)) == py.first_unheld(block_hashes(lone, BS)) == 0


def _fill(n_targets: int, blocks: int, shared: bool) -> tuple[NativeKvIndex, int]:
    idx = NativeKvIndex()
    keys = [f"w{t}" for t in range(n_targets)]
    for k in keys:
        idx.add_target(k, 1)
    base = idx._view.memory_bytes()
    for t, k in enumerate(keys):
        start = 0 if shared else (t + 1) * 1_000_000
        idx.apply(k, EventBatch(0.0, [Stored(list(range(1, blocks + 1)), None, list(range(start, start + blocks)), 1)]))
    assert sum(idx.block_counts(keys)) == n_targets * blocks
    return idx, idx._view.memory_bytes() - base


@pytest.mark.parametrize("shared", [False, True])
def test_bytes_per_entry_at_a_thousand_targets(shared):
    """≤ 48 B per (block, target) entry at 1,000 targets, blocks distinct or shared (issue 30)."""
    _, nbytes = _fill(1000, 300, shared)
    assert nbytes / (1000 * 300) <= 48


def test_a_block_held_by_one_target_costs_the_same_in_any_fleet():
    """The holder set of a block held by one target does not grow with the fleet."""
    _, small = _fill(10, 2000, False)
    _, large = _fill(1000, 20, False)
    per_small, per_large = small / 20_000, large / 20_000
    assert per_large <= per_small * 1.25, (per_small, per_large)
