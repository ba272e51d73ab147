"""KV events over NATS without a broker: the server-side sequence rules (table-driven), the relay's
publishing (verbatim payloads, headers, reset markers, loss handling, purge on stop) against a fake
JetStream, and the bridge choosing the NATS subscriber and the engine's own decoder."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import nats.js.errors
import pytest

from infera.discovery.fleet import Fleet
from infera.discovery.record import WorkerRecord
from infera.engine.sim.kv_events import StoredEvent
from infera.engine.sim.kv_events import encode_batch as sim_encode_batch
from infera.kv.events import decode_array_form
from infera.kv.index import KvIndex
from infera.server.kv import KvEventsBridge
from infera.transport import kv_events_nats as kvn
from infera.transport.kv_events_nats import (HDR_EPOCH, HDR_RESET, HDR_SEQ, STREAM, NatsKvEventSubscriber,
                                             ensure_stream, kv_event_subject)
from infera.transport.kv_relay_nats import KvEventNatsRelay
from infera.transport.nats_conn import subject_token
from tests.conftest import free_port, wait_for

# -- server side: sequence rules ------------------------------------------------------------------------

R = "R"  # a reset marker


def msg(m, epoch: str = "run.1") -> tuple[dict, bytes]:
    """A message as the relay publishes it: "R" a marker, None an untracked batch, an int a batch."""
    if m == R:
        return {HDR_EPOCH: epoch, HDR_RESET: "test"}, b""
    if isinstance(m, tuple):  # (seq, epoch)
        m, epoch = m
    headers = {HDR_EPOCH: epoch}
    if m is not None:
        headers[HDR_SEQ] = str(m)
    return headers, f"p{m}".encode()


def run(msgs: list) -> tuple[list[str], dict]:
    calls: list[str] = []
    sub = NatsKvEventSubscriber(None, lambda k, seq, p: calls.append(f"b{seq}"), lambda k: calls.append("reset"))
    sub.add("w")
    st = sub._keys["w"]
    for i, m in enumerate(msgs, start=1):
        headers, data = msg(m)
        sub._handle(st, i, headers, data)
    return calls, sub.stats("w")


@pytest.mark.parametrize("msgs, calls, counters", [
    ([R, 0, 1, 2], ["reset", "b0", "b1", "b2"], {"markers": 1, "resets": 1}),
    ([0, 1], ["b0", "b1"], {"resets": 0}),  # first contact at seq 0: nothing missed
    ([5, 6], ["reset", "b5", "b6"], {"resets": 1, "gaps": 0}),  # the stream's limits dropped the start
    ([R, 0, 1, 4, 5], ["reset", "b0", "b1", "reset", "b4", "b5"], {"gaps": 1, "resets": 2}),  # seq jump
    ([R, 0, 1, 2, 0, 1], ["reset", "b0", "b1", "b2", "reset", "b0", "b1"], {"restarts": 1}),  # seq backwards
    ([R, 0, 1, 1], ["reset", "b0", "b1", "reset", "b1"], {"restarts": 1}),  # a repeated seq
    ([R, 0, 1, R, 0], ["reset", "b0", "b1", "reset", "b0"], {"markers": 2, "resets": 2, "gaps": 0}),
    ([R, 0, 1, R, 7], ["reset", "b0", "b1", "reset", "b7"], {"gaps": 0}),  # after a marker any seq starts
    ([R, 0, (1, "run.2")], ["reset", "b0", "reset", "b1"], {"restarts": 1}),  # new epoch, its marker lost
    ([R, None, None, 0], ["reset", "b-1", "b-1", "b0"], {"resets": 1}),  # untracked (ATOM) batches
])
def test_sequence_rules(msgs, calls, counters):
    got, stats = run(msgs)
    assert got == calls
    for name, value in counters.items():
        assert stats[name] == value, name
    assert stats["batches"] == sum(1 for c in calls if c.startswith("b"))


def test_duplicate_stream_messages_are_delivered_once():
    calls: list[str] = []
    sub = NatsKvEventSubscriber(None, lambda k, seq, p: calls.append(f"b{seq}"), lambda k: calls.append("reset"))
    sub.add("w")
    st = sub._keys["w"]
    for sseq, m in [(1, R), (2, 0), (3, 1), (2, 0), (3, 1), (4, 2)]:  # history fetch and live overlap
        sub._handle(st, sseq, *msg(m))
    assert calls == ["reset", "b0", "b1", "b2"]


def test_subjects_and_route_keys():
    assert kv_event_subject("10.0.0.1:8000", None) == f"infera.kv.events.{subject_token('10.0.0.1:8000')}.0"
    assert kv_event_subject("h:1", 3).endswith(".3")
    assert kvn._subject_for_key("h:1#dp2") == kv_event_subject("h:1", 2)
    assert kvn._subject_for_key("h:1") == kv_event_subject("h:1", None)
    sub = NatsKvEventSubscriber(None, lambda *a: None, lambda k: None)
    sub.add("w", kv_event_subject("w", 1))
    assert sub.stats("w")["subject"] == kv_event_subject("w", 1) and sub.replaying("w")  # not caught up yet
    sub.remove("w")
    assert sub.keys() == []


# -- worker side: the relay against a fake JetStream -------------------------------------------------------

class FakeJs:
    def __init__(self) -> None:
        self.msgs: list[tuple[str, dict, bytes]] = []
        self.purged: list[tuple[str, str]] = []
        self.stall = False  # acks never come
        self.fail = 0  # the next N publish_async acks fail
        self.streams = 0

    async def add_stream(self, config):
        self.streams += 1
        assert config.name == STREAM and config.subjects == ["infera.kv.events.>"]
        assert (config.max_bytes, config.max_msgs) == (256 * 1024 * 1024, 1_000_000)
        return SimpleNamespace(created="t0", state=SimpleNamespace(last_seq=0, messages=0))

    async def publish_async(self, subject, payload=b"", headers=None):
        fut = asyncio.get_running_loop().create_future()
        if self.stall:
            return fut
        if self.fail:
            self.fail -= 1
            fut.set_exception(nats.js.errors.APIError(description="boom"))
            return fut
        self.msgs.append((subject, dict(headers or {}), payload))
        fut.set_result(SimpleNamespace(seq=len(self.msgs)))
        return fut

    async def publish(self, subject, payload=b"", timeout=None, headers=None):
        self.msgs.append((subject, dict(headers or {}), payload))

    async def purge_stream(self, name, subject=None):
        self.purged.append((name, subject))
        return True


class FakeNats:
    def __init__(self) -> None:
        self.js = FakeJs()
        self.connected = True
        self.down: list = []
        self.up: list = []

    def on_disconnect(self, listener) -> None:
        self.down.append(listener)

    def on_reconnect(self, listener) -> None:
        self.up.append(listener)


def record(**kw) -> WorkerRecord:
    return WorkerRecord(worker_id=kw.pop("worker_id", f"127.0.0.1:{free_port()}"), url="http://x:1", model_name="m",
                        engine=kw.pop("engine", "vllm"), kv_block_size=4,
                        kv_events_endpoint=f"tcp://127.0.0.1:{free_port()}",
                        kv_event_transport=kw.pop("kv_event_transport", "nats"), **kw)


def kinds(js: FakeJs) -> list[tuple]:
    """(subject rank, "R"/seq, epoch generation) per published message."""
    out = []
    for subject, headers, _ in js.msgs:
        what = "R" if HDR_RESET in headers else int(headers[HDR_SEQ])
        out.append((subject.rsplit(".", 1)[1], what, int(headers[HDR_EPOCH].rsplit(".", 1)[1])))
    return out


@pytest.fixture
async def relay():
    relays: list[KvEventNatsRelay] = []

    async def factory(rec: WorkerRecord | None = None, **kw) -> tuple[KvEventNatsRelay, FakeNats]:
        conn = FakeNats()
        r = KvEventNatsRelay(conn, rec or record(), ack_timeout=0.3, resync_interval_s=0.0, **kw)
        relays.append(r)
        await r.start()
        return r, conn

    yield factory
    for r in relays:
        await r.stop()


async def test_relay_publishes_payloads_verbatim_with_seq_and_epoch(relay):
    rec = record(dp_size=2)
    r, conn = await relay(rec)
    js = conn.js
    assert js.streams == 1
    assert kinds(js) == [("0", "R", 1), ("1", "R", 1)]  # a new engine: history before it is void
    payload = sim_encode_batch([StoredEvent([11], None, [1, 2, 3, 4], 4)], "sglang")
    r._on_batch("dp1", 0, payload)
    r._on_batch("dp0", 0, b"\x93opaque")
    r._on_batch("dp0", 1, b"x")
    await wait_for(lambda: len(js.msgs) == 5, 5, message="batches published")
    subject, headers, data = js.msgs[2]
    assert subject == kv_event_subject(rec.worker_id, 1) and data == payload  # byte for byte
    assert headers == {HDR_SEQ: "0", HDR_EPOCH: f"{r.run_id}.1"}
    assert kinds(js)[2:] == [("1", 0, 1), ("0", 0, 1), ("0", 1, 1)]
    # the ZMQ side lost continuity (engine restart): a marker, then the new epoch
    r._on_reset("dp0")
    r._on_batch("dp0", 0, b"y")
    await wait_for(lambda: len(js.msgs) == 7, 5, message="marker published")
    assert kinds(js)[5:] == [("0", "R", 2), ("0", 0, 2)]


async def test_relay_untracked_batches_carry_no_seq(relay):
    r, conn = await relay()
    r._on_batch("dp0", -1, b"atom")
    await wait_for(lambda: len(conn.js.msgs) == 2, 5, message="published")
    assert HDR_SEQ not in conn.js.msgs[1][1] and conn.js.msgs[1][2] == b"atom"


async def test_relay_overflow_drops_then_resets_once_nats_is_back(relay):
    r, conn = await relay(queue_max_msgs=3)
    js = conn.js
    await wait_for(lambda: len(js.msgs) == 1, 5, message="start marker")
    conn.connected = False  # NATS down: batches queue up, then overflow
    for seq in range(5):
        r._on_batch("dp0", seq, b"b%d" % seq)
    assert r.ranks["dp0"].dirty and r.stats()["queued"] == 0  # the rank's backlog went with the loss
    r._on_batch("dp0", 5, b"b5")  # superseded until the marker is out
    conn.connected = True
    await wait_for(lambda: not r.ranks["dp0"].dirty, 5, message="recovered")
    r._on_batch("dp0", 6, b"b6")
    await wait_for(lambda: len(js.msgs) == 3, 5, message="marker then live")
    assert kinds(js) == [("0", "R", 1), ("0", "R", 2), ("0", 6, 2)]  # never a silent gap
    assert js.msgs[1][1][HDR_RESET] == "nats" and r.stats()["ranks"]["dp0"]["dropped"] == 6


async def test_relay_failed_or_missing_acks_reset_the_rank(relay):
    r, conn = await relay()
    js = conn.js
    await wait_for(lambda: len(js.msgs) == 1, 5, message="start marker")
    js.fail = 1
    r._on_batch("dp0", 0, b"a")
    r._on_batch("dp0", 1, b"b")
    await wait_for(lambda: kinds(js)[-1:] == [("0", "R", 2)], 5, message="marker after a failed ack")
    assert ("0", 1, 1) in kinds(js)  # published after the failed one: the server sees the gap, then the marker
    js.stall = True
    r._on_batch("dp0", 2, b"c")
    await wait_for(lambda: r.ranks["dp0"].failures == 2, 5, message="ack timed out")
    js.stall = False
    await wait_for(lambda: kinds(js)[-1:] == [("0", "R", 3)], 5, message="marker after a lost ack")


async def test_relay_with_a_replay_socket_resends_the_engine_buffer_after_a_loss(relay, monkeypatch):
    rec = record(kv_events_replay_endpoint=f"tcp://127.0.0.1:{free_port()}")
    r, conn = await relay(rec, replay_timeout=0.2, start_timeout=0.5)
    readded: list[tuple] = []
    monkeypatch.setattr(r.zmq, "add", lambda *a: readded.append(a))
    conn.js.fail = 1
    r._on_batch("dp0", 0, b"a")
    await wait_for(lambda: readded, 5, message="resync")
    assert readded == [("dp0", rec.kv_events_endpoint, rec.kv_events_replay_endpoint)]
    assert r.stats()["ranks"]["dp0"]["resyncs"] == 1


async def test_relay_stop_flushes_then_purges_its_subjects(relay):
    r, conn = await relay()
    r._on_batch("dp0", 0, b"last")
    await r.stop()
    assert kinds(conn.js)[-1] == ("0", 0, 1)
    assert conn.js.purged == [(STREAM, f"infera.kv.events.{r.token}.>")]


async def test_ensure_stream_tolerates_one_with_other_settings():
    class Js:
        async def add_stream(self, config):
            raise nats.js.errors.BadRequestError(code=400, err_code=10058, description="stream name already in use")

        async def stream_info(self, name):
            return SimpleNamespace(name=name)

    assert (await ensure_stream(Js())).name == STREAM


# -- the bridge ---------------------------------------------------------------------------------------------

def test_bridge_follows_nats_workers_on_nats_and_decodes_sglang_as_sglang():
    fleet = Fleet()
    bridge = KvEventsBridge(fleet, KvIndex(), nats=FakeNats())
    sg = record(engine="sglang", worker_id="sg:1")
    zmq_only = record(worker_id="z:1", kv_event_transport="zmq")
    fleet.upsert(sg)
    fleet.upsert(zmq_only)
    assert bridge.transport("sg:1") == "nats" and bridge.transport("z:1") == "zmq"
    assert bridge.nats_subscriber.keys() == ["sg:1"] and bridge.subscriber.keys() == ["z:1"]
    assert bridge._decoders["sglang"] is decode_array_form
    # An SGLang batch (SGLang 0.5.23's "type"-tagged maps, signed 64-bit hashes) exactly as the
    # relay carries it.
    tokens = list(range(100, 112))
    payload = sim_encode_batch([StoredEvent([1, 2, 3], None, tokens, 4)], "sglang")
    sub = bridge.nats_subscriber
    sub._handle(sub._keys["sg:1"], 1, {HDR_EPOCH: "e.1", HDR_RESET: "start"}, b"")
    sub._handle(sub._keys["sg:1"], 2, {HDR_EPOCH: "e.1", HDR_SEQ: "0"}, payload)
    view = bridge.cache_view("sg:1", None)
    assert (view["block_count"], view["decode_errors"], view["transport"], view["batches"]) == (3, 0, "nats", 1)
    assert bridge.stats("sg:1")["markers"] == 1
    # the worker leaves: its subscription goes from the subscriber that held it
    fleet.remove("sg:1")
    assert sub.keys() == [] and bridge.transport("sg:1") is None


def test_bridge_without_nats_follows_relaying_workers_on_zmq():
    fleet = Fleet()
    bridge = KvEventsBridge(fleet, KvIndex())
    fleet.upsert(record(worker_id="n:1", dp_size=2))
    assert bridge.nats_subscriber is None
    assert sorted(bridge.subscriber.keys()) == ["n:1#dp0", "n:1#dp1"]
    assert bridge.transport("n:1#dp1") == "zmq"


async def test_a_failing_publisher_backs_off_and_logs_once_per_state_change(monkeypatch, caplog):
    """A publish round that keeps raising (a bug, fd exhaustion) is retried with a growing jittered
    delay, logged once at ERROR, at DEBUG while it goes on and once at INFO when a round succeeds:
    it logged a traceback every 0.5 s, forever."""
    from infera.transport import kv_relay_nats

    relay = KvEventNatsRelay(SimpleNamespace(connected=True), record())
    delays: list[int] = []
    monkeypatch.setattr(kv_relay_nats, "retry_delay", lambda failures, first, cap: delays.append(failures) or 0.001)
    rounds = {"n": 0}
    recovered = asyncio.Event()

    async def publish_round() -> None:
        rounds["n"] += 1
        if rounds["n"] <= 6:
            raise OSError(24, "Too many open files")
        if rounds["n"] == 8:  # the round after the first good one: the recovery is logged by then
            recovered.set()
            await asyncio.sleep(3600)

    monkeypatch.setattr(relay, "_publish_round", publish_round)
    caplog.set_level("DEBUG", logger="infera.transport.kv_relay_nats")
    task = asyncio.ensure_future(relay._publisher())
    try:
        await asyncio.wait_for(recovered.wait(), 5)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert delays == [1, 2, 3, 4, 5, 6]  # each retry waits as the n-th failure in a row
    records = [r for r in caplog.records if r.name == "infera.transport.kv_relay_nats"]
    assert [r.levelname for r in records if r.levelname != "DEBUG"] == ["ERROR", "INFO"]
    assert sum(r.levelname == "DEBUG" for r in records) == 5
    assert "recovered after 6 failed round(s)" in records[-1].getMessage()


def test_retry_delay_doubles_to_its_cap_with_jitter():
    from infera.transport.backoff import retry_delay

    for failures, base in [(1, 0.5), (2, 1.0), (3, 2.0), (7, 30.0), (50, 30.0), (0, 0.5)]:
        samples = [retry_delay(failures, 0.5, 30.0) for _ in range(200)]
        assert all(0.75 * base <= d <= 1.25 * base for d in samples)
        assert len(set(samples)) > 1  # jittered: peers that failed together do not retry in step


async def test_history_fetches_run_at_most_history_concurrency_at_once(monkeypatch):
    """Keys re-added together (their history went by) fetch it through at most
    ``history_concurrency`` pull consumers at once; the others wait, and every key catches up."""
    limit, n = 2, 6
    sub = NatsKvEventSubscriber(None, lambda k, s, p: None, lambda k: None, history_concurrency=limit)
    running, most, release = 0, 0, asyncio.Event()

    async def fetch_once(st) -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        try:
            await release.wait()
        finally:
            running -= 1

    monkeypatch.setattr(sub, "_fetch_once", fetch_once)
    keys = [kvn._Key(f"w{i}", kv_event_subject(f"w{i}", 0)) for i in range(n)]
    tasks = [asyncio.ensure_future(sub._fetch_history(st)) for st in keys]
    await wait_for(lambda: running == limit, 5, message=f"{limit} fetches running")
    for _ in range(20):  # the waiting keys get every chance to start one too many
        await asyncio.sleep(0)
    assert running == limit
    release.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert most == limit
    assert all(st.caught_up and st.live for st in keys)


def test_history_concurrency_must_be_positive():
    with pytest.raises(ValueError, match="history_concurrency"):
        NatsKvEventSubscriber(None, lambda k, s, p: None, lambda k: None, history_concurrency=0)
