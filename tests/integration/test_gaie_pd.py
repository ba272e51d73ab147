"""PD behind a gateway: sim PD pairs, each worker on its own loopback IP (so one fixed destination
port serves every worker, as a Pod IP does in Kubernetes), a per-worker ``infera.server
--router-mode direct`` sidecar on the decode worker's IP at that port, the EPP and a real Envoy.

The EPP chooses the pair; Envoy sends the request to the decode worker's sidecar with
``x-worker-instance-id`` (decode) and ``x-prefill-instance-id``; the sidecar's DisaggRouter runs
exactly that pair. Both legs are checked on the sims' own metrics."""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import sys
import time

import aiohttp
import pytest

from infera.engine.base.prom import sample_sum
from tests.conftest import free_port, requests_by_worker, stop_process_group, wait_for
from tests.integration.test_gaie_failures import gateway  # noqa: F401  (fixture)

pytestmark = pytest.mark.integration

MODEL = "pd"
NIXL = {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"}
SYSTEM = "You are a meticulous assistant who answers in one sentence. " * 30
EXTERNAL = ('vllm:prompt_tokens_by_source_total', 'source="external_kv_transfer"')


def nixl(role: str) -> tuple[str, str]:
    return "--kv-transfer-config", json.dumps({**NIXL, "kv_role": role})


def messages(tag: str) -> list[dict]:
    return [{"role": "system", "content": f"[{tag}] {SYSTEM}"}, {"role": "user", "content": "What is a router?"}]


def loopback_ips(n: int) -> list[str]:
    """``n`` distinct 127.a.b.c addresses (Linux routes all of 127/8 to lo), away from 127.0.0.1 and
    the local kubelet's 127.0.200+ ranges; random so concurrent tests rarely share one."""
    base = (random.randint(1, 199), random.randint(0, 255))
    return [f"127.{base[0]}.{base[1]}.{i + 2}" for i in range(n)]


def port_free_on(ips: list[str]) -> int:
    """One port free on every address: the fleet's fixed destination port."""
    for _ in range(64):
        port = free_port()
        try:
            for ip in ips:
                with socket.socket() as s:
                    s.bind((ip, port))
        except OSError:
            continue
        return port
    raise RuntimeError("no port free on every loopback address")


class Sim:
    """A sim worker bound to (and advertising) its own loopback IP."""

    def __init__(self, proc: asyncio.subprocess.Process, host: str, port: int) -> None:
        self.proc, self.host, self.port = proc, host, port
        self.worker_id = f"{host}:{port}"
        self.url = f"http://{host}:{port}"

    async def metric(self, session: aiohttp.ClientSession, name: str, label: str = "") -> float:
        async with session.get(self.url + "/metrics") as r:
            return sample_sum(await r.text(), name, label)


@pytest.fixture
async def sims(etcd, prefix):
    """``await sims(host, *engine_args)``: a registered sim worker on ``host``."""
    started: list[Sim] = []

    async def factory(host: str, *engine_args: str, model: str = MODEL, speedup: float = 50.0) -> Sim:
        port = free_port()
        cmd = [sys.executable, "-m", "infera.engine.sim", "--etcd-endpoint", etcd.endpoint, "--etcd-prefix", prefix,
               "--lease-ttl", "2", "--drain-settle", "0.3", "--advertise-host", host, "--disaggregation-allow-tcp",
               "--log-level", "warning", "--model", model, "--port", str(port), "--host", host,
               "--speedup", str(speedup), *engine_args]
        sim = Sim(await asyncio.create_subprocess_exec(*cmd, start_new_session=True), host, port)
        started.append(sim)
        return sim

    yield factory
    for sim in started:
        if sim.proc.returncode is None:
            try:
                os.killpg(sim.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await sim.proc.wait()


class Sidecar:
    """``python -m infera.server --router-mode direct`` on a worker's IP at the destination port."""

    def __init__(self, proc: asyncio.subprocess.Process, host: str, port: int) -> None:
        self.proc, self.host, self.port = proc, host, port
        self.url = f"http://{host}:{port}"

    async def routable(self, session: aiohttp.ClientSession, worker_ids: set[str]) -> bool:
        try:
            async with session.get(self.url + "/v1/workers", timeout=aiohttp.ClientTimeout(total=2)) as r:
                if r.status != 200:
                    return False
                listed = await r.json()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False
        rows = listed["workers"] if isinstance(listed, dict) else listed
        return worker_ids <= {w["worker_id"] for w in rows if w.get("routable")}


@pytest.fixture
async def sidecars(etcd, prefix):
    """``await sidecars(host, port)``: a direct-mode server on ``host:port`` seeing the fleet."""
    started: list[Sidecar] = []

    async def factory(host: str, port: int) -> Sidecar:
        cmd = [sys.executable, "-m", "infera.server", "--router-mode", "direct", "--router-policy", "round-robin",
               "--host", host, "--port", str(port), "--etcd-endpoint", etcd.endpoint, "--etcd-prefix", prefix,
               "--log-level", "warning"]
        sidecar = Sidecar(await asyncio.create_subprocess_exec(*cmd, start_new_session=True), host, port)
        started.append(sidecar)
        return sidecar

    yield factory
    for sidecar in started:
        await stop_process_group(sidecar.proc, grace=5)


async def pd_pairs(sims, sidecars, n_pairs: int) -> tuple[list[tuple[Sim, Sim, Sidecar]], int]:
    """``n_pairs`` (prefill, decode, decode's sidecar), every worker on its own IP, the sidecars all
    on one destination port; waits until every sidecar can route every worker."""
    ips = loopback_ips(2 * n_pairs)
    dest_port = port_free_on(ips)
    pairs = []
    for i in range(n_pairs):
        p = await sims(ips[2 * i], *nixl("kv_producer"))
        d = await sims(ips[2 * i + 1], *nixl("kv_consumer"))
        pairs.append((p, d, await sidecars(d.host, dest_port)))
    ids = {w.worker_id for p, d, _ in pairs for w in (p, d)}
    async with aiohttp.ClientSession() as s:
        for _, _, car in pairs:
            await wait_for(lambda car=car: car.routable(s, ids), 45, interval=0.2,
                           message=f"sidecar {car.url} routes {sorted(ids)}")
    return pairs, dest_port


async def test_sidecar_serves_exactly_the_pair_the_headers_name(sims, sidecars):
    """The gateway's hop alone: the decode worker's sidecar runs the pair named by the headers, on
    both sims (prefill served it, decode pulled its KV), streaming and unary."""
    pairs, _ = await pd_pairs(sims, sidecars, 2)
    (p0, d0, car0), (p1, d1, _) = pairs
    async with aiohttp.ClientSession() as s:
        # the sidecar of pair 0 told to run (prefill of pair 1, its own decode)
        for stream in (False, True):
            before = [await w.metric(s, "vllm:request_success_total") for w in (p0, d0, p1, d1)]
            moved = await d0.metric(s, *EXTERNAL)
            body = {"model": MODEL, "messages": messages(f"hop-{stream}"), "max_tokens": 6, "stream": stream}
            headers = {"x-worker-instance-id": d0.worker_id, "x-prefill-instance-id": p1.worker_id}
            async with s.post(car0.url + "/v1/chat/completions", json=body, headers=headers,
                              timeout=aiohttp.ClientTimeout(total=20)) as r:
                assert r.status == 200, await r.text()
                await r.read()
            after = [await w.metric(s, "vllm:request_success_total") for w in (p0, d0, p1, d1)]
            assert [a - b for a, b in zip(after, before)] == [0, 1, 1, 0]
            assert await d0.metric(s, *EXTERNAL) > moved


async def test_chat_through_envoy_is_served_by_the_pair_the_epp_chose(sims, sidecars, gateway):
    """Envoy + EPP in front of 2 PD pairs: each chat (unary, then streaming) runs on one prefill and
    one decode (the decode pulled the prompt's KV), through that decode worker's own sidecar."""
    pairs, dest_port = await pd_pairs(sims, sidecars, 2)
    gw = await gateway("--router-policy", "round-robin", destination_port=dest_port)
    await wait_for(lambda: gw.has_workers(4), 30, message="the EPP sees both pairs")
    prefills = [p for p, _, _ in pairs]
    decodes = [d for _, d, _ in pairs]
    cars = {d.worker_id: car for _, d, car in pairs}
    async with aiohttp.ClientSession() as s:
        async def snapshot() -> tuple[list[float], list[float], list[float], dict[str, float]]:
            done_p = [await p.metric(s, "vllm:request_success_total") for p in prefills]
            done_d = [await d.metric(s, "vllm:request_success_total") for d in decodes]
            moved = [await d.metric(s, *EXTERNAL) for d in decodes]
            by_car = {}
            for wid, car in cars.items():
                async with s.get(car.url + "/metrics") as r:
                    by_car[wid] = requests_by_worker(await r.text()).get(wid, 0)
            return done_p, done_d, moved, by_car

        for i, stream in enumerate((False, True, False, True)):
            before = await snapshot()
            body = {"model": MODEL, "messages": messages(f"gw-{i}"), "max_tokens": 6, "stream": stream}
            async with s.post(gw.url + "/v1/chat/completions", json=body,
                              timeout=aiohttp.ClientTimeout(total=20)) as r:
                assert r.status == 200, await r.text()
                text = await r.text()
                named = (r.headers.get("x-worker-instance-id"), r.headers.get("x-prefill-instance-id"))
            if stream:
                assert text.rstrip().endswith("data: [DONE]")
            after = await snapshot()
            served_p = [a - b for a, b in zip(after[0], before[0])]
            served_d = [a - b for a, b in zip(after[1], before[1])]
            assert sorted(served_p) == [0, 1] and sorted(served_d) == [0, 1], (served_p, served_d)
            decode = decodes[served_d.index(1)]
            # the pair the EPP named (echoed on the reply) is the pair that served
            assert named == (decode.worker_id, prefills[served_p.index(1)].worker_id), named
            assert after[2][served_d.index(1)] > before[2][served_d.index(1)], "the decode pulled no KV"
            # it came through the chosen decode worker's own sidecar, and no other
            assert {wid: after[3][wid] - before[3][wid] for wid in cars} == {
                wid: int(wid == decode.worker_id) for wid in cars}


async def test_a_killed_prefill_never_fails_a_request(sims, sidecars, gateway):
    """SIGKILL one pair's prefill worker under sequential load. Until discovery drops it the EPP may
    still pair it: the decode's sidecar cannot reach it and says so (x-infera-upstream-connect-failure
    naming it), Envoy retries through the EPP, which picks a pair without it. No request fails, and
    after the drop every request goes to the live prefill, with either decode."""
    pairs, dest_port = await pd_pairs(sims, sidecars, 2)
    gw = await gateway("--router-policy", "round-robin", destination_port=dest_port)
    await wait_for(lambda: gw.has_workers(4), 30, message="the EPP sees both pairs")
    (p0, d0, _), (p1, d1, _) = pairs
    os.killpg(p1.proc.pid, signal.SIGKILL)
    window: list[tuple[int, float, str]] = []
    async with aiohttp.ClientSession() as s:
        async def one(tag: str) -> int:
            t0 = time.monotonic()
            body = {"model": MODEL, "messages": messages(tag), "max_tokens": 4}
            async with s.post(gw.url + "/v1/chat/completions", json=body,
                              timeout=aiohttp.ClientTimeout(total=20)) as r:
                text = await r.text()
                window.append((r.status, time.monotonic() - t0, text[:200]))
                return r.status

        async def dropped() -> bool:
            await one(f"window-{len(window)}")
            return await gw.has_workers(3)

        await wait_for(dropped, 30, message="discovery drops the killed prefill")
        before = [await w.metric(s, "vllm:request_success_total") for w in (p0, d0, d1)]
        statuses = [await one(f"after-{i}") for i in range(6)]
        after = [await w.metric(s, "vllm:request_success_total") for w in (p0, d0, d1)]
    retried = (await gw.stats()).get("cluster.infera_pick.upstream_rq_retry_success", 0)
    failed = [w for w in window if w[0] != 200]
    assert not failed, f"{len(failed)} of {len(window)} requests failed while the prefill was dead: {failed[:3]}"
    assert retried >= 1, "no request was paired with the dead prefill before the drop: nothing was tested"
    assert statuses == [200] * 6
    assert after[0] - before[0] == 6 and (after[1] - before[1]) + (after[2] - before[2]) == 6
    print(f"killed prefill: {len(window)} requests before the drop, {retried} retried onto the live prefill, 0 failed")
