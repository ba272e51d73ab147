"""The router's self-check: a systematic prediction mismatch (tokenizer, template, block size, hash
seed) is reported; occasional races under cache pressure are not."""
from __future__ import annotations

import logging

import pytest

from infera.discovery.fleet import Fleet
from infera.discovery.record import WorkerRecord
from infera.kv.events import EventBatch, encode_batch
from infera.kv.index import KvIndex
from infera.router.policy import RoutedRequest
from infera.server.kv import DIVERGENCE_WINDOW, KvEventsBridge

BS = 32
PROMPT = 40 * BS  # tokens: 39 predictable blocks (the last one is always recomputed)
WORKER = WorkerRecord(worker_id="w", url="http://w:1", model_name="m", engine="vllm", kv_block_size=BS,
                      kv_events_endpoint="tcp://127.0.0.1:1")


class NoSubscriber:
    def add(self, *a) -> None: ...
    def remove(self, *a) -> None: ...
    def stats(self, key): return {}
    def replaying(self, key) -> bool: return False


def bridge() -> KvEventsBridge:
    fleet = Fleet()
    b = KvEventsBridge(fleet, KvIndex(), subscriber=NoSubscriber())
    fleet.upsert(WORKER)
    return b


def observe(b: KvEventsBridge, predicted_blocks: int, reported_tokens: int) -> None:
    req = RoutedRequest(route="/v1/completions", body=b"", parsed=None, model="m", stream=False, request_id="r",
                        state={"route_key": "w", "block_size": BS, "predicted_hit_blocks": predicted_blocks,
                               "tokens": [0] * PROMPT})
    b.observe_usage(WORKER, req, reported_tokens)


def diverged(caplog) -> bool:
    return any("disagree" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


@pytest.mark.parametrize("pattern, warns", [
    # router predicts 30 blocks, engine agrees on all but every 5th (an eviction race): fine
    (lambda i: (30, 0 if i % 5 == 0 else 30 * BS), False),
    # cold prompts only: nothing predicted, nothing cached — says nothing either way
    (lambda i: (0, 0), False),
    # router hashes never match the engine's (tokenizer/template mismatch): predicts 0, engine hits
    (lambda i: (0, 30 * BS), True),
    # block size mismatch: the router's count is always far off
    (lambda i: (30, 10 * BS), True),
    # off by exactly one block (vLLM recomputing a last full block): within tolerance
    (lambda i: (31, 30 * BS), False),
])
def test_divergence_is_reported_only_when_systematic(caplog, pattern, warns):
    b = bridge()
    with caplog.at_level(logging.WARNING):
        for i in range(3 * DIVERGENCE_WINDOW):
            observe(b, *pattern(i))
    assert diverged(caplog) is warns
    view = b.cache_view("w", None)["prediction"]
    assert view["observations"] == 3 * DIVERGENCE_WINDOW


def test_warned_once_per_worker(caplog):
    b = bridge()
    with caplog.at_level(logging.WARNING):
        for _ in range(5 * DIVERGENCE_WINDOW):
            observe(b, 0, 30 * BS)
    assert sum("disagree" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("batches_before, warns", [(0, False), (3, True)])
def test_reset_warns_only_when_a_view_existed(caplog, batches_before, warns):
    """A partial history at first contact (a long-running engine) is not a loss of continuity."""
    b = bridge()
    b.targets["w"].batches = batches_before
    with caplog.at_level(logging.INFO):
        b._on_reset("w")
    warned = any("lost continuity" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert warned is warns


def test_wrong_predictions_are_counted_by_direction():
    b = bridge()
    observe(b, 30, 10 * BS)   # predicted 20 blocks too many: over (a stale view)
    observe(b, 30, 0)         # over
    observe(b, 0, 30 * BS)    # under (a prefill of it finished meanwhile)
    observe(b, 31, 30 * BS)   # one block off: tolerated, not counted
    observe(b, 30, 30 * BS)   # exact
    view = b.cache_view("w", None)["prediction"]
    assert (view["over"], view["under"], view["exact"], view["observations"]) == (2, 1, 1, 5)
    samples = {(s.labels["worker_id"], s.labels["direction"]): s.value
               for fam in b.collect() if fam.name == "infera_kv_predictions_off" for s in fam.samples}
    assert samples == {("w", "over"): 2, ("w", "under"): 1}


def test_event_delay_is_measured_from_the_engine_timestamp():
    now = [1000.0]
    fleet = Fleet()
    b = KvEventsBridge(fleet, KvIndex(), subscriber=NoSubscriber(), wall_clock=lambda: now[0])
    fleet.upsert(WORKER)
    assert b.cache_view("w", None)["delay_ms"] is None
    b._on_batch("w", 0, encode_batch(EventBatch(999.95, [])))   # 50 ms on the way
    assert b.cache_view("w", None)["delay_ms"] == 50.0
    b._on_batch("w", 1, encode_batch(EventBatch(1000.5, [])))   # a clock ahead of ours: 0, not negative
    assert b.cache_view("w", None)["delay_ms"] == 40.0          # smoothed: 50 + 0.2 × (0 − 50)
    fam = next(f for f in b.collect() if f.name == "infera_kv_event_delay_seconds")
    counts = {s.labels["le"]: s.value for s in fam.samples if s.name.endswith("_bucket")}
    assert counts["0.001"] == 1 and counts["0.05"] == 2 and counts["0.025"] == 1


def test_replayed_history_is_not_counted_as_event_delay():
    class Replaying(NoSubscriber):
        def replaying(self, key):
            return True

    fleet = Fleet()
    b = KvEventsBridge(fleet, KvIndex(), subscriber=Replaying(), wall_clock=lambda: 5000.0)
    fleet.upsert(WORKER)
    b._on_batch("w", 0, encode_batch(EventBatch(1000.0, [])))  # an hour old: history, not lag
    view = b.cache_view("w", None)
    assert view["delay_ms"] is None and view["batches"] == 1


def test_event_cpu_is_accounted_per_worker_even_for_a_batch_that_fails_to_decode():
    from infera.kv.events import Stored
    b = bridge()
    cpu = lambda: {s.labels["worker_id"]: s.value for f in b.collect()  # noqa: E731
                   if f.name == "infera_kv_event_cpu_seconds" for s in f.samples}
    assert cpu() == {"w": 0.0}
    stored = [Stored(block_hashes=[i], parent=i - 1 if i else None, token_ids=list(range(BS)),
                     block_size=BS) for i in range(200)]
    b._on_batch("w", 0, encode_batch(EventBatch(0.0, stored)))
    first = cpu()["w"]
    assert first > 0 and b.index.block_count("w") == 200
    b._on_batch("w", 1, b"\xc1 not msgpack")
    assert cpu()["w"] > first and b.targets["w"].decode_errors == 1
