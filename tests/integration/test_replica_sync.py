"""Two kv-aware server replicas over the same sim workers, sharing over a real nats-server what only
each of them knows: its requests in flight and the requests it just served."""
from __future__ import annotations

import asyncio

import aiohttp

from tests.conftest import wait_for
from tests.integration.conftest import wait_workers
from tests.integration.test_kv_routing import chat, post

QUIET = ("--no-enable-kv-events",)  # no KV events ever: only the replicas themselves know


def sync_flags(url: str) -> tuple[str, ...]:
    return ("--replica-sync", "nats", "--nats-server", url)


async def replicas_over(make_server, spawn_worker, url: str, n_workers: int = 2, speedup: float = 50.0):
    a = await make_server(*sync_flags(url))
    b = await make_server(*sync_flags(url))
    workers = [await spawn_worker("--num-gpu-blocks", "2048", speedup=speedup, launcher_args=QUIET)
               for _ in range(n_workers)]
    ids = {w.worker_id for w in workers}
    await wait_workers(a, ids)
    await wait_workers(b, ids)
    await wait_for(lambda: a.replica_sync.subscribed and b.replica_sync.subscribed, 10, message="syncs subscribed")
    return a, b, workers


async def test_follow_up_on_the_other_replica_lands_where_the_first_turn_ran(make_server, spawn_worker, nats_server):
    """Turn 1 through replica A, turn 2 through replica B right after, no KV event ever: B sends it
    to the worker A picked, which holds its prefix (the reply's cached tokens prove it)."""
    a, b, _ = await replicas_over(make_server, spawn_worker, nats_server.url)
    base_a, base_b = f"http://127.0.0.1:{a.port}", f"http://127.0.0.1:{b.port}"
    async with aiohttp.ClientSession() as s:
        # B routed a request of its own before: its cold-pick rotation is out of step with A's, so
        # only what A tells it can send a follow-up to the right worker
        await post(s, base_b, chat(99, "unrelated"))
        await wait_for(lambda: a.policy.replicas.remote_finished >= 1, 5, message="B's finish heard by A")
        for g in range(4):  # A's cold first turns rotate over the two workers
            await post(s, base_a, chat(g, "first question"))
            await wait_for(lambda: b.policy.replicas.remote_finished >= g + 1, 5, interval=0.002,
                           message="A's finish heard by B")
            _, reply = await post(s, base_b, chat(g, "second question"))
            assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * 10, (g, reply["usage"])
    landed_on = {k for k, v in b.policy.landed.items() if v}
    assert len(landed_on) == 2  # the groups did spread over both workers (so B had to know which)
    assert not any(b.policy.active.values())
    # A counted B's follow-ups while they ran; their finishes release them there too
    await wait_for(lambda: not any(a.policy.active.values()), 5, message="nothing in flight on A")
    assert a.replica_sync.stats()["messages_received"] > 0 and b.replica_sync.stats()["deltas_dropped"] == 0


async def test_in_flight_requests_are_shared_and_released(make_server, spawn_worker, nats_server):
    a, b, workers = await replicas_over(make_server, spawn_worker, nats_server.url, speedup=1.0)
    base_a = f"http://127.0.0.1:{a.port}"
    body = chat(7, "tell me a long story", max_tokens=1000, stream=True)
    async with aiohttp.ClientSession() as s:
        async with s.post(base_a + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            await r.content.readany()  # streaming: in flight on one worker
            busy = next(k for k, v in a.policy.active.items() if v)
            await wait_for(lambda: b.policy.active_blocks(busy) == a.policy.active_blocks(busy) > 0, 5,
                           message="A's request in flight counted by B")
            # B's own cold request goes to the idle worker: the busy one carries A's load
            _, reply = await post(s, f"http://127.0.0.1:{b.port}", chat(8, "short"))
            assert b.policy.landed.keys() - {busy}
        # the client went away: A releases the request, and so does B
        await wait_for(lambda: b.policy.active_blocks(busy) == 0, 10, message="released on B")
        metrics = await (await s.get(f"http://127.0.0.1:{b.port}/metrics")).text()
    assert b.policy.replicas.remote_blocks == 0 and b.policy.replicas.remote_expired == 0
    assert "infera_replica_sync_peers 1.0" in metrics and "infera_replica_sync_messages_received_total" in metrics


async def test_a_stopped_replica_is_dropped_at_once(make_server, spawn_worker, nats_server):
    a, b, _ = await replicas_over(make_server, spawn_worker, nats_server.url, n_workers=1)
    async with aiohttp.ClientSession() as s:
        await post(s, f"http://127.0.0.1:{a.port}", chat(3, "hello"))
    await wait_for(lambda: a.replica_sync.replica_id in b.policy.replicas.peers, 5, message="B knows A")
    await a.replica_sync.stop()  # says goodbye
    await wait_for(lambda: a.replica_sync.replica_id not in b.policy.replicas.peers, 5, message="B dropped A")


async def test_broker_outage_leaves_routing_up_and_the_state_converges_after(make_server, spawn_worker,
                                                                             own_nats_server):
    """While NATS is down both replicas route on what they know; a request started during the
    outage is learned by the other replica once the broker is back."""
    a, b, _ = await replicas_over(make_server, spawn_worker, own_nats_server.url, speedup=1.0)
    base_a, base_b = f"http://127.0.0.1:{a.port}", f"http://127.0.0.1:{b.port}"
    own_nats_server.stop()
    await wait_for(lambda: not a.nats.connected and not b.nats.connected, 10, message="NATS down")
    async with aiohttp.ClientSession() as s:
        for base in (base_a, base_b):  # routing does not need the sync
            await post(s, base, chat(1, "during the outage"))
        body = chat(9, "a long one", max_tokens=1000, stream=True)
        async with s.post(base_a + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            await r.content.readany()
            busy = next(k for k, v in a.policy.active.items() if v)
            await asyncio.sleep(0)  # its start is dropped, not queued
            assert b.policy.active_blocks(busy) == 0
            own_nats_server.start()
            await wait_for(lambda: b.policy.active_blocks(busy) == a.policy.active_blocks(busy) > 0, 20,
                           message="B learns A's request after the reconnect")
        await wait_for(lambda: b.policy.active_blocks(busy) == 0, 10, message="released on B")
    assert a.replica_sync.deltas_dropped > 0


async def test_sync_off_shares_nothing(make_server, spawn_worker, nats_server):
    a = await make_server("--replica-sync", "off", "--nats-server", nats_server.url)
    assert a.replica_sync is None and a.policy.replicas is None
    default = await make_server()  # no NATS plane asked for: no sync
    assert default.replica_sync is None and default.args.replica_sync == "off"
