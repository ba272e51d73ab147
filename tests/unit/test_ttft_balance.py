"""TtftBalance: what one request in flight costs a new request's TTFT, in missed blocks, and the
kv-aware policy weighing its targets' requests in flight by it."""
from __future__ import annotations

import random

import pytest

from infera.kv.hashing import block_hashes
from infera.router.ttft_balance import MAX_RATIO, MIN_SAMPLES, TtftBalance
from infera.server.cli import parse_args
from tests.unit.test_kv_aware_policy import BS, make, pick, request, worker


def feed(balance: TtftBalance, n: int, ttft, seed: int = 0) -> None:
    rng = random.Random(seed)
    for _ in range(n):
        missed, in_flight = rng.randint(0, 64), rng.randint(0, 8)
        balance.observe(missed, in_flight, ttft(missed, in_flight, rng))


@pytest.mark.parametrize("ttft, expected", [
    # 0.2 ms per missed block, 5 ms per request ahead: one request weighs 25 blocks
    (lambda m, q, r: 0.010 + 0.0002 * m + 0.005 * q + r.gauss(0, 0.001), 25.0),
    # prefill costs nothing measurable: pure balance (the cap)
    (lambda m, q, r: 0.010 + 0.005 * q + r.gauss(0, 0.0005), MAX_RATIO),
    # queueing costs nothing: upstream's load term (0)
    (lambda m, q, r: 0.010 + 0.0002 * m + r.gauss(0, 0.0005), 0.0),
])
def test_the_ratio_is_learned_from_the_replies(ttft, expected):
    balance = TtftBalance()
    feed(balance, 3000, ttft)
    if expected == MAX_RATIO:
        assert balance.ratio == expected
    elif expected == 0.0:  # noise leaves a slope of a few hundredths of a block at most
        assert balance.ratio < 0.5
    else:
        assert balance.ratio == pytest.approx(expected, rel=0.15)


def test_nothing_is_used_before_enough_replies_and_a_fixed_weight_never_moves():
    learned, fixed = TtftBalance(), TtftBalance(3.0)
    feed(learned, MIN_SAMPLES - 1, lambda m, q, r: 0.005 * q)
    feed(fixed, 3000, lambda m, q, r: 0.005 * q)
    assert learned.ratio == 0.0 and fixed.ratio == 3.0
    with pytest.raises(ValueError):
        TtftBalance(-1.0)


def test_a_term_that_never_varies_tells_nothing():
    balance = TtftBalance()
    for i in range(2000):
        balance.observe(i % 50, 2, 0.01 + 0.001 * (i % 50))  # always 2 in flight: c cannot be told
    assert balance.ratio == 0.0 and balance.b is None


def test_the_fit_follows_a_fleet_that_changes_speed():
    balance = TtftBalance(half_life=500)
    feed(balance, 3000, lambda m, q, r: 0.0002 * m + 0.005 * q)  # 25
    before = balance.ratio
    feed(balance, 6000, lambda m, q, r: 0.002 * m + 0.005 * q, seed=1)  # prefill 10x slower: 2.5
    assert before == pytest.approx(25, rel=0.1) and balance.ratio == pytest.approx(2.5, rel=0.1)


@pytest.mark.parametrize("weight, expected", [(0.0, "a"), (1000.0, "b")])
def test_requests_in_flight_outweigh_a_cached_prefix_by_the_weight(weight, expected):
    index, policy = make(inflight_weight=weight, overlap_weight=16.0)  # the server default
    workers = [worker("a"), worker("b")]
    prompt = list(range(8 * BS))
    first = request(prompt)
    assert pick(policy, workers, first) == workers[0]
    index.hold("a", block_hashes(prompt, BS))
    for i in range(3):  # three requests of that prefix already running on "a"
        r = request(prompt + [i])
        policy.on_started(pick(policy, workers[:1], r), r)
    assert policy.inflight == {"a": 3}
    nxt = request(prompt + [99])
    assert pick(policy, workers, nxt).worker_id == expected


def test_in_flight_counts_are_released_and_observed_once():
    index, policy = make()
    workers = [worker("a"), worker("b")]
    reqs = [request(list(range(4 * BS)) + [i]) for i in range(4)]
    for r in reqs:
        policy.on_started(pick(policy, workers, r), r)
    assert sum(policy.inflight.values()) == 4
    for r in reqs:
        policy.on_first_byte(r, 0.01)
        policy.on_first_byte(r, 0.01)  # a second call finds nothing to learn from
        policy.on_finished(workers[0], r)
    assert policy.inflight == {} and policy.balance.samples == 4
    policy.on_started(workers[0], reqs[0])
    policy.forget(reqs[0].state["route_key"])
    assert policy.inflight == {}


ETCD = ["--etcd-endpoint", "http://127.0.0.1:2379"]


@pytest.mark.parametrize("value, expected", [("auto", None), ("AUTO", None), ("0", 0.0), ("12.5", 12.5)])
def test_flag(value, expected):
    assert parse_args([*ETCD, "--kv-inflight-weight", value], environ={}).kv_inflight_weight == expected
    assert parse_args(ETCD, environ={"INFERA_KV_INFLIGHT_WEIGHT": value}).kv_inflight_weight == expected
    assert parse_args(ETCD, environ={}).kv_inflight_weight is None


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "lots"])
def test_flag_rejects(value):
    with pytest.raises(SystemExit):
        parse_args([*ETCD, "--kv-inflight-weight", value], environ={})
