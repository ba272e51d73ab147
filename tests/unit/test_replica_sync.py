"""Replica sync without NATS: kv-aware policies of two (or three) server replicas connected through
an in-memory bus that stands in for the broker. The sync's background task is not run: each test
calls ``tick`` (what the task does every few ms, and as a heartbeat every second) with a fake clock."""
import asyncio

import pytest

import infera.kv.replica_share as replica_share  # (the replica sync's caps live there)
from infera.kv.hashing import block_hashes
from infera.kv.prompt import PromptTokenizer
from infera.router.kv_aware import LANDED_TTL_S, PEER_TIMEOUT_S, SYNC_BLOCKS_PER_REQUEST, KvAwarePolicy
from infera.transport.replica_sync_nats import (SUBJECT_PREFIX, NatsReplicaSync, ReplicaMsg, Started, _decode,
                                                _encode, pack_blocks, subject_for, unpack_blocks)
from tests.unit.test_kv_aware_policy import BS, PROMPT, FakeIndex, pick, request, worker


class Bus:
    """The broker: a publish reaches every subscriber at once, the sender included (as NATS
    echoes); ``drops`` lose the next messages that match."""

    def __init__(self):
        self.syncs: list[NatsReplicaSync] = []
        self.published: list[tuple[str, ReplicaMsg]] = []
        self.drops: list = []  # predicates on (sender, msg): matching messages are lost, once each

    def deliver(self, sender, subject, data):
        msg = _decode(data)
        self.published.append((subject, msg))
        for i, pred in enumerate(self.drops):
            if pred(sender, msg):
                del self.drops[i]
                return
        for s in self.syncs:
            s.receive(subject, data)


class FakeNc:
    def __init__(self, bus, owner):
        self.bus, self.owner = bus, owner

    async def publish(self, subject, data):
        if not self.owner.up:
            raise ConnectionError("down")
        self.bus.deliver(self.owner.sync, subject, data)

    async def flush(self, timeout=None):
        pass


class FakeConn:
    """What NatsReplicaSync uses of NatsConnection."""

    def __init__(self, bus):
        self.up = True
        self.sync = None
        self.nc = FakeNc(bus, self)
        self.reconnect_listeners = []

    @property
    def connected(self):
        return self.up

    def on_reconnect(self, listener):
        self.reconnect_listeners.append(listener)


class Clock:
    def __init__(self):
        self.t = 1000.0
        self.wall = 5000.0

    def __call__(self):
        return self.t

    def advance(self, s):
        self.t += s
        self.wall += s


class Replica:
    def __init__(self, bus, clock, index, name, sync=True, **kw):
        self.conn = FakeConn(bus)
        self.sync = NatsReplicaSync(self.conn, replica_id=name, clock=clock, **kw) if sync else None
        self.conn.sync = self.sync
        self.policy = KvAwarePolicy(index, PromptTokenizer.from_path(None), overlap_weight=16.0, clock=clock,
                                    wall_clock=lambda: clock.wall, replica_sync=self.sync)
        self.clock = clock
        if sync:
            bus.syncs.append(self.sync)

    def tick(self, heartbeat=False):
        if self.sync is not None:
            asyncio.run(self.sync.tick(self.clock(), heartbeat=heartbeat))

    def start(self, workers, prompt, model="m"):
        req = request(prompt)
        req.model = model
        w = pick(self.policy, workers, req)
        self.policy.on_started(w, req)
        return w, req

    def finish(self, w, req, served=True):
        if served:
            req.state["served"] = True
        self.policy.on_finished(w, req)


@pytest.fixture
def fleet():
    """(make_replica, bus, clock, index): replicas share one index (every replica reads every
    engine's KV events: their views agree)."""
    bus, clock, index = Bus(), Clock(), FakeIndex()
    return (lambda name, **kw: Replica(bus, clock, index, name, **kw)), bus, clock, index


A_, B_ = worker("a"), worker("b")
OTHER = list(range(500, 532))  # 8 blocks, nothing in common with PROMPT


@pytest.mark.parametrize("sync, expected", [(True, "b"), (False, "a")])
def test_another_replicas_in_flight_request_is_load(fleet, sync, expected):
    make, _, _, _ = fleet
    ra, rb = make("A", sync=sync), make("B", sync=sync)
    w, _ = ra.start([A_, B_], PROMPT)
    assert w.worker_id == "a"  # full tie: the rotation starts at the first
    ra.tick()
    # B's first pick: a full tie too, unless it knows that A's request is running on a
    w2, _ = rb.start([A_, B_], OTHER)
    assert w2.worker_id == expected
    if sync:
        assert rb.policy.active_blocks("a") == 8


@pytest.mark.parametrize("sync, expected_hit", [(True, 8), (False, 0)])
def test_another_replicas_served_blocks_count_as_cached_before_the_events(fleet, sync, expected_hit):
    make, _, clock, _ = fleet
    ra, rb = make("A", sync=sync), make("B", sync=sync)
    ra.policy._picks = 1  # A's rotation is one step ahead: it runs it on b (B's first full tie goes to a)
    w, req = ra.start([A_, B_], PROMPT)
    assert w.worker_id == "b"
    ra.finish(w, req)
    ra.tick()
    clock.advance(0.5)  # the engine's events are still on the way (here: never come)
    follow_up = request(PROMPT + list(range(900, 908)))
    picked = pick(rb.policy, [A_, B_], follow_up)
    assert follow_up.state["predicted_hit_blocks"] == expected_hit
    if sync:
        assert picked.worker_id == "b"
        assert rb.policy.active_blocks("b") == 0  # finished: no load left


def test_another_replicas_pick_charge_counts_until_its_request_finishes(fleet, caplog):
    """recent_misses (the prefill a pick queued on a target) is in-flight state too: a replica
    charges the other's cold picks like its own, and releases them when they finish."""
    make, _, _, _ = fleet
    ra, rb = make("A"), make("B")
    w, req = ra.start([A_, B_], PROMPT)
    assert req.state["charge"][0] == 8 and ra.policy.recent_charge("a") == 8
    ra.tick()
    assert rb.policy.recent_charge("a") == 8 and rb.policy.active_blocks("a") == 8
    with caplog.at_level("DEBUG", logger="infera.router.kv_aware"):
        pick(rb.policy, [A_, B_], request(OTHER))
    line = next(r.getMessage() for r in caplog.records if "pick policy=kv-aware" in r.getMessage())
    assert "picked=b" in line and "a:hit=0,load=16.0" in line  # 8 blocks in flight + 8 charged
    ra.finish(w, req)
    ra.tick()
    assert "a" not in ra.policy.recent and "a" not in rb.policy.recent and rb.policy.active_blocks("a") == 0


def test_a_prefix_being_prefilled_by_another_replica_is_followed(fleet):
    """Two conversations of one prefix start together on two replicas: the second follows the
    first's prefill instead of computing a duplicate elsewhere (the in-flight rule, fleet-wide)."""
    make, _, _, _ = fleet
    ra, rb = make("A"), make("B")
    ra.policy._picks = 1
    w, _ = ra.start([A_, B_], PROMPT + [1, 2, 3, 4])
    assert w.worker_id == "b"
    ra.tick()
    second = request(PROMPT + [9, 9, 9, 9])
    assert pick(rb.policy, [A_, B_], second).worker_id == "b"
    assert second.state["predicted_hit_blocks"] == 8


def test_remote_landed_claims_expire_and_give_way_to_caught_up_events(fleet):
    make, _, clock, index = fleet
    made_until = {}
    index.events_made_until = lambda key: made_until.get(key, 0.0)
    ra, rb = make("A"), make("B")
    w, req = ra.start([A_], PROMPT)
    ra.finish(w, req)
    finished_at = clock.wall
    ra.tick()
    rb.policy._events_made_until = index.events_made_until

    def hit():
        r = request(PROMPT)
        pick(rb.policy, [A_], r)
        return r.state["predicted_hit_blocks"]

    made_until["a"] = finished_at - 0.1
    assert hit() == 8  # events behind the finish: the claim stands
    made_until["a"] = finished_at + 0.1
    assert hit() == 0  # events caught up (and hold nothing): the claim goes
    w, req = ra.start([A_], PROMPT)
    ra.finish(w, req)
    ra.tick()  # a finish heard after the events got past it claims nothing
    assert "a" not in rb.policy.landed or not rb.policy.landed["a"]
    made_until.clear()
    clock.advance(0.01)
    w, req = ra.start([A_], PROMPT)
    ra.finish(w, req)
    ra.tick()
    assert hit() == 8
    clock.advance(LANDED_TTL_S + 0.1)
    assert hit() == 0  # at most LANDED_TTL_S


def test_a_lost_finish_is_cleared_by_the_next_heartbeat(fleet):
    make, bus, clock, _ = fleet
    ra, rb = make("A"), make("B")
    w, req = ra.start([A_], PROMPT)
    ra.tick()
    assert rb.policy.active_blocks("a") == 8
    bus.drops.append(lambda sender, msg: sender is ra.sync and msg.finished)
    ra.finish(w, req)
    ra.tick()
    assert rb.policy.active_blocks("a") == 8  # lost: phantom load, for now
    clock.advance(1.0)
    ra.tick(heartbeat=True)  # A's heartbeat lists nothing in flight
    assert rb.policy.active_blocks("a") == 0
    assert rb.policy.replicas.remote_expired == 1 and rb.policy.replicas.remote_blocks == 0


@pytest.mark.parametrize("how", ["silent", "bye"])
def test_a_replica_that_goes_away_is_dropped_with_its_state(fleet, how):
    make, _, clock, _ = fleet
    ra, rb = make("A"), make("B")
    ra.start([A_], PROMPT)
    ra.tick()
    assert rb.policy.active_blocks("a") == 8 and "A" in rb.policy.replicas.peers
    if how == "bye":
        asyncio.run(ra.sync.stop())
    else:  # crashed or cut off: nothing more from it
        clock.advance(PEER_TIMEOUT_S - 0.5)
        rb.tick(heartbeat=True)
        assert rb.policy.active_blocks("a") == 8  # not yet
        clock.advance(1.0)
        rb.tick(heartbeat=True)
    assert rb.policy.active_blocks("a") == 0 and "A" not in rb.policy.replicas.peers
    assert rb.policy.replicas.peers_dropped == 1


def test_heartbeats_keep_a_long_request_alive(fleet):
    make, _, clock, _ = fleet
    ra, rb = make("A"), make("B")
    ra.start([A_], PROMPT)
    ra.tick()
    for _ in range(10):  # a 10 s stream
        clock.advance(1.0)
        ra.tick(heartbeat=True)
        rb.tick(heartbeat=True)
    assert rb.policy.active_blocks("a") == 8


def test_a_missed_start_is_repaired_by_asking_for_the_full_state(fleet):
    make, bus, _, _ = fleet
    ra, rb = make("A"), make("B")
    bus.drops.append(lambda sender, msg: sender is ra.sync and msg.started)
    ra.start([A_], PROMPT)
    ra.tick()  # lost
    ra.start([B_], OTHER)
    ra.tick()  # B sees a gap in A's sequence
    assert rb.policy.active_blocks("a") == 0 and rb.policy.active_blocks("b") == 8
    assert rb.sync.gaps == 1
    rb.tick()  # B: want A
    assert bus.published[-1][1].want == ["A"]
    ra.tick()  # A: its full state
    assert rb.policy.active_blocks("a") == 8 and rb.policy.active_blocks("b") == 8
    assert ra.sync.snapshots_sent == 1


def test_a_newcomer_learns_what_is_already_in_flight(fleet):
    make, _, clock, _ = fleet
    ra = make("A")
    ra.start([A_], PROMPT)
    ra.tick()
    rc = make("C")  # starts later: A's first messages went by before it
    clock.advance(1.0)
    ra.tick(heartbeat=True)  # C hears A first at seq 2: asks for the full state
    rc.tick()
    ra.tick()
    assert rc.policy.active_blocks("a") == 8


def test_own_messages_are_ignored(fleet):
    make, bus, _, _ = fleet
    ra = make("A")
    ra.start([A_], PROMPT)
    ra.tick()
    assert bus.published and not ra.policy.replicas.peers
    assert ra.policy.active_blocks("a") == 8  # its own, counted once


def test_nats_down_pauses_publishing_and_state_converges_after_reconnect(fleet):
    make, bus, _, _ = fleet
    ra, rb = make("A"), make("B")
    ra.conn.up = False
    w1, r1 = ra.start([A_], PROMPT)
    w2, r2 = ra.start([B_], OTHER)
    ra.finish(w2, r2)
    ra.tick()
    assert ra.sync.deltas_dropped == 3 and rb.policy.active_blocks("a") == 0
    # routing on A is unaffected
    assert ra.policy.active_blocks("a") == 8
    ra.conn.up = True
    for listener in ra.conn.reconnect_listeners:
        listener()
    ra.tick()  # the full state goes out again
    assert rb.policy.active_blocks("a") == 8 and rb.policy.active_blocks("b") == 0


def test_forget_drops_the_other_replicas_state_for_the_worker(fleet):
    make, _, _, _ = fleet
    ra, rb = make("A"), make("B")
    w, req = ra.start([A_], PROMPT)
    ra.tick()
    rb.policy.forget("a")
    assert "a" not in rb.policy.active and rb.policy.replicas.remote_blocks == 0
    ra.finish(w, req)
    ra.tick()  # the late finish finds nothing to release (and lands nothing)
    assert "a" not in rb.policy.active and "a" not in rb.policy.landed


def test_models_travel_on_subjects_of_their_own(fleet):
    make, bus, _, _ = fleet
    ra, rb = make("A"), make("B")
    ra.start([A_], PROMPT, model="m1")
    ra.start([B_], OTHER, model="org/m2:v1.0")
    ra.start([worker("c")], list(range(700, 732)), model="")  # the API requires one; the sync copes anyway
    ra.tick()
    assert {s for s, _ in bus.published} == {subject_for("m1"), subject_for("org/m2:v1.0"), subject_for("")}
    assert all(s.startswith(SUBJECT_PREFIX) and s.count(".") == 2 and not s.endswith(".") for s, _ in bus.published)
    assert [rb.policy.active_blocks(k) for k in "abc"] == [8, 8, 8]
    assert {e[0] for e in rb.policy.replicas.peers["A"].entries.values()} == {"m1", "org/m2:v1.0", ""}


# -- bounds -------------------------------------------------------------------------------------

def test_outbox_overflow_drops_the_oldest_and_the_full_state_follows(fleet, monkeypatch):
    monkeypatch.setattr(replica_share, "SYNC_OUTBOX_CAP", 4)
    make, _, _, _ = fleet
    ra, rb = make("A"), make("B")
    reqs = [ra.start([A_], list(range(1000 * i, 1000 * i + 32))) for i in range(1, 4)]
    for w, req in reqs:
        ra.finish(w, req)  # 6 deltas in a 4-slot outbox
    ra.start([A_], PROMPT)  # 7
    share = ra.policy.replicas
    assert len(share.outbox) == 4 and share.outbox_dropped == 3 and share.lossy
    ra.tick()
    assert rb.policy.active_blocks("a") == 8  # exactly the one still in flight
    assert sum(len(p.entries) for p in rb.policy.replicas.peers.values()) == 1


@pytest.mark.parametrize("cap_name, cap, n_requests, kept", [
    ("PEER_REQUESTS_CAP", 2, 5, 2),
    ("REMOTE_BLOCKS_CAP", 20, 5, 2),  # 8 blocks each: a third would pass 20
    ("SYNC_LIVE_CAP", 3, 5, 3),
])
def test_remote_tables_are_bounded(fleet, monkeypatch, cap_name, cap, n_requests, kept):
    monkeypatch.setattr(replica_share, cap_name, cap)
    make, _, _, _ = fleet
    ra, rb = make("A"), make("B")
    for i in range(n_requests):
        ra.start([A_], list(range(1000 * i, 1000 * i + 32)))
    ra.tick()
    peer = rb.policy.replicas.peers["A"]
    assert len(peer.entries) == kept
    assert rb.policy.replicas.remote_blocks == 8 * kept
    assert rb.policy.active_blocks("a") == 8 * kept
    share = ra.policy.replicas if cap_name == "SYNC_LIVE_CAP" else rb.policy.replicas
    counter = share.live_overflow if cap_name == "SYNC_LIVE_CAP" else share.remote_rejected
    assert counter == n_requests - kept


def test_a_long_request_shares_its_first_blocks_only(fleet):
    make, _, _, _ = fleet
    ra, rb = make("A"), make("B")
    ra.start([worker("a", bs=1)], list(range(SYNC_BLOCKS_PER_REQUEST + 100)))
    ra.tick()
    assert rb.policy.active_blocks("a") == SYNC_BLOCKS_PER_REQUEST


def test_messages_stay_under_the_size_cap(fleet):
    make, bus, _, _ = fleet
    ra, rb = make("A", max_message_bytes=600), make("B")
    for i in range(12):  # 8 blocks = 64 bytes of hashes each
        ra.start([A_], list(range(1000 * i, 1000 * i + 32)))
    ra.tick()
    sizes = [len(_encode(m)) for _, m in bus.published]
    assert len(sizes) >= 2 and max(sizes) <= 600
    assert rb.policy.active_blocks("a") == 96 and rb.sync.gaps == 0


def test_peers_are_bounded(fleet, monkeypatch):
    monkeypatch.setattr(replica_share, "PEERS_CAP", 2)
    make, _, _, _ = fleet
    replicas = [make(n) for n in "ABCD"]
    for r in replicas[1:]:
        r.start([A_], PROMPT)
        r.tick()
    assert set(replicas[0].policy.replicas.peers) == {"B", "C"}
    assert replicas[0].policy.active_blocks("a") == 8  # D's request (same blocks) was not kept


def test_garbage_is_counted_not_applied(fleet):
    make, _, _, _ = fleet
    rb = make("B")
    rb.sync.receive(subject_for("m"), b"\x01\x02not msgpack")
    rb.sync.receive(SUBJECT_PREFIX, _encode(ReplicaMsg(1, "X", 1)))  # no model
    rb.sync.receive(subject_for("m"), _encode(ReplicaMsg(99, "X", 1, started=[Started(1, "a", pack_blocks([1]))])))
    assert rb.sync.decode_errors == 2 and not rb.policy.replicas.peers and rb.policy.active_blocks("a") == 0


def test_block_packing_round_trips_u64():
    hashes = block_hashes(PROMPT, BS) + [0, (1 << 64) - 1]
    assert list(unpack_blocks(pack_blocks(hashes))) == hashes
    assert len(pack_blocks(hashes)) == 8 * len(hashes)
