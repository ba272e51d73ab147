"""Tier-aware KV routing: the index's lower-tier query (``KvIndex.match_lower``) and the kv-aware
policy's scoring of lower-tier blocks (``--kv-lower-tier-weight``)."""
from __future__ import annotations

import random

import pytest

from infera.kv.events import Cleared, EventBatch, Removed, Stored
from infera.kv.hashing import block_hashes
from infera.kv.index import KvIndex

BS = 4
rng = random.Random(4321)
TOK = [rng.randrange(1, 50_000) for _ in range(32 * BS)]
RH = block_hashes(TOK, BS)


def eh(i: int) -> int:
    return 70_000 + i


def st(i: int, j: int, medium: str | None = None) -> Stored:
    """BlockStored of blocks i..j-1 (engine hashes eh(i..j-1), parent eh(i-1)) on ``medium``."""
    return Stored([eh(k) for k in range(i, j)], eh(i - 1) if i else None, TOK[i * BS:j * BS], BS, None, medium)


def rm(*idx: int, medium: str | None = None) -> Removed:
    return Removed([eh(k) for k in idx], medium)


def index_with(*events, key: str = "w") -> KvIndex:
    idx = KvIndex()
    idx.add_target(key, BS)
    if events:
        idx.apply(key, EventBatch(1.0, list(events)))
    return idx


# (events applied to target "w", start, expected lower run from start over RH[:10])
MATCH_LOWER_CASES = [
    pytest.param([], 0, 0, id="no-lower-tier"),
    pytest.param([st(0, 4)], 4, 0, id="gpu-only"),
    pytest.param([st(0, 6, "CPU")], 0, 6, id="all-on-cpu-from-0"),
    pytest.param([st(0, 2), st(2, 6, "CPU")], 2, 4, id="cpu-after-gpu-hit"),
    pytest.param([st(0, 2), st(2, 6, "cpu")], 2, 4, id="medium-case-folded"),
    pytest.param([st(0, 2), st(2, 4, "CPU"), st(4, 7, "DISK")], 2, 5, id="tiers-chain-together"),
    pytest.param([st(0, 8, "CPU_PINNED"), rm(5, medium="CPU_PINNED")], 2, 3, id="removed-breaks-the-run"),
    pytest.param([st(0, 8, "CPU"), rm(5)], 2, 6, id="gpu-remove-leaves-cpu"),
    pytest.param([st(0, 8, "CPU"), Cleared("CPU")], 0, 0, id="tier-cleared"),
    pytest.param([st(0, 4, "CPU"), st(0, 8, "DISK"), Cleared("CPU")], 0, 8, id="other-tier-survives-clear"),
    pytest.param([st(0, 8, "CPU"), Cleared()], 0, 0, id="unscoped-clear-drops-all"),
    pytest.param([st(0, 4, "CPU"), st(0, 4, "DISK"), rm(1, medium="CPU")], 0, 4, id="held-on-two-tiers"),
    pytest.param([st(0, 6, "CPU")], 10, 0, id="start-at-end"),
    pytest.param([st(0, 6, "CPU")], 3, 3, id="start-inside-run"),
]


@pytest.mark.parametrize("events,start,want", MATCH_LOWER_CASES)
def test_match_lower_table(events, start, want):
    idx = index_with(*events)
    assert idx.match_lower(RH[:10], ["w"], [start]) == [want]


def test_match_lower_per_target_and_unknown_keys():
    idx = KvIndex()
    for k in ("a", "b", "c"):
        idx.add_target(k, BS)
    idx.apply("a", EventBatch(1.0, [st(0, 3), st(3, 9, "CPU")]))
    idx.apply("b", EventBatch(1.0, [st(0, 5, "CPU")]))
    assert idx.match(RH[:10], ["a", "b", "c"]) == [3, 0, 0]
    assert idx.match_lower(RH[:10], ["a", "b", "c", "gone"], [3, 0, 0, 0]) == [6, 5, 0, 0]
    assert idx.lower_block_count("a") == 6 and idx.lower_block_count("c") == 0


def test_gate_counts_targets_with_lower_tiers():
    idx = index_with()
    assert not idx.has_lower_tiers()
    idx.apply("w", EventBatch(1.0, [st(0, 4, "CPU")]))
    assert idx.has_lower_tiers()
    idx.reset("w")
    assert not idx.has_lower_tiers() and idx.match_lower(RH, ["w"], [0]) == [0]
    idx.apply("w", EventBatch(1.0, [st(0, 4, "CPU")]))
    idx.add_target("w", BS * 2)  # block size changed: every view of the old size goes
    assert not idx.has_lower_tiers()
    idx.add_target("w", BS)
    idx.apply("w", EventBatch(1.0, [st(0, 4, "CPU")]))
    assert idx.remove_target("w") and not idx.has_lower_tiers()


def test_restored_block_is_counted_once_and_removal_balances():
    idx = index_with(st(0, 4, "CPU"), st(0, 4, "CPU"))  # offloaded twice (stored again after a load)
    assert idx.lower_block_count("w") == 4
    idx.apply("w", EventBatch(1.0, [rm(0, 1, 2, 3, medium="CPU")]))
    assert idx.lower_block_count("w") == 0 and idx.match_lower(RH, ["w"], [0]) == [0]
    assert idx.tier_block_counts("w") == {"CPU": 0}


def test_gpu_view_untouched_by_lower_query():
    idx = index_with(st(0, 3), st(3, 6, "CPU"))
    before = idx.match(RH[:10], ["w"])
    idx.match_lower(RH[:10], ["w"], before)
    assert idx.match(RH[:10], ["w"]) == before == [3]
    assert idx.block_count("w") == 3


# --- the kv-aware policy: cost = w × (missed − (1 − t) × lower) + load -------------------------

import asyncio  # noqa: E402

from infera.api.requests import parse_request  # noqa: E402
from infera.discovery.record import WorkerRecord  # noqa: E402
from infera.kv.prompt import PromptTokenizer  # noqa: E402
from infera.router.kv_aware import DEFAULT_LOWER_TIER_WEIGHT, KvAwarePolicy  # noqa: E402
from infera.router.policy import RoutedRequest  # noqa: E402

PROMPT = TOK[:8 * BS]  # 8 blocks


def _worker(wid: str) -> WorkerRecord:
    return WorkerRecord(worker_id=wid, url=f"http://{wid}", model_name="m", kv_block_size=BS)


def _request() -> RoutedRequest:
    import json

    body = json.dumps({"model": "m", "prompt": PROMPT}).encode()
    return RoutedRequest(route="/v1/completions", body=body, parsed=parse_request("/v1/completions", body),
                         model="m", stream=False, request_id="r")


def _fleet(views: dict[str, list]) -> KvIndex:
    idx = KvIndex()
    for key, events in views.items():
        idx.add_target(key, BS)
        if events:
            idx.apply(key, EventBatch(1.0, list(events)))
    return idx


def _pick(idx: KvIndex, weight: float | None) -> tuple[str, RoutedRequest]:
    kw = {} if weight is None else {"lower_tier_weight": weight}
    policy = KvAwarePolicy(idx, PromptTokenizer.from_path(None), **kw)
    req = _request()
    asyncio.run(policy.prepare(req))
    return policy.pick([_worker(k) for k in idx.keys()], req).worker_id, req


# (views per worker, lower-tier weight, expected pick, expected predicted_hit_blocks)
PICK_CASES = [
    # a: 2 on GPU (cost 6); b: all 8 on host (tier-aware 8 − 0.75×8 = 2, tier-blind 8)
    pytest.param({"a": [st(0, 2)], "b": [st(0, 8, "CPU")]}, None, "b", 8, id="host-prefix-beats-short-gpu"),
    pytest.param({"a": [st(0, 2)], "b": [st(0, 8, "CPU")]}, 1.0, "a", 2, id="tier-blind-ignores-host"),
    # the same blocks on the GPU beat them on the host (0 < 2)
    pytest.param({"a": [st(0, 8)], "b": [st(0, 8, "CPU")]}, None, "a", 8, id="gpu-beats-equal-host"),
    # b: 2 on GPU then 6 on host: 6 − 0.75×6 = 1.5 < a's 4
    pytest.param({"a": [st(0, 4)], "b": [st(0, 2), st(2, 8, "CPU")]}, None, "b", 8, id="host-run-after-gpu-hit"),
    # t = 0: a host block is as good as a GPU one; the tie goes to the target holding fewer GPU blocks
    pytest.param({"a": [st(0, 8)], "b": [st(0, 8, "DISK")]}, 0.0, "b", 8, id="weight-0-host-equals-gpu"),
    # a host run that breaks early only counts up to the break
    pytest.param({"a": [st(0, 3)], "b": [st(0, 8, "CPU"), rm(1, medium="CPU")]}, None, "a", 3,
                 id="broken-host-run"),
]


@pytest.mark.parametrize("views,weight,want,predicted", PICK_CASES)
def test_pick_scores_lower_tiers(views, weight, want, predicted):
    got, req = _pick(_fleet(views), weight)
    assert got == want
    assert req.state["predicted_hit_blocks"] == predicted


def test_charge_counts_host_blocks_as_a_fraction_of_a_miss():
    _, req = _pick(_fleet({"b": [st(0, 8, "CPU")]}), None)
    assert req.state["charge"][0] == pytest.approx(8 * DEFAULT_LOWER_TIER_WEIGHT)
    _, req = _pick(_fleet({"b": [st(0, 8, "CPU")]}), 1.0)
    assert req.state["charge"][0] == 8


@pytest.mark.parametrize("bad", [-0.1, 1.5])
def test_weight_out_of_range(bad):
    with pytest.raises(ValueError):
        KvAwarePolicy(KvIndex(), PromptTokenizer.from_path(None), lower_tier_weight=bad)
