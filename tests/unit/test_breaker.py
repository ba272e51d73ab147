"""Circuit breaker transitions, driven by a fake clock (no test sleeps).

Each scenario is a script of steps on one worker "w" (threshold 3, cooldown 5 s, max 20 s, probe
timeout 60 s unless the scenario says otherwise):

* ``fail`` / ``ok`` / ``neutral`` — record_failure / record_success / record_neutral
* ``+N`` — the clock moves N seconds
* ``allow`` / ``deny`` — allows() must return True / False (True claims a half-open probe slot)
* ``closed`` / ``open`` / ``half_open`` — the stored state
* ``trips=N`` — the trip counter
"""
from __future__ import annotations

import logging

import pytest

from infera.discovery.record import WorkerRecord
from infera.router.breaker import CircuitBreaker
from infera.server.cli import parse_args


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_breaker(clock: FakeClock, **overrides) -> CircuitBreaker:
    kwargs = dict(failure_threshold=3, cooldown_s=5, max_cooldown_s=20, probe_timeout_s=60)
    kwargs.update(overrides)
    return CircuitBreaker(**kwargs, clock=clock)


def run_script(breaker: CircuitBreaker, clock: FakeClock, script: str) -> None:
    for i, step in enumerate(script.split()):
        where = f"step {i} ({step!r}) of {script!r}"
        if step == "fail":
            breaker.record_failure("w")
        elif step == "ok":
            breaker.record_success("w")
        elif step == "neutral":
            breaker.record_neutral("w")
        elif step.startswith("+"):
            clock.now += float(step[1:])
        elif step in ("allow", "deny"):
            assert breaker.allows("w") is (step == "allow"), where
        elif step in ("closed", "open", "half_open"):
            assert breaker.state("w") == step, where
        elif step.startswith("trips="):
            assert breaker.trips("w") == int(step[6:]), where
        else:
            raise AssertionError(f"unknown step {step!r}")


SCENARIOS = {
    "unknown worker is allowed": "allow closed trips=0",
    "below the threshold stays closed": "fail fail closed allow allow trips=0",
    "threshold opens and denies until the cooldown": "fail fail fail open trips=1 deny +4.9 deny",
    "success resets the consecutive count": "fail fail ok fail fail closed allow fail open",
    "cooldown passed: half-open admits one probe": "fail fail fail +5 allow half_open deny deny",
    "probe success closes": "fail fail fail +5 allow ok closed allow allow trips=1",
    "after a close the threshold counts from zero": "fail fail fail +5 allow ok fail fail closed fail open trips=2",
    "probe failure reopens with the cooldown doubled": "fail fail fail +5 allow fail open trips=2 +9.9 deny +0.1 allow",
    "cooldown doubles up to the max": (
        "fail fail fail +5 allow fail +10 allow fail +20 allow fail trips=4 +19.9 deny +0.1 allow fail +20 allow"),
    "success resets the cooldown to the base": "fail fail fail +5 allow fail +10 allow ok fail fail fail +5 allow",
    "neutral frees the probe slot": "fail fail fail +5 allow deny neutral half_open allow deny",
    "neutral on a closed worker changes nothing": "fail fail neutral fail open",
    "a stuck probe is reclaimed after the probe timeout": "fail fail fail +5 allow +59.9 deny +0.1 allow deny",
    "failure while open extends the cooldown, no new trip": "fail fail fail +3 fail trips=1 +4.9 deny +0.1 allow",
}


@pytest.mark.parametrize("script", SCENARIOS.values(), ids=list(SCENARIOS))
def test_transitions(script):
    clock = FakeClock()
    run_script(make_breaker(clock), clock, script)


@pytest.mark.parametrize("threshold", [0, -1])
def test_threshold_zero_or_less_disables(threshold):
    clock = FakeClock()
    breaker = make_breaker(clock, failure_threshold=threshold)
    run_script(breaker, clock, "fail fail fail fail fail allow closed trips=0")
    workers = _workers("w", "x")
    assert breaker.filter(workers) is workers
    assert breaker.entry("w") is None  # nothing is kept for a disabled breaker


def test_threshold_one_opens_on_the_first_failure():
    clock = FakeClock()
    run_script(make_breaker(clock, failure_threshold=1), clock, "fail open deny +5 allow fail open trips=2")


def _workers(*ids: str) -> tuple[WorkerRecord, ...]:
    return tuple(WorkerRecord(worker_id=i, url=f"http://{i}", model_name="m") for i in ids)


def _open(breaker: CircuitBreaker, worker_id: str) -> None:
    for _ in range(breaker.failure_threshold):
        breaker.record_failure(worker_id)


@pytest.mark.parametrize("opened, expect", [
    ((), ["a", "b", "c"]),
    (("b",), ["a", "c"]),
    (("a", "c"), ["b"]),
    (("a", "b", "c"), ["a", "b", "c"]),  # none allowed: all of them, never a 503
])
def test_filter_keeps_allowed_in_order_or_returns_all(opened, expect):
    clock = FakeClock()
    breaker = make_breaker(clock)
    for w in opened:
        _open(breaker, w)
    assert [w.worker_id for w in breaker.filter(_workers("a", "b", "c"))] == expect


def test_filter_returns_its_input_untouched_while_every_worker_is_closed():
    breaker = make_breaker(FakeClock())
    breaker.record_failure("a")  # a failure below the threshold: still closed
    workers = _workers("a", "b")
    assert breaker.filter(workers) is workers


def test_filter_claims_no_probe_slot_only_claim_does():
    clock = FakeClock()
    breaker = make_breaker(clock)
    _open(breaker, "a")
    clock.now += 5
    workers = _workers("a", "b")
    # Repeated filtering (the policy may pick "b" each time) never uses up "a"'s probe slot.
    for _ in range(3):
        assert [w.worker_id for w in breaker.filter(workers)] == ["a", "b"]
    breaker.claim("a")  # the policy picked "a": it is the probe now
    assert [w.worker_id for w in breaker.filter(workers)] == ["b"]
    assert breaker.allows("a") is False
    breaker.record_neutral("a")
    assert [w.worker_id for w in breaker.filter(workers)] == ["a", "b"]


def test_claim_on_closed_or_still_open_worker_changes_nothing():
    clock = FakeClock()
    breaker = make_breaker(clock)
    breaker.claim("new")
    assert breaker.entry("new") is None
    _open(breaker, "a")
    breaker.claim("a")  # picked from filter's fall-back (every worker open): no probe, still open
    assert breaker.state("a") == "open" and breaker.entry("a").probe_started_at is None


def test_forget_drops_the_worker():
    clock = FakeClock()
    breaker = make_breaker(clock)
    _open(breaker, "a")
    breaker.forget("a")
    assert breaker.entry("a") is None and breaker.state("a") == "closed" and breaker.trips("a") == 0
    workers = _workers("a", "b")
    assert breaker.filter(workers) is workers
    breaker.forget("never-seen")  # harmless


def test_a_trip_logs_one_warning(caplog):
    clock = FakeClock()
    breaker = make_breaker(clock, failure_threshold=2)
    with caplog.at_level(logging.WARNING, logger="infera.router.breaker"):
        for _ in range(4):  # the third and fourth failure land while already open: no new trip
            breaker.record_failure("a")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "a" in warnings[0].getMessage() and breaker.trips("a") == 1


def test_success_and_neutral_on_unknown_worker_keep_nothing():
    breaker = make_breaker(FakeClock())
    breaker.record_success("x")
    breaker.record_neutral("x")
    assert breaker.entry("x") is None


@pytest.mark.parametrize("cooldown, max_cooldown", [(0, 10), (-1, 10), (10, 5)])
def test_bad_cooldowns_are_refused(cooldown, max_cooldown):
    with pytest.raises(ValueError, match="cooldown"):
        CircuitBreaker(cooldown_s=cooldown, max_cooldown_s=max_cooldown)


@pytest.mark.parametrize("argv, env, expected", [
    ([], {}, (3, 5.0, 60.0)),
    ([], {"INFERA_BREAKER_FAILURE_THRESHOLD": "0", "INFERA_BREAKER_COOLDOWN_S": "0.5",
          "INFERA_BREAKER_MAX_COOLDOWN_S": "2"}, (0, 0.5, 2.0)),
    (["--breaker-failure-threshold", "5", "--breaker-cooldown-s", "1", "--breaker-max-cooldown-s", "8"],
     {"INFERA_BREAKER_FAILURE_THRESHOLD": "0", "INFERA_BREAKER_COOLDOWN_S": "0.5"}, (5, 1.0, 8.0)),
])
def test_server_flags_flag_env_default(argv, env, expected):
    args = parse_args(["--etcd-endpoint", "h", *argv], environ=env)
    assert (args.breaker_failure_threshold, args.breaker_cooldown_s, args.breaker_max_cooldown_s) == expected


@pytest.mark.parametrize("argv", [["--breaker-failure-threshold", "-1"], ["--breaker-cooldown-s", "0"],
                                  ["--breaker-cooldown-s", "10", "--breaker-max-cooldown-s", "5"]])
def test_server_flags_refuse_bad_values(argv):
    with pytest.raises(SystemExit):
        parse_args(["--etcd-endpoint", "h", *argv], environ={})
