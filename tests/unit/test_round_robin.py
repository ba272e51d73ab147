from collections import Counter

from infera.discovery.record import WorkerRecord
from infera.router.policies import make_policy
from infera.router.policy import RoutedRequest


def _workers(*ids):
    return tuple(WorkerRecord(worker_id=i, url=f"http://{i}", model_name="m") for i in ids)


def _req():
    return RoutedRequest(route="/v1/completions", body=b"{}", parsed=None, model="m", stream=False, request_id="r")


def test_even_split():
    rr = make_policy("round-robin")
    ws = _workers("a", "b", "c")
    counts = Counter(rr.pick(ws, _req()).worker_id for _ in range(30))
    assert counts == {"a": 10, "b": 10, "c": 10}


def test_strict_rotation_order():
    rr = make_policy("round-robin")
    ws = _workers("a", "b")
    assert [rr.pick(ws, _req()).worker_id for _ in range(4)] == ["a", "b", "a", "b"]


def test_independent_counters_per_candidate_set():
    rr = make_policy("round-robin")
    ab, cd = _workers("a", "b"), _workers("c", "d")
    seq = [rr.pick(ab, _req()).worker_id, rr.pick(cd, _req()).worker_id, rr.pick(ab, _req()).worker_id]
    assert seq == ["a", "c", "b"]


def test_single_candidate():
    rr = make_policy("round-robin")
    assert rr.pick(_workers("x"), _req()).worker_id == "x"


def test_forget_drops_state_of_departed_worker():
    rr = make_policy("round-robin")
    rr.pick(_workers("a", "b"), _req())
    rr.pick(_workers("c", "d"), _req())
    rr.forget("a")
    assert list(rr._counters) == [("c", "d")]


def test_unknown_policy():
    import pytest

    with pytest.raises(ValueError, match="unknown router policy"):
        make_policy("random")
