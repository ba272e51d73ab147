"""KubernetesDiscovery / KubernetesRegistration through lightkube against the fake API server
(tests/fakes/kube_api.py): list + watch, selectors, drain-before-signal, re-watch, 410 re-list,
"too large resource version" re-list, a restarted API server, bookmarks, outages, the fake's
field selectors, and the annotation a registration writes."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest

from infera.discovery.fleet import Fleet
from infera.discovery.kubernetes import (
    ANNOTATION,
    KubernetesDiscovery,
    KubernetesRegistration,
    KubernetesRegistrationError,
)
from infera.discovery.record import WorkerRecord, decode_record, encode_record
from infera.server.cli import parse_args
from infera.server.main import InferaServer
from tests.conftest import free_port, wait_for
from tests.fakes.kube_api import FakeKubeApi

pytestmark = pytest.mark.integration

NS = "ns"
SELECTOR = "app=w"
T = 5.0  # deadline for every convergence; things happen in milliseconds here


def rec(worker_id: str, **fields) -> WorkerRecord:
    return WorkerRecord(worker_id=worker_id, url=f"http://{worker_id}", model_name=fields.pop("model_name", "m"),
                        **fields)


def ann(worker_id: str, **fields) -> dict[str, str]:
    return {ANNOTATION: encode_record(rec(worker_id, **fields)).decode()}


def ids(fleet: Fleet) -> set[str]:
    return {r.worker_id for r in fleet.all()}


@pytest.fixture
async def api() -> AsyncIterator[FakeKubeApi]:
    server = await FakeKubeApi(namespace=NS).start()
    yield server
    await server.stop()


StartDiscovery = Callable[..., Awaitable[tuple[KubernetesDiscovery, Fleet]]]


@pytest.fixture
async def start_discovery(api: FakeKubeApi) -> AsyncIterator[StartDiscovery]:
    started: list[KubernetesDiscovery] = []

    async def factory(selector: str = SELECTOR, **kw) -> tuple[KubernetesDiscovery, Fleet]:
        kw.setdefault("backoff_initial", 0.02)
        kw.setdefault("backoff_max", 0.1)
        d = KubernetesDiscovery(selector, NS, config=api.kubeconfig(), **kw)
        fleet = Fleet()
        await d.start(fleet)
        started.append(d)
        await asyncio.wait_for(d.ready.wait(), T)
        return d, fleet

    yield factory
    for d in started:
        await d.stop()


@pytest.fixture
async def registrations(api: FakeKubeApi) -> AsyncIterator[list[KubernetesRegistration]]:
    regs: list[KubernetesRegistration] = []
    yield regs
    for r in regs:
        await r.close()


def registration(api: FakeKubeApi, regs: list, pod_name: str, **kw) -> KubernetesRegistration:
    r = KubernetesRegistration(NS, pod_name, config=api.kubeconfig(), **kw)
    regs.append(r)
    return r


async def wait_watching(api: FakeKubeApi, count: int = 1) -> None:
    await wait_for(lambda: api.open_watches >= count, T, message=f"{count} open watch(es)")


# -- list + watch ---------------------------------------------------------------------------------

async def test_list_then_watch_adds_and_honours_selector(api: FakeKubeApi, start_discovery: StartDiscovery) -> None:
    api.add_pod("p1", {"app": "w"}, ann("w1"))
    api.add_pod("other", {"app": "x"}, ann("wx"))  # selector excludes it
    api.add_pod("other-ns", {"app": "w"}, ann("wn"), namespace="elsewhere")
    d, fleet = await start_discovery()
    assert ids(fleet) == {"w1"}

    api.add_pod("p2", {"app": "w", "tier": "a"}, ann("w2"))
    api.add_pod("other2", {"app": "y"}, ann("wy"))
    api.add_pod("pending", {"app": "w"}, ann("w3"), phase="Pending")
    await wait_for(lambda: ids(fleet) == {"w1", "w2"}, T, message="w2 added")

    api.set_phase("pending", "Running")
    await wait_for(lambda: ids(fleet) == {"w1", "w2", "w3"}, T, message="w3 running")
    # The selector went to the server on both requests, and the watch asked for bookmarks.
    assert api.requests["list"] == 1
    assert api.watch_params[0]["labelSelector"] == SELECTOR
    assert api.watch_params[0]["allowWatchBookmarks"] == "true"
    assert d.resource_version == str(api.rv)
    # No field selector: the product filters phase and annotation itself (the fake would answer 400
    # to one it does not implement, so a product relying on one could not pass here silently).
    assert all("fieldSelector" not in q for q in api.list_params + api.watch_params)


async def test_relabel_in_and_out_of_selector(api: FakeKubeApi, start_discovery: StartDiscovery) -> None:
    api.add_pod("p1", {"app": "w"}, ann("w1"))
    api.add_pod("p2", {"app": "x"}, ann("w2"))
    _, fleet = await start_discovery()
    api.set_labels("p1", {"app": "x"})  # out: the watch sees DELETED
    api.set_labels("p2", {"app": "w"})  # in: the watch sees ADDED
    await wait_for(lambda: ids(fleet) == {"w2"}, T, message="selector transitions applied")


async def test_drain_before_signal_then_remove(api: FakeKubeApi, start_discovery: StartDiscovery) -> None:
    api.add_pod("p1", {"app": "w"}, ann("w1"))
    api.add_pod("p2", {"app": "w"}, ann("w2"))
    _, fleet = await start_discovery()
    assert {r.worker_id for r in fleet.active()} == {"w1", "w2"}

    api.begin_graceful_delete("p1")  # the kubelet has not signalled anything yet
    await wait_for(lambda: fleet.get("w1") is not None and fleet.get("w1").status == "draining", T,
                   message="w1 draining")
    assert api.get_pod("p1") is not None  # the Pod still exists...
    assert ids(fleet) == {"w1", "w2"}  # ...so the worker is still listed (GET /v1/workers)
    assert {r.worker_id for r in fleet.active()} == {"w2"}  # but no longer routed to

    api.finish_delete("p1")
    await wait_for(lambda: ids(fleet) == {"w2"}, T, message="w1 removed on DELETED")


async def test_annotation_changes(api: FakeKubeApi, start_discovery: StartDiscovery, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="infera.discovery.kubernetes")
    api.add_pod("p1", {"app": "w"}, ann("w1"))
    _, fleet = await start_discovery()

    api.set_annotation("p1", ANNOTATION, encode_record(rec("w1", model_name="m2")).decode())
    await wait_for(lambda: fleet.get("w1") is not None and fleet.get("w1").model_name == "m2", T,
                   message="record updated")
    api.set_annotation("p1", ANNOTATION, encode_record(rec("w1b")).decode())  # a new worker_id
    await wait_for(lambda: ids(fleet) == {"w1b"}, T, message="old worker_id removed")
    api.set_annotation("p1", ANNOTATION, "{not json")
    await wait_for(lambda: ids(fleet) == set(), T, message="bad annotation → removed")
    api.set_annotation("p1", "unrelated", "1")  # another MODIFIED with the same bad value
    api.set_annotation("p1", ANNOTATION, encode_record(rec("w1")).decode())
    await wait_for(lambda: ids(fleet) == {"w1"}, T, message="good again")
    assert len([r for r in caplog.records if "undecodable" in r.getMessage()]) == 1
    api.set_annotation("p1", ANNOTATION, None)
    await wait_for(lambda: ids(fleet) == set(), T, message="annotation cleared → removed")


# -- re-watch, 410, bookmarks, outages --------------------------------------------------------------

@pytest.mark.parametrize("abrupt", [False, True], ids=["clean-end", "dropped"])
async def test_rewatch_without_losing_events(api: FakeKubeApi, start_discovery: StartDiscovery, abrupt: bool) -> None:
    api.add_pod("p1", {"app": "w"}, ann("w1"))
    d, fleet = await start_discovery()
    await wait_watching(api)
    rv_before = d.resource_version
    watches = api.requests["watch"]
    assert api.close_watches(abrupt=abrupt) == 1
    # All of this lands while no watch is open: only the replayed history can deliver it.
    api.add_pod("p2", {"app": "w"}, ann("w2"))
    api.finish_delete("p1")
    api.begin_graceful_delete("p2")
    await wait_for(lambda: ids(fleet) == {"w2"} and fleet.get("w2").status == "draining", T,
                   message="events replayed after re-watch")
    assert api.requests["watch"] == watches + 1
    assert api.watch_params[-1]["resourceVersion"] == rv_before  # resumed, not restarted
    assert d.relists == 1 and d.expired == 0


async def test_410_relists_and_drops_ghosts(api: FakeKubeApi, start_discovery: StartDiscovery) -> None:
    api.add_pod("p1", {"app": "w"}, ann("w1"))
    api.add_pod("p2", {"app": "w"}, ann("w2"))
    d, fleet = await start_discovery()
    await wait_watching(api)
    api.close_watches(abrupt=True)
    api.finish_delete("p1")  # missed: compacted away before the re-watch
    api.add_pod("p3", {"app": "w"}, ann("w3"))
    api.compact()
    await wait_for(lambda: ids(fleet) == {"w2", "w3"}, T, message="re-list reconciled the fleet")
    assert d.expired == 1 and d.relists == 2
    assert api.requests["list"] == 2
    await wait_watching(api)
    api.add_pod("p4", {"app": "w"}, ann("w4"))  # and the new watch works
    await wait_for(lambda: ids(fleet) == {"w2", "w3", "w4"}, T, message="watch after re-list")


async def test_http_410_on_watch_request_relists(api: FakeKubeApi, start_discovery: StartDiscovery) -> None:
    api.add_pod("p1", {"app": "w"}, ann("w1"))
    d, fleet = await start_discovery()
    await wait_watching(api)
    api.fail_next(410, kind="watch")  # the HTTP status itself, not an ERROR event
    api.close_watches(abrupt=True)
    api.finish_delete("p1")
    await wait_for(lambda: d.relists == 2 and ids(fleet) == set(), T, message="re-list after HTTP 410")
    assert d.expired == 1


def record_sleeps(d: KubernetesDiscovery) -> list[float]:
    """Every backoff wait the discovery asks for, in order (it still sleeps them)."""
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        await asyncio.sleep(seconds)

    d._sleep = sleep
    return waits


async def test_repeated_410_backs_off_and_recovers(api: FakeKubeApi, start_discovery: StartDiscovery) -> None:
    api.add_pod("p1", {"app": "w"}, ann("w1"))
    d, fleet = await start_discovery(backoff_initial=0.02, backoff_max=0.05)
    await wait_watching(api)
    waits = record_sleeps(d)
    log_from = len(api.request_log)
    api.fail_next(410, count=6, kind="watch")
    api.close_watches()  # a clean end: the re-watch meets the 410s (a dropped one would back off first)
    api.add_pod("p2", {"app": "w"}, ann("w2"))
    await wait_for(lambda: ids(fleet) == {"w1", "w2"} and api.open_watches == 1, T, message="recovered")
    assert d.expired == 6 and d.relists == 7 and api.requests["list"] == 7
    # The first 410 re-lists at once; each further one in a row waits twice as long as the one
    # before, up to backoff_max: it grows, and it is bounded.
    assert waits == [0.02, 0.04, 0.05, 0.05, 0.05]
    # And the waits really passed between the re-lists the server saw (a lower bound: never flaky).
    lists = [t for t, kind, _ in api.request_log[log_from:] if kind == "list"]
    gaps = [b - a for a, b in zip(lists, lists[1:])]
    assert len(gaps) == len(waits) == 5
    assert all(gap >= wait - 0.002 for gap, wait in zip(gaps, waits)), (gaps, waits)


@pytest.mark.parametrize("answer", ["event", "http"])
async def test_too_large_resource_version_relists(start_discovery: StartDiscovery, answer: str) -> None:
    """etcd restored from a backup: the server's resourceVersion went back, so the one the
    discovery resumes from is "too large" (a watch ERROR event, or the HTTP 504 itself). The same
    version can never work; a re-list from the latest state can, and the fleet becomes what the
    restored server holds."""
    api = await FakeKubeApi(namespace=NS, too_large_as=answer, too_large_wait_s=0.1).start()
    try:
        d = KubernetesDiscovery(SELECTOR, NS, config=api.kubeconfig(), backoff_initial=0.02, backoff_max=0.1)
        fleet = Fleet()
        await d.start(fleet)
        try:
            await asyncio.wait_for(d.ready.wait(), T)
            api.add_pod("p1", {"app": "w"}, ann("w1"))
            api.add_pod("p2", {"app": "w"}, ann("w2"))
            await wait_for(lambda: ids(fleet) == {"w1", "w2"}, T, message="w1, w2 watched")
            backup = api.snapshot()
            api.finish_delete("p1")
            api.add_pod("p3", {"app": "w"}, ann("w3"))
            for i in range(3):
                api.add_pod(f"x{i}", {"app": "x"})  # the resourceVersion moves further on
            await wait_for(lambda: ids(fleet) == {"w2", "w3"}, T, message="after the backup")
            assert api.bookmark() == 1
            await wait_for(lambda: d.resource_version == str(api.rv), T, message="the latest resourceVersion")
            ahead = d.resource_version

            await api.stop()
            api.restore(backup)  # p1 back, p3 never existed, the resourceVersion went back
            assert int(ahead) > api.rv
            log_from = len(api.request_log)
            await api.start()
            await wait_for(lambda: ids(fleet) == {"w1", "w2"}, T, message="the restored server's Pods")
            assert api.too_large == 1 and d.too_large == 1 and d.expired == 0 and d.relists == 2
            assert "Too large resource version" in (d.last_error or "") and "504" in d.last_error
            # Not retried with the same version: one watch from it, then a list, then a watch from the list's.
            seen = [(kind, q.get("resourceVersion")) for _, kind, q in api.request_log[log_from:]]
            assert seen[:3] == [("watch", ahead), ("list", None), ("watch", str(api.rv))], seen
            await wait_watching(api)
            api.add_pod("p4", {"app": "w"}, ann("w4"))  # and the new watch works
            await wait_for(lambda: ids(fleet) == {"w1", "w2", "w4"}, T, message="watch after the re-list")
        finally:
            await d.stop()
    finally:
        await api.stop()


async def test_restarted_api_server_lost_its_watch_cache(api: FakeKubeApi, start_discovery: StartDiscovery) -> None:
    """A restarted API server rebuilt its watch cache from a list: a watch from an older
    resourceVersion gets 410 Gone. The discovery re-lists and converges: no stale worker stays,
    the new ones are found."""
    api.add_pod("p1", {"app": "w"}, ann("w1"))
    api.add_pod("p2", {"app": "w"}, ann("w2"))
    api.add_pod("p3", {"app": "w"}, ann("w3"))
    d, fleet = await start_discovery()
    await wait_watching(api)
    assert ids(fleet) == {"w1", "w2", "w3"}
    await api.stop()
    await wait_for(lambda: d.last_error is not None, T, message="discovery noticed the outage")
    # While it was down the cluster moved on (other API servers, the kubelets):
    api.finish_delete("p1")  # gone
    api.begin_graceful_delete("p2")
    api.finish_delete("p2")  # gone too, after a drain nobody here saw
    api.set_annotation("p3", ANNOTATION, encode_record(rec("w3b")).decode())  # a new worker in p3
    api.add_pod("p4", {"app": "w"}, ann("w4"))
    api.add_pod("p5", {"app": "w"}, ann("w5"), phase="Pending")
    await api.start(fresh_watch_cache=True)
    await wait_for(lambda: ids(fleet) == {"w3b", "w4"}, T, message="converged after the restart")
    assert d.expired == 1 and d.relists == 2 and d.too_large == 0
    assert "410" in (d.last_error or "")
    await wait_watching(api)
    api.set_phase("p5", "Running")
    await wait_for(lambda: ids(fleet) == {"w3b", "w4", "w5"}, T, message="watching after the re-list")


async def test_bookmark_advances_resource_version(api: FakeKubeApi, start_discovery: StartDiscovery) -> None:
    api.add_pod("p1", {"app": "w"}, ann("w1"))
    d, fleet = await start_discovery()
    await wait_watching(api)
    for i in range(3):  # changes the selector hides: the global resourceVersion moves on
        api.add_pod(f"x{i}", {"app": "x"})
    assert d.resource_version != str(api.rv)
    assert api.bookmark() == 1
    await wait_for(lambda: d.resource_version == str(api.rv), T, message="bookmark applied")
    assert d.bookmarks == 1
    # History compacted up to the bookmark: resuming from it is still valid, so no 410 / re-list.
    api.compact()
    api.close_watches(abrupt=True)
    api.add_pod("p2", {"app": "w"}, ann("w2"))
    await wait_for(lambda: ids(fleet) == {"w1", "w2"}, T, message="watch resumed from the bookmark")
    assert d.expired == 0 and d.relists == 1


async def test_periodic_bookmarks() -> None:
    api = await FakeKubeApi(namespace=NS, bookmark_interval=0.05).start()
    d = KubernetesDiscovery(SELECTOR, NS, config=api.kubeconfig())
    try:
        await d.start(Fleet())
        await wait_for(lambda: d.bookmarks >= 2, T, message="periodic bookmarks")
    finally:
        await d.stop()
        await api.stop()


async def test_server_side_watch_timeout_rewatches(api: FakeKubeApi, start_discovery: StartDiscovery) -> None:
    api.add_pod("p1", {"app": "w"}, ann("w1"))
    d, fleet = await start_discovery(watch_timeout_s=1)
    await wait_for(lambda: api.requests.get("watch", 0) >= 2, T, message="server ended the watch; re-opened")
    assert api.watch_params[0]["timeoutSeconds"] == "1"
    api.add_pod("p2", {"app": "w"}, ann("w2"))
    await wait_for(lambda: ids(fleet) == {"w1", "w2"}, T, message="still watching")
    assert d.relists == 1


async def test_silent_watch_is_reopened(api: FakeKubeApi, start_discovery: StartDiscovery) -> None:
    # No bookmarks and no events for idle_timeout_s looks like a half-open connection: re-open it.
    api.add_pod("p1", {"app": "w"}, ann("w1"))
    d, fleet = await start_discovery(idle_timeout_s=0.2)
    await wait_for(lambda: api.requests.get("watch", 0) >= 2, T, message="idle watch re-opened")
    assert api.watch_params[1]["resourceVersion"] == api.watch_params[0]["resourceVersion"]
    api.add_pod("p2", {"app": "w"}, ann("w2"))
    await wait_for(lambda: ids(fleet) == {"w1", "w2"}, T, message="still watching")
    assert d.relists == 1 and d.last_error is None


async def test_outage_keeps_fleet_then_converges(api: FakeKubeApi, start_discovery: StartDiscovery) -> None:
    api.add_pod("p1", {"app": "w"}, ann("w1"))
    d, fleet = await start_discovery()
    await wait_watching(api)
    await api.stop()
    await wait_for(lambda: d.last_error is not None, T, message="discovery noticed the outage")
    errors_seen = d.last_error
    assert ids(fleet) == {"w1"}  # the last known fleet is kept while the API is down
    api.finish_delete("p1")
    api.add_pod("p2", {"app": "w"}, ann("w2"))
    await api.start()  # same port, same state
    await wait_for(lambda: ids(fleet) == {"w2"}, T, message="converged after the outage")
    assert errors_seen


async def test_list_failure_is_retried(api: FakeKubeApi, start_discovery: StartDiscovery) -> None:
    api.add_pod("p1", {"app": "w"}, ann("w1"))
    api.fail_next(503, count=2, kind="list")
    d, fleet = await start_discovery()
    assert ids(fleet) == {"w1"} and api.requests["list"] == 3
    assert "503" in (d.last_error or "")


# -- registration ---------------------------------------------------------------------------------

async def test_registration_is_discovered_and_deregistered(api: FakeKubeApi, start_discovery: StartDiscovery,
                                                           registrations: list) -> None:
    api.add_pod("worker-0", {"app": "w"}, ip="10.0.0.5")
    _, fleet = await start_discovery()
    reg = registration(api, registrations, "worker-0", refresh_s=60)
    await reg.register(rec("10.0.0.5:8000"))
    assert decode_record(api.annotations("worker-0")[ANNOTATION]).worker_id == "10.0.0.5:8000"
    await wait_for(lambda: ids(fleet) == {"10.0.0.5:8000"}, T, message="registered worker discovered")

    assert await reg.update(rec("10.0.0.5:8000", model_name="m2")) is True
    await wait_for(lambda: fleet.get("10.0.0.5:8000").model_name == "m2", T, message="update seen")

    await reg.deregister()
    assert ANNOTATION not in api.annotations("worker-0")
    await wait_for(lambda: ids(fleet) == set(), T, message="deregistered worker removed")


async def test_refresh_reasserts_a_lost_annotation(api: FakeKubeApi, start_discovery: StartDiscovery,
                                                   registrations: list) -> None:
    api.add_pod("worker-0", {"app": "w"})
    _, fleet = await start_discovery()
    reg = registration(api, registrations, "worker-0", refresh_s=0.05)
    await reg.register(rec("w0"))
    await wait_for(lambda: ids(fleet) == {"w0"}, T, message="registered")
    rv = api.rv
    await wait_for(lambda: reg.refreshes >= 2, T, message="refreshes ran")
    assert api.rv == rv  # re-asserting an unchanged annotation writes nothing (no-op merge patch)
    api.set_annotation("worker-0", ANNOTATION, None)  # someone removed it
    await wait_for(lambda: ANNOTATION in api.annotations("worker-0"), T, message="annotation re-asserted")
    await wait_for(lambda: ids(fleet) == {"w0"}, T, message="worker back in the fleet")
    refresh = reg._refresh_task
    await reg.deregister()
    # The refresh loop has ended (deregister waited for it, and for any patch it had in flight,
    # before its own): nothing is left that could re-add the annotation.
    assert refresh is not None and refresh.done() and reg._refresh_task is None
    assert api.patches[-1] == ("worker-0", {"metadata": {"annotations": {ANNOTATION: None}}})
    assert ANNOTATION not in api.annotations("worker-0")


async def test_register_retries_server_errors(api: FakeKubeApi, registrations: list) -> None:
    api.add_pod("worker-0", {"app": "w"})
    api.fail_next(503, count=2, kind="patch")
    reg = registration(api, registrations, "worker-0")
    await reg.register(rec("w0"))
    assert api.requests["patch"] == 3 and ANNOTATION in api.annotations("worker-0")


async def test_register_fails_fast_on_missing_pod(api: FakeKubeApi, registrations: list) -> None:
    reg = registration(api, registrations, "no-such-pod", first_timeout=10)
    start = time.monotonic()
    with pytest.raises(KubernetesRegistrationError, match="no-such-pod.*404"):
        await reg.register(rec("w0"))
    assert time.monotonic() - start < 2 and api.requests["patch"] == 1  # not retried


async def test_register_gives_up_when_unreachable(registrations: list) -> None:
    dead = FakeKubeApi(namespace=NS)
    dead.port = free_port()  # nothing listens there
    reg = KubernetesRegistration(NS, "worker-0", config=dead.kubeconfig(), first_timeout=0.5)
    registrations.append(reg)
    start = time.monotonic()
    with pytest.raises(KubernetesRegistrationError, match=r"within 0.5s \(last error: ConnectError"):
        await reg.register(rec("w0"))
    assert time.monotonic() - start < 3


async def test_deregister_never_raises(api: FakeKubeApi, registrations: list, caplog) -> None:
    caplog.set_level(logging.INFO, logger="infera.discovery.kubernetes")
    api.add_pod("worker-0", {"app": "w"})
    reg = registration(api, registrations, "worker-0", refresh_s=60, request_timeout=2)
    await reg.register(rec("w0"))
    patches = len(api.patches)
    await api.stop()
    await reg.deregister()  # logged, not raised
    failed = [r for r in caplog.records if r.getMessage().startswith("deregister: could not clear")]
    assert len(failed) == 1 and failed[0].levelno == logging.WARNING, [r.getMessage() for r in caplog.records]
    assert "worker-0" in failed[0].getMessage() and "ConnectError" in failed[0].getMessage()
    # The Pod is left behind still carrying the record (the Pod's deletion removes it).
    assert decode_record(api.annotations("worker-0")[ANNOTATION]).worker_id == "w0"
    assert len(api.patches) == patches
    api.finish_delete("worker-0")
    await api.start()
    await reg.deregister()  # the Pod is gone: fine too
    gone = [r for r in caplog.records if r.getMessage() == "deregister: Pod worker-0 is already gone"]
    assert len(gone) == 1 and gone[0].levelno == logging.INFO
    assert api.get_pod("worker-0") is None and api.requests["patch"] == patches + 1  # it was asked: 404


# -- the fake's field selectors: implemented or refused, never ignored -------------------------------

async def test_fake_refuses_field_selectors_it_does_not_implement(api: FakeKubeApi) -> None:
    api.add_pod("p1", {"app": "w"})
    headers = {"Authorization": f"Bearer {api.token}"}
    async with aiohttp.ClientSession(headers=headers) as s:
        for query in ({"fieldSelector": "spec.restartPolicy=Always"},
                      {"fieldSelector": "spec.restartPolicy=Always", "watch": "true"},
                      {"fieldSelector": "status.phase=Running,spec.schedulerName=x"}):
            async with s.get(f"{api.url}/api/v1/namespaces/{NS}/pods", params=query) as r:
                assert r.status == 400, query
                body = await r.json()
            assert body["kind"] == "Status" and body["reason"] == "BadRequest"
            assert body["message"].startswith("field label not supported: spec."), body
        async with s.get(f"{api.url}/api/v1/namespaces/{NS}/pods", params={"fieldSelector": "status.phase"}) as r:
            assert r.status == 400  # malformed
    assert api.open_watches == 0


async def test_fake_field_selectors_filter_lists_and_watches(api: FakeKubeApi) -> None:
    api.add_pod("run", {"app": "w"})
    api.add_pod("wait", {"app": "w"}, phase="Pending")
    api.add_pod("other", {"app": "w"}, namespace="elsewhere")
    url = f"{api.url}/api/v1/namespaces/{NS}/pods"
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {api.token}"}) as s:
        async with s.get(url, params={"fieldSelector": "status.phase=Running"}) as r:
            assert [p["metadata"]["name"] for p in (await r.json())["items"]] == ["run"]
        async with s.get(url, params={"fieldSelector": "status.phase!=Running,metadata.name!=x"}) as r:
            assert [p["metadata"]["name"] for p in (await r.json())["items"]] == ["wait"]
        async with s.get(f"{api.url}/api/v1/pods", params={"fieldSelector": "metadata.namespace==elsewhere"}) as r:
            assert [p["metadata"]["name"] for p in (await r.json())["items"]] == ["other"]
        params = {"watch": "true", "fieldSelector": "status.phase=Running", "resourceVersion": str(api.rv)}
        async with s.get(url, params=params) as r:
            await wait_watching(api)
            api.set_phase("wait", "Running")  # into the selector: ADDED
            api.set_phase("run", "Failed")  # out of it: DELETED
            api.set_annotation("wait", "a", "1")  # in it before and after: MODIFIED
            api.set_annotation("run", "a", "1")  # in it neither before nor after: nothing
            api.add_pod("sentinel", {"app": "w"})  # Running: the last event this watch must see
            events = []
            async for line in r.content:
                event = json.loads(line)
                events.append((event["type"], event["object"]["metadata"]["name"]))
                if events[-1][1] == "sentinel":
                    break
    assert events == [("ADDED", "wait"), ("DELETED", "run"), ("MODIFIED", "wait"), ("ADDED", "sentinel")]


# -- the server, configured from flags and KUBECONFIG ----------------------------------------------

async def test_server_discovers_pods_via_kubeconfig(api: FakeKubeApi, tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # never the in-cluster path here
    monkeypatch.setenv("KUBECONFIG", api.write_kubeconfig(tmp_path / "kubeconfig"))
    args = parse_args(["--discovery-backend", "kubernetes", "--k8s-label-selector", SELECTOR, "--k8s-namespace", NS,
                       "--router-policy", "round-robin", "--port", "0", "--host", "127.0.0.1"], environ={})
    server = InferaServer(args)
    await server.start()
    try:
        api.add_pod("worker-0", {"app": "w"}, ann("10.0.0.7:8000"), ip="10.0.0.7")
        api.add_pod("worker-1", {"app": "w"}, ann("10.0.0.8:8000"), ip="10.0.0.8")
        api.begin_graceful_delete("worker-1")

        async def listed() -> bool:
            async with aiohttp.ClientSession() as s:
                async with s.get(f"http://127.0.0.1:{server.port}/v1/workers") as r:
                    workers = {w["worker_id"]: w for w in (await r.json())["workers"]}
            return (set(workers) == {"10.0.0.7:8000", "10.0.0.8:8000"}
                    and workers["10.0.0.8:8000"]["status"] == "draining"
                    and workers["10.0.0.8:8000"]["routable"] is False
                    and workers["10.0.0.7:8000"]["routable"] is True)

        await wait_for(listed, T, message="/v1/workers lists the Pods' workers")
    finally:
        await server.stop()
