"""Hit-rate counters and the self-check window: the router's predicted cached tokens per worker,
the engine-reported ones, and the comparison with the engine's own prefix-cache counters over a
window (engine /metrics scraped by a fake)."""
from __future__ import annotations

import asyncio
import logging

import pytest

from infera.discovery.fleet import Fleet
from infera.discovery.record import WorkerRecord
from infera.kv.index import KvIndex
from infera.router.policy import RoutedRequest
from infera.server import engine_scrape
from infera.server.engine_scrape import EngineHitWindow, engine_hit_counters
from infera.server.kv import KvEventsBridge
from tests.conftest import wait_for

BS = 16


def worker(wid: str, **kw) -> WorkerRecord:
    return WorkerRecord(worker_id=wid, url=f"http://{wid}:1", model_name="m", engine="vllm", kv_block_size=BS,
                        kv_events_endpoint="tcp://127.0.0.1:1", **kw)


class NoSubscriber:
    def add(self, *a) -> None: ...
    def remove(self, *a) -> None: ...
    def stats(self, key): return {}
    def replaying(self, key) -> bool: return False


def request(key: str, hit_blocks: int, prompt: int, more: int = 0) -> RoutedRequest:
    return RoutedRequest(route="/v1/chat/completions", body=b"", parsed=None, model="m", stream=True,
                         request_id="r", state={"route_key": key, "block_size": BS, "predicted_hit_blocks": hit_blocks,
                                                "tokens": [0] * prompt, "more_tokens": more})


def families(collector) -> dict[str, dict[tuple, float]]:
    out: dict[str, dict[tuple, float]] = {}
    for fam in collector.collect():
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


# -- the router's counters ---------------------------------------------------------------------------

def test_every_completed_reply_counts_with_or_without_usage():
    fleet = Fleet()
    b = KvEventsBridge(fleet, KvIndex(), subscriber=NoSubscriber())
    w = worker("w")
    fleet.upsert(w)
    b.observe_usage(w, request("w", 4, 100), None)  # a stream without include_usage
    b.observe_usage(w, request("w", 2, 50), 32)     # usage: 32 cached
    # prompt cut at the tokenization horizon: the estimated rest counts, the cap uses the whole prompt
    b.observe_usage(w, request("w", 3, 48, more=52), None)
    got = families(b)
    key = (("worker_id", "w"),)
    assert got["infera_kv_prompt_tokens_total"][key] == 100 + 50 + 100
    assert got["infera_kv_predicted_cached_tokens_total"][key] == 4 * BS + 2 * BS + 3 * BS
    assert got["infera_kv_reported_prompt_tokens_total"][key] == 50
    assert got["infera_kv_reported_cached_tokens_total"][key] == 32
    assert b.cache_view("w", None)["prediction"]["observations"] == 1  # the per-reply check: usage only


def test_hit_totals_sum_a_workers_dp_ranks_and_predictions_never_exceed_the_prompt():
    fleet = Fleet()
    b = KvEventsBridge(fleet, KvIndex(), subscriber=NoSubscriber())
    w = worker("d", dp_size=2)
    fleet.upsert(w)
    b.observe_usage(w, request("d#dp0", 2, 40), None)
    b.observe_usage(w, request("d#dp1", 9, 40), None)  # more hits than the prompt's full blocks: capped
    # 40 tokens: the last block is always recomputed, so at most 2 full blocks (32 tokens)
    assert b.hit_totals("d") == (2 * BS + 2 * BS, 80)
    assert b.hit_totals("unknown") == (0, 0)


def test_active_blocks_exported_when_the_policy_is_wired():
    fleet = Fleet()
    b = KvEventsBridge(fleet, KvIndex(), subscriber=NoSubscriber())
    fleet.upsert(worker("w"))
    assert "infera_policy_active_blocks" not in families(b)
    b.active_blocks = lambda key: 7
    assert families(b)["infera_policy_active_blocks"][(("worker_id", "w"),)] == 7


# -- engine counters ----------------------------------------------------------------------------------

VLLM_TEXT = """# HELP vllm:prefix_cache_queries_total Prefix cache queries
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 500.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 400.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 100.0
vllm:prompt_tokens_total{model_name="m"} 9.0
"""
SGLANG_TEXT = """sglang:prompt_tokens_total{model_name="m"} 800.0
sglang:cached_tokens_total{model_name="m",cache_source="device"} 300.0
sglang:cached_tokens_total{model_name="m",cache_source="host"} 100.0
"""


def test_engine_counters_of_each_engine_family():
    assert engine_hit_counters(VLLM_TEXT) == (500.0, 1500.0)
    assert engine_hit_counters(SGLANG_TEXT) == (400.0, 800.0)
    assert engine_hit_counters('sglang:prompt_tokens_total{model_name="m"} 8.0\n') == (0.0, 8.0)  # nothing hit yet
    assert engine_hit_counters("other_metric 1\n") is None


# -- the window ----------------------------------------------------------------------------------------

class FakeEngines:
    """Per worker: the engine's counters (what /metrics says), the router's totals, or a failure."""

    def __init__(self) -> None:
        self.engine: dict[str, tuple[float, float]] = {}
        self.router: dict[str, tuple[int, int]] = {}
        self.fail: dict[str, BaseException] = {}
        self.hang: set[str] = set()
        self.fetched: list[str] = []

    async def fetch(self, record: WorkerRecord) -> str:
        self.fetched.append(record.worker_id)
        if record.worker_id in self.hang:
            await asyncio.sleep(3600)
        if record.worker_id in self.fail:
            raise self.fail[record.worker_id]
        if record.worker_id not in self.engine:
            return "unrelated_metric 1\n"
        hits, queries = self.engine[record.worker_id]
        return (f'vllm:prefix_cache_hits_total{{model_name="m"}} {hits}\n'
                f'vllm:prefix_cache_queries_total{{model_name="m"}} {queries}\n')

    def totals(self, worker_id: str) -> tuple[int, int]:
        return self.router.get(worker_id, (0, 0))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def window(fleet: Fleet, fakes: FakeEngines, clock: Clock, **kw) -> EngineHitWindow:
    return EngineHitWindow(fleet, fakes.totals, interval_s=10, window_s=60, timeout_s=0.2, fetch=fakes.fetch,
                           clock=clock, **kw)


async def test_rates_over_the_window_follow_the_counters_deltas():
    fleet, fakes, clock = Fleet(), FakeEngines(), Clock()
    fleet.upsert(worker("a"))
    win = window(fleet, fakes, clock)
    # Lifetime before the window: 90 % hits (engine) — not what the window must show.
    fakes.engine["a"], fakes.router["a"] = (9000, 10000), (9000, 10000)
    await win.scrape_once()
    assert win.rates("a")[:2] == (None, None)  # one sample: no rate yet
    for step in range(1, 10):  # 10 s apart: +1000 queried tokens each, 30 % hit; router predicts 40 %
        clock.now += 10
        fakes.engine["a"] = (9000 + 300 * step, 10000 + 1000 * step)
        fakes.router["a"] = (9000 + 400 * step, 10000 + 1000 * step)
        await win.scrape_once()
    predicted, engine, seconds = win.rates("a")
    assert predicted == pytest.approx(0.4) and engine == pytest.approx(0.3)
    assert 60 <= seconds <= 70  # the baseline is the newest sample at or before the window's start
    got = families(win)
    assert got["infera_kv_window_predicted_hit_rate"][(("worker_id", "a"),)] == pytest.approx(0.4)
    assert got["infera_kv_window_engine_hit_rate"][(("worker_id", "a"),)] == pytest.approx(0.3)
    assert got["infera_engine_metrics_scrapes_total"][(("outcome", "ok"), ("worker_id", "a"))] == 10


async def test_a_counter_going_back_restarts_the_window():
    fleet, fakes, clock = Fleet(), FakeEngines(), Clock()
    fleet.upsert(worker("a"))
    win = window(fleet, fakes, clock)
    fakes.engine["a"], fakes.router["a"] = (500, 1000), (500, 1000)
    await win.scrape_once()
    clock.now += 10
    fakes.engine["a"], fakes.router["a"] = (900, 2000), (900, 2000)
    await win.scrape_once()
    assert win.rates("a")[1] == pytest.approx(0.4)
    clock.now += 10
    fakes.engine["a"] = (10, 100)  # engine restarted: its counters start over
    fakes.router["a"] = (950, 2100)
    await win.scrape_once()
    assert win.rates("a")[:2] == (None, None)
    clock.now += 10
    fakes.engine["a"], fakes.router["a"] = (60, 200), (1000, 2200)
    await win.scrape_once()
    assert win.rates("a")[:2] == (pytest.approx(0.5), pytest.approx(0.5))


async def test_failures_are_counted_and_bounded_and_do_not_stop_other_workers(monkeypatch):
    fleet, fakes, clock = Fleet(), FakeEngines(), Clock()
    for wid in ("ok", "down", "slow", "plain"):
        fleet.upsert(worker(wid))
    fleet.upsert(worker("draining", status="draining"))
    win = window(fleet, fakes, clock)
    fakes.engine["ok"] = (1, 10)
    fakes.fail["down"] = ConnectionRefusedError()
    fakes.hang.add("slow")
    loop = asyncio.get_running_loop()
    started = loop.time()
    await win.scrape_once()
    assert loop.time() - started < 2  # the hung engine cost one timeout, not the round
    got = families(win)["infera_engine_metrics_scrapes_total"]
    assert got == {(("outcome", "ok"), ("worker_id", "ok")): 1, (("outcome", "error"), ("worker_id", "down")): 1,
                   (("outcome", "timeout"), ("worker_id", "slow")): 1,
                   (("outcome", "no_counters"), ("worker_id", "plain")): 1}
    assert "draining" not in fakes.fetched  # only active workers are scraped


async def test_departed_workers_take_their_series_along():
    fleet, fakes, clock = Fleet(), FakeEngines(), Clock()
    fleet.upsert(worker("a"))
    win = window(fleet, fakes, clock)
    fakes.engine["a"], fakes.router["a"] = (1, 10), (1, 10)
    await win.scrape_once()
    fleet.remove("a")
    got = families(win)
    assert not any(dict(k).get("worker_id") == "a" for series in got.values() for k in series)


async def test_warns_once_when_rates_diverge(caplog, monkeypatch):
    monkeypatch.setattr(engine_scrape, "MIN_WARN_TOKENS", 100)
    fleet, fakes, clock = Fleet(), FakeEngines(), Clock()
    fleet.upsert(worker("a"))
    fleet.upsert(worker("b"))
    win = window(fleet, fakes, clock)
    with caplog.at_level(logging.WARNING):
        for step in range(6):
            clock.now += 10
            # a: the router predicts 80 % hits, the engine finds none (a tokenizer mismatch); b: agree
            fakes.engine["a"], fakes.router["a"] = (0, 1000 * step), (800 * step, 1000 * step)
            fakes.engine["b"], fakes.router["b"] = (500 * step, 1000 * step), (520 * step, 1000 * step)
            await win.scrape_once()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "worker a" in warnings[0], warnings


async def test_the_background_task_scrapes_every_interval_and_stops():
    fleet, fakes = Fleet(), FakeEngines()
    fleet.upsert(worker("a"))
    fakes.engine["a"] = (1, 10)
    win = EngineHitWindow(fleet, fakes.totals, interval_s=0.05, window_s=1, fetch=fakes.fetch)
    assert win.window_s == 1
    await win.start()
    await wait_for(lambda: win.rounds >= 3, 5, interval=0.01, message="3 scrape rounds")
    task = win._task
    await win.stop()
    # Stopped means the scraping task has ended (not just "no round in the next few intervals"):
    # nothing is left that could scrape again.
    assert task is not None and task.done() and win._task is None
    rounds, fetched = win.rounds, len(fakes.fetched)
    await win.scrape_once()  # the sentinel: a round still works by hand, and is the only one
    assert (win.rounds, len(fakes.fetched)) == (rounds + 1, fetched + 1)


def test_window_is_at_least_two_intervals():
    assert EngineHitWindow(Fleet(), lambda w: (0, 0), interval_s=30, window_s=10).window_s == 60
    with pytest.raises(ValueError):
        EngineHitWindow(Fleet(), lambda w: (0, 0), interval_s=0)


class NoDiscovery:
    async def start(self, fleet) -> None: ...
    async def stop(self) -> None: ...


def test_flags_set_turn_off_and_follow_env():
    from infera.server.cli import parse_args
    from infera.server.main import InferaServer

    def server(*flags: str, env: dict | None = None) -> InferaServer:
        return InferaServer(parse_args(["--etcd-endpoint", "x:1", *flags], environ=env or {}), discovery=NoDiscovery())

    default = server().engine_window
    assert (default.interval_s, default.window_s) == (10.0, 300.0)
    assert server("--engine-scrape-interval", "0").engine_window is None
    assert server("--router-policy", "round-robin").engine_window is None  # no predictions to compare
    from_env = server(env={"INFERA_ENGINE_SCRAPE_INTERVAL": "2", "INFERA_ENGINE_SCRAPE_WINDOW": "30"}).engine_window
    assert (from_env.interval_s, from_env.window_s) == (2.0, 30.0)
    flag_wins = server("--engine-scrape-window", "40", env={"INFERA_ENGINE_SCRAPE_WINDOW": "30"}).engine_window
    assert flag_wins.window_s == 40.0
