"""Self-healing KV views (issue 30 item 5), as a state machine with no sockets: the real ZMQ
subscriber's sequence rules (driven message by message, its replay socket answered by the test),
the real bridge and index, and the kv-aware policy reading the bridge's ``warming`` set."""
from __future__ import annotations

import asyncio
import json
import logging

import pytest

from infera.api.requests import parse_request
from infera.discovery.fleet import Fleet
from infera.discovery.record import WorkerRecord
from infera.kv.events import Cleared, EventBatch, Stored, encode_batch
from infera.kv.index import KvIndex
from infera.kv.prompt import PromptTokenizer
from infera.router.kv_aware import KvAwarePolicy
from infera.router.policy import RoutedRequest
from infera.server.kv import KvEventsBridge
from infera.transport.kv_events_zmq import RESET_GAP, RESET_HISTORY, RESET_RESTART, ZmqKvEventSubscriber

BS = 4
TOPIC = b"kv-events"
PROMPT = list(range(100, 132))  # 8 blocks of 4


def record(wid: str = "w", port: int = 5557, **kw) -> WorkerRecord:
    return WorkerRecord(worker_id=wid, url=f"http://{wid}:1", model_name="m", engine="vllm", kv_block_size=BS,
                        kv_events_endpoint=f"tcp://127.0.0.1:{port}",
                        kv_events_replay_endpoint=f"tcp://127.0.0.1:{port + 1}", **kw)


def stored(tokens: list[int], first_hash: int = 1) -> Stored:
    n = len(tokens) // BS
    return Stored(block_hashes=list(range(first_hash, first_hash + n)), parent=None, token_ids=tokens, block_size=BS)


def payload(*events, ts: float = 0.0) -> bytes:
    return encode_batch(EventBatch(ts, list(events)))


def frames(seq: int, data: bytes) -> list[bytes]:
    return [TOPIC, seq.to_bytes(8, "big"), data]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeSub:
    """A subscriber whose catching up and resets the test decides (the bridge's side only)."""

    def __init__(self) -> None:
        self.keys: dict[str, dict] = {}
        self.reasons: dict[str, str] = {}
        self.on_caught_up = None
        self.added: list[tuple] = []

    def add(self, key, *endpoints) -> None:
        self.keys[key] = {"caught_up": False}
        self.added.append((key, *endpoints))

    def remove(self, key) -> None:
        self.keys.pop(key, None)

    def stats(self, key) -> dict:
        return self.keys.get(key, {})

    def replaying(self, key) -> bool:
        return False

    def reset_reason(self, key):
        return self.reasons.get(key)

    def catch_up(self, key) -> None:
        self.keys[key]["caught_up"] = True
        self.on_caught_up(key)

    def reset(self, bridge: KvEventsBridge, key: str, reason: str) -> None:
        self.reasons[key] = reason
        bridge._on_reset(key)


def fake_bridge(*records: WorkerRecord, clock: Clock | None = None) -> tuple[KvEventsBridge, FakeSub, Fleet]:
    fleet, sub = Fleet(), FakeSub()
    b = KvEventsBridge(fleet, KvIndex(), subscriber=sub, clock=clock or Clock())
    for r in records:
        fleet.upsert(r)
    return b, sub, fleet


def metric(b: KvEventsBridge, name: str, key: str = "w") -> float:
    for fam in b.collect():
        for s in fam.samples:
            if s.name in (name, name + "_total") and s.labels.get("worker_id") == key:
                return s.value
    raise KeyError(name)


# -- engine restart ------------------------------------------------------------------------------------------

def real_bridge(*records: WorkerRecord) -> tuple[KvEventsBridge, ZmqKvEventSubscriber]:
    """The bridge with its own (unstarted) ZMQ subscriber, whose message handling the test drives."""
    fleet = Fleet()
    b = KvEventsBridge(fleet, KvIndex())
    for r in records:
        fleet.upsert(r)
    return b, b.subscriber


def test_seq_going_back_drops_the_old_engines_blocks_at_once(caplog):
    b, sub = real_bridge(record())
    st = sub._keys["w"]
    st.replay_endpoint = None  # no replay: what the stream itself shows

    async def run():
        await sub._on_message(st, frames(0, payload(stored(PROMPT[:16]))))
        await sub._on_message(st, frames(1, payload(stored(PROMPT[16:], first_hash=50))))
        assert b.index.block_count("w") == 8
        with caplog.at_level(logging.INFO, logger="infera.server.kv"):
            # the new engine's first batch: seq 0 again, other content
            await sub._on_message(st, frames(0, payload(stored(PROMPT[:4], first_hash=90))))

    asyncio.run(run())
    assert b.index.block_count("w") == 1  # only what the new engine stored
    view = b.cache_view("w", None)
    assert view["engine_restarts"] == 1 and view["degraded"] is False
    assert sub.stats("w")["reset_reasons"] == {RESET_RESTART: 1}
    assert metric(b, "infera_kv_engine_restarts") == 1
    lines = [r.getMessage() for r in caplog.records if "restarted" in r.getMessage()]
    assert len(lines) == 1 and r"100" not in lines[0]  # one line, no prompt data (token ids)


@pytest.mark.parametrize("replay, restart, delivered", [
    # (what the replay socket answers to a probe from our last seq 2, restart found?, seqs delivered after)
    ("same anchor, nothing newer", False, []),
    ("same anchor, two newer", False, [3, 4]),
    ("anchor differs", True, [0, 1]),         # a new engine that has published as many: reset, its 0..1 replayed
    ("ends before our last", True, [0, 1]),   # a new engine with fewer batches
    ("no answer", False, []),                 # the replay socket is down: nothing can be told yet
])
def test_probe_tells_a_restarted_engine_by_the_replay_anchor(replay, restart, delivered):
    b, sub = real_bridge(record())
    st = sub._keys["w"]
    old = [payload(stored(PROMPT[4 * i:4 * i + 4], first_hash=10 + i), ts=float(i)) for i in range(3)]
    new = [payload(stored(PROMPT[:4], first_hash=70 + i), ts=100.0 + i) for i in range(2)]
    answers = {"same anchor, nothing newer": [(2, old[2])],
               "same anchor, two newer": [(2, old[2]), (3, payload(ts=3.0)), (4, payload(ts=4.0))],
               "anchor differs": [(0, new[0]), (1, new[1]), (2, payload(ts=102.0))],
               "ends before our last": [(0, new[0]), (1, new[1])],
               "no answer": None}
    seen: list[int] = []

    async def fetch(st_, start, counted=True):
        if start == 0 and restart:  # after the reset: the new engine's history from its seq 0
            return [a for a in answers[replay] if a[0] < 2]
        got = answers[replay]
        return None if got is None else [a for a in got if a[0] >= start]

    async def run():
        for seq, data in enumerate(old):
            await sub._on_message(st, frames(seq, data))
        st.replay_answers = 1  # it answered with batches before (the first-contact replay)
        sub._fetch = fetch
        orig = sub.on_batch
        sub.on_batch = lambda key, seq, data: (seen.append(seq), orig(key, seq, data))
        await sub._probe(st)

    asyncio.run(run())
    assert (sub.stats("w")["restarts"] == 1) is restart
    assert seen == delivered
    assert b.cache_view("w", None)["engine_restarts"] == (1 if restart else 0)
    if restart:
        assert b.index.block_count("w") == 1  # the old engine's 3 blocks gone; the new one's 1 (stored twice)


def test_an_empty_replay_from_a_socket_that_never_answered_is_not_a_restart():
    """A replay socket that buffers nothing would otherwise look restarted at every idle probe."""
    b, sub = real_bridge(record())
    st = sub._keys["w"]

    async def fetch(st_, start, counted=True):
        return []

    async def run():
        await sub._on_message(st, frames(0, payload(stored(PROMPT[:4]))))
        sub._fetch = fetch
        await sub._probe(st)

    asyncio.run(run())
    assert sub.stats("w")["restarts"] == 0 and b.index.block_count("w") == 1


@pytest.mark.parametrize("change, restart", [
    ({"kv_events_endpoint": "tcp://127.0.0.1:6001"}, True),        # a relaunch: fresh event ports
    ({"kv_events_replay_endpoint": "tcp://127.0.0.1:6002"}, True),
    ({"kv_event_transport": "nats"}, True),
    ({"tokenizer_sha256": "ab" * 32}, False),                      # the same engine, a record filled in
    ({"url": "http://w:1"}, False),                                # no change at all
])
def test_a_worker_registering_a_new_event_stream_is_a_new_engine(change, restart):
    clock = Clock()
    b, sub, fleet = fake_bridge(record(), clock=clock)
    sub.catch_up("w")
    b._on_batch("w", 0, payload(stored(PROMPT)))
    assert b.index.block_count("w") == 8
    b.targets["w"].observations = 5  # counters of the target go on across its engine's restarts
    fields = {f: getattr(record(), f) for f in record().__struct_fields__}
    fleet.upsert(WorkerRecord(**{**fields, **change}))
    view = b.cache_view("w", None)
    assert (view["block_count"] == 0) is restart
    assert view["engine_restarts"] == (1 if restart else 0)
    assert view["caught_up"] is (not restart)  # a new subscription warms up again
    assert view["prediction"]["observations"] == 5
    assert len(sub.added) == (2 if restart else 1)  # resubscribed (no NATS here: ZMQ for all)


def test_a_worker_that_leaves_and_comes_back_starts_with_an_empty_view():
    b, sub, fleet = fake_bridge(record())
    b._on_batch("w", 0, payload(stored(PROMPT)))
    fleet.remove("w")
    assert not b.index.has_target("w") and "w" not in b.warming
    fleet.upsert(record())
    assert b.index.block_count("w") == 0


# -- degraded ----------------------------------------------------------------------------------------------

def test_an_unrepaired_gap_degrades_the_view_until_the_engine_clears_its_cache(caplog):
    b, sub, _ = fake_bridge(record())
    b._on_batch("w", 0, payload(stored(PROMPT[:16])))
    assert b.cache_view("w", None)["degraded"] is False
    with caplog.at_level(logging.WARNING, logger="infera.server.kv"):
        sub.reset(b, "w", RESET_GAP)  # batches lost; replay could not bring them back
    assert any("degraded" in r.getMessage() for r in caplog.records)
    b._on_batch("w", 7, payload(stored(PROMPT[16:], first_hash=50)))
    view = b.cache_view("w", None)
    assert (view["degraded"], view["degraded_reason"], view["block_count"]) == (True, "gap", 4)
    assert metric(b, "infera_kv_view_degraded") == 1
    # It under-predicts, it never over-predicts: the blocks before the gap are simply unknown.
    b._on_batch("w", 8, payload(stored(PROMPT[:4], first_hash=60)))
    assert b.cache_view("w", None)["degraded"] is True
    b._on_batch("w", 9, payload(Cleared()))  # the engine's cache is empty: so is the view, whole again
    view = b.cache_view("w", None)
    assert (view["degraded"], view["block_count"]) == (False, 0)
    assert metric(b, "infera_kv_view_degraded") == 0


@pytest.mark.parametrize("steps, degraded", [
    # (what the view goes through, degraded after)
    ([("batch", 0)], None),                                   # from the engine's first batch: whole
    ([("batch", 5)], "history"),                              # first contact past seq 0, no reset said so
    ([("reset", RESET_HISTORY), ("batch", 40)], "history"),   # older batches out of the replay buffer
    ([("batch", 0), ("reset", RESET_GAP), ("batch", 4)], "gap"),
    ([("batch", 0), ("reset", RESET_GAP), ("reset", RESET_RESTART)], None),  # a restart: empty cache, whole
    ([("batch", 0), ("reset", RESET_GAP), ("reset", RESET_RESTART), ("batch", 0)], None),
    ([("batch", 0), ("reset", RESET_RESTART), ("batch", 3)], "history"),  # the new engine's start was missed
    ([("batch", 0), ("reset", "reconnect"), ("batch", 0)], None),         # replayed from 0 after a reconnect
    ([("batch", 0), ("reset", RESET_GAP), ("batch", 4), ("batch", 5), ("clear", 6)], None),
    ([("clear", 0), ("batch", 1)], None),
    ([("batch", -1)], None),                                  # no sequence numbers (ATOM): nothing to tell
])
def test_degraded_state_machine(steps, degraded):
    b, sub, _ = fake_bridge(record())
    for what, arg in steps:
        if what == "batch":
            b._on_batch("w", arg, payload(stored(PROMPT[:4])))
        elif what == "clear":
            b._on_batch("w", arg, payload(Cleared()))
        else:
            sub.reset(b, "w", arg)
    assert b.cache_view("w", None)["degraded_reason"] == degraded


def test_a_lower_tier_clear_does_not_make_a_degraded_view_whole():
    b, sub, _ = fake_bridge(record())
    b._on_batch("w", 3, payload(stored(PROMPT[:4])))
    b._on_batch("w", 4, payload(Cleared(medium="CPU")))  # one lower tier emptied: the GPU view still lacks blocks
    assert b.cache_view("w", None)["degraded"] is True


# -- staleness --------------------------------------------------------------------------------------------

def test_staleness_is_the_age_of_the_last_applied_batch_at_scrape_time():
    clock = Clock()
    b, _, _ = fake_bridge(record(), clock=clock)
    clock.now += 3.0
    assert metric(b, "infera_kv_view_staleness_seconds") == 3.0  # no batch yet: the subscription's age
    b._on_batch("w", 0, payload(stored(PROMPT[:4])))
    assert metric(b, "infera_kv_view_staleness_seconds") == 0.0
    clock.now += 12.5
    assert metric(b, "infera_kv_view_staleness_seconds") == 12.5
    assert b.cache_view("w", None)["staleness_s"] == 12.5


# -- warm-up ---------------------------------------------------------------------------------------------

def request(prompt_ids: list[int]) -> RoutedRequest:
    body = json.dumps({"model": "m", "prompt": prompt_ids}).encode()
    return RoutedRequest(route="/v1/completions", body=body, parsed=parse_request("/v1/completions", body), model="m",
                         stream=False, request_id="r")


def pick(policy: KvAwarePolicy, workers, req: RoutedRequest) -> WorkerRecord:
    asyncio.run(policy.prepare(req))
    return policy.pick(workers, req, "mixed")


def test_warming_views_make_picks_by_load_until_every_candidate_caught_up(caplog):
    a, w = record("a", 7000), record("w", 7100)
    b, sub, _ = fake_bridge(a, w)
    policy = KvAwarePolicy(b.index, PromptTokenizer.from_path(None), observer=b)
    assert b.warming == {"a", "w"} and metric(b, "infera_kv_view_caught_up") == 0
    b._on_batch("w", 0, payload(stored(PROMPT)))  # w's replayed history: the whole prompt
    sub.catch_up("w")
    # a is still warming: no credit for w's hits, the pick is by load (a tie: the emptier view, a)
    req = request(PROMPT)
    assert pick(policy, (a, w), req).worker_id == "a"
    assert req.state["predicted_hit_blocks"] == 0 and req.state["kv_load_only"] is True
    policy.on_finished(a, req)
    with caplog.at_level(logging.INFO, logger="infera.server.kv"):
        sub.catch_up("a")
    assert sum("caught up" in r.getMessage() for r in caplog.records) == 1
    assert not b.warming and metric(b, "infera_kv_view_caught_up", "a") == 1
    req = request(PROMPT)
    assert pick(policy, (a, w), req).worker_id == "w"
    assert req.state["predicted_hit_blocks"] == 8 and "kv_load_only" not in req.state
    # a new worker joining warms up alone: picks among it and the others go by load meanwhile
    assert b.cache_view("w", None)["caught_up"] is True


def test_a_load_only_reply_is_not_blamed_on_the_view():
    b, sub, _ = fake_bridge(record())

    def reply(cached: int) -> None:
        req = request(PROMPT)
        req.state.update({"route_key": "w", "block_size": BS, "predicted_hit_blocks": 0, "tokens": PROMPT,
                          "kv_load_only": True})
        b.observe_usage(record(), req, cached)

    reply(32)  # the engine had it all cached; a pick by load did not ask the view: not counted
    view = b.cache_view("w", None)
    assert view["prediction"]["observations"] == 0 and view["prediction"]["under"] == 0
    assert b.targets["w"].reported_cached_tokens == 32  # the engine's numbers are still counted
    reply(0)  # cold: nothing cached either way, counted as any cold reply
    view = b.cache_view("w", None)
    assert (view["prediction"]["observations"], view["prediction"]["exact"]) == (1, 1)


def test_the_watchdog_catches_a_subscriber_that_never_calls_back():
    async def run():
        b, sub, _ = fake_bridge(record())
        sub.on_caught_up = None
        sub.keys["w"]["caught_up"] = True  # caught up without saying so
        task = asyncio.ensure_future(b._watch_silence())
        try:
            for _ in range(30):
                if not b.warming:
                    break
                await asyncio.sleep(0.1)
        finally:
            task.cancel()
        return b.warming

    assert asyncio.run(run()) == set()


def test_a_restart_also_drops_the_blocks_the_policy_credits_beyond_the_view():
    """Blocks of a request just served count as cached there until the events confirm them
    (landed claims): a restarted engine has lost those too."""
    b, sub, fleet = fake_bridge(record())
    sub.catch_up("w")
    policy = KvAwarePolicy(b.index, PromptTokenizer.from_path(None), observer=b)
    w = record()
    req = request(PROMPT)
    assert pick(policy, (w,), req).worker_id == "w" and req.state["predicted_hit_blocks"] == 0
    policy.on_started(w, req)
    req.state["served"] = True
    policy.on_finished(w, req)  # served: its blocks are claimed as cached on w
    follow_up = request(PROMPT)
    pick(policy, (w,), follow_up)
    assert follow_up.state["predicted_hit_blocks"] == 8
    fields = {f: getattr(w, f) for f in w.__struct_fields__}
    fleet.upsert(WorkerRecord(**{**fields, "kv_events_endpoint": "tcp://127.0.0.1:6001"}))  # relaunched
    sub.catch_up("w")
    after = request(PROMPT)
    pick(policy, (w,), after)
    assert after.state["predicted_hit_blocks"] == 0


def test_a_restart_found_on_the_stream_drops_the_policys_claims_too():
    b, sub, _ = fake_bridge(record())
    dropped: list[str] = []
    b.on_engine_restart.append(dropped.append)
    sub.reset(b, "w", RESET_GAP)
    assert dropped == []  # a gap: the engine still has its blocks
    sub.reset(b, "w", RESET_RESTART)
    assert dropped == ["w"]


# -- NATS: the same reasons, and caught_up said once the history is in -------------------------------------

def nats_msg(m, epoch: str = "run.1") -> tuple[dict, bytes]:
    from infera.transport.kv_events_nats import HDR_EPOCH, HDR_RESET, HDR_SEQ

    if isinstance(m, str) and m.startswith("marker:"):
        return {HDR_EPOCH: epoch, HDR_RESET: m.split(":", 1)[1]}, b""
    if isinstance(m, tuple):
        m, epoch = m
    return {HDR_EPOCH: epoch, HDR_SEQ: str(m)}, b"p"


@pytest.mark.parametrize("msgs, reasons, last", [
    (["marker:relay-start", 0, 1], {RESET_RESTART: 1}, RESET_RESTART),  # a relay (and its engine) started
    (["marker:relay-start", 0, 1, "marker:engine", 0], {RESET_RESTART: 1, RESET_GAP: 1}, RESET_GAP),  # relay lost some
    (["marker:relay-start", 0, 1, 0], {RESET_RESTART: 2}, RESET_RESTART),  # seq back
    (["marker:relay-start", 0, (1, "run.2")], {RESET_RESTART: 2}, RESET_RESTART),  # a new epoch, its marker lost
    (["marker:relay-start", 0, 3], {RESET_RESTART: 1, RESET_GAP: 1}, RESET_GAP),
    ([4, 5], {RESET_HISTORY: 1}, RESET_HISTORY),  # the stream's limits dropped the start
])
def test_nats_resets_carry_their_reason(msgs, reasons, last):
    from infera.transport.kv_events_nats import NatsKvEventSubscriber

    sub = NatsKvEventSubscriber(None, lambda *a: None, lambda k: None)
    sub.add("w")
    st = sub._keys["w"]
    for sseq, m in enumerate(msgs, start=1):
        sub._handle(st, sseq, *nats_msg(m))
    assert sub.stats("w")["reset_reasons"] == reasons
    assert sub.reset_reason("w") == last


def test_nats_says_caught_up_per_key_when_the_shared_consumer_reaches_the_end():
    from infera.transport.kv_events_nats import NatsKvEventSubscriber

    told: list[str] = []
    sub = NatsKvEventSubscriber(None, lambda *a: None, lambda k: None, on_caught_up=told.append)
    sub.add("a")
    sub.add("b")
    assert not sub.stats("a")["caught_up"] and told == []
    sub._mark_global_caught_up()
    assert sorted(told) == ["a", "b"] and sub.stats("a")["caught_up"]
    sub.add("c")  # added after: nothing of it in the stream yet, live from here
    assert told[-1] == "c"


def test_the_replay_load_is_collected():
    """``infera_kv_event_replays``: the ZMQ subscriber's replays asked, waiting and its bound."""
    sub = ZmqKvEventSubscriber(lambda k, s, p: None, lambda k: None, replay_concurrency=7)
    b = KvEventsBridge(Fleet(), KvIndex(), subscriber=sub)
    sub._replays_in_flight, sub._replays_waiting = 7, 3  # as mid warm-up
    fam = {m.name: m for m in b.collect()}["infera_kv_event_replays"]
    assert {s.labels["state"]: s.value for s in fam.samples} == {"in_flight": 7, "waiting": 3, "limit": 7}
