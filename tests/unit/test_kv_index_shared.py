"""A reader process's KV index (infera/kv/index_shared.py): what it answers attached to a writer's
arena, told the writer's targets, and what it answers without one (nothing held, counted)."""
from __future__ import annotations

import os

import pytest

from infera.kv.events import EventBatch, Stored
from infera.kv.hashing import block_hashes
from infera.kv.index import NativeKvIndex
from infera.kv.index_shared import SharedKvIndex, TargetRow
from infera.kv.native import native

pytestmark = pytest.mark.skipif(native is None, reason="the C accelerator is not built")

BS = 4


def _writer() -> tuple[NativeKvIndex, list[int]]:
    w = NativeKvIndex(shared_bytes=16 << 20)
    for k in ("a", "b", "c"):
        w.add_target(k, BS)
    tokens = list(range(40))
    w.apply("a", EventBatch(123.5, [Stored(list(range(1, 11)), None, tokens, BS)]))
    w.apply("b", EventBatch(124.0, [Stored(list(range(1, 4)), None, tokens[:12], BS)]))
    return w, block_hashes(tokens, BS)


def _rows(w: NativeKvIndex) -> dict[str, TargetRow]:
    return {key: TargetRow(bit, bs, blocks, made, ev) for key, bit, bs, blocks, made, ev in w.target_rows()}


def test_answers_as_the_writer_once_attached_and_told_its_targets() -> None:
    w, hs = _writer()
    r = SharedKvIndex()
    fd = w.shared_fd()
    assert fd is not None
    r.attach(fd, generation=3)
    r.update(_rows(w), len(w))
    keys = ["a", "b", "c", "nobody"]
    assert r.match(hs, keys) == w.match(hs, keys) == [10, 3, 0, 0]
    assert r.match_one(hs, "b") == 3
    assert r.first_unheld(hs) == w.first_unheld(hs) == 10
    assert r.block_counts(keys) == [10, 3, 0, 0] and r.block_count("a") == 10
    assert r.events_made_until("a") == 123.5 and r.events_made_until("nobody") == 0.0
    assert r.block_size("a") == BS and r.block_size("nobody") is None
    assert sorted(r.keys()) == ["a", "b", "c"] and "a" in r and len(r) == 10
    assert r.generation == 3 and r.attached and r.writer_alive()
    assert r.unanswered == 0
    size, taken, _retries, failures = r.stats()
    assert size >= 16 << 20 and taken > 0 and failures == 0


def test_a_target_the_rows_do_not_name_matches_nothing() -> None:
    w, hs = _writer()
    r = SharedKvIndex()
    r.attach(w.shared_fd(), 0)
    rows = _rows(w)
    del rows["a"]  # the writer's rows have not told this reader of "a" yet
    r.update(rows, len(w))
    assert r.match(hs, ["a", "b"]) == [0, 3]


def test_without_a_writer_nothing_is_held_and_each_read_is_counted() -> None:
    r = SharedKvIndex()
    hs = block_hashes(list(range(40)), BS)
    assert not r.attached and not r.writer_alive()
    assert r.match(hs, ["a", "b"]) == [0, 0]
    assert r.first_unheld(hs, 2) == 2
    assert r.match([], ["a"]) == [0] and r.match(hs, []) == []  # nothing to answer: not counted
    assert r.unanswered == 2
    assert r.stats() == (0, 0, 0, 0)
    w, _ = _writer()
    r.attach(w.shared_fd(), 1)
    r.update(_rows(w), len(w))
    assert r.match(hs, ["a"]) == [10]
    r.detach()  # the writer went
    assert r.match(hs, ["a"]) == [0] and r.block_count("a") == 0 and len(r) == 0 and r.unanswered == 3


def test_the_reader_keeps_its_mapping_after_the_fd_goes_and_a_freed_table_reads_as_empty() -> None:
    w, hs = _writer()
    fd = os.dup(w.shared_fd())
    r = SharedKvIndex()
    r.attach(fd, 0)
    os.close(fd)  # the mapping stays
    r.update(_rows(w), len(w))
    assert r.match(hs, ["a"]) == [10]
    del w  # the writer frees its table and sets into the arena: punched pages read as zeros
    assert r.match(hs, ["a"]) == [0]
    assert r.first_unheld(hs) == 0
