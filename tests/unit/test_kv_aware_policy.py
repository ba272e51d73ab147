import asyncio

import pytest

from infera.api.requests import parse_request
from infera.discovery.record import WorkerRecord
from infera.kv.hashing import block_hashes
from infera.kv.prompt import PromptTokenizer
from infera.router.kv_aware import LANDED_TTL_S, KvAwarePolicy, expand_targets, predicted_cached_tokens
from infera.router.policy import RoutedRequest

BS = 4


class FakeIndex:
    """Views as plain sets: the policy needs match() and block_count()."""

    def __init__(self):
        self.views: dict[str, set[int]] = {}

    def block_count(self, key):
        return len(self.views.get(key, ()))

    def hold(self, key, hashes):
        self.views.setdefault(key, set()).update(hashes)

    def match(self, hashes, keys):
        out = []
        for k in keys:
            view, n = self.views.get(k, set()), 0
            for h in hashes:
                if h not in view:
                    break
                n += 1
            out.append(n)
        return out


def worker(wid, bs=BS, dp_size=None, dp_rank=None):
    return WorkerRecord(worker_id=wid, url=f"http://{wid}", model_name="m", kv_block_size=bs, dp_size=dp_size,
                        dp_rank=dp_rank)


def request(prompt_ids, **extra):
    import json

    body = json.dumps({"model": "m", "prompt": prompt_ids, **extra}).encode()
    return RoutedRequest(route="/v1/completions", body=body, parsed=parse_request("/v1/completions", body), model="m",
                         stream=False, request_id="r")


def make(**kw):
    index = FakeIndex()
    return index, KvAwarePolicy(index, PromptTokenizer.from_path(None), **kw)


def pick(policy, workers, req, role="mixed"):
    asyncio.run(policy.prepare(req))
    return policy.pick(workers, req, role)


PROMPT = list(range(100, 132))  # 8 blocks of 4


def test_longest_cached_prefix_wins():
    index, policy = make()
    a, b, c = worker("a"), worker("b"), worker("c")
    hashes = block_hashes(PROMPT, BS)
    index.hold("a", hashes[:2])
    index.hold("b", hashes[:6])
    req = request(PROMPT)
    assert pick(policy, [a, b, c], req).worker_id == "b"
    assert req.state["predicted_hit_blocks"] == 6 and req.state["route_key"] == "b"
    assert list(req.state["blocks"]) == hashes


def test_load_breaks_ties_and_in_flight_is_released():
    index, policy = make()
    a, b = worker("a"), worker("b")
    r1 = request(PROMPT)
    assert pick(policy, [a, b], r1).worker_id == "a"  # full tie → the rotation starts at the first
    policy.on_started(a, r1)
    assert policy.active_blocks("a") == 8
    r2 = request(list(range(500, 532)))
    assert pick(policy, [a, b], r2).worker_id == "b"  # a is loaded
    policy.on_finished(a, r1)
    assert policy.active_blocks("a") == 0


def test_shared_prefix_in_flight_counts_once():
    _, policy = make()
    a = worker("a")
    r1, r2 = request(PROMPT), request(PROMPT)
    pick(policy, [a], r1)
    pick(policy, [a], r2)
    policy.on_started(a, r1)
    policy.on_started(a, r2)
    assert policy.active_blocks("a") == 8
    policy.on_finished(a, r1)
    assert policy.active_blocks("a") == 8
    policy.on_finished(a, r2)
    assert policy.active_blocks("a") == 0


@pytest.mark.parametrize("weight, expected", [(1.0, "a"), (0.0, "b")])
def test_overlap_weight_against_load(weight, expected):
    index, policy = make(overlap_weight=weight)
    a, b = worker("a"), worker("b")
    index.hold("a", block_hashes(PROMPT, BS))
    busy = request(list(range(900, 912)))  # 3 blocks in flight on a
    busy.state.update(route_key="a", blocks=block_hashes(list(range(900, 912)), BS))
    policy.on_started(a, busy)
    assert pick(policy, [a, b], request(PROMPT)).worker_id == expected


def test_retention_long_amplifies_overlap():
    index, policy = make(overlap_weight=0.5)
    a, b = worker("a"), worker("b")
    index.hold("a", block_hashes(PROMPT, BS)[:4])
    busy = request(list(range(900, 916)))
    busy.state.update(route_key="a", blocks=block_hashes(list(range(900, 916)), BS)[:3])
    policy.on_started(a, busy)
    # a: 0.5*4 missed + 3 load = 5 vs b: 0.5*8 = 4 → b; with long retention: a 4+3=7 vs b 8 → a
    assert pick(policy, [a, b], request(PROMPT)).worker_id == "b"
    index2, policy2 = make(overlap_weight=0.5)
    index2.hold("a", block_hashes(PROMPT, BS)[:4])
    policy2.on_started(a, busy)
    assert pick(policy2, [a, b], request(PROMPT, prompt_cache_retention="24h")).worker_id == "a"


def test_role_weights():
    _, policy = make(overlap_weight=1.0, prefill_overlap_weight=20.0, decode_overlap_weight=2.0)
    assert policy.weights == {"mixed": 1.0, "prefill": 20.0, "decode": 2.0}


def test_rank_multiplexed_worker_is_scored_per_rank():
    index, policy = make()
    w = worker("w", dp_size=4)
    assert [k for _, k in expand_targets(w)] == ["w#dp0", "w#dp1", "w#dp2", "w#dp3"]
    index.hold("w#dp2", block_hashes(PROMPT, BS))
    req = request(PROMPT)
    assert pick(policy, [w], req) is w
    assert req.state["dp_rank"] == 2 and req.state["route_key"] == "w#dp2"
    pinned = worker("p", dp_size=4, dp_rank=1)  # external LB: one rank per record, no header
    req = request(PROMPT)
    pick(policy, [pinned], req)
    assert req.state["dp_rank"] is None


def test_recent_misses_decay_and_spread_cold_load():
    _, policy = make()
    a, b = worker("a"), worker("b")
    seq = [pick(policy, [a, b], request(list(range(1000 * i, 1000 * i + 32)))).worker_id for i in range(4)]
    assert seq == ["a", "b", "a", "b"]  # each cold prefill charges its worker
    assert 0 < policy.recent_charge("a") < 16


@pytest.mark.parametrize("picks_after", [1, 10, 229, 240, 12_000])
def test_a_charge_decays_per_pick_elsewhere_and_is_dropped_once_spent(picks_after):
    # Lazy decay: one multiplication per pick, rebased past ~11,000 picks; the charge left is the
    # same as decaying every entry on every pick, and a spent one leaves the table.
    _, policy = make()
    a, b = worker("a"), worker("b")
    held = request(list(range(32)))  # 8 blocks missed on a, kept in flight
    assert pick(policy, [a], held) is a
    policy.on_started(a, held)
    for i in range(picks_after):
        r = request([100_000 + i])  # under a block: charges 1 on b, released at once
        pick(policy, [b], r)
        policy.on_started(b, r)
        policy.on_finished(b, r)
    left = 8 * 0.97 ** picks_after
    assert policy.recent_charge("a") == pytest.approx(left if left >= 1e-3 else 0.0, rel=1e-9, abs=1e-3)
    assert "b" not in policy.recent  # each released in full
    if picks_after > 11_000:
        assert "a" not in policy.recent  # spent, dropped at the rebase
    policy.on_finished(a, held)
    assert "a" not in policy.recent


def test_unsized_workers_pay_no_overlap_but_are_still_candidates():
    index, policy = make()
    sized, unsized = worker("s"), worker("u", bs=None)
    index.hold("s", block_hashes(PROMPT, BS))
    assert pick(policy, [unsized, sized], request(PROMPT)).worker_id == "s"


def test_multimodal_routes_by_image_affinity():
    _, policy = make()
    a, b = worker("a"), worker("b")

    def mm(url):
        import json

        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": url}}]}]}).encode()
        return RoutedRequest(route="/v1/chat/completions", body=body,
                             parsed=parse_request("/v1/chat/completions", body), model="m", stream=False, request_id="x")

    first = pick(policy, [a, b], mm("http://img/1.png")).worker_id
    other = pick(policy, [a, b], mm("http://img/2.png")).worker_id
    assert other != first
    assert pick(policy, [a, b], mm("http://img/1.png")).worker_id == first


def test_forget_drops_every_rank():
    _, policy = make()
    w = worker("w", dp_size=2)
    req = request(PROMPT)
    pick(policy, [w], req)
    policy.on_started(w, req)
    policy.forget("w")
    assert not any(k.startswith("w") for t in (policy.active, policy.recent, policy.mm_affinity) for k in t)


def test_untokenizable_request_routes_by_load():
    _, policy = make()
    a = worker("a")
    req = request(["a", "b"])  # batched prompts: not prefix-routed
    assert pick(policy, [a], req) is a and list(req.state["blocks"]) == []


@pytest.mark.parametrize("hits, bs, prompt, expected", [
    (0, 16, 100, 0), (3, 16, 100, 48), (7, 16, 112, 96), (7, 16, 113, 112), (6, 16, 113, 96), (2, 0, 50, 0),
])
def test_predicted_cached_tokens(hits, bs, prompt, expected):
    assert predicted_cached_tokens(hits, bs, prompt) == expected


def test_finished_cold_prefill_no_longer_repels_the_next_turn():
    index, policy = make()
    a, b = worker("a"), worker("b")
    first = request(PROMPT)
    assert pick(policy, [a, b], first).worker_id == "a"
    policy.on_started(a, first)
    policy.on_finished(a, first)
    assert "a" not in policy.recent  # the finished prefill's charge is gone
    index.hold("a", block_hashes(PROMPT, BS)[:1])  # even a 1-block hit now keeps the conversation on a
    assert pick(policy, [a, b], request(PROMPT)).worker_id == "a"


def test_charge_of_a_request_in_flight_still_counts():
    _, policy = make()
    a, b = worker("a"), worker("b")
    first = request(PROMPT)
    pick(policy, [a, b], first)
    policy.on_started(a, first)
    assert pick(policy, [a, b], request(list(range(700, 732)))).worker_id == "b"


def test_ties_go_to_the_emptier_cache_then_rotate():
    index, policy = make()
    a, b, c = worker("a"), worker("b"), worker("c")
    index.hold("a", [1, 2, 3])
    index.hold("b", [4])
    # cold prompt, idle fleet: c holds nothing → c
    req = request(list(range(5000, 5032)))
    assert pick(policy, [a, b, c], req).worker_id == "c"
    policy.on_finished(c, req)
    # sequential cold requests on equally empty caches rotate instead of piling onto one worker
    _, fresh = make()
    seen = []
    for i in range(3):
        r = request(list(range(9000 + 100 * i, 9032 + 100 * i)))
        seen.append(pick(fresh, [a, b, c], r).worker_id)
        fresh.on_finished(None, r)
    assert sorted(seen) == ["a", "b", "c"]


@pytest.mark.parametrize("tokens, bs, n", [([], 16, 0), (list(range(15)), 16, 0), (list(range(16)), 16, 1),
                                           (list(range(40)), 16, 2), (list(range(40)), 0, 0)])
def test_block_hashes_full_blocks_only(tokens, bs, n):
    assert len(block_hashes(tokens, bs)) == n


@pytest.mark.parametrize("weight, expected, predicted", [(16.0, "a", 8), (0.0, "b", 0)])
def test_prefix_in_flight_counts_as_held_so_no_duplicate_prefill(weight, expected, predicted):
    """Two conversations of one prefix starting together: the second follows the first's prefill
    (its blocks are in no KV event yet) instead of computing a duplicate elsewhere."""
    _, policy = make(overlap_weight=weight)
    a, b = worker("a"), worker("b")
    first = request(PROMPT + [1, 2, 3, 4])
    assert pick(policy, [a, b], first).worker_id == "a"
    policy.on_started(a, first)
    second = request(PROMPT + [9, 9, 9, 9])
    assert pick(policy, [a, b], second).worker_id == expected
    assert second.state["predicted_hit_blocks"] == predicted


def test_a_cached_copy_outbids_a_prefill_in_flight_elsewhere():
    """The in-flight extension applies only to prefixes cached nowhere: a follow-up turn goes to the
    worker whose cache holds its history, not to one merely prefilling the shared prefix now."""
    index, policy = make(overlap_weight=16.0)
    a, b = worker("a"), worker("b")
    index.hold("a", block_hashes(PROMPT, BS)[:6])
    running = request(PROMPT + [1, 2, 3, 4])
    assert pick(policy, [b], running).worker_id == "b"
    policy.on_started(b, running)  # all 9 of its blocks are now being prefilled on b
    follow_up = request(PROMPT + [9, 9, 9, 9])
    assert pick(policy, [a, b], follow_up).worker_id == "a"
    assert follow_up.state["predicted_hit_blocks"] == 6


def test_debug_log_says_why_each_target_scored_as_it_did(caplog):
    index, policy = make()
    a, b = worker("a"), worker("b")
    index.hold("b", block_hashes(PROMPT, BS)[:5])
    with caplog.at_level("DEBUG", logger="infera.router.kv_aware"):
        assert pick(policy, [a, b], request(PROMPT)).worker_id == "b"
    line = next(r.getMessage() for r in caplog.records if "pick policy=kv-aware" in r.getMessage())
    assert "picked=b cache_hits=5 request_blocks=8" in line
    assert "targets=[a:hit=0,load=0.0,held=0,cost=8.0 b:hit=5,load=0.0,held=5,cost=3.0]" in line


def _served_on(policy, workers, prompt, served=True):
    """One request picked, run and finished; ``served``: the worker answered (it computed the prompt)."""
    req = request(prompt)
    w = pick(policy, workers, req)
    policy.on_started(w, req)
    if served:
        req.state["served"] = True
    policy.on_finished(w, req)
    return w


@pytest.mark.parametrize("served, after_s, expected_hit", [
    (True, 0.5, 8),    # its events are still on the way: the blocks count as cached where it ran
    (True, 2.5, 0),    # past LANDED_TTL_S only the events speak
    (False, 0.5, 0),   # the worker failed before answering: it computed nothing
])
def test_a_served_request_counts_as_cached_before_its_events_arrive(served, after_s, expected_hit):
    now = [100.0]
    index = FakeIndex()
    policy = KvAwarePolicy(index, PromptTokenizer.from_path(None), clock=lambda: now[0])
    a, b = worker("a"), worker("b")
    ran_on = _served_on(policy, [a, b], PROMPT, served)
    now[0] += after_s
    assert after_s < LANDED_TTL_S or expected_hit == 0
    follow_up = request(PROMPT + list(range(900, 908)))  # the next turn: same prefix plus 2 blocks
    picked = pick(policy, [a, b] if ran_on.worker_id == "b" else [b, a], follow_up)
    assert follow_up.state["predicted_hit_blocks"] == expected_hit
    if expected_hit:
        assert picked.worker_id == ran_on.worker_id  # even listed second
        assert follow_up.state["charge"][0] == 2  # only its new blocks are charged as a miss


def test_landed_blocks_are_bounded_and_forgotten_with_the_worker():
    _, policy = make()
    a = worker("a")
    _served_on(policy, [a], PROMPT)
    assert len(policy.landed["a"]) == 8
    policy.forget("a")
    assert "a" not in policy.landed


def test_landed_blocks_give_way_once_the_events_catch_up():
    """After a batch made later than the finish is applied, the view says what became of the
    blocks (an eviction included): the landed claim must not outlive it."""
    wall = [100.0]
    index = FakeIndex()
    made_until = {}
    index.events_made_until = lambda key: made_until.get(key, 0.0)
    policy = KvAwarePolicy(index, PromptTokenizer.from_path(None), wall_clock=lambda: wall[0])
    a, b = worker("a"), worker("b")
    ran_on = _served_on(policy, [a, b], PROMPT)
    made_until[ran_on.worker_id] = 99.9   # its events are behind the finish: still counts
    req = request(PROMPT)
    pick(policy, [a, b], req)
    assert req.state["predicted_hit_blocks"] == 8
    made_until[ran_on.worker_id] = 100.1  # caught up, and the view holds nothing (evicted)
    req = request(PROMPT)
    pick(policy, [a, b], req)
    assert req.state["predicted_hit_blocks"] == 0
    assert not policy.landed[ran_on.worker_id]
