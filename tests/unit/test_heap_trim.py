"""The freed-heap trimmer (infera/heap_trim.py): its accounting, its schedule, its switch, and a real
glibc trim giving back the pages a burst left free between live chunks."""
from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from infera.heap_trim import HeapTrimmer, libc_malloc_trim, limit_malloc_arenas, rss_bytes
from infera.server.cli import parse_args


class FakeHeap:
    def __init__(self, rss: list[int]) -> None:
        self.rss_reads = list(rss)
        self.calls = 0

    def trim(self) -> None:
        self.calls += 1

    def rss(self) -> int:
        return self.rss_reads.pop(0)


@pytest.mark.parametrize("before, after, returned", [
    (100 << 20, 90 << 20, 10 << 20),  # pages went back
    (100 << 20, 100 << 20, 0),  # nothing free
    (100 << 20, 101 << 20, 0),  # the process grew meanwhile: nothing is counted as given back
])
def test_trim_once_counts_what_rss_gave_back(before: int, after: int, returned: int) -> None:
    heap = FakeHeap([before, after])
    trimmer = HeapTrimmer(10.0, heap.trim, heap.rss)
    assert asyncio.run(trimmer.trim_once()) == returned
    assert (heap.calls, trimmer.trims, trimmer.returned_bytes) == (1, 1, returned)
    assert trimmer.seconds >= 0.0


def test_runs_every_interval_until_stopped() -> None:
    heap = FakeHeap([0] * 10_000)

    async def main() -> int:
        trimmer = HeapTrimmer(0.01, heap.trim, heap.rss)
        trimmer.start()
        deadline = time.monotonic() + 10
        while trimmer.trims < 3:
            assert time.monotonic() < deadline, "the trimmer did not run"
            await asyncio.sleep(0.01)
        await trimmer.stop()
        stopped_at = heap.calls
        await asyncio.sleep(0.05)
        return stopped_at

    stopped_at = asyncio.run(main())
    assert heap.calls == stopped_at  # no trim after stop()


@pytest.mark.parametrize("interval, trim, enabled", [(0.0, True, False), (10.0, False, False), (10.0, True, True)])
def test_off_without_interval_or_trim(interval: float, trim: bool, enabled: bool) -> None:
    heap = FakeHeap([])
    trimmer = HeapTrimmer(interval, heap.trim if trim else None, heap.rss)
    assert trimmer.enabled is enabled

    async def main() -> bool:
        trimmer.start()
        started = trimmer._task is not None
        await trimmer.stop()
        return started

    assert asyncio.run(main()) is enabled
    registry = CollectorRegistry()
    registry.register(trimmer)
    text = generate_latest(registry).decode()
    assert f"infera_process_heap_trim_interval_seconds {interval if enabled else 0.0}" in text
    assert "infera_process_heap_trims_total 0.0" in text


def test_negative_interval_is_refused() -> None:
    with pytest.raises(ValueError):
        HeapTrimmer(-1.0)


@pytest.mark.parametrize("argv, environ, expected", [
    ([], {}, 10.0),
    ([], {"INFERA_HEAP_TRIM_INTERVAL": "2.5"}, 2.5),
    (["--heap-trim-interval", "0"], {"INFERA_HEAP_TRIM_INTERVAL": "2.5"}, 0.0),  # flag > env
])
def test_flag_env_default(argv: list[str], environ: dict[str, str], expected: float) -> None:
    base = ["--etcd-endpoint", "http://127.0.0.1:2379"]
    assert parse_args(base + argv, environ).heap_trim_interval == expected


def test_flag_rejects_negative(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--heap-trim-interval", "-1"], {})
    assert "--heap-trim-interval" in capsys.readouterr().err


def test_real_trim_gives_back_the_holes_a_burst_left() -> None:
    trim = libc_malloc_trim()
    if trim is None:
        pytest.skip("this C library has no malloc_trim")
    # 48 MiB of 48 KiB chunks (below glibc's mmap threshold: they come from the heap), every 64th
    # kept alive: the rest are freed holes between live chunks, which free() itself never returns.
    burst = [bytes(48 * 1024) for _ in range(1024)]
    kept = burst[::64]
    del burst
    gc.collect()
    trimmer = HeapTrimmer(10.0, trim)
    before = rss_bytes()
    returned = asyncio.run(trimmer.trim_once())
    assert kept  # alive until after the trim
    assert returned >= 16 << 20, f"gave back {returned} B of ~47 MiB of holes"
    assert rss_bytes() <= before - (16 << 20)


# A child process (a thread keeps the arena it has: the cap must come first in a fresh process):
# four threads alive at once each free a burst; then a trim. glibc gives each its own arena, whose
# freed top the trim cannot return, unless the arenas are capped at one.
_ARENA_CHILD = """
import sys, threading
from infera.heap_trim import libc_malloc_trim, limit_malloc_arenas, rss_bytes
if sys.argv[1] == "capped":
    assert limit_malloc_arenas({}) == 1
both = threading.Barrier(4)
def burst():
    both.wait()
    big = bytes(8 << 20)  # an mmapped buffer, freed: glibc raises its mmap and trim thresholds
    del big
    parts = [bytearray(256 << 10) for _ in range(40)]  # so these come from this thread's arena
    del parts
    both.wait()
before = rss_bytes()
threads = [threading.Thread(target=burst) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
libc_malloc_trim()()
print(rss_bytes() - before)
"""


@pytest.mark.skipif(libc_malloc_trim() is None, reason="needs glibc's malloc_trim and mallopt")
def test_capped_arenas_let_the_trim_return_what_threads_freed() -> None:
    def kept(mode: str) -> int:
        env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
        out = subprocess.run([sys.executable, "-c", _ARENA_CHILD, mode], env=env, capture_output=True, text=True,
                             timeout=60, check=True, cwd=Path(__file__).parents[2])
        return int(out.stdout)

    assert kept("default") >= 24 << 20  # ~40 MiB: four arenas' tops stay with the process
    assert kept("capped") < 8 << 20


def test_the_environment_s_arena_cap_wins() -> None:
    assert limit_malloc_arenas({"MALLOC_ARENA_MAX": "4"}) is None
