"""The shared GPU view (issue 30 item 4, its first slice): a NativeKvIndex whose holder table lives in
a shared arena, and GpuViewReader, which matches against that arena as another process would. Within
one process, after every batch of a random fleet's events -- stores, removals, resets, targets that
leave and come back, evictions at a byte bound, holder sets in every form -- the reader answers
exactly as the writer's own view and as a private index fed the same events."""
from __future__ import annotations

import os
import random

import pytest

from infera.kv.events import Cleared, EventBatch, Removed, Stored
from infera.kv.hashing import block_hashes
from infera.kv.index import NativeKvIndex
from infera.kv.native import native

pytestmark = pytest.mark.skipif(native is None, reason="the C accelerator is not built")

BS = 4
ARENA = 64 << 20


def _agree(private: NativeKvIndex, shared: NativeKvIndex, reader, prompts, rng: random.Random) -> None:
    keys = private.keys()
    assert shared.keys() == keys and len(shared) == len(private)
    for prompt in prompts:
        hs = block_hashes(prompt, BS)
        cands = rng.sample(keys, min(len(keys), rng.choice([1, 3, 70, len(keys)]))) if keys else []
        bits = shared._bits(cands)
        want = private.match(hs, cands)
        assert shared.match(hs, cands) == want
        assert reader.match(hs, bits) == want
        assert reader.first_unheld(hs) == private.first_unheld(hs)
        assert reader.first_unheld(hs, 2) == private.first_unheld(hs, 2)


@pytest.mark.parametrize("n_targets, max_bytes", [(8, 0), (300, 0), (300, 40_000)])
def test_reader_answers_as_a_private_index(n_targets: int, max_bytes: int) -> None:
    rng = random.Random(n_targets + max_bytes)
    private, shared = NativeKvIndex(max_bytes), NativeKvIndex(max_bytes, shared_bytes=ARENA)
    fd = shared.shared_fd()
    assert fd is not None and private.shared_fd() is None
    reader = native.GpuViewReader(fd)
    idxs = (private, shared)
    keys = [f"w{t}" for t in range(n_targets)]
    for k in keys:
        for idx in idxs:
            idx.add_target(k, BS)
    prompts = [[rng.randrange(50_000) for _ in range(BS * rng.randint(3, 40))] for _ in range(8)]
    held: dict[str, list[int]] = {k: [] for k in keys}
    next_hash = 1
    for step in range(1200):
        k = rng.choice(keys)
        r = rng.random()
        if r < 0.6:
            p = rng.choice(prompts)
            take = rng.randint(1, len(p) // BS)
            ehs = list(range(next_hash, next_hash + take))
            next_hash += take
            got = [idx.apply(k, EventBatch(0.0, [Stored(ehs, None, p[:take * BS], BS)])) for idx in idxs]
            assert got[0] == got[1]
            held[k].extend(ehs)
        elif r < 0.88 and held[k]:
            gone = rng.sample(held[k], min(len(held[k]), rng.randint(1, 8)))
            for idx in idxs:
                idx.apply(k, EventBatch(0.0, [Removed(gone)]))
            held[k] = [h for h in held[k] if h not in set(gone)]
        elif r < 0.93:
            for idx in idxs:
                idx.apply(k, EventBatch(0.0, [Cleared()]))
            held[k] = []
        else:
            for idx in idxs:  # leave and come back: its bit is freed and reused
                idx.remove_target(k)
                idx.add_target(k, BS)
            held[k] = []
        if step % 60 == 59:
            _agree(private, shared, reader, prompts, rng)
    _agree(private, shared, reader, prompts, rng)
    if max_bytes:
        assert shared.bound_stats() == private.bound_stats()
        assert shared.bound_stats().evicted_entries > 0  # the bound's evictions went through the arena too
    pid, size, taken, changes, _retries, failures = reader.stats()
    assert (pid, size, failures) == (os.getpid(), ARENA, 0)
    assert 0 < taken <= size and changes >= 3  # the table grew, and each new one was published
    assert reader.writer_alive()


def test_a_bitmap_set_grows_shrinks_and_moves_in_the_arena() -> None:
    """One block held by 1 … 1,000 targets and released: inline ids, an array, a bitmap and back,
    every form re-allocated in the arena; the reader sees each, and the arena's large blocks go back."""
    shared = NativeKvIndex(shared_bytes=ARENA)
    reader = native.GpuViewReader(shared.shared_fd())
    keys = [f"w{t}" for t in range(1000)]
    for k in keys:
        shared.add_target(k, BS)
    tokens = list(range(BS))
    hs = block_hashes(tokens, BS)
    probe = [keys[i] for i in (0, 61, 62, 63, 64, 127, 500, 999)]
    bits = shared._bits(probe)
    for t, k in enumerate(keys):
        shared.apply(k, EventBatch(0.0, [Stored([t + 1], None, tokens, BS)]))
        if t in (0, 2, 3, 61, 62, 63, 64, 100, 500, 999):
            assert reader.match(hs, bits) == shared.match(hs, probe) == [1 if keys.index(p) <= t else 0 for p in probe]
    for t, k in enumerate(keys):
        shared.apply(k, EventBatch(0.0, [Removed([t + 1])]))
        if t in (0, 500, 998):
            assert reader.match(hs, bits) == shared.match(hs, probe)
    assert reader.match(hs, bits) == [0] * len(probe)
    assert reader.first_unheld(hs) == 0


def test_the_arena_holds_the_last_table_not_every_size_it_passed_through() -> None:
    """A table grown to 20,000 blocks was rebuilt 30-odd times: each old one's pages went back."""
    shared = NativeKvIndex(shared_bytes=ARENA)
    shared.add_target("w", BS)
    rng = random.Random(3)
    tokens = [rng.randrange(1 << 20) for _ in range(BS * 20_000)]
    shared.apply("w", EventBatch(0.0, [Stored(list(range(1, 20_001)), None, tokens, BS)]))
    taken = shared._view.shared()[2]
    # 17 B a slot at 68-85 % full, plus a chunk of small blocks and the page rounding (the sum of
    # every size, had the old tables stayed: ~5x the last)
    assert 20_000 / 0.85 * 17 <= taken <= 20_000 / 0.68 * 17 + 2 * 65536


def test_reader_refuses_what_is_not_an_arena(tmp_path) -> None:
    path = tmp_path / "plain"
    path.write_bytes(b"\0" * 8192)
    with open(path, "rb") as f, pytest.raises(ValueError):
        native.GpuViewReader(f.fileno())
    path.write_bytes(b"\0" * 100)
    with open(path, "rb") as f, pytest.raises(ValueError):
        native.GpuViewReader(f.fileno())


def test_match_arguments_as_the_view() -> None:
    shared = NativeKvIndex(shared_bytes=ARENA)
    reader = native.GpuViewReader(shared.shared_fd())
    assert reader.match([], [0, 1]) == [0, 0]
    assert reader.match([1, 2, 3], []) == []
    assert reader.match([1, 2], [-1, 1 << 30]) == [0, 0]  # no such bits
    with pytest.raises(ValueError):
        reader.first_unheld([1], -1)
    with pytest.raises(TypeError):
        reader.match([1], 5)
