"""The Responses store among the processes of a ``--workers N`` server without NATS: two stores over
real local replica-sync channels (Unix sockets in a private runtime folder) share each stored
response and each delete; an entry over the shared size stays with the process that stored it."""

from __future__ import annotations

import shutil

import pytest

import infera.server.responses_store as store_mod
from infera.server.responses_store import ResponsesStore, SiblingResponsesStore
from infera.server.supervisor import make_runtime_dir
from infera.transport.replica_sync_local import LocalReplicaSync
from tests.conftest import wait_for

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
