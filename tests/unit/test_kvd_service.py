"""kvd service (in process): tiers working together — write-through, promotion, prefetch, metrics."""
from __future__ import annotations

import asyncio

import pytest

from infera.kvd import protocol as p
from infera.kvd.service import PREFETCH_QUEUE, Connection, KvdService
from infera.kvd.store import HostStore, Namespaced
from infera.kvd.tablespace import Tablespace
from tests.conftest import wait_for

K = [bytes([i]) * 8 for i in range(8)]


@pytest.fixture
async def service(tmp_path):
    long_region = Tablespace(str(tmp_path), 1 << 20, container_bytes=1 << 20, slot_bytes=4096).open()
    svc = KvdService(HostStore(64 * 1024), long_region=long_region)
    yield svc
    await svc.close()


async def call(svc: KvdService, req, conn: Connection | None = None):
    return await svc.handle(req, conn or Connection())


def sample(svc: KvdService, name: str, **labels) -> float:
    return svc.metrics.registry.get_sample_value(name, labels) or 0.0


async def test_long_is_written_through_and_short_is_not(service):
    assert await call(service, p.Set(key=K[0], value=b"L" * 100, retention="long")) == p.SetAck(accepted=True)
    assert await call(service, p.Set(key=K[1], value=b"S" * 100, retention="short")) == p.SetAck(accepted=True)
    assert service.long.contains(Namespaced("", "", K[0])) and not service.long.contains(Namespaced("", "", K[1]))
    assert service.stats().long_bytes == 100


async def test_ram_miss_promotes_from_l3_and_counts_by_tier(service):
    await call(service, p.Set(key=K[0], value=b"v" * 10, retention="long", model="m"))
    service.store.clear()
    r = await call(service, p.Get(key=K[0], model="m"))
    assert r == p.GetResponse(value=b"v" * 10, retention="long")
    assert service.store.contains(Namespaced("m", "", K[0]))  # promoted
    await call(service, p.Get(key=K[0], model="m"))
    await call(service, p.Get(key=K[1], model="m"))
    assert sample(service, "infera_kvd_hits_total", tier="l3") == 1
    assert sample(service, "infera_kvd_hits_total", tier="l2") == 1
    assert sample(service, "infera_kvd_misses_total", tier="l2") == 2
    assert sample(service, "infera_kvd_misses_total", tier="l3") == 1
    assert sample(service, "infera_kvd_load_seconds_count", tier="l3") == 1
    s = service.stats()
    assert (s.gets_total, s.hits_total, s.misses_total, s.l2_hits_total, s.l3_hits_total) == (3, 2, 1, 1, 1)
    assert sample(service, "infera_kvd_bytes", tier="l3") == 10
    assert b'infera_kvd_hits_total{tier="l3"} 1.0' in service.metrics.render()


async def test_evictions_are_counted_by_tier(service):
    for i in range(7):  # 7 x 10 KiB into a 64 KiB store
        await call(service, p.Set(key=K[i], value=bytes([i]) * 10240))
    assert sample(service, "infera_kvd_evictions_total", tier="l2") == 1
    assert service.stats().evictions_total == 1


async def test_prefetch_loads_from_l3_as_short_with_deadline_ttl(service):
    service.start()
    for i in range(3):
        await call(service, p.Set(key=K[i], value=bytes([i]) * 50, retention="long"))
    service.store.clear()
    assert await call(service, p.PrefetchHint(keys=K[:4], deadline_ms=60_000)) is None  # no reply
    await wait_for(lambda: service.prefetch_loaded_total == 3, 10, message="prefetch")
    entry = service.store.lookup(Namespaced("", "", K[0]), touch=False)
    assert entry.retention == "short" and entry.expires_at is not None
    assert service.stats().l3_hits_total == 0  # prefetch is not a GET
    assert sample(service, "infera_kvd_prefetch_keys_total", outcome="absent") == 1


async def test_prefetch_queue_overflow_is_counted_and_dropped(service):
    # the worker is not started: the bounded queue fills up
    for _ in range(PREFETCH_QUEUE):
        await call(service, p.PrefetchHint(keys=K[:1]))
    await call(service, p.PrefetchHint(keys=K[:3]))
    assert service.prefetch_dropped_total == 3
    assert sample(service, "infera_kvd_prefetch_keys_total", outcome="dropped") == 3


async def test_concurrent_long_sets_leave_l3_with_what_ram_kept(service):
    results = await asyncio.gather(*(call(service, p.Set(key=K[0], value=bytes([i]) * 1000, retention="long"))
                                     for i in range(10)))
    assert all(r.accepted for r in results)
    ns = Namespaced("", "", K[0])
    assert service.long.get(ns)[0] == service.store.value_of(service.store.lookup(ns))


async def test_clear_reaches_l3_and_stats_fields(service):
    await call(service, p.Set(key=K[0], value=b"x", retention="long", model="a"))
    await call(service, p.Set(key=K[1], value=b"y", model="b"))
    assert await call(service, p.Clear(model="a")) == p.ClearAck(cleared_entries=1)  # one entry, in RAM and L3
    assert await call(service, p.Exists(keys=[K[0], K[1]], model="b")) == p.ExistsResponse(present=[False, True])


async def test_set_commit_without_lease_is_refused(service):
    r = await call(service, p.SetCommit(lease_token=5, key=K[0], length=1))
    assert r == p.SetCommitResponse(accepted=False, reason="unknown_lease")
    assert await call(service, p.SetCancel(lease_token=5)) == p.SetCancelResponse()


async def test_a_big_prefetch_hint_yields_to_other_clients():
    # no L3: every key is "absent" without an await; the loop must still let others run between keys
    svc = KvdService(HostStore(64 * 1024))
    svc.start()
    try:
        n = 50_000
        keys = [i.to_bytes(8, "big") for i in range(n)]
        assert await call(svc, p.PrefetchHint(keys=keys, deadline_ms=60_000)) is None
        seen = []
        while (done := sample(svc, "infera_kvd_prefetch_keys_total", outcome="absent")) < n:
            seen.append(done)  # what another client sees between its own turns on the loop
            assert (await call(svc, p.Get(key=K[0]))).value is None
            await asyncio.sleep(0)
            assert len(seen) < 10 * n  # (a deadline: never spins forever)
        assert any(0 < x < n for x in seen), "the prefetch loop never yielded mid-hint"
    finally:
        await svc.close()


async def test_an_expired_prefetch_hint_counts_its_rest_at_once(service):
    await call(service, p.PrefetchHint(keys=K, deadline_ms=1))  # queued before the worker runs
    await asyncio.sleep(0.01)
    service.start()
    await wait_for(lambda: sample(service, "infera_kvd_prefetch_keys_total", outcome="expired") == len(K), 10,
                   message="expired")
