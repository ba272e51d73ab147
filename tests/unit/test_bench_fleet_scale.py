"""bench/fleet_scale.py's pure pieces: the engines' LRU workload (what vLLM would emit), the
memory slope, histogram quantiles, the /metrics reader, the table and the goals."""
from __future__ import annotations

import os
import sys
from collections import OrderedDict

import msgspec
import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

import _fleet_report as rep  # noqa: E402
import _fleet_workload as fw  # noqa: E402
from infera.kv.events import decoder_for  # noqa: E402

BS = 16
POOL = 256


@pytest.fixture(scope="module")
def catalog() -> fw.Catalog:
    return fw.Catalog(3, BS, POOL)


def replay_checked(reqs, pool: int, lru: OrderedDict) -> list[fw.Batch]:
    """simulate(), checking every batch against a mirror of the pool as a server would see it."""
    mirror = set(lru)
    batches = fw.simulate(reqs, pool, BS, lru)
    for b in batches:
        for h in b.removed:
            assert h in mirror, "removed a block that was not cached"
            mirror.discard(h)
        for hashes, parent, tokens in b.stored:
            assert parent is None or parent in mirror, "stored a block whose parent is not cached"
            assert len(tokens) == BS * len(hashes)
            for h in hashes:
                assert h not in mirror, "stored a block already cached"
                mirror.add(h)
        assert len(mirror) <= pool
    assert mirror == set(lru)
    return batches


@pytest.mark.parametrize("sharing", [0.0, 0.5, 1.0])
def test_lru_events_are_consistent_and_periodic(catalog: fw.Catalog, sharing: float) -> None:
    reqs = fw.requests(1, 3, BS, POOL, sharing, catalog)
    touched = {h for conv, t in reqs for h in conv.hashes[:conv.turns[t][1] // BS]}
    assert len(touched) >= fw.PERIOD_POOLS * POOL
    lru: OrderedDict[int, None] = OrderedDict()
    warm = replay_checked(reqs, POOL, lru)
    assert len(lru) == POOL  # the first period fills the pool
    assert not warm[0].removed
    second = replay_checked(reqs, POOL, lru)
    state = list(lru)
    third = replay_checked(reqs, POOL, lru)
    # every period after the first emits the same events and leaves the same pool
    assert [(b.removed, b.stored) for b in second] == [(b.removed, b.stored) for b in third]
    assert list(lru) == state
    # steady state: as many blocks evicted as stored over a period
    assert sum(len(b.removed) for b in second) == sum(len(h) for b in second for h, _, _ in b.stored)


def test_cached_blocks_of_a_chain_are_a_prefix(catalog: fw.Catalog) -> None:
    reqs = fw.requests(2, 3, BS, POOL, 0.5, catalog)
    lru: OrderedDict[int, None] = OrderedDict()
    fw.simulate(reqs, POOL, BS, lru)
    for conv, _ in reqs:
        held = [h in lru for h in conv.hashes]
        assert held == sorted(held, reverse=True), "a cached block whose parent was evicted"


def test_sharing_controls_shared_blocks(catalog: fw.Catalog) -> None:
    def pools(sharing: float) -> list[set[int]]:
        out = []
        for engine in range(3):
            lru: OrderedDict[int, None] = OrderedDict()
            fw.simulate(fw.requests(engine, 3, BS, POOL, sharing, catalog), POOL, BS, lru)
            out.append(set(lru))
        return out

    distinct = pools(0.0)
    assert not (distinct[0] & distinct[1]) and not (distinct[1] & distinct[2])
    shared = pools(1.0)
    assert len(shared[0] & shared[1]) > POOL // 4


def test_payload_is_vllm_wire_and_restamped(catalog: fw.Catalog) -> None:
    ev = fw.engine_events(0, 3, BS, POOL, 0.5, catalog)
    assert sum(n for _, n in ev.loop) > 0
    payload, n = next((p, n) for p, n in ev.loop if n)
    stamped = fw.stamp(payload, 1234.5)
    raw = msgspec.msgpack.decode(stamped)
    assert raw[0] == 1234.5 and raw[2] == 0
    kinds = {e["type"] for e in raw[1]}
    assert kinds <= {"BlockStored", "BlockRemoved"}
    stored = next(e for e in raw[1] if e["type"] == "BlockStored")
    assert set(stored) == {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                           "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"}
    batch = decoder_for("vllm")(stamped)  # what the server decodes
    assert batch.ts == 1234.5
    assert sum(len(e.block_hashes) for e in batch.events) == n


@pytest.mark.parametrize("xs,ys,want", [
    ([1, 2, 3], [10, 20, 30], 10.0),
    ([100, 300, 1000], [5 + 48 * x for x in (100, 300, 1000)], 48.0),
    ([1, 1], [1, 2], None),
    ([1], [1], None),
])
def test_slope(xs, ys, want) -> None:
    got = rep.slope(xs, ys)
    assert got == pytest.approx(want) if want is not None else got is None


@pytest.mark.parametrize("cum,q,want", [
    ([(0.001, 50), (0.01, 100), (float("inf"), 100)], 0.5, 0.001),
    ([(0.001, 50), (0.01, 100), (float("inf"), 100)], 0.75, 0.0055),
    ([(0.001, 0), (1.0, 0), (float("inf"), 10)], 0.99, 1.0),  # all past the last bound: that bound
    ([(0.001, 0), (float("inf"), 0)], 0.5, None),
])
def test_hist_quantile(cum, q, want) -> None:
    got = rep.hist_quantile(cum, q)
    assert got == pytest.approx(want) if want is not None else got is None


@pytest.mark.parametrize("sent,applied,drain,p99,held", [
    (1000, 1000, 0.1, 0.5, True),
    (1000, 990, 0.1, 0.5, False),  # not all applied
    (1000, 1000, 1.5, 0.5, False),  # drained too late
    (1000, 1000, 0.1, 1.0, False),  # lag at the bound
    (0, 0, 0.0, None, False),
])
def test_window_held(sent, applied, drain, p99, held) -> None:
    assert rep.window_held(sent, applied, drain, p99) is held


METRICS = """# HELP infera_kv_block_events_total Block events applied
infera_kv_block_events_total{process="0",worker_id="a"} 10.0
infera_kv_block_events_total{process="0",worker_id="b"} 5.0
infera_kv_block_events_total{process="1",worker_id="a"} 7.0
infera_policy_cache_view_size{process="1",worker_id="a"} 2048.0
infera_kv_event_delay_seconds_bucket{le="0.001",process="0",worker_id="a"} 3.0
infera_kv_event_delay_seconds_bucket{le="+Inf",process="0",worker_id="a"} 4.0
infera_kv_event_delay_seconds_bucket{le="0.001",process="0",worker_id="b"} 1.0
infera_kv_event_delay_seconds_bucket{le="+Inf",process="0",worker_id="b"} 1.0
infera_kv_event_gaps_total{process="0",worker_id="a"} 2.0
infera_kv_prediction_error_tokens_count 9.0
infera_process_heap_trims_total{process="1"} 4.0
infera_kv_index_role{process="0",role="writer"} 1.0
infera_kv_index_role{process="1",role="reader"} 1.0
"""


def test_parse_kv_metrics() -> None:
    got = rep.parse_kv_metrics(METRICS)
    assert got["0"].block_events == 15 and got["1"].block_events == 7
    assert got["1"].view_blocks == 2048 and got["0"].gaps == 2
    assert got["0"].delay_buckets == {0.001: 4.0, float("inf"): 5.0}
    assert got["1"].heap_trims == 4 and got["0"].heap_trims == 0
    assert (got["0"].role, got["1"].role) == ("writer", "reader")
    assert rep.parse_kv_metrics('infera_kv_block_events_total{worker_id="a"} 3.0\n')["0"].role == "own"
    one = rep.parse_kv_metrics('infera_kv_block_events_total{worker_id="a"} 3.0\n')
    assert list(one) == ["0"] and one["0"].block_events == 3


def _result(sharing, workers, engines, run, pss_per_entry=100, per_core=2e6, p99=0.5):
    entries = engines * 2048
    return {"sharing": sharing, "workers": workers, "engines": engines, "run": run, "entries": entries,
            "pss_bytes": 40e6 * workers + pss_per_entry * entries * workers, "rss_bytes": 50e6 + pss_per_entry * entries,
            "pss_mb": (40e6 * workers + pss_per_entry * entries * workers) / 2 ** 20,
            "events_per_core": per_core / workers, "lag_p50_ms": 1.0, "lag_p99_ms": 5.0,
            "sent_at_rate": 1e6, "max_held_rate": 1.6e6, "pick_p50_ms": 1.0, "pick_p99_ms": 2.0,
            "added_p50_ms": p99 / 2, "added_p99_ms": p99, "cpu_ms_per_request": 1.0,
            "scrape_cpu_ms": 80.0, "scrape_wall_ms": 120.0, "health_idle_p99_ms": 0.6, "health_scrape_p50_ms": 0.4,
            "health_scrape_p99_ms": 9.0, "health_scrape_max_ms": 31.5}


def test_medians_slopes_table_and_goals() -> None:
    results = [_result(s, w, n, r) for s in (0.0, 1.0) for w in (1, 2) for n in (100, 300) for r in range(3)]
    rows = rep.medians(results)
    assert len(rows) == 8 and all(r["runs"] == 3 for r in rows)
    slopes = rep.memory_slopes(results)
    assert slopes[(0.0, 1)]["bytes_per_entry"] == pytest.approx(100)
    assert slopes[(0.0, 2)]["bytes_per_entry"] == pytest.approx(200)
    text = rep.table(rows, slopes)
    assert len(text.splitlines()) == 2 + len(rows) and "B/entry" in text
    scrapes = rep.scrape_table(rows).splitlines()
    assert len(scrapes) == 2 + len(rows)
    assert scrapes[2].split() == ["0", "1", "100", "80", "120", "0.6", "0.4", "/", "9.0", "/", "31.5"]
    checks = rep.goals(rows, slopes)
    assert set(checks) == {"bytes_per_entry", "workers2_memory_per_entry_ratio", "workers2_event_cpu_ratio",
                           "events_per_core", "held_rate_lag_under_1s", "pick_p99_ms"}
    # per entry, per core, held: --workers 1's; --workers 2 is judged by the ratios
    assert checks["bytes_per_entry"]["ok"] is False and checks["bytes_per_entry"]["value"] == pytest.approx(100)
    assert checks["workers2_memory_per_entry_ratio"]["ok"] is False
    assert checks["workers2_memory_per_entry_ratio"]["value"] == pytest.approx(2.0)  # 200 B against 100
    # the whole PSS at the largest fleet: 2 x (40 MB + 100 B x 614,400) against one process's
    assert rep.total_pss_ratios(rows)["0"] == pytest.approx((80e6 + 200 * 614400) / (40e6 + 100 * 614400))
    assert checks["workers2_event_cpu_ratio"]["value"] == pytest.approx(2.0)
    assert checks["events_per_core"]["ok"] is True and checks["pick_p99_ms"]["ok"] is True
    assert checks["held_rate_lag_under_1s"]["ok"] is True
    good = [_result(s, w, n, r, pss_per_entry=30) for s in (0.0,) for w in (1,) for n in (100, 300) for r in range(2)]
    g = rep.goals(rep.medians(good), rep.memory_slopes(good))
    assert g["bytes_per_entry"]["ok"] is True and g["workers2_memory_per_entry_ratio"]["ok"] is None
    assert rep.total_pss_ratios(rep.medians(good)) == {}


def test_resolve_args() -> None:
    import fleet_scale
    q = fleet_scale.resolve_args(["--quick"])
    assert q.engines == [20, 60] and q.runs == 1 and q.rate == 200_000
    a = fleet_scale.resolve_args(["--engines", "300", "100", "300", "--workers", "1"])
    assert a.engines == [100, 300] and a.runs == 3 and a.rate == 1_000_000
    assert fleet_scale.resolve_args(["--mode", "nats"]).mode == "nats"
    for bad in (["--sharing", "1.5"], ["--engines", "0"], ["--mode", "grpc"]):
        with pytest.raises(SystemExit):
            fleet_scale.resolve_args(bad)


def test_the_policy_pick_histogram_is_read_per_process_for_the_mixed_role() -> None:
    text = "\n".join([
        'infera_router_pick_seconds_bucket{le="0.0001",process="0",role="mixed"} 3.0',
        'infera_router_pick_seconds_bucket{le="+Inf",process="0",role="mixed"} 4.0',
        'infera_router_pick_seconds_bucket{le="0.0001",process="1",role="mixed"} 1.0',
        'infera_router_pick_seconds_bucket{le="+Inf",process="1",role="mixed"} 1.0',
        'infera_router_pick_seconds_bucket{le="+Inf",process="1",role="decode"} 9.0',  # not the mixed pick
    ])
    got = rep.parse_kv_metrics(text)
    assert got["0"].pick_buckets == {0.0001: 3.0, float("inf"): 4.0}
    assert got["1"].pick_buckets == {0.0001: 1.0, float("inf"): 1.0}
    cum = rep.bucket_delta({0.0001: 4.0, float("inf"): 5.0}, {0.0001: 1.0, float("inf"): 1.0})
    assert cum == [(0.0001, 3.0), (float("inf"), 4.0)] and rep.hist_quantile(cum, 0.5) <= 0.0001


def test_untrimmed_slope_is_reported_beside_the_trimmed_one() -> None:
    results = [_result(0.0, 1, n, r, pss_per_entry=45) for n in (100, 300, 1000) for r in range(3)]
    for r in results:
        r["pss_untrimmed_bytes"] = r["pss_bytes"] + 3 * r["entries"]  # the fill's freed heap, 3 B an entry
    slopes = rep.memory_slopes(results)
    assert slopes[(0.0, 1)]["bytes_per_entry"] == pytest.approx(45)
    assert slopes[(0.0, 1)]["untrimmed_bytes_per_entry"] == pytest.approx(48)
    older = rep.memory_slopes([_result(0.0, 1, n, 0) for n in (100, 300)])  # JSON from before the trimmer
    assert "untrimmed_bytes_per_entry" not in older[(0.0, 1)]
