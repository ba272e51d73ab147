"""The self-check under the KV index's byte bound: a view the bound evicted from may lack blocks its
engine still holds, so an under-prediction there is counted apart, not as drift (no divergence
warning, no ``predictions_off``), while an over-prediction still is; and /metrics-style collection
shows the bytes held and the entries evicted."""
from __future__ import annotations

import logging

import pytest

from infera.discovery.fleet import Fleet
from infera.discovery.record import WorkerRecord
from infera.kv.bound import model_bytes
from infera.kv.events import EventBatch, Stored
from infera.kv.index import NativeKvIndex, PyKvIndex
from infera.kv.native import native
from infera.router.policy import RoutedRequest
from infera.server.kv import DIVERGENCE_WINDOW, KvEventsBridge

BS = 32
PROMPT = 40 * BS
WORKER = WorkerRecord(worker_id="w", url="http://w:1", model_name="m", engine="vllm", kv_block_size=BS,
                      kv_events_endpoint="tcp://127.0.0.1:1")
KINDS = [PyKvIndex] + ([NativeKvIndex] if native is not None else [])


class NoSubscriber:
    def add(self, *a) -> None: ...
    def remove(self, *a) -> None: ...
    def stats(self, key): return {}
    def replaying(self, key) -> bool: return False


def bridge(index) -> KvEventsBridge:
    fleet = Fleet()
    b = KvEventsBridge(fleet, index, subscriber=NoSubscriber())
    fleet.upsert(WORKER)
    return b


def fill_past_the_bound(index) -> None:
    """Chains of 40 blocks stored in turn until the bound evicts the first ones."""
    for i in range(12):
        tokens = [i * 100_000 + t for t in range(40 * BS)]
        index.apply("w", EventBatch(0.0, [Stored(list(range(100 * i, 100 * i + 40)), None, tokens, BS)]))
    assert index.evicted_entries("w") > 0


def observe(b: KvEventsBridge, predicted_blocks: int, reported_tokens: int) -> None:
    req = RoutedRequest(route="/v1/completions", body=b"", parsed=None, model="m", stream=False, request_id="r",
                        state={"route_key": "w", "block_size": BS, "predicted_hit_blocks": predicted_blocks,
                               "tokens": [0] * PROMPT})
    b.observe_usage(WORKER, req, reported_tokens)


def diverged(caplog) -> bool:
    return any("disagree" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


@pytest.mark.parametrize("kind", KINDS)
def test_under_predictions_on_an_evicted_view_are_not_drift(kind, caplog):
    index = kind(max_bytes=model_bytes(200, 200))
    b = bridge(index)
    fill_past_the_bound(index)
    with caplog.at_level(logging.WARNING):
        for _ in range(3 * DIVERGENCE_WINDOW):
            observe(b, 0, 30 * BS)  # the engine had 30 blocks the view had let go
    assert not diverged(caplog)
    state = b.targets["w"]
    assert state.evicted_under == 3 * DIVERGENCE_WINDOW
    assert state.under == 0 and state.wrong == 0
    assert b.cache_view("w", None)["prediction"]["observations"] == 0
    families = {m.name: m for m in b.collect()}
    assert [s.value for s in families["infera_kv_predictions_evicted"].samples
            if s.name.endswith("_total")] == [3 * DIVERGENCE_WINDOW]
    assert [s.value for s in families["infera_kv_predictions_off"].samples
            if s.labels.get("direction") == "under" and s.name.endswith("_total")] == [0]


@pytest.mark.parametrize("kind", KINDS)
def test_the_same_replies_on_a_view_that_evicted_nothing_are_drift(kind, caplog):
    index = kind(max_bytes=model_bytes(100_000, 100_000))
    b = bridge(index)
    with caplog.at_level(logging.WARNING):
        for _ in range(3 * DIVERGENCE_WINDOW):
            observe(b, 0, 30 * BS)
    assert diverged(caplog)
    assert b.targets["w"].under == 3 * DIVERGENCE_WINDOW and b.targets["w"].evicted_under == 0


@pytest.mark.parametrize("kind", KINDS)
def test_over_predictions_on_an_evicted_view_still_count(kind, caplog):
    """Eviction only ever takes blocks from the view: predicting more than the engine had is drift."""
    index = kind(max_bytes=model_bytes(200, 200))
    b = bridge(index)
    fill_past_the_bound(index)
    with caplog.at_level(logging.WARNING):
        for _ in range(3 * DIVERGENCE_WINDOW):
            observe(b, 30, 0)
    assert diverged(caplog)
    assert b.targets["w"].over == 3 * DIVERGENCE_WINDOW and b.targets["w"].evicted_under == 0


@pytest.mark.parametrize("kind", KINDS)
def test_the_bound_is_collected(kind):
    bound = model_bytes(200, 200)
    index = kind(max_bytes=bound)
    b = bridge(index)
    fill_past_the_bound(index)
    families = {m.name: m for m in b.collect()}
    held = families["infera_kv_index_bytes"].samples[0].value
    assert 0 < held <= bound
    assert families["infera_kv_index_max_bytes"].samples[0].value == bound
    evicted = [s.value for s in families["infera_kv_index_evicted_entries"].samples if s.name.endswith("_total")]
    assert evicted == [index.bound_stats().evicted_entries] and evicted[0] > 0
