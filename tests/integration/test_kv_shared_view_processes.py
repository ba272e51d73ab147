"""One KV index per host (issue 30 item 4), across processes: a writer process changes a shared
GPU view as fast as it can while this process reads it without locks (GpuViewReader). Blocks the
writer never changes must read the same on every match, however the table moves around them; and
when the writer is killed mid-change, the reader goes on: it knows the writer is gone, and what it
answers is right or nothing (None: route by load), never a wrong prefix."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infera.kv.hashing import block_hashes
from infera.kv.native import native
from tests.integration import shared_view_writer as writer

pytestmark = pytest.mark.skipif(native is None, reason="the C accelerator is not built")

REPO = Path(__file__).resolve().parents[2]

ANCHOR = block_hashes(writer.ANCHOR_TOKENS, writer.BS)
NEVER = block_hashes(list(range(7, 7 + 32 * writer.BS)), writer.BS)  # stored by nobody
PROBE = [0, 70, 105, 140, *writer.CHURN_BITS[:8], 199]
N_ANCHORED = 4  # PROBE's first four bits hold ANCHOR throughout


def _start_writer(seconds: float) -> tuple[subprocess.Popen, int]:
    ours, theirs = socket.socketpair()
    proc = subprocess.Popen([sys.executable, writer.__file__, str(theirs.fileno()), str(seconds)],
                            pass_fds=[theirs.fileno()], env={**os.environ, "PYTHONPATH": str(REPO)})
    theirs.close()
    ours.settimeout(30)
    try:
        _msg, fds, _flags, _addr = socket.recv_fds(ours, 16, 1)
    finally:
        ours.close()
    assert len(fds) == 1, "the writer sent no arena"
    return proc, fds[0]


def _check(reader) -> bool:
    """One round of reads; False when a read gave no answer."""
    m = reader.match(ANCHOR, PROBE)
    if m is None:
        return False
    assert m[:N_ANCHORED] == [len(ANCHOR)] * N_ANCHORED, m
    assert all(0 <= x <= len(ANCHOR) for x in m[N_ANCHORED:]), m
    first = reader.first_unheld(ANCHOR)
    if first is None:
        return False
    assert first == len(ANCHOR)
    never = reader.match(NEVER, PROBE[:2])
    if never is None:
        return False
    assert never == [0, 0]
    return True


def test_reader_sees_a_consistent_view_while_the_writer_churns_and_after_it_is_killed() -> None:
    proc, fd = _start_writer(60)
    try:
        reader = native.GpuViewReader(fd)
        os.close(fd)  # the mapping stays
        assert reader.writer_alive()
        taken0, tables0 = reader.stats()[2:4]
        rounds = answered = 0
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            rounds += 1
            answered += _check(reader)
        _pid, _size, taken, tables, retries, failures = reader.stats()
        # the writer wrote while we read: its table grew (and moved) several times
        assert tables - tables0 >= 5 and taken > taken0 + (1 << 20), (tables0, tables, taken0, taken)
        assert answered >= rounds * 0.99, (answered, rounds, retries, failures)
        proc.send_signal(signal.SIGKILL)  # wherever it is: maybe inside a change
        proc.wait(10)
        deadline = time.monotonic() + 5
        while reader.writer_alive():
            assert time.monotonic() < deadline, "the reader still thinks the writer runs"
            time.sleep(0.01)
        # after the writer's death: right or nothing, never wrong (its last change may be half done)
        for _ in range(200):
            _check(reader)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
