"""``GET /v1/fleet``: the fleet as operators (and ``/dashboard``) see it, in one JSON document.

Built on demand from the server's own state objects (fleet, metrics, breaker, KV-events bridge):
nothing here runs per request except ``RecentWorkerStats.observe_ttft`` (one bounded ring append).
A build walks the fleet and the request counters once: O(workers + counter entries), no locks (one
event loop), and every structure it keeps is bounded per worker and dropped when the worker leaves.

Recent figures are over ``window_s`` (10 s):

* request rate: the server's per-worker request counters (``ServerMetrics.requests``) sampled once
  a second (``run_sampler``, started with the app) and when the document is built, into a short
  ring per worker; rate = counter delta / time delta against the oldest sample inside the window.
  A prefill worker's replies go to its decode worker and are not counted there: its rate (and
  ``requests_total``) is its kv-aware prefill picks (``rate_source``), or null (0) under the
  other policies.
* TTFT: the streamed replies' first-byte times, per worker, in a ring of the last ``TTFT_RING``;
  p50 over those inside the window, plus an EWMA over all of them.
"""
from __future__ import annotations

import asyncio
import time
from array import array
from collections import deque
from typing import Any, Callable

from infera.discovery.fleet import Fleet
from infera.discovery.record import WorkerRecord
from infera.router.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from infera.router.pd_legs import pd_kind  # a prefill pairs only with a decode of its kind
from infera.router.kv_aware import expand_targets

WINDOW_S = 10.0
TTFT_RING = 64  # streamed replies remembered per worker for the windowed p50
TTFT_SMOOTHING = 0.2  # weight of the newest reply in the TTFT EWMA
MIN_SAMPLE_GAP_S = 0.25  # a rate ring takes at most one sample this often (ring ≤ window / gap + 2)
MIN_RATE_SPAN_S = 0.2  # a rate over a shorter span says nothing yet: null
SAMPLE_INTERVAL_S = 1.0  # the background sampler's period: a first look already has a rate
ROLES = ("mixed", "prefill", "decode")


class _RateRing:
    """(time, counter) samples of one worker: the last one at or before ``now - window`` (the base)
    and every later one, flat in one array of doubles (t0, n0, t1, n1, ...): one per worker, so not
    a deque of tuples (an empty deque alone is 0.76 KB, a sample in a tuple ~0.1 KB)."""

    __slots__ = ("samples",)

    def __init__(self) -> None:
        self.samples = array("d")

    def rate(self, now: float, total: float, window: float) -> float | None:
        """Per second over the window (None until the ring spans ``MIN_RATE_SPAN_S``)."""
        samples = self.samples
        if not samples or now - samples[-2] >= MIN_SAMPLE_GAP_S:
            samples.append(now)
            samples.append(total)
        drop = 0  # samples before the base: at most window / gap of them, dropped at once
        while len(samples) - drop >= 4 and samples[drop + 2] <= now - window:
            drop += 2
        if drop:
            del samples[:drop]
        t0, n0 = samples[0], samples[1]
        span = now - t0
        if span < MIN_RATE_SPAN_S:
            return None
        return max(0.0, total - n0) / span  # a counter that went down (the worker left and came back): 0


class _TtftRing:
    __slots__ = ("recent", "ewma")

    def __init__(self) -> None:
        self.recent: deque[tuple[float, float]] = deque(maxlen=TTFT_RING)
        self.ewma: float | None = None

    def observe(self, now: float, seconds: float) -> None:
        self.recent.append((now, seconds))
        self.ewma = seconds if self.ewma is None else self.ewma + TTFT_SMOOTHING * (seconds - self.ewma)

    def p50(self, now: float, window: float) -> float | None:
        values = sorted(s for t, s in self.recent if now - t <= window)
        return values[len(values) // 2] if values else None


class RecentWorkerStats:
    """Per-worker recent figures the server's metrics do not keep per worker: bounded rings, held
    only for workers in the fleet (a reply finishing after its worker left is not recorded)."""

    def __init__(self, fleet: Fleet, clock: Callable[[], float] = time.monotonic) -> None:
        self._fleet = fleet
        self.clock = clock
        self.ttft: dict[str, _TtftRing] = {}
        self.rates: dict[str, _RateRing] = {}
        fleet.subscribe(self._on_fleet_change)

    def observe_ttft(self, worker_id: str, seconds: float) -> None:
        """Hot path (streamed replies): an O(1) append."""
        ring = self.ttft.get(worker_id)
        if ring is None:
            if self._fleet.get(worker_id) is None:
                return
            ring = self.ttft[worker_id] = _TtftRing()
        ring.observe(self.clock(), seconds)

    def rate(self, worker_id: str, total: float, now: float, window: float) -> float | None:
        """Feed ``worker_id``'s ring with its counter ``total``; its rate over ``window``."""
        ring = self.rates.get(worker_id)
        if ring is None:
            ring = self.rates[worker_id] = _RateRing()
        return ring.rate(now, total, window)

    def _on_fleet_change(self, worker_id: str, record: WorkerRecord | None) -> None:
        if record is None:
            self.ttft.pop(worker_id, None)
            self.rates.pop(worker_id, None)


# The rate ring of requests rejected before any pick (counted on worker "none"): no worker id holds a NUL.
_SERVER_KEY = "\x00rejected"


def health_of(record: WorkerRecord, unroutable: str | None, breaker_state: str) -> str:
    """One word for the colour: what a request to this worker would meet now."""
    if unroutable is not None:
        return "unroutable"
    if not record.is_active:
        return "draining"
    if breaker_state == OPEN:
        return "breaker_open"
    if breaker_state == HALF_OPEN:
        return "breaker_half_open"
    return "healthy"


class FleetView:
    """Builds the ``/v1/fleet`` document. Holds references only; ``build`` reads them."""

    def __init__(self, fleet: Fleet, metrics: Any, recent: RecentWorkerStats, *,
                 breaker: CircuitBreaker | None = None, kv: Any = None, tokenizers: Any = None,
                 process: dict | None = None, policy: str | None = None, window_s: float = WINDOW_S,
                 wall_clock: Callable[[], float] = time.time, admission: Any = None) -> None:
        self.fleet = fleet
        self.metrics = metrics  # infera.server.metrics.ServerMetrics
        self.recent = recent
        self.breaker = breaker
        self.kv = kv  # KvEventsBridge under kv-aware, else None
        self.tokenizers = tokenizers
        self.process = process
        self.policy = policy or ("kv-aware" if kv is not None else "round-robin")  # --router-policy
        self.window_s = window_s
        self.clock = recent.clock  # one clock for the rings and the windows
        self.wall_clock = wall_clock
        self.started_at = self.clock()
        self.admission = admission  # --max-inflight-per-worker: AdmissionQueue (infera/server/admission.py)

    # -- pieces ------------------------------------------------------------------------------------
    def _request_totals(self) -> tuple[dict[str, float], dict[str, float]]:
        """Requests per worker since it joined (any status), and those that were 5xx."""
        totals: dict[str, float] = {}
        errors: dict[str, float] = {}
        for (_route, status, worker), n in self.metrics.requests.items():
            totals[worker] = totals.get(worker, 0) + n
            if status.startswith("5"):
                errors[worker] = errors.get(worker, 0) + n
        return totals, errors

    def _prefill_picks(self) -> dict[str, float]:
        picks: dict[str, float] = {}
        if self.kv is not None:
            for (role, key), n in self.kv.picks.items():
                if role == "prefill":
                    worker = key.split("#dp", 1)[0] if "#dp" in key else key
                    picks[worker] = picks.get(worker, 0) + n
        return picks

    def _breaker(self, worker_id: str) -> dict:
        if self.breaker is None or not self.breaker.enabled:
            return {"state": CLOSED, "enabled": False, "trips": 0, "consecutive_failures": 0}
        entry = self.breaker.entry(worker_id)
        return {"state": self.breaker.state(worker_id), "enabled": True, "trips": self.breaker.trips(worker_id),
                "consecutive_failures": entry.consecutive_failures if entry is not None else 0}

    def _kv(self, record: WorkerRecord) -> dict | None:
        """The router's view of the worker's cache: summed over its DP ranks, each rank listed."""
        if self.kv is None:
            return None
        ranks = []
        for rank, _key in expand_targets(record):
            view = self.kv.cache_view(record.worker_id, rank)
            if view is not None:
                ranks.append(view)
        if not ranks:
            return {"subscribed": False}
        pred = [v["prediction"] for v in ranks]
        lags = [v["lag_s"] for v in ranks if v["lag_s"] is not None]
        delays = [v["delay_ms"] for v in ranks if v["delay_ms"] is not None]
        errors = [p["mean_error_blocks"] for p in pred if p["mean_error_blocks"] is not None]
        out = {"subscribed": True, "transport": ranks[0]["transport"],
               "blocks": sum(v["block_count"] for v in ranks),
               "batches": sum(v["batches"] for v in ranks),
               "last_batch_age_s": max(lags) if lags else None,  # the stalest rank
               "delay_ms": max(delays) if delays else None,
               "events_silent": any(v["events_silent"] for v in ranks),
               "gaps": sum(v["gaps"] for v in ranks), "resets": sum(v["resets"] for v in ranks),
               "decode_errors": sum(v["decode_errors"] for v in ranks),
               # self-healing: warmed up from the engine's history, complete, fresh, restarts seen
               "caught_up": all(v.get("caught_up", False) for v in ranks),
               "degraded": any(v.get("degraded", False) for v in ranks),
               "staleness_s": max((v["staleness_s"] for v in ranks if v.get("staleness_s") is not None), default=None),
               "engine_restarts": sum(v.get("engine_restarts", 0) for v in ranks),
               "prediction": {"observations": sum(p["observations"] for p in pred),
                              "exact": sum(p["exact"] for p in pred),
                              "over": sum(p["over"] for p in pred), "under": sum(p["under"] for p in pred),
                              # the worst rank's mean |predicted − reported| over its recent replies
                              "mean_error_blocks": round(max(errors), 3) if errors else None}}
        if len(ranks) > 1:
            out["ranks"] = [{"dp_rank": v["dp_rank"], "blocks": v["block_count"], "last_batch_age_s": v["lag_s"],
                             "delay_ms": v["delay_ms"], "events_silent": v["events_silent"]} for v in ranks]
        return out

    def _rate_source(self, record: WorkerRecord) -> str | None:
        if record.disagg_mode != "prefill":
            return "replies"
        return "prefill_picks" if self.kv is not None else None

    def _counted(self, record: WorkerRecord, totals: dict[str, float], picks: dict[str, float]) -> float | None:
        """What the worker's rate counts (``rate_source``): its replies, or a prefill's picks."""
        source = self._rate_source(record)
        if source is None:
            return None
        return picks.get(record.worker_id, 0) if source == "prefill_picks" else totals.get(record.worker_id, 0)

    def _sample(self, now: float, totals: dict[str, float], picks: dict[str, float]) -> dict[str, float | None]:
        """Feed every worker's rate ring (and the rejections'); the rates over the window."""
        rates: dict[str, float | None] = {}
        for record in self.fleet.all():
            counted = self._counted(record, totals, picks)
            if counted is not None:
                rates[record.worker_id] = self.recent.rate(record.worker_id, counted, now, self.window_s)
        rates[_SERVER_KEY] = self.recent.rate(_SERVER_KEY, totals.get("none", 0), now, self.window_s)
        return rates

    def sample(self) -> None:
        self._sample(self.clock(), self._request_totals()[0], self._prefill_picks())

    async def run_sampler(self, interval: float = SAMPLE_INTERVAL_S) -> None:
        """Sample the counters every ``interval`` until cancelled (O(workers + counters) a time)."""
        while True:
            await asyncio.sleep(interval)
            self.sample()

    def _worker(self, record: WorkerRecord, now: float, totals: dict[str, float], errors: dict[str, float],
                picks: dict[str, float], rate: float | None) -> dict:
        wid = record.worker_id
        unroutable = self.fleet.unroutable_reasons.get(wid)
        breaker = self._breaker(wid)
        gauge = self.metrics.inflight.get(wid)
        source = self._rate_source(record)
        ttft = self.recent.ttft.get(wid)
        p50 = ttft.p50(now, self.window_s) if ttft is not None else None
        out = {"worker_id": wid, "url": record.url, "engine": record.engine, "role": record.disagg_mode,
               "status": record.status, "health": health_of(record, unroutable, breaker["state"]),
               "in_flight": gauge.value if gauge is not None else 0,
               "requests_total": self._counted(record, totals, picks) or 0, "errors_5xx_total": errors.get(wid, 0),
               "requests_per_s": None if rate is None else round(rate, 3), "rate_source": source,
               "ttft_p50_ms": None if p50 is None else round(p50 * 1000, 1),
               "ttft_ewma_ms": None if ttft is None or ttft.ewma is None else round(ttft.ewma * 1000, 1),
               "ttft_samples": 0 if ttft is None else sum(1 for t, _ in ttft.recent if now - t <= self.window_s),
               "breaker": breaker, "kv": self._kv(record)}
        if record.disagg_mode != "mixed":
            out["pd_protocol"] = pd_kind(record)[1]
        if record.dp_size and record.dp_size > 1:
            out["dp_size"], out["dp_rank"] = record.dp_size, record.dp_rank
        if unroutable is not None:
            out["unroutable_reason"] = f"it {unroutable}"
        if self.tokenizers is not None:
            out["kv_routing"], why = self.tokenizers.worker_status(record)
            if why is not None:
                out["kv_routing_reason"] = why
        return out

    def _pd(self, model: str) -> tuple[str, list[dict], list[str]]:
        """The model's topology as AutoRouter routes it, its PD pair groups and its lone prefills.

        Every routable prefill pairs with every routable decode of its kind (engine, protocol): the
        policy picks one of each per request. A group lists both sides once (O(P + D), not P × D)."""
        prefills = self.fleet.active(model, "prefill")
        decodes = self.fleet.active(model, "decode")
        mixed = self.fleet.active(model, "mixed")
        if prefills and decodes:
            topology = "disaggregated"
        elif prefills or decodes:
            topology = "mixed" if mixed else ("missing_decode" if prefills else "missing_prefill")
        else:
            topology = "mixed" if mixed else "unavailable"
        groups: dict[tuple[str, str], dict] = {}
        for w in prefills:
            g = groups.setdefault(pd_kind(w), {"engine": w.engine, "protocol": pd_kind(w)[1],
                                               "prefill": [], "decode": []})
            g["prefill"].append(w.worker_id)
        for w in decodes:
            g = groups.get(pd_kind(w))
            if g is not None:
                g["decode"].append(w.worker_id)
        pairs, lone = [], []
        for g in groups.values():
            if g["decode"]:
                g["pairs"] = len(g["prefill"]) * len(g["decode"])
                pairs.append(g)
            else:
                lone.extend(g["prefill"])
        return topology, pairs, lone

    # -- the document -------------------------------------------------------------------------------
    def build(self) -> dict:
        now = self.clock()
        totals, errors = self._request_totals()
        picks = self._prefill_picks()
        rates = self._sample(now, totals, picks)
        by_model: dict[str, dict[str, list[dict]]] = {}
        health_counts: dict[str, int] = {}
        in_flight = 0
        for record in self.fleet.all():
            w = self._worker(record, now, totals, errors, picks, rates.get(record.worker_id))
            by_model.setdefault(record.model_name, {r: [] for r in ROLES})[record.disagg_mode].append(w)
            health_counts[w["health"]] = health_counts.get(w["health"], 0) + 1
            in_flight += w["in_flight"]
        models = []
        for name in sorted(by_model):
            topology, pairs, lone = self._pd(name)
            roles = by_model[name]
            models.append({"model": name, "topology": topology, "workers": roles,
                           "pd_pairs": pairs, "unpaired_prefill": lone,
                           "requests_per_s": round(sum(w["requests_per_s"] or 0 for r in ("mixed", "decode")
                                                       for w in roles[r]), 3),
                           "in_flight": sum(w["in_flight"] for r in ROLES for w in roles[r]),
                           # the fair queue's line (None: no queue, or no request for it yet)
                           "queue": self.admission.view(name) if self.admission is not None else None})
        requests_total = sum(totals.values())
        rejected_rate = rates[_SERVER_KEY]
        counters = self.metrics
        server = {"workers": len(self.fleet), "active_workers": len(self.fleet.active()),
                  "health": health_counts, "models": len(models), "in_flight": in_flight,
                  "requests_total": requests_total,
                  "requests_per_s": round(sum(m["requests_per_s"] for m in models), 3),
                  "rejected_per_s": None if rejected_rate is None else round(rejected_rate, 3),
                  "retries_total": sum(counters.retries.values()),
                  "midstream_failures_total": sum(counters.midstream_failures.values()),
                  "client_disconnects_total": sum(counters.client_disconnects.values()),
                  "migrations_total": sum(counters.migrations.values()),
                  "kv_blocks": (sum(self.kv.index.block_count(k) for k in self.kv.targets)
                                if self.kv is not None else None),
                  "policy": self.policy,
                  "breaker_enabled": bool(self.breaker is not None and self.breaker.enabled),
                  "uptime_s": round(now - self.started_at, 1), "fleet_generation": self.fleet.generation}
        if self.process is not None:
            server["process"] = self.process  # one of a --workers N server's processes: its view only
        return {"object": "fleet", "generated_at": round(self.wall_clock(), 3), "window_s": self.window_s,
                "server": server, "models": models}
