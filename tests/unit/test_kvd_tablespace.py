"""L3 tablespace: allocation, journal replay and torn-tail truncation, snapshots, checksums,
eviction, TTL, group commit."""
from __future__ import annotations

import json
import os
import threading
import time

import pytest

from infera.kvd import tablespace as ts_mod
from infera.kvd.store import Namespaced
from infera.kvd.tablespace import JOURNAL, SNAPSHOT, Tablespace

SLOT = 4096
CONTAINER = 16 * SLOT


def open_ts(root, total=4 * CONTAINER, interval=0) -> Tablespace:
    return Tablespace(str(root), total, container_bytes=CONTAINER, slot_bytes=SLOT, flush_interval_ms=interval).open()


def k(i: int, model: str = "m") -> Namespaced:
    return Namespaced(model, "c", i.to_bytes(8, "big"))


def val(i: int, size: int = 5000) -> bytes:
    return (i.to_bytes(4, "big") * (size // 4 + 1))[:size]


def test_layout_put_get_and_reopen_from_snapshot(tmp_path):
    t = open_ts(tmp_path)
    assert sorted(os.listdir(tmp_path / "containers")) == [f"{i:04d}.bin" for i in range(4)]
    assert all(os.path.getsize(tmp_path / "containers" / f) == CONTAINER for f in os.listdir(tmp_path / "containers"))
    for i in range(10):
        assert t.put(k(i), val(i))
    assert t.get(k(3)) == (val(3), "long") and t.get(k(99)) is None
    assert t.used_bytes == 10 * 5000 and len(t) == 10
    t.close()
    assert os.path.getsize(tmp_path / JOURNAL) == 0  # the snapshot covers everything
    assert len(json.loads((tmp_path / SNAPSHOT).read_bytes())["records"]) == 10
    t = open_ts(tmp_path)
    try:
        assert [t.get(k(i))[0] for i in range(10)] == [val(i) for i in range(10)]
    finally:
        t.close()


def test_value_spans_contiguous_slots_and_too_big_is_refused(tmp_path):
    t = open_ts(tmp_path)
    try:
        assert t.put(k(1), val(1, CONTAINER))  # exactly one container
        assert not t.put(k(2), val(2, CONTAINER + 1))
        assert t.get(k(1))[0] == val(1, CONTAINER)
    finally:
        t.close()


def test_overwrite_frees_the_old_extent(tmp_path):
    t = open_ts(tmp_path, total=CONTAINER)
    try:
        for round_ in range(5):
            assert t.put(k(1), val(round_, 10 * SLOT))  # 10 of 16 slots: only fits if the old one is freed
        assert t.get(k(1))[0] == val(4, 10 * SLOT) and t.evictions_total == 0
    finally:
        t.close()


def test_full_tablespace_evicts_least_recently_used(tmp_path):
    t = open_ts(tmp_path, total=CONTAINER)
    try:
        for i in range(4):
            t.put(k(i), val(i, 4 * SLOT))  # 4 x 4 slots fill the container
        t.get(k(0))  # refresh 0: 1 is now the oldest
        t.put(k(4), val(4, 4 * SLOT))
        assert t.get(k(1)) is None and t.get(k(0)) is not None and t.get(k(4)) is not None
        assert t.evictions_total == 1
    finally:
        t.close()
    t = open_ts(tmp_path, total=CONTAINER)  # the eviction was journaled
    try:
        assert t.get(k(1)) is None and len(t) == 4
    finally:
        t.close()


def test_torn_journal_tail_is_truncated(tmp_path):
    t = open_ts(tmp_path)
    for i in range(3):
        t.put(k(i), val(i))
    t._flush()
    good = os.path.getsize(tmp_path / JOURNAL)
    os.close(t._journal_fd)  # crash: no snapshot, fds just vanish
    for fd in t._fds:
        os.close(fd)
    with open(tmp_path / JOURNAL, "ab") as f:
        f.write(b'{"op":"put","seq":99,"m":"m","c":"c","k":"AAAA')  # a line the crash cut short
    t = open_ts(tmp_path)
    try:
        assert os.path.getsize(tmp_path / JOURNAL) == good
        assert [t.get(k(i))[0] for i in range(3)] == [val(i) for i in range(3)]
        assert t.put(k(3), val(3)) and t.get(k(3))[0] == val(3)  # appends after the cut
    finally:
        t.close()


def test_garbage_line_mid_journal_cuts_the_rest(tmp_path):
    (tmp_path / "containers").mkdir()
    t = open_ts(tmp_path)
    t.put(k(1), val(1))
    t._flush()
    os.close(t._journal_fd)
    for fd in t._fds:
        os.close(fd)
    with open(tmp_path / JOURNAL, "ab") as f:
        f.write(b"not json\n")
        f.write(json.dumps({"op": "del", "seq": 50, "m": "m", "c": "c", "k": "AAAAAAAAAAE="}).encode() + b"\n")
    t = open_ts(tmp_path)
    try:
        assert t.get(k(1))[0] == val(1)  # the del after the garbage line was not applied
    finally:
        t.close()


def test_corrupted_data_is_a_miss_never_served(tmp_path):
    t = open_ts(tmp_path)
    try:
        t.put(k(1), val(1))
        rec = t._index[k(1)]
        os.pwrite(t._fds[rec.container], b"\xff" * 10, rec.slot * SLOT + 100)
        assert t.get(k(1)) is None and t.corrupt_reads_total == 1
        assert not t.contains(k(1)) and t.used_bytes == 0
    finally:
        t.close()


def test_snapshot_falls_back_to_bak_and_replays_journal(tmp_path):
    t = open_ts(tmp_path)
    t.put(k(1), val(1))
    t.close()  # snapshot #1 holds k1
    t = open_ts(tmp_path)
    t.put(k(2), val(2))
    t.close()  # snapshot #2 holds k1, k2; #1 became .bak
    (tmp_path / SNAPSHOT).write_bytes(b"{broken")
    t = open_ts(tmp_path)
    try:
        assert t.get(k(1))[0] == val(1)  # from .bak (k2 lost with the broken snapshot, never served wrong)
    finally:
        t.close()


def test_geometry_change_starts_empty(tmp_path):
    t = open_ts(tmp_path)
    t.put(k(1), val(1))
    t.close()
    t = Tablespace(str(tmp_path), 4 * CONTAINER, container_bytes=CONTAINER, slot_bytes=2 * SLOT).open()
    try:
        assert len(t) == 0 and t.get(k(1)) is None
    finally:
        t.close()


def test_ttl_is_wall_clock_and_lazy(tmp_path):
    t = open_ts(tmp_path)
    try:
        t.put(k(1), val(1), expires_at=time.time() - 1)
        t.put(k(2), val(2), expires_at=time.time() + 3600)
        assert t.get(k(1)) is None and t.get(k(2)) is not None
    finally:
        t.close()


def test_clear_and_remove_are_journaled(tmp_path):
    t = open_ts(tmp_path)
    for i in range(4):
        t.put(k(i, model="a" if i % 2 else "b"), val(i))
    assert len(t.clear(model="a")) == 2 and t.remove(k(0, model="b"))
    t._flush()
    os.close(t._journal_fd)
    for fd in t._fds:
        os.close(fd)
    t = open_ts(tmp_path)
    try:
        assert len(t) == 1 and t.get(k(2, model="b"))[0] == val(2)
    finally:
        t.close()


def test_group_commit_batches_fsyncs(tmp_path, monkeypatch):
    t = open_ts(tmp_path, total=8 * CONTAINER, interval=50)
    journal_syncs = []
    real_fsync = os.fsync

    def counting_fsync(fd):
        if fd == t._journal_fd:
            journal_syncs.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(ts_mod.os, "fsync", counting_fsync)
    try:
        threads = [threading.Thread(target=t.put, args=(k(i), val(i))) for i in range(16)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        assert all(t.get(k(i))[0] == val(i) for i in range(16))
        assert 1 <= len(journal_syncs) < 16  # a window carries several puts
    finally:
        monkeypatch.setattr(ts_mod.os, "fsync", real_fsync)
        t.close()


def test_selfcheck_reports_rates(tmp_path):
    w, r = ts_mod.selfcheck(str(tmp_path), nbytes=2 << 20)
    assert w > 0 and r > 0 and os.listdir(tmp_path) == []


def test_bad_geometry_arguments():
    with pytest.raises(ValueError):
        Tablespace("/nonexistent", 10, container_bytes=100, slot_bytes=10)


def test_close_waits_for_puts_in_flight(tmp_path):
    t = open_ts(tmp_path, interval=200)  # a long window: puts are still waiting when close starts
    threads = [threading.Thread(target=t.put, args=(k(i), val(i))) for i in range(4)]
    for th in threads:
        th.start()
    deadline = time.monotonic() + 10
    while t._inflight < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    t.close()
    for th in threads:
        th.join(10)
    assert not t.put(k(9), val(9))  # closed: refused, not written to a closed fd
    t = open_ts(tmp_path)
    try:
        assert [t.get(k(i))[0] for i in range(4)] == [val(i) for i in range(4)]
    finally:
        t.close()
