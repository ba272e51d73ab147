"""The KV self-check over a window: the router's predicted hit rate per worker against the
engine's own prefix-cache counters, scraped from each worker's ``/metrics``.

The per-reply self-check (``KvEventsBridge.observe_usage``) needs ``usage.prompt_tokens_details``
in the reply, which a stream without ``stream_options.include_usage`` (the SDKs' default) never
carries. The engine counts every request it serves, so comparing rates over a window covers all
traffic:

* engine hit rate = Δhits / Δqueries of the engine's counters over the window: vLLM (and the sim)
  ``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total`` (tokens, counted when a new
  request is scheduled; preempted requests' re-lookups are not in them), SGLang
  ``sglang:cached_tokens_total`` / ``sglang:prompt_tokens_total`` (tokens, counted per finished
  request; every ``cache_source`` of the cached tokens summed), every label set summed;
* predicted hit rate = Δpredicted cached tokens / Δprompt tokens of the router's own per-worker
  counters (``infera_kv_predicted_cached_tokens_total`` / ``infera_kv_prompt_tokens_total``), both
  sampled at the moment the engine's reply arrives, summed over the worker's DP ranks. They count
  each completed 200 reply the router routed there, with or without usage, when it completes. The
  predicted hits are exact; a prompt's length past the router's tokenization horizon
  (``kv_aware.Horizon``) is estimated from its characters, and so is that part of the denominator.

Rates rather than totals: the engine also serves requests this router replica did not route (other
replicas, ``--workers N`` siblings, direct clients), and it counts at schedule time where the router
counts at completion; a window of minutes makes both small next to its traffic.

Off the hot path: one background task scrapes every active worker each ``interval_s`` (at most
``MAX_CONCURRENT_SCRAPES`` at once, each bounded by ``timeout_s``), and the texts are parsed in a
thread. A counter that went down (engine restarted, worker re-registered) restarts that window.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Awaitable, Callable, Iterator

import aiohttp
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from infera.discovery.fleet import Fleet
from infera.discovery.record import WorkerRecord
from infera.engine.base.prom import samples
from infera.runtime import wait_for
from infera.server.metrics import drop_worker_keys

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 10.0
DEFAULT_WINDOW_S = 300.0
SCRAPE_TIMEOUT_S = 2.0  # per worker; a slow engine is skipped this round, never waited on longer
MAX_CONCURRENT_SCRAPES = 16
# (hits, queries) counter names per engine family, tried in order; the first pair present is used.
ENGINE_COUNTERS = (("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
                   ("sglang:cached_tokens_total", "sglang:prompt_tokens_total"))
# Warn (once per worker) when the two rates differ by more than this over a window holding at least
# MIN_WARN_TOKENS of both the router's and the engine's prompt tokens.
DIVERGENCE = 0.25
MIN_WARN_TOKENS = 50_000

Fetch = Callable[[WorkerRecord], Awaitable[str]]
Totals = Callable[[str], "tuple[int, int]"]


class _Sample:
    __slots__ = ("t", "hits", "queries", "predicted", "prompt")

    def __init__(self, t: float, hits: float, queries: float, predicted: int, prompt: int) -> None:
        self.t, self.hits, self.queries, self.predicted, self.prompt = t, hits, queries, predicted, prompt

    def __repr__(self) -> str:
        return (f"_Sample(t={self.t:.3f}, hits={self.hits:g}, queries={self.queries:g}, predicted={self.predicted}, "
                f"prompt={self.prompt})")

    def went_back(self, earlier: "_Sample") -> bool:
        return (self.hits < earlier.hits or self.queries < earlier.queries or self.predicted < earlier.predicted
                or self.prompt < earlier.prompt)


def engine_hit_counters(text: str) -> tuple[float, float] | None:
    """(hits, queries) in tokens from an engine's /metrics text; None when it exports neither pair."""
    wanted = {name for pair in ENGINE_COUNTERS for name in pair}
    sums: dict[str, float] = {}
    for name, _, value in samples(text):
        if name in wanted:
            sums[name] = sums.get(name, 0.0) + value
    for hits, queries in ENGINE_COUNTERS:
        if queries in sums:
            return sums.get(hits, 0.0), sums[queries]  # a hits counter with no sample yet: none hit
    return None


class EngineHitWindow:
    """Scrapes the fleet's engines in the background and exports, per worker, the predicted and
    the engine-measured prefix-cache hit rates over the last ``window_s`` seconds."""

    def __init__(self, fleet: Fleet, totals: Totals, *, interval_s: float = DEFAULT_INTERVAL_S,
                 window_s: float = DEFAULT_WINDOW_S, timeout_s: float = SCRAPE_TIMEOUT_S, fetch: Fetch | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self.fleet = fleet
        self.totals = totals  # worker id → (predicted cached tokens, prompt tokens) so far
        self.interval_s = interval_s
        self.window_s = max(window_s, 2 * interval_s)  # a rate needs two samples in the window
        self.timeout_s = timeout_s
        self.clock = clock
        self._fetch = fetch or self._http_fetch
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task | None = None
        self._limit = asyncio.Semaphore(MAX_CONCURRENT_SCRAPES)
        self.windows: dict[str, deque[_Sample]] = {}
        self.scrapes: dict[tuple[str, str], int] = {}  # (worker id, outcome) → scrapes
        self.rounds = 0
        self._warned: set[str] = set()
        fleet.subscribe(self._on_fleet_change)

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _run(self) -> None:
        while True:
            started = self.clock()
            try:
                await self.scrape_once()
            except Exception:  # a bug here must not end the self-check for good
                log.exception("engine metrics scrape round failed")
            await asyncio.sleep(max(0.0, self.interval_s - (self.clock() - started)))

    def _on_fleet_change(self, worker_id: str, record: WorkerRecord | None) -> None:
        if record is None:
            self.windows.pop(worker_id, None)
            drop_worker_keys(self.scrapes, worker_id, 0)

    # -- one round -------------------------------------------------------------------------------
    async def _http_fetch(self, record: WorkerRecord) -> str:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with self._session.get(record.url.rstrip("/") + "/metrics", timeout=timeout) as resp:
            resp.raise_for_status()
            return await resp.text()

    async def _scrape(self, record: WorkerRecord) -> tuple[WorkerRecord, str | None, float, int, int]:
        """(record, text or the outcome that kept it, when it arrived, router totals then)."""
        async with self._limit:
            try:
                text = await wait_for(self._fetch(record), self.timeout_s)
            except asyncio.TimeoutError:
                return record, None, 0.0, 0, 0
            except (aiohttp.ClientError, OSError, ValueError):
                return record, "", 0.0, 0, 0
        predicted, prompt = self.totals(record.worker_id)  # at the same moment as the engine's counters
        return record, text, self.clock(), predicted, prompt

    async def scrape_once(self) -> None:
        workers = [r for r in self.fleet.all() if r.is_active and r.url]
        got = await asyncio.gather(*(self._scrape(r) for r in workers))
        texts = [text for _, text, *_ in got if text]
        parsed = iter(await asyncio.to_thread(lambda: [engine_hit_counters(t) for t in texts]) if texts else ())
        for record, text, at, predicted, prompt in got:
            wid = record.worker_id
            if text is None:
                self._count(wid, "timeout")
                continue
            if not text:
                self._count(wid, "error")
                continue
            counters = next(parsed)
            if counters is None:
                self._count(wid, "no_counters")
                continue
            self._count(wid, "ok")
            if self.fleet.get(wid) is None:
                continue  # left while we were scraping
            self._add(wid, _Sample(at, counters[0], counters[1], predicted, prompt))
        self.rounds += 1

    def _count(self, worker_id: str, outcome: str) -> None:
        if self.fleet.get(worker_id) is not None:
            self.scrapes[(worker_id, outcome)] = self.scrapes.get((worker_id, outcome), 0) + 1

    def _add(self, worker_id: str, sample: _Sample) -> None:
        window = self.windows.get(worker_id)
        if window is None:
            window = self.windows[worker_id] = deque()
        elif sample.went_back(window[-1]):
            window.clear()  # engine restarted or the worker re-registered: a new window
        window.append(sample)
        # Keep the newest sample at or before the window's start as the baseline.
        while len(window) > 2 and window[1].t <= sample.t - self.window_s:
            window.popleft()
        self._check(worker_id)

    # -- results -----------------------------------------------------------------------------------
    def rates(self, worker_id: str) -> tuple[float | None, float | None, float]:
        """(predicted hit rate, engine hit rate, seconds covered) over the window; a rate is None
        while its denominator did not move."""
        window = self.windows.get(worker_id)
        if not window or len(window) < 2:
            return None, None, 0.0
        first, last = window[0], window[-1]
        prompt, queries = last.prompt - first.prompt, last.queries - first.queries
        predicted = (last.predicted - first.predicted) / prompt if prompt > 0 else None
        engine = (last.hits - first.hits) / queries if queries > 0 else None
        return predicted, engine, last.t - first.t

    def _check(self, worker_id: str) -> None:
        predicted, engine, _ = self.rates(worker_id)
        if predicted is None or engine is None or worker_id in self._warned:
            return
        window = self.windows[worker_id]
        prompt, queries = window[-1].prompt - window[0].prompt, window[-1].queries - window[0].queries
        if min(prompt, queries) >= MIN_WARN_TOKENS and abs(predicted - engine) > DIVERGENCE:
            self._warned.add(worker_id)
            log.warning("worker %s: the router predicted a %.0f%% prefix-cache hit rate over the last %.0f s, the "
                        "engine measured %.0f%%: check that the router tokenizer and chat template match the "
                        "engine's, and that the worker's KV events reach this server", worker_id, 100 * predicted,
                        self.window_s, 100 * engine)

    def collect(self) -> Iterator[Metric]:
        predicted = GaugeMetricFamily("infera_kv_window_predicted_hit_rate", "Router-predicted share of prompt "
                                      "tokens cached, over the self-check window", labels=["worker_id"])
        engine = GaugeMetricFamily("infera_kv_window_engine_hit_rate", "Engine-measured prefix-cache hit rate "
                                   "(its own counters), over the self-check window", labels=["worker_id"])
        span = GaugeMetricFamily("infera_kv_window_seconds", "Seconds the self-check window covers so far",
                                 labels=["worker_id"])
        for wid in sorted(self.windows):
            p, e, seconds = self.rates(wid)
            if p is not None:
                predicted.add_metric([wid], p)
            if e is not None:
                engine.add_metric([wid], e)
            span.add_metric([wid], seconds)
        scrapes = CounterMetricFamily("infera_engine_metrics_scrapes", "Scrapes of a worker's /metrics by the "
                                      "self-check: ok, timeout, error (unreachable, HTTP error), no_counters (no "
                                      "prefix-cache counters exported)", labels=["worker_id", "outcome"])
        for (wid, outcome), n in sorted(self.scrapes.items()):
            scrapes.add_metric([wid, outcome], n)
        yield from (predicted, engine, span, scrapes)
