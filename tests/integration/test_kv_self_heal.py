"""Self-healing KV views end to end (issue 30 item 5): real sim engines (``python -m
infera.engine.sim``) registered in a real etcd, their KV events over ZMQ with replay, in-process
servers. An engine that restarts has its blocks dropped at once; a server that restarts warms up
from the engines' replay buffers before it says ``caught_up``, picks by load until then, and then
predicts exactly the hits the engines report on blocks stored before its restart."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys

import aiohttp
import pytest

from infera.api.requests import parse_request
from infera.router.policy import RoutedRequest
from tests.conftest import free_port, wait_for
from tests.integration.conftest import wait_workers

pytestmark = pytest.mark.integration

ADMIN_TOKEN = "kv-self-heal-test-admin"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()
BS = 16  # the simulator's default block size


def system_prompt(group: int, n_words: int = 300) -> str:
    return " ".join(f"{WORDS[(group * 5 + i) % len(WORDS)]}{(group * 37 + i) % 89}" for i in range(n_words))


def chat(group: int, question: str) -> dict:
    return {"model": "sim-model", "max_tokens": 4, "ignore_eos": True,
            "messages": [{"role": "system", "content": system_prompt(group)}, {"role": "user", "content": question}]}


async def post(s: aiohttp.ClientSession, base: str, body: dict) -> dict:
    async with s.post(base + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def cache_view(s: aiohttp.ClientSession, base: str, worker_id: str) -> dict:
    async with s.get(f"{base}/v1/admin/cache-view/{worker_id}", headers=ADMIN) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def metrics(s: aiohttp.ClientSession, base: str) -> str:
    async with s.get(base + "/metrics", headers=ADMIN) as r:
        assert r.status == 200
        return await r.text()


class Sim:
    """A sim worker on a port the test chooses, so that a restart keeps its worker id."""

    def __init__(self, proc: asyncio.subprocess.Process, port: int) -> None:
        self.proc = proc
        self.port = port
        self.worker_id = f"127.0.0.1:{port}"
        self.url = f"http://127.0.0.1:{port}"

    def signal_group(self, sig: int) -> None:  # the launcher (its engine runs in a session of its own)
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def engines(self) -> list[int]:
        with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
            engines = [int(p) for p in f.read().split()]
        assert engines, "the launcher has no engine process"
        return engines

    def signal_engine(self, sig: int, engines: list[int] | None = None) -> None:
        """The engine process alone (the launcher keeps the registration alive meanwhile)."""
        for pid in engines or self.engines():
            try:
                os.killpg(pid, sig)  # (the engine leads its own session)
            except ProcessLookupError:
                pass


@pytest.fixture
async def sims(etcd, prefix):
    started: list[Sim] = []

    async def spawn(port: int, *engine_args: str, lease_ttl: float = 30.0) -> Sim:
        # A long lease: a killed or stopped worker stays registered, so that its restart is an
        # update of its record (as when an engine restarts under a live pod), not a leave and a join.
        cmd = [sys.executable, "-m", "infera.engine.sim", "--etcd-endpoint", etcd.endpoint, "--etcd-prefix", prefix,
               "--lease-ttl", str(lease_ttl), "--drain-settle", "0.3", "--model", "sim-model", "--port", str(port),
               "--host", "127.0.0.1", "--speedup", "50", "--num-gpu-blocks", "2048", *engine_args]
        sim = Sim(await asyncio.create_subprocess_exec(*cmd, start_new_session=True), port)
        started.append(sim)
        return sim

    async def kill(sim: Sim) -> None:
        # The launcher first: seeing its engine die, it would deregister the worker.
        engines = sim.engines()
        sim.signal_group(signal.SIGKILL)
        await sim.proc.wait()
        sim.signal_engine(signal.SIGKILL, engines)

    spawn.kill = kill
    yield spawn
    for sim in started:
        if sim.proc.returncode is None:
            try:
                engines = sim.engines()
            except (OSError, AssertionError):
                engines = []
            sim.signal_group(signal.SIGKILL)
            await sim.proc.wait()
            if engines:
                sim.signal_engine(signal.SIGKILL, engines)


async def healthy(url: str) -> bool:
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/health", timeout=aiohttp.ClientTimeout(total=1)) as r:
                return r.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return False


async def serving(sim: Sim) -> bool:
    if sim.proc.returncode is not None:  # (a port taken meanwhile by another process, typically)
        raise AssertionError(f"the sim on :{sim.port} exited with {sim.proc.returncode}")
    return await healthy(sim.url)


def caught_up(server, worker_id: str) -> bool:
    return worker_id in server.kv.targets and worker_id not in server.kv.warming


# -- an engine restart -----------------------------------------------------------------------------------------

async def test_a_relaunched_engine_has_its_blocks_dropped_when_it_registers_again(make_server, sims):
    """The launcher binds fresh event ports per start: the new registration names another stream."""
    server = await make_server("--admin-token", ADMIN_TOKEN)
    base = f"http://127.0.0.1:{server.port}"
    port = free_port()
    old = await sims(port)
    await wait_workers(server, {old.worker_id})
    wid = old.worker_id
    await wait_for(lambda: caught_up(server, wid), 10, message="subscribed and caught up")
    async with aiohttp.ClientSession() as s:
        await post(s, base, chat(1, "first question"))
        await wait_for(lambda: server.kv.index.block_count(wid) > 10, 10, message="view filled")
        old_stream = server.fleet.get(wid).kv_events_endpoint
        await sims.kill(old)  # its record stays (lease): the router still credits its blocks
        assert server.kv.index.block_count(wid) > 10
        new = await sims(port)
        await wait_for(lambda: server.fleet.get(wid).kv_events_endpoint != old_stream, 30,
                       message="the new engine's registration")
        # dropped in the same step as the record changed: nothing of the old engine is credited
        assert server.kv.index.block_count(wid) == 0
        view = await cache_view(s, base, wid)
        assert view["engine_restarts"] == 1 and view["degraded"] is False
        assert 'infera_kv_engine_restarts_total{worker_id="%s"} 1.0' % wid in await metrics(s, base)
        # The same prompt again: the new engine has nothing cached and the router predicted nothing.
        await wait_for(lambda: serving(new), 30, message="the new engine serves")
        await wait_for(lambda: caught_up(server, wid), 10, message="the new stream caught up")
        reply = await post(s, base, chat(1, "first question"))
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        view = await cache_view(s, base, wid)
        assert view["prediction"]["over"] == 0 and view["prediction"]["exact"] == view["prediction"]["observations"]


async def test_an_engine_restarted_on_the_same_ports_is_found_before_it_publishes(make_server, sims):
    """A user-given --kv-events-config keeps the ports: the record does not change. The SUB's reconnect
    asks the replay socket, whose history now ends before the router's last batch: a new engine."""
    for attempt in range(3):  # free ports are not reserved: another process may take one first
        pub, replay, port = free_port(), free_port(), free_port()
        cfg = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
                          "replay_endpoint": f"tcp://*:{replay}", "topic": "kv-events"})
        old = await sims(port, "--kv-events-config", cfg)
        try:
            await wait_for(lambda: serving(old), 30, message="the engine serves")
            break
        except AssertionError:
            if attempt == 2:
                raise
    wid = old.worker_id
    async with aiohttp.ClientSession() as s:
        await post(s, old.url, chat(2, "stored before the router subscribed"))
    server = await make_server("--admin-token", ADMIN_TOKEN)
    await wait_workers(server, {wid})
    await wait_for(lambda: caught_up(server, wid), 10, message="caught up")
    stats = server.kv.subscriber.stats(wid)
    assert stats["replay_answers"] >= 1 and server.kv.index.block_count(wid) > 10  # warmed up from replay
    record = server.fleet.get(wid)
    await sims.kill(old)
    await sims(port, "--kv-events-config", cfg)
    # nothing is sent to the new engine: the restart is found on the reconnect alone
    await wait_for(lambda: server.kv.subscriber.stats(wid)["restarts"] == 1, 30, message="restart found")
    assert server.kv.index.block_count(wid) == 0
    assert server.fleet.get(wid) == record  # the record never changed: the stream told
    assert server.kv.subscriber.stats(wid)["reset_reasons"] == {"restart": 1}
    assert server.kv.cache_view(wid, None)["engine_restarts"] == 1


# -- a server restart ----------------------------------------------------------------------------------------

async def test_a_restarted_server_warms_up_from_replay_and_predicts_the_hits_of_blocks_stored_before(
        make_server, sims, caplog):
    a, b = await sims(free_port()), await sims(free_port())
    ids = {a.worker_id, b.worker_id}
    first = await make_server("--admin-token", ADMIN_TOKEN)
    await wait_workers(first, ids)
    await wait_for(lambda: all(caught_up(first, w) for w in ids), 10, message="first server caught up")
    base = f"http://127.0.0.1:{first.port}"
    groups = range(4)
    async with aiohttp.ClientSession() as s:
        for g in groups:  # cold first turns: spread over both engines
            await post(s, base, chat(g, "first question"))
        await wait_for(lambda: all(first.kv.index.block_count(w) > 10 for w in ids), 10,
                       message="both engines hold prompts")
    held = {w: first.kv.index.block_count(w) for w in ids}
    await first.stop()

    # Engine a cannot answer for now (stopped): the new server's view of it cannot catch up yet.
    a.signal_engine(signal.SIGSTOP)
    caplog.set_level(logging.INFO, logger="infera.server.kv")
    try:
        server = await make_server("--admin-token", ADMIN_TOKEN)
        logged = len(caplog.records)  # (the first server's lines before)
        at_caught_up: dict[str, int] = {}
        notify = server.kv.subscriber.on_caught_up

        def seen(key: str) -> None:  # what the view holds when it says it caught up
            at_caught_up[key] = server.kv.index.block_count(key)
            notify(key)

        server.kv.subscriber.on_caught_up = seen
        await wait_workers(server, ids)
        await wait_for(lambda: caught_up(server, b.worker_id), 10, message="b caught up")
        assert a.worker_id in server.kv.warming
        base = f"http://127.0.0.1:{server.port}"
        async with aiohttp.ClientSession() as s:
            assert (await cache_view(s, base, a.worker_id))["caught_up"] is False
            assert 'infera_kv_view_caught_up{worker_id="%s"} 0.0' % a.worker_id in await metrics(s, base)
        # Until then every pick is by load: b's view is whole, but no target is credited.
        for g in groups:
            req = routed(chat(g, "second question"))
            await server.policy.prepare(req)
            server.policy.pick(server.fleet.active("sim-model"), req)
            assert req.state["kv_load_only"] is True and req.state["predicted_hit_blocks"] == 0
    finally:
        a.signal_engine(signal.SIGCONT)

    await wait_for(lambda: caught_up(server, a.worker_id), 15, message="a caught up")
    # It said so only once its history was in: every block the old server saw, from replay.
    assert at_caught_up[a.worker_id] >= held[a.worker_id] > 10
    assert server.kv.subscriber.stats(a.worker_id)["replay_answers"] >= 1
    lines = [r.getMessage() for r in caplog.records[logged:] if "KV views caught up" in r.getMessage()]
    assert len(lines) == 1 and "2 target(s)" in lines[0], lines
    async with aiohttp.ClientSession() as s:
        assert 'infera_kv_view_caught_up{worker_id="%s"} 1.0' % a.worker_id in await metrics(s, base)
        for g in groups:  # follow-ups land on the prefix, exactly as predicted from the replayed views
            reply = await post(s, base, chat(g, "second question"))
            assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= 10 * BS
        views = [await cache_view(s, base, w) for w in sorted(ids)]
    assert sum(v["prediction"]["observations"] for v in views) == len(groups)
    assert sum(v["prediction"]["exact"] for v in views) == len(groups)
    assert all(v["caught_up"] and not v["degraded"] for v in views)


def routed(body: dict) -> RoutedRequest:
    raw = json.dumps(body).encode()
    return RoutedRequest(route="/v1/chat/completions", body=raw, parsed=parse_request("/v1/chat/completions", raw),
                         model="sim-model", stream=False, request_id="probe")


async def test_a_server_following_jetstream_says_caught_up_only_once_the_history_is_in(
        make_server, spawn_worker, nats_server):
    from tests.integration.test_kv_events_nats import _more_than, kv_nats, stored

    import nats.js.errors

    async def relayed() -> int:
        try:
            return await stored(nats_server.url, w.worker_id)
        except nats.js.errors.NotFoundError:  # the relay has not created the stream yet
            return 0

    w = await spawn_worker("--num-gpu-blocks", "2048", launcher_args=kv_nats(nats_server.url))
    await wait_for(relayed, 20, message="the relay's start marker")
    await wait_for(lambda: healthy(w.url), 20, message="worker up")  # (spawn_worker's: no Sim)
    async with aiohttp.ClientSession() as s:
        for g in range(3):  # straight to the engine: the server that follows is started after
            await post(s, w.url, chat(g, "before this server"))
    await wait_for(lambda: _more_than(nats_server.url, w.worker_id, 3), 10, message="batches in the stream")

    server = await make_server("--kv-event-transport", "nats", "--nats-server", nats_server.url,
                               "--admin-token", ADMIN_TOKEN)
    at_caught_up: dict[str, int] = {}
    notify = server.kv.nats_subscriber.on_caught_up

    def seen(key: str) -> None:
        at_caught_up[key] = server.kv.index.block_count(key)
        notify(key)

    server.kv.nats_subscriber.on_caught_up = seen
    await wait_workers(server, {w.worker_id})
    await wait_for(lambda: caught_up(server, w.worker_id), 15, message="caught up from the stream")
    assert at_caught_up[w.worker_id] >= 3 * 18  # every prompt's blocks, from the history
    base = f"http://127.0.0.1:{server.port}"
    async with aiohttp.ClientSession() as s:
        reply = await post(s, base, chat(1, "after"))
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= 10 * BS
        view = await cache_view(s, base, w.worker_id)
    assert view["transport"] == "nats" and view["caught_up"] and not view["degraded"]
    assert view["prediction"]["observations"] == view["prediction"]["exact"] == 1
