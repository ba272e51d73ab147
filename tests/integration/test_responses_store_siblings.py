"""The Responses store among the processes of a ``--workers N`` server without NATS: two stores over
real local replica-sync channels (Unix sockets in a private runtime folder) share each stored
response and each delete; an entry over the shared size stays with the process that stored it."""

from __future__ import annotations

import shutil
from collections.abc import Awaitable

import pytest

import infera.server.responses_store as store_mod
from infera.server.responses_store import ResponsesStore, SiblingResponsesStore
from infera.server.supervisor import make_runtime_dir
from infera.transport.replica_sync_local import LocalReplicaSync
from tests.conftest import wait_for
from tests.integration.test_server_workers import pinned_sessions, start_server  # noqa: F401 (a fixture)

pytestmark = pytest.mark.integration


@pytest.fixture
async def stores():
    runtime_dir = make_runtime_dir()
    syncs = [LocalReplicaSync(runtime_dir, i, 2, replica_id=f"p{i}") for i in range(2)]
    for sync in syncs:
        await sync.start()
    await wait_for(lambda: all(s.stats()["siblings_connected"] == 1 for s in syncs), 10, message="siblings connected")
    yield [SiblingResponsesStore(ResponsesStore(max_bytes=1 << 20, ttl_s=60), sync) for sync in syncs]
    for sync in syncs:
        await sync.stop()
    shutil.rmtree(runtime_dir, ignore_errors=True)


async def _has(store: SiblingResponsesStore, response_id: str) -> bool:
    return await store.get(response_id) is not None


async def test_puts_and_deletes_reach_the_sibling(stores, monkeypatch):
    one, two = stores
    assert await one.put("resp_1", b'{"input":[],"response":{}}')
    await wait_for(lambda: _has(two, "resp_1"), 10, message="the sibling has it")
    assert await two.get("resp_1") == b'{"input":[],"response":{}}'
    assert await two.delete("resp_1")
    await wait_for(lambda: _gone(one, "resp_1"), 10, message="the delete reached the first")
    monkeypatch.setattr(store_mod, "MAX_SHARED_VALUE_BYTES", 10)
    assert await one.put("resp_big", b"x" * 100)  # kept here, not sent
    assert await one.put("resp_after", b"y")  # sent after it: once it is there, the big one would have been too
    await wait_for(lambda: _has(two, "resp_after"), 10, message="the small one arrived")
    assert await two.get("resp_big") is None and await one.get("resp_big") == b"x" * 100


async def _gone(store: SiblingResponsesStore, response_id: str) -> bool:
    return await store.get(response_id) is None


async def test_a_workers_2_server_serves_a_conversation_from_either_process(start_server, spawn_worker):
    """``python -m infera.server --workers 2`` (kv-aware, no NATS): a response stored through one
    process is read and continued through the other, and a delete through the other reaches the first."""
    await spawn_worker("--no-enable-kv-events")
    server = await start_server(active=1)
    pinned = await pinned_sessions(server, 2)
    url = server.base + "/v1/responses"
    ask = {"model": "sim-model", "input": "Turn one", "max_output_tokens": 3, "ignore_eos": True}
    try:
        async with pinned[0].post(url, json=ask) as r:
            assert r.status == 200, await r.text()
            first = await r.json()

        async def status_on(index: int) -> int:
            async with pinned[index].get(f"{url}/{first['id']}") as r:
                return r.status

        await wait_for(lambda: _is(status_on(1), 200), 10, message="the sibling process has it")
        follow = {**ask, "input": "Turn two", "previous_response_id": first["id"]}
        async with pinned[1].post(url, json=follow) as r:
            assert r.status == 200, await r.text()
            second = await r.json()
        assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"]
        async with pinned[1].delete(f"{url}/{first['id']}") as r:
            assert r.status == 200 and (await r.json())["deleted"] is True
        await wait_for(lambda: _is(status_on(0), 404), 10, message="the delete reached the first process")
    finally:
        for s in pinned.values():
            await s.close()


async def _is(status: Awaitable[int], expected: int) -> bool:
    return await status == expected
