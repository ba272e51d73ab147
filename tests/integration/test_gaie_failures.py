"""The gateway's failure behaviour, on a real Envoy (the ``--print-envoy-config`` bootstrap), the
real EPP (``python -m infera.gaie``) and sim workers:

* the EPP down: with ``failure_mode_allow`` off Envoy answers 503 at once; with it on the request
  goes on without a destination, which an ORIGINAL_DST cluster cannot route (503 "no healthy
  upstream") — and a client's own destination header must not steer it either;
* a worker that refuses connections (SIGKILL) never fails a request: the refused attempt is retried
  through the picker, which picks another worker; after discovery drops it, nothing goes there;
* a client that leaves mid-stream releases the picker's in-flight charge;
* the EPP killed and restarted under load: fast 503s while it is down (no hang), success again
  within a bound once it is back on the same port.

Every request has a deadline; every wait polls a condition with a deadline.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import pytest

from infera.engine.base.prom import sample_sum, samples
from tests.conftest import free_port, wait_for
from tests.integration.gaie_harness import EnvoyProcess, EppProcess, envoy_config

pytestmark = pytest.mark.integration

REQUEST_DEADLINE = aiohttp.ClientTimeout(total=10)
EPP_DOWN = 503  # Envoy's answer while the picker is unreachable (ext_proc status_on_error)
RETRIED = "cluster.infera_pick.upstream_rq_retry_success"  # refused attempts the outer stage retried, served
PREFIX = " ".join(f"word{i}" for i in range(300))  # a long shared prefix: kv-aware keeps it on one worker


def chat(tag: str, max_tokens: int = 4, **extra) -> dict:
    return {"model": "sim-model", "max_tokens": max_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"[{tag}] say something about gateways"}], **extra}


class Gateway:
    """One EPP (restartable on its ports, with its metrics on ``metrics_port``) and one Envoy started
    from the EPP's printed bootstrap (gaie_harness's processes)."""

    def __init__(self, etcd_endpoint: str, prefix: str, epp_flags: tuple[str, ...], *, destination_port: int,
                 mode: str, failure_mode_allow: bool) -> None:
        self.metrics_port = free_port()
        self.listen_port = free_port()
        self.admin_port = free_port()
        self.mode, self.failure_mode_allow = mode, failure_mode_allow
        self.epp = EppProcess(etcd_endpoint, prefix, destination_port=destination_port, secure=False,
                              metrics_port=self.metrics_port, extra=epp_flags)
        self.envoy: EnvoyProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listen_port}"

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    async def start(self) -> None:
        await self.epp.start()
        config = await envoy_config(self.listen_port, self.epp.grpc_port, mode=self.mode, secure=False,
                                    admin_port=self.admin_port, failure_mode_allow=self.failure_mode_allow)
        self.envoy = EnvoyProcess(config, admin_port=self.admin_port)
        await self.envoy.start()

    async def kill_epp(self) -> None:
        """SIGKILL, and wait until it is gone."""
        self.epp.kill()
        assert self.epp.proc is not None
        await asyncio.wait_for(self.epp.proc.wait(), 10)

    async def stats(self) -> dict[str, int]:
        async with aiohttp.ClientSession() as s, s.get(self.admin + "/stats?format=json") as r:
            data = await r.json()
        return {st["name"]: st["value"] for st in data["stats"] if "name" in st and "value" in st}

    async def epp_metrics(self) -> str:
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                                       timeout=aiohttp.ClientTimeout(total=3)) as r:
            return await r.text()

    async def active_workers(self) -> float:
        try:
            return sample_sum(await self.epp_metrics(), "infera_workers", 'status="active"')
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return -1

    async def has_workers(self, n: int) -> bool:
        return await self.active_workers() == n

    async def close(self) -> None:
        if self.envoy is not None:
            await self.envoy.stop()
        await self.epp.stop(5)


@pytest.fixture
async def gateway(etcd, prefix):
    """``await gateway(*epp_flags, failure_mode_allow=False, mode=...)``: a started Gateway; without a
    ``--destination-port`` flag the EPP sends requests to the sims' own ports (no sidecars)."""
    made: list[Gateway] = []

    async def factory(*epp_flags: str, failure_mode_allow: bool = False, mode: str = "full-duplex-streamed",
                      destination_port: int = 0) -> Gateway:
        gw = Gateway(etcd.endpoint, prefix, epp_flags, destination_port=destination_port, mode=mode,
                     failure_mode_allow=failure_mode_allow)
        made.append(gw)
        await gw.start()
        return gw

    yield factory
    for gw in made:
        await gw.close()


async def post(s: aiohttp.ClientSession, url: str, body: dict, headers: dict | None = None) -> tuple[int, str]:
    async with s.post(url + "/v1/chat/completions", json=body, headers=headers or {}, timeout=REQUEST_DEADLINE) as r:
        return r.status, await r.text()


def kill_worker(worker) -> None:
    """SIGKILL the launcher's whole group: the engine's port closes at once, its lease runs out later."""
    os.killpg(worker.proc.pid, signal.SIGKILL)


def inflight(metrics_text: str) -> dict[str, float]:
    return {labels: v for n, labels, v in samples(metrics_text) if n == "infera_worker_inflight_requests"}


# -- the EPP down ---------------------------------------------------------------------------------

async def test_epp_down_with_failure_mode_allow_off_is_a_fast_503(gateway, spawn_worker):
    w = await spawn_worker()
    gw = await gateway("--router-policy", "round-robin")
    await wait_for(lambda: gw.has_workers(1), 30, message="the EPP sees the worker")
    async with aiohttp.ClientSession() as s:
        status, text = await post(s, gw.url, chat("up"))
        assert status == 200, text
        await gw.kill_epp()
        for i in range(3):
            t0 = time.monotonic()
            status, text = await post(s, gw.url, chat(f"down-{i}"))
            assert status == EPP_DOWN, text
            assert time.monotonic() - t0 < 2, "a down picker must fail fast, not hang"
    assert w.proc.returncode is None


@pytest.mark.parametrize("mode", ["buffered", "full-duplex-streamed"])
async def test_epp_down_with_failure_mode_allow_on_still_fails(gateway, spawn_worker, mode):
    """failure_mode_allow on buys nothing here. Buffered: Envoy goes on without the picker, so
    without a destination header, and ORIGINAL_DST has nowhere to connect (503 "no healthy
    upstream"). FULL_DUPLEX_STREAMED: Envoy cannot fail open once the body is streamed to the
    picker; it answers the ext_proc error status (503). Either way a client naming a destination
    itself must not get through (the bootstrap strips client routing headers)."""
    w = await spawn_worker()
    gw = await gateway("--router-policy", "round-robin", failure_mode_allow=True, mode=mode)
    await wait_for(lambda: gw.has_workers(1), 30, message="the EPP sees the worker")
    async with aiohttp.ClientSession() as s:
        status, text = await post(s, gw.url, chat("up"))
        assert status == 200, text
        served_before = await w.engine_metric(s, "vllm:request_success_total")
        await gw.kill_epp()
        status, text = await post(s, gw.url, chat("down"))
        assert status == EPP_DOWN, text
        if mode == "buffered":
            assert text == "no healthy upstream"
        status, text = await post(s, gw.url, chat("spoofed"), headers={
            "x-gateway-destination-endpoint": w.worker_id, "x-worker-instance-id": w.worker_id})
        assert status == 503, f"a client-supplied destination was honoured with the picker down: {status} {text}"
        assert await w.engine_metric(s, "vllm:request_success_total") == served_before
    allowed = sum(v for k, v in (await gw.stats()).items() if k.endswith("ext_proc.failure_mode_allowed"))
    # buffered: Envoy did fail open (and had nowhere to go); streamed: it never could
    assert (allowed >= 1) if mode == "buffered" else (allowed == 0), allowed


# -- a worker that refuses connections ------------------------------------------------------------

@pytest.mark.parametrize("mode", ["buffered", "full-duplex-streamed"])
async def test_killed_worker_is_retried_through_the_picker_and_then_dropped(gateway, spawn_worker, mode):
    """3 workers under kv-aware load (each client repeats its own long prefix, so it sticks to the
    worker caching it); the busiest worker is SIGKILLed, in both processing modes. Requests in flight
    on it (reset before their reply began) and those picked onto it before its lease ran out
    (refused) are retried through the picker and served elsewhere: none fails. Once discovery
    dropped it, every request succeeds and none is refused. (This does not single out the EPP's
    per-request exclusion: with it disabled the policy also moved off the dead worker here; that
    rule has its own unit tests, tests/unit/test_gaie_ext_proc.py.)"""
    workers = [await spawn_worker(lease_ttl=3.0) for _ in range(3)]
    gw = await gateway(mode=mode)  # kv-aware, the default
    await wait_for(lambda: gw.has_workers(3), 30, message="the EPP sees 3 workers")
    failures: list[tuple[int, str]] = []
    served = 0
    stop = asyncio.Event()

    async with aiohttp.ClientSession() as s:
        async def client(i: int) -> None:
            nonlocal served
            n = 0
            while not stop.is_set():
                body = chat(f"load-{i}-{n}")
                body["messages"].insert(0, {"role": "system", "content": f"client {i}: " + PREFIX})
                try:
                    status, text = await post(s, gw.url, body)
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    status, text = -1, repr(exc)
                n += 1
                if status == 200:
                    served += 1
                else:
                    failures.append((status, text[:200]))

        clients = [asyncio.create_task(client(i)) for i in range(6)]
        try:
            await wait_for(lambda: served >= 30, 20, message="load running")
            by_worker = {w.worker_id: await w.engine_metric(s, "vllm:request_success_total") for w in workers}
            busiest = max(workers, key=lambda w: by_worker[w.worker_id])
            kill_worker(busiest)
            killed_at = time.monotonic()
            await wait_for(lambda: gw.has_workers(2), 20, message="discovery drops the killed worker")
            dropped_after = time.monotonic() - killed_at
            at_drop = (await gw.stats()).get(RETRIED, 0)
            after_drop = served
            await wait_for(lambda: served >= after_drop + 30, 20, message="30 requests after the drop")
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(*clients), 15)
    stats = await gw.stats()
    retried = stats.get(RETRIED, 0)
    assert failures == [], f"{len(failures)} requests failed, first: {failures[:3]}"
    assert by_worker[busiest.worker_id] > 0
    assert at_drop >= 1, f"no refused request was retried (dropped after {dropped_after:.1f}s)"
    # after the drop only requests already in flight to it (at most one per client) can be refused
    assert retried - at_drop <= 6, (at_drop, retried)
    # every refused connection (inner stage) was retried (outer stage), as was any request the kill reset
    # before its reply began; and every retry was served
    refused = stats.get("cluster.infera_workers.upstream_cx_connect_fail", 0)
    attempts = stats.get("cluster.infera_pick.upstream_rq_retry", 0)
    assert 1 <= refused <= attempts == retried, (refused, attempts, retried)
    print(f"killed worker ({mode}): dropped after {dropped_after:.1f}s; {refused} refused connections, {retried} "
          f"requests retried elsewhere; "
          f"{served} served, 0 failed")


# -- a client that leaves -------------------------------------------------------------------------

async def test_client_disconnect_mid_stream_releases_the_in_flight_charge(gateway, spawn_worker):
    w = await spawn_worker(speedup=1.0)  # a stream that lasts seconds
    gw = await gateway("--router-policy", "round-robin")
    await wait_for(lambda: gw.has_workers(1), 30, message="the EPP sees the worker")
    label = f'worker_id="{w.worker_id}"'

    async def charged() -> float:
        return sum(v for labels, v in inflight(await gw.epp_metrics()).items() if label in labels)

    async with aiohttp.ClientSession() as s:
        body = chat("leave", max_tokens=2000, stream=True)
        async with s.post(gw.url + "/v1/chat/completions", json=body, timeout=REQUEST_DEADLINE) as r:
            assert r.status == 200
            events = 0
            async for line in r.content:
                if line.startswith(b"data:"):
                    events += 1
                    if events == 3:
                        break
            assert await charged() == 1
            r.close()  # the client leaves mid-stream
    async def released() -> bool:
        return await charged() == 0

    await wait_for(released, 10, message="in-flight charge back to 0")


# -- the EPP killed and restarted under load ------------------------------------------------------

async def test_epp_killed_and_restarted_under_load(gateway, spawn_worker):
    await spawn_worker()
    await spawn_worker()
    gw = await gateway("--router-policy", "round-robin")
    await wait_for(lambda: gw.has_workers(2), 30, message="the EPP sees 2 workers")
    outcomes: list[tuple[float, int, float]] = []  # (start, status or -1 for a broken request, seconds)
    stop = asyncio.Event()

    async with aiohttp.ClientSession() as s:
        async def client(i: int) -> None:
            n = 0
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    status, _ = await post(s, gw.url, chat(f"epp-{i}-{n}"))
                except asyncio.TimeoutError:
                    status = 0  # hung past its deadline: the failure this test exists for
                except aiohttp.ClientError:
                    status = -1  # in flight when the picker died: its ext_proc stream broke
                outcomes.append((t0, status, time.monotonic() - t0))
                n += 1
                if status != 200:
                    await asyncio.sleep(0.02)  # a failing gateway answers at once: don't spin

        clients = [asyncio.create_task(client(i)) for i in range(4)]
        try:
            await wait_for(lambda: sum(1 for o in outcomes if o[1] == 200) >= 20, 20, message="load running")
            killed_at = time.monotonic()
            await gw.kill_epp()
            await wait_for(lambda: sum(1 for o in outcomes if o[0] > killed_at and o[1] == EPP_DOWN) >= 10, 10,
                           message="503s while the EPP is down")
            restarting_at = time.monotonic()
            await gw.epp.start()
            back_at = time.monotonic()
            await wait_for(lambda: sum(1 for o in outcomes if o[0] > back_at and o[1] == 200) >= 20, 20,
                           message="success again after the restart")
            # from SERVING to the first request that started after it and succeeded
            recovered = min(o[0] + o[2] for o in outcomes if o[0] > back_at and o[1] == 200) - back_at
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(*clients), 15)
    assert not [o for o in outcomes if o[1] == 0], "a request hung past its deadline"
    down = [o for o in outcomes if killed_at < o[0] and o[0] + o[2] < restarting_at]
    slow_or_other = [o for o in down if not (o[1] == EPP_DOWN and o[2] < 2)]
    assert down and not slow_or_other, f"while down: fast 503s only, not {slow_or_other[:5]}"
    # before the kill everything succeeded; at the kill only requests already in flight may break
    before = [o for o in outcomes if o[0] + o[2] < killed_at and o[1] != 200]
    assert not before, f"failures before the kill: {before[:5]}"
    assert all(o[1] in (200, EPP_DOWN, -1) for o in outcomes), sorted({o[1] for o in outcomes})
    assert recovered < 10
    print(f"EPP restart: {len(down)} fast 503s while down (slowest {max(o[2] for o in down) * 1000:.0f} ms); "
          f"restarted in {back_at - restarting_at:.1f}s; first success {recovered * 1000:.0f} ms after SERVING")
