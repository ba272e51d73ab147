"""Heap the process no longer uses, given back to the OS (``--heap-trim-interval``).

glibc's malloc returns freed memory to the OS only from the top of its heap. A burst (a fleet's
first fill of the KV index, a backlog of event batches, a large request) leaves free chunks between
live ones, and the process keeps their pages: at 1,000 engines ~3 B per KV index entry
(``bench/fleet_scale.py``). jemalloc and tcmalloc purge such pages by themselves after a decay
time; glibc needs ``malloc_trim``, which releases every whole free page of every arena.

A trim walks the free chunks (~1.5 ms at 1,000 engines) holding each arena's lock in turn, so it
runs in a thread (ctypes releases the GIL), never on the event loop, once per interval: a
thousandth of a core at the default. Pages it returns that are used again cost a page fault each,
far less than the trim. Where the C library has no ``malloc_trim`` (musl, macOS) there is nothing
to do: :func:`libc_malloc_trim` is None and the trimmer stays off.

A trim cannot give back the top of a thread's own arena: glibc gives each thread that allocates its
own (up to 8 per core), and a thread's arena keeps its freed top below a threshold that rises with
the largest buffer it has freed (up to 64 MiB). The server's threads (``asyncio.to_thread``: the
``--workers N`` /metrics merge, large prompts) each kept one: at 1,000 workers a ``--workers 2``
process grew by ~30 MB per six scrapes while one process stayed flat. :func:`limit_malloc_arenas`
keeps every thread on the main arena, which the trim empties; the GIL already serializes nearly all
of their allocations, so one arena costs no contention worth measuring.
"""
from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import time
from typing import Any, Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from infera.runtime import cancel_and_wait

log = logging.getLogger(__name__)

DEFAULT_HEAP_TRIM_INTERVAL_S = 10.0


def _libc_function(name: str) -> Any:
    """``name`` in the C library this process already runs on, or None where it has none (musl, macOS)."""
    try:
        return getattr(ctypes.CDLL(None), name)
    except (AttributeError, OSError):
        return None


def libc_malloc_trim() -> Callable[[], None] | None:
    """glibc's ``malloc_trim(0)`` as a callable (every arena, no padding kept), or None without it."""
    fn = _libc_function("malloc_trim")
    if fn is None:
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int

    def trim() -> None:
        fn(0)

    return trim


M_ARENA_MAX = -8  # glibc's mallopt parameter


def limit_malloc_arenas(environ: Mapping[str, str], arenas: int = 1) -> int | None:
    """Cap glibc's malloc arenas at ``arenas`` (the module docstring says why), unless the
    environment sets ``MALLOC_ARENA_MAX`` (glibc's own knob, which then wins). Call it first thing
    in a process: a thread keeps the arena it already has. The cap set, or None where nothing was
    set (the environment's, or a C library without ``mallopt``)."""
    if "MALLOC_ARENA_MAX" in environ:
        return None
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return arenas if mallopt(M_ARENA_MAX, arenas) == 1 else None


def rss_bytes(path: str = "/proc/self/statm") -> int:
    """This process's resident memory (0 where /proc is not there)."""
    try:
        with open(path, "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class HeapTrimmer:
    """Every ``interval_s`` seconds, ``trim`` in a thread; counts the trims, their time and the
    resident bytes they gave back (RSS before − after, when it fell), for /metrics. ``interval_s``
    0 or no ``trim``: off."""

    def __init__(self, interval_s: float, trim: Callable[[], None] | None = None,
                 rss: Callable[[], int] = rss_bytes) -> None:
        if interval_s < 0:
            raise ValueError(f"heap trim interval must be >= 0, got {interval_s}")
        self.interval_s = interval_s
        self._trim = trim
        self._rss = rss
        self.trims = 0
        self.seconds = 0.0
        self.returned_bytes = 0
        self._task: asyncio.Task | None = None

    @classmethod
    def for_this_process(cls, interval_s: float) -> "HeapTrimmer":
        trim = libc_malloc_trim() if interval_s > 0 else None
        if interval_s > 0 and trim is None:
            log.info("heap trim: this C library has no malloc_trim; freed heap stays with the process")
        return cls(interval_s, trim)

    @property
    def enabled(self) -> bool:
        return self.interval_s > 0 and self._trim is not None

    def start(self) -> None:
        if self.enabled and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="heap-trim")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.trim_once()

    async def trim_once(self) -> int:
        """One trim, off the event loop; the bytes it gave back."""
        returned, took = await asyncio.to_thread(self._trim_blocking)
        self.trims += 1
        self.seconds += took
        self.returned_bytes += returned
        return returned

    def _trim_blocking(self) -> tuple[int, float]:
        assert self._trim is not None
        before = self._rss()
        t0 = time.perf_counter()
        self._trim()
        took = time.perf_counter() - t0
        return max(0, before - self._rss()), took

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("infera_process_heap_trim_interval_seconds",
                                "seconds between trims of the freed heap (--heap-trim-interval; 0: off)",
                                value=self.interval_s if self.enabled else 0.0)
        yield CounterMetricFamily("infera_process_heap_trims_total",
                                  "trims of the freed heap (glibc malloc_trim, in a thread)", value=self.trims)
        yield CounterMetricFamily("infera_process_heap_trim_seconds_total", "time the heap trims took",
                                  value=self.seconds)
        yield CounterMetricFamily("infera_process_heap_trim_returned_bytes_total",
                                  "resident bytes the heap trims gave back to the OS", value=self.returned_bytes)
