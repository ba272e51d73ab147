"""KvAwarePolicy.pick with its loop over the targets in C (``native.score_targets``) against the
same policy with the Python loop (``_score = None``, as under ``INFERA_NATIVE=0``): seeded random
fleets and request streams, every pick compared, in lockstep."""
from __future__ import annotations

import asyncio
import json
import random

import pytest

from infera.api.requests import parse_request
from infera.discovery.record import WorkerRecord
from infera.kv.hashing import block_hashes
from infera.kv.native import native, why_not
from infera.kv.prompt import PromptTokenizer
from infera.router.kv_aware import KvAwarePolicy
from infera.router.policy import RoutedRequest
from tests.unit.test_kv_aware_policy import FakeIndex

pytestmark = pytest.mark.skipif(native is None, reason=f"C accelerator: {why_not}")


class SetIndex(FakeIndex):
    """Views as sets; ``block_counts`` only when asked for (without it, ties are settled in Python)."""

    def __init__(self, batch: bool) -> None:
        super().__init__()
        if batch:
            self.block_counts = lambda keys: [len(self.views.get(k, ())) for k in keys]


def fleet(rng: random.Random) -> tuple[WorkerRecord, ...]:
    sizes = rng.choice([[4], [4], [4, 8], [4, 0], [8, 4, 0]])
    out = []
    for i in range(rng.randint(1, 9)):
        dp = 2 if rng.random() < 0.2 else None
        out.append(WorkerRecord(worker_id=f"w{i}", url=f"http://w{i}", model_name="m", kv_block_size=rng.choice(sizes),
                                dp_size=dp))
    return tuple(out)


def request(i: int, ids: list[int]) -> RoutedRequest:
    body = json.dumps({"model": "m", "prompt": ids}).encode()
    return RoutedRequest(route="/v1/completions", body=body, parsed=parse_request("/v1/completions", body), model="m",
                         stream=False, request_id=str(i))


def the_pick(worker: WorkerRecord, req: RoutedRequest) -> tuple:
    st = req.state
    return (worker.worker_id, st["dp_rank"], st["charge"], st["predicted_hit_blocks"], st["view_hit"],
            st["unhashed"], list(st["blocks"]))


@pytest.mark.parametrize("seed", range(40))
def test_the_c_loop_picks_exactly_as_the_python_loop(seed):
    rng = random.Random(seed)
    workers = fleet(rng)
    batch = rng.random() < 0.5
    kw = {"overlap_weight": rng.choice([0.0, 1.0, 16.0]),
          "inflight_weight": rng.choice([None, 0.0, 3.0])}
    policies = []
    for loop in ("c", "python"):
        index = SetIndex(batch)
        policy = KvAwarePolicy(index, PromptTokenizer.from_path(None), **kw)
        if loop == "python":
            policy._score = None
        else:
            assert policy._score is native.score_targets
        policies.append((index, policy))
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice([0, 3, 8, 16, 24]))] for _ in range(5)]
    in_flight: list[tuple] = []
    for i in range(300):
        ids = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.choice([1, 2, 5, 9]))]
        candidates = workers if rng.random() < 0.8 else tuple(rng.sample(workers, rng.randint(1, len(workers))))
        more = rng.choice([0, 0, 0, 40])
        if rng.random() < 0.1:  # a target's view takes a prefix (as its KV events would say)
            w = rng.choice(workers)
            key = w.worker_id if not w.dp_size else f"{w.worker_id}#dp{rng.randrange(2)}"
            held = block_hashes(rng.choice(prefixes), w.kv_block_size or 4)
            for index, _ in policies:
                index.views.setdefault(key, set()).update(held)
        picked = []
        for index, policy in policies:
            req = request(i, ids)
            asyncio.run(policy.prepare(req))
            if more:
                req.state["more_tokens"] = more
            w = policy.pick(candidates, req)
            policy.on_started(w, req)
            picked.append((w, req))
        assert the_pick(*picked[0]) == the_pick(*picked[1]), f"pick {i}"
        in_flight.append((picked, rng.random() < 0.8))
        while in_flight and (len(in_flight) > 12 or rng.random() < 0.4):
            done, served = in_flight.pop(rng.randrange(len(in_flight)))
            for (w, req), (_, policy) in zip(done, policies):
                req.state["served"] = served
                policy.on_finished(w, req)
    c, py = policies[0][1], policies[1][1]
    assert c.recent == py.recent and c.inflight == py.inflight and c.unhashed == py.unhashed


def test_score_targets_refuses_what_it_cannot_read():
    with pytest.raises(ValueError):
        native.score_targets(["a", "b"], [1], {}, {}, 1.0, {}, {}, 0.0, 1.0, 3, None, False, None, 0)
    with pytest.raises(ValueError):  # held(keys) must answer for every key
        native.score_targets(["a", "b"], None, {}, {}, 1.0, {}, {}, 0.0, 1.0, 3, None, False, lambda keys: [0], 0)
    with pytest.raises(TypeError):
        native.score_targets(("a",), None, {}, {}, 1.0, {}, {}, 0.0, 1.0, 3, None, False, None, 0)
