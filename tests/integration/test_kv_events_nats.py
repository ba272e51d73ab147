"""KV events over NATS JetStream end to end: a real nats-server, real sim workers whose launchers relay
their engines' ZMQ events (``--kv-event-transport nats``), in-process servers following the stream."""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys

import aiohttp
import nats
import pytest

from infera.transport.kv_events_nats import (HDR_EPOCH, HDR_RESET, HDR_SEQ, STREAM, NatsKvEventSubscriber,
                                             ensure_stream, kv_event_subject)
from infera.transport.nats_conn import NatsConnection, subject_token
from tests.conftest import free_port, wait_for
from tests.integration.conftest import Worker, wait_workers
from tests.integration.test_kv_routing import ADMIN_TOKEN, cache_view, chat, full_blocks, post

pytestmark = pytest.mark.integration


def kv_nats(url: str) -> tuple[str, ...]:
    return ("--kv-event-transport", "nats", "--nats-server", url)


async def stored(url: str, worker_id: str) -> int:
    """Messages of a worker's subjects in the stream."""
    nc = await nats.connect(url)
    try:
        subjects = f"infera.kv.events.{subject_token(worker_id)}.>"
        info = await nc.jetstream().stream_info(STREAM, subjects_filter=subjects)
        return sum((info.state.subjects or {}).values())
    finally:
        await nc.close()


async def view_of(s: aiohttp.ClientSession, server, worker_id: str) -> dict:
    return await cache_view(s, f"http://127.0.0.1:{server.port}", worker_id)


# -- (a) kv-aware picks driven by events that came over NATS only --------------------------------------

async def test_kv_aware_picks_follow_events_relayed_over_nats(make_server, spawn_worker, nats_server):
    server = await make_server(*kv_nats(nats_server.url), "--admin-token", ADMIN_TOKEN)
    workers = [await spawn_worker("--num-gpu-blocks", "2048", launcher_args=kv_nats(nats_server.url))
               for _ in range(2)]
    await wait_workers(server, {w.worker_id for w in workers})
    assert all(server.fleet.get(w.worker_id).kv_event_transport == "nats" for w in workers)
    base = f"http://127.0.0.1:{server.port}"
    async with aiohttp.ClientSession() as s:
        await wait_for(lambda: all(server.kv.stats(w.worker_id).get("connected") for w in workers), 10,
                       message="JetStream subscription up")
        stored = 0
        for g in range(2):
            stored += full_blocks((await post(s, base, chat(g, "first question")))[1])
        # every group's blocks: one group's prompt alone is over 20, and a follow-up predicted on part
        # of them would not be exact
        await wait_for(lambda: sum(server.kv.index.block_count(w.worker_id) for w in workers) >= stored, 10,
                       message="views filled from events over NATS")
        for g in range(2):
            _, reply = await post(s, base, chat(g, "second question"))
            assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * 10, (g, reply["usage"])
        views = [await view_of(s, server, w.worker_id) for w in workers]
    # Fed by NATS alone: the ZMQ subscriber holds nothing, the NATS one counted the batches.
    assert server.kv.subscriber.keys() == []
    for w, v in zip(workers, views):
        st = server.kv.stats(w.worker_id)
        assert st["transport"] == "nats" and v["transport"] == "nats" and v["caught_up"]
        assert st["batches"] == server.kv.targets[w.worker_id].batches and st["gaps"] == 0
    assert sum(v["batches"] for v in views) > 0
    assert sum(v["prediction"]["exact"] for v in views) == 4  # the self-check agrees with the engines


async def test_mixed_planes_each_worker_on_its_transport(make_server, spawn_worker, nats_server):
    """A nats-relaying worker still publishes on ZMQ: a server without NATS follows it there, and a
    server with NATS follows a ZMQ-only worker on ZMQ."""
    with_nats = await make_server(*kv_nats(nats_server.url), "--admin-token", ADMIN_TOKEN)
    without = await make_server("--admin-token", ADMIN_TOKEN)
    relayed = await spawn_worker(launcher_args=kv_nats(nats_server.url))
    plain = await spawn_worker()
    ids = {relayed.worker_id, plain.worker_id}
    await wait_workers(with_nats, ids)
    await wait_workers(without, ids)
    await wait_for(lambda: with_nats.kv.transport(relayed.worker_id) == "nats"
                   and with_nats.kv.transport(plain.worker_id) == "zmq"
                   and without.kv.transport(relayed.worker_id) == "zmq", 5, message="transports chosen")
    async with aiohttp.ClientSession() as s:
        for w in (relayed, plain):  # straight to the engines: every server sees the events
            async with s.post(w.url + "/v1/chat/completions", json=chat(3, "hi")) as r:
                assert r.status == 200
        for server in (with_nats, without):
            await wait_for(lambda: all(server.kv.index.block_count(w.worker_id) >= 10 for w in (relayed, plain)),
                           10, message="views of both workers filled")


# -- (b) a server started after the events replays them from the stream ----------------------------------

async def test_server_started_later_rebuilds_views_from_the_stream(make_server, spawn_worker, nats_server):
    w = await spawn_worker("--num-gpu-blocks", "2048", launcher_args=kv_nats(nats_server.url))
    await wait_for(lambda: stored(nats_server.url, w.worker_id), 20, message="the relay's start marker")
    async with aiohttp.ClientSession() as s:
        await wait_for(lambda: _healthy(s, w), 20, message="worker up")
        for g in range(3):  # straight to the engine: no server exists yet
            async with s.post(w.url + "/v1/chat/completions", json=chat(g, "before any router")) as r:
                assert r.status == 200
        await wait_for(lambda: _more_than(nats_server.url, w.worker_id, 3), 10, message="batches in the stream")

        server = await make_server(*kv_nats(nats_server.url), "--admin-token", ADMIN_TOKEN)
        await wait_workers(server, {w.worker_id})
        await wait_for(lambda: server.kv.index.block_count(w.worker_id) >= 3 * 18, 10,
                       message="history replayed into the new server's view")
        view = await view_of(s, server, w.worker_id)
        assert view["caught_up"] and view["transport"] == "nats" and view["block_count"] >= 3 * 18
        # History is not event delay (a batch the engine sent late may still arrive live).
        delays = server.kv.targets[w.worker_id].delays  # (None: no live batch measured)
        measured = sum(delays.counts) if delays is not None else 0
        assert measured < view["batches"] - 2, (measured, view["batches"])
        # and the router uses it: the first request it routes for group 1 is a cache hit
        _, reply = await post(s, f"http://127.0.0.1:{server.port}", chat(1, "after"))
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * 10


async def _healthy(s: aiohttp.ClientSession, w: Worker) -> bool:
    try:
        async with s.get(w.url + "/health") as r:
            return r.status == 200
    except aiohttp.ClientError:
        return False


async def _more_than(url: str, worker_id: str, n: int) -> bool:
    return await stored(url, worker_id) > n


# -- (d) SGLang-format events through the relay, decoded as SGLang ----------------------------------------

async def test_sglang_events_relayed_verbatim_and_decoded_as_sglang(make_server, etcd, prefix, nats_server):
    server = await make_server(*kv_nats(nats_server.url), "--admin-token", ADMIN_TOKEN)
    port = free_port()
    cmd = [sys.executable, "-m", "infera.engine.sglang", "--etcd-endpoint", etcd.endpoint, "--etcd-prefix", prefix,
           "--lease-ttl", "2", "--drain-settle", "0.3", "--log-level", "warning", *kv_nats(nats_server.url),
           "--engine-entrypoint", "python -m infera.engine.sim.sglang_standin",
           "--port", str(port), "--host", "127.0.0.1", "--speedup", "50", "--model-path", "sim-model",
           "--page-size", "16"]
    proc = await asyncio.create_subprocess_exec(*cmd, start_new_session=True)
    w = Worker(proc, port)
    try:
        await wait_workers(server, {w.worker_id})
        rec = server.fleet.get(w.worker_id)
        assert (rec.engine, rec.kv_event_transport) == ("sglang", "nats")
        async with aiohttp.ClientSession() as s:
            await post(s, f"http://127.0.0.1:{server.port}", chat(7, "hello sglang"))
            await wait_for(lambda: server.kv.index.block_count(w.worker_id) >= 18, 10, message="SGLang view filled")
            view = await view_of(s, server, w.worker_id)
        assert view["engine"] == "sglang" and view["transport"] == "nats" and view["decode_errors"] == 0
        w.signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
        assert await stored(nats_server.url, w.worker_id) == 0  # its history purged with it
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()


# -- (e) the broker restarts: relay and subscriber resume, views keep converging ----------------------------

async def fed_view(make_server, spawn_worker, url: str, s: aiohttp.ClientSession, min_blocks: int):
    """A NATS-fed server, a relaying worker, and one group's prefix in the server's view of it:
    (server, worker, base URL, blocks in the view)."""
    server = await make_server(*kv_nats(url), "--admin-token", ADMIN_TOKEN)
    w = await spawn_worker("--num-gpu-blocks", "2048", launcher_args=kv_nats(url))
    await wait_workers(server, {w.worker_id})
    base = f"http://127.0.0.1:{server.port}"
    await wait_for(lambda: server.kv.stats(w.worker_id).get("connected"), 10, message="subscribed")
    await post(s, base, chat(0, "before the broker goes"))
    await wait_for(lambda: server.kv.index.block_count(w.worker_id) >= min_blocks, 10, message="view filled")
    return server, w, base, server.kv.index.block_count(w.worker_id)


async def test_broker_restart_relay_and_server_resume(make_server, spawn_worker, own_nats_server):
    async with aiohttp.ClientSession() as s:
        server, w, base, before = await fed_view(make_server, spawn_worker, own_nats_server.url, s, 18)

        own_nats_server.restart()  # same port, same store: the stream survives, the consumers do not
        async with s.post(w.url + "/v1/chat/completions", json=chat(1, "during the restart")) as r:
            assert r.status == 200  # the engine serves on; its events queue up in the relay
        await wait_for(lambda: server.nats.connected, 10, message="server reconnected")
        await post(s, base, chat(2, "after the restart"))
        # Everything the engine cached is in the view again: both new groups and the first one.
        await wait_for(lambda: server.kv.index.block_count(w.worker_id) >= before + 2 * 18, 15,
                       message="view converged after the broker restart")
        _, reply = await post(s, base, chat(0, "and once more"))
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * 10
        view = await view_of(s, server, w.worker_id)
        assert view["caught_up"] and view["transport"] == "nats"


async def test_broker_that_lost_its_store_gets_the_views_resent(make_server, spawn_worker, own_nats_server):
    """A broker back without its JetStream store: the stream is re-created, its sequence numbers start
    over. The relay resends the engine's buffer after a reset marker; the server starts its views over
    from the new stream -- and they hold what the engine cached before the loss."""
    async with aiohttp.ClientSession() as s:
        server, w, base, before = await fed_view(make_server, spawn_worker, own_nats_server.url, s, 10)
        resets = server.kv.stats(w.worker_id)["resets"]

        own_nats_server.stop()
        shutil.rmtree(os.path.join(own_nats_server.store_dir, "jetstream"), ignore_errors=True)
        own_nats_server.start()
        await wait_for(lambda: server.kv.nats_subscriber.resubscribes == 1, 10, message="server saw a new stream")
        await wait_for(lambda: server.kv.index.block_count(w.worker_id) >= before, 10,
                       message="view rebuilt from the resent buffer")
        assert server.kv.stats(w.worker_id)["resets"] > resets
        _, reply = await post(s, base, chat(0, "after the loss"))
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * 10


# -- the server-side subscriber against crafted relay traffic ----------------------------------------------

class Sink:
    def __init__(self) -> None:
        self.log: list[tuple] = []

    def on_batch(self, key: str, seq: int, payload: bytes) -> None:
        self.log.append(("batch", key, seq, payload))

    def on_reset(self, key: str) -> None:
        self.log.append(("reset", key))

    def of(self, key: str) -> list[tuple]:
        return [e[:1] + e[2:] for e in self.log if e[1] == key]


async def publish(js, worker_id: str, rank, *msgs, epoch: str = "run.1") -> None:
    """``msgs``: an int is a batch with that engine seq (payload b"s<seq>"), "R" a reset marker."""
    subject = kv_event_subject(worker_id, rank)
    for m in msgs:
        if m == "R":
            await js.publish(subject, b"", headers={HDR_EPOCH: epoch, HDR_RESET: "test"})
        else:
            await js.publish(subject, f"s{m}".encode(), headers={HDR_EPOCH: epoch, HDR_SEQ: str(m)})


@pytest.fixture
async def raw(nats_server):
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    await ensure_stream(js)
    conns: list[NatsConnection] = []
    subs: list[NatsKvEventSubscriber] = []

    async def subscriber() -> tuple[NatsKvEventSubscriber, Sink]:
        conn = NatsConnection(nats_server.url)
        await conn.start()
        conns.append(conn)
        sink = Sink()
        sub = NatsKvEventSubscriber(conn, sink.on_batch, sink.on_reset)
        subs.append(sub)
        return sub, sink

    yield js, subscriber
    for sub in subs:
        await sub.stop()
    for conn in conns:
        await conn.close()
    await nc.close()


def wid() -> str:
    return f"127.0.0.1:{free_port()}"  # a fresh worker id: subjects of its own in the shared stream


async def test_history_is_replayed_to_keys_added_before_and_after_it_went_by(raw):
    js, subscriber = raw
    a, b = wid(), wid()
    await publish(js, a, None, "R", 0, 1, 2)
    await publish(js, b, 1, "R", 0, 1)
    sub, sink = await subscriber()
    sub.add(a)  # before start: the shared consumer's replay from the first message brings it
    await sub.start()
    await wait_for(lambda: sub.stats(a)["caught_up"], 10, message="a caught up")
    assert sink.of(a) == [("reset",), ("batch", 0, b"s0"), ("batch", 1, b"s1"), ("batch", 2, b"s2")]
    # b's history went by while nobody had added it: adding it fetches that subject again
    await wait_for(lambda: kv_event_subject(b, 1) in sub._passed, 5, message="b's history passed")
    sub.add(f"{b}#dp1")
    await wait_for(lambda: sub.stats(f"{b}#dp1")["caught_up"], 10, message="b caught up")
    assert sink.of(f"{b}#dp1") == [("reset",), ("batch", 0, b"s0"), ("batch", 1, b"s1")]
    assert sub.stats(f"{b}#dp1")["replays"] == 1
    # live from here, for both, exactly once
    await publish(js, a, None, 3)
    await publish(js, b, 1, 2)
    await wait_for(lambda: len(sink.of(a)) == 5 and len(sink.of(f"{b}#dp1")) == 4, 10, message="live batches")
    assert sink.of(a)[-1] == ("batch", 3, b"s3") and sink.of(f"{b}#dp1")[-1] == ("batch", 2, b"s2")
    assert not sub.replaying(a) and sub.stats(a)["gaps"] == 0
    # removed and added again: a fresh view, rebuilt from the whole history
    sub.remove(a)
    sub.add(a)
    await wait_for(lambda: sub.stats(a)["caught_up"] and sub.stats(a)["batches"] == 4, 10, message="re-added")
    assert sink.of(a)[5:] == [("reset",), ("batch", 0, b"s0"), ("batch", 1, b"s1"), ("batch", 2, b"s2"),
                              ("batch", 3, b"s3")]


async def test_sequence_rules_on_the_wire(raw):
    js, subscriber = raw
    w = wid()
    sub, sink = await subscriber()
    await sub.start()
    sub.add(w)
    await wait_for(lambda: sub.stats(w)["connected"] and sub.stats(w)["caught_up"], 10, message="subscribed")
    await publish(js, w, None, "R", 0, 1, 3, 1, "R", 0)
    await publish(js, w, None, 1, epoch="run.2")  # a new epoch without its marker: continuity broken
    await wait_for(lambda: sub.stats(w)["batches"] == 6, 10, message="all batches")
    assert [e[:2] for e in sink.of(w)] == [("reset",), ("batch", 0), ("batch", 1), ("reset",), ("batch", 3),
                                           ("reset",), ("batch", 1), ("reset",), ("batch", 0), ("reset",),
                                           ("batch", 1)]
    st = sub.stats(w)
    assert (st["gaps"], st["restarts"], st["markers"], st["resets"]) == (1, 2, 2, 5)


async def test_stopping_relay_purges_its_subjects(make_server, spawn_worker, nats_server):
    w = await spawn_worker(launcher_args=kv_nats(nats_server.url))
    await wait_for(lambda: _more_than(nats_server.url, w.worker_id, 0), 20, message="relay started")
    w.signal(signal.SIGTERM)
    assert await asyncio.wait_for(w.proc.wait(), 15) == 0
    assert await stored(nats_server.url, w.worker_id) == 0
