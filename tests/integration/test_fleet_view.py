"""GET /v1/fleet and GET|POST /dashboard on a real server over loopback: real sim workers in a real
etcd for the live figures, a fed fleet for topology, and the admin token's door on both."""
from __future__ import annotations

import asyncio
import signal

import aiohttp
import pytest

from infera.discovery.record import WorkerRecord
from tests.conftest import wait_for
from tests.integration.conftest import wait_workers

pytestmark = pytest.mark.integration

TOKEN = "fleet-view-admin-token"
BEARER = {"Authorization": f"Bearer {TOKEN}"}
SYSTEM = "You are a careful assistant. Answer briefly and precisely, in plain words. " * 8


def chat(content: str, **kw) -> dict:
    return {"model": "sim-model", "messages": [{"role": "system", "content": SYSTEM},
                                              {"role": "user", "content": content}], **kw}


async def fleet_doc(s: aiohttp.ClientSession, base: str, headers: dict | None = BEARER) -> dict:
    async with s.get(base + "/v1/fleet", headers=headers) as r:
        assert r.status == 200, await r.text()
        assert r.headers["Cache-Control"] == "no-store"
        return await r.json()


def workers_of(doc: dict) -> dict[str, dict]:
    return {w["worker_id"]: w for m in doc["models"] for role in m["workers"].values() for w in role}


async def test_live_fleet_in_flight_rate_ttft_kv_and_a_killed_worker(make_server, spawn_worker):
    server = await make_server("--admin-token", TOKEN)  # kv-aware, the default policy
    a, b = await spawn_worker(speedup=4.0), await spawn_worker(speedup=4.0)
    await wait_workers(server, {a.worker_id, b.worker_id})
    base = f"http://127.0.0.1:{server.port}"
    async with aiohttp.ClientSession() as s:
        async with s.get(base + "/v1/fleet") as r:
            assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_admin_token"
            assert r.headers["WWW-Authenticate"].startswith("Bearer")
        async with s.get(base + "/v1/fleet", headers={"Authorization": "Bearer wrong"}) as r:
            assert r.status == 401
        doc = await fleet_doc(s, base)
        assert doc["object"] == "fleet" and doc["window_s"] == 10.0 and doc["server"]["policy"] == "kv-aware"
        [m] = doc["models"]
        assert m["model"] == "sim-model" and m["topology"] == "mixed" and m["pd_pairs"] == []
        ws = workers_of(doc)
        assert set(ws) == {a.worker_id, b.worker_id}
        for w in ws.values():
            assert (w["health"], w["role"], w["in_flight"], w["engine"]) == ("healthy", "mixed", 0, "sim")
            assert w["kv"]["subscribed"] and w["kv"]["transport"] == "zmq"
            assert w["breaker"]["state"] == "closed"

        # a slow stream: its worker shows it in flight until it ends
        async def slow_stream() -> str:
            async with s.post(base + "/v1/chat/completions",
                              json=chat("tell me a long story", stream=True, max_tokens=60, ignore_eos=True)) as r:
                assert r.status == 200
                return (await r.read()).decode()

        task = asyncio.create_task(slow_stream())

        async def busy() -> str | None:
            doc = await fleet_doc(s, base)
            hot = [w["worker_id"] for w in workers_of(doc).values() if w["in_flight"] == 1]
            return hot[0] if len(hot) == 1 and doc["server"]["in_flight"] == 1 else None

        await wait_for(busy, 10, message="one worker with the stream in flight")
        assert not task.done(), "the stream ended before it was seen in flight: make it slower"
        streamed_on = await busy()
        assert "[DONE]" in await task
        doc = await fleet_doc(s, base)
        w = workers_of(doc)[streamed_on]
        assert doc["server"]["in_flight"] == 0 and w["in_flight"] == 0 and w["requests_total"] == 1
        assert w["ttft_samples"] == 1 and w["ttft_p50_ms"] > 0 and w["ttft_ewma_ms"] == w["ttft_p50_ms"]

        # a burst of requests sharing a prefix: rates rise, the cache view fills, predictions are checked
        for i in range(12):
            async with s.post(base + "/v1/chat/completions", json=chat(f"question {i}", max_tokens=4)) as r:
                assert r.status == 200
        doc = await fleet_doc(s, base)
        assert doc["server"]["requests_total"] == 13 and doc["server"]["requests_per_s"] > 0
        assert sum(w["requests_total"] for w in workers_of(doc).values()) == 13
        assert doc["models"][0]["requests_per_s"] == doc["server"]["requests_per_s"]

        async def kv_seen() -> bool:
            ws = workers_of(await fleet_doc(s, base))
            return (sum(w["kv"]["blocks"] for w in ws.values()) > 0
                    and sum(w["kv"]["prediction"]["observations"] for w in ws.values()) >= 12
                    and all(w["kv"]["last_batch_age_s"] is not None for w in ws.values() if w["kv"]["batches"]))

        await wait_for(kv_seen, 10, message="KV blocks and self-check observations in /v1/fleet")
        doc = await fleet_doc(s, base)
        assert doc["server"]["kv_blocks"] == sum(w["kv"]["blocks"] for w in workers_of(doc).values())
        for w in workers_of(doc).values():  # the views' health: warmed up, complete, fresh, no restart
            kv = w["kv"]
            assert kv["caught_up"] and not kv["degraded"] and kv["engine_restarts"] == 0
            assert kv["staleness_s"] is not None and kv["staleness_s"] >= 0

        # SIGKILL one launcher (its engine dies with it): the worker leaves the document with its lease
        a.signal(signal.SIGKILL)

        async def gone() -> bool:
            doc = await fleet_doc(s, base)
            return set(workers_of(doc)) == {b.worker_id} and doc["server"]["workers"] == 1

        await wait_for(gone, 10, message="the killed worker gone from /v1/fleet")
        assert workers_of(await fleet_doc(s, base))[b.worker_id]["health"] == "healthy"


async def test_fed_fleet_pd_pairs_over_http(fed_server):
    server, base = await fed_server()  # no token: open
    for wid, mode in (("p1", "prefill"), ("p2", "prefill"), ("d1", "decode")):
        server.fleet.upsert(WorkerRecord(worker_id=wid, url=f"http://127.0.0.1:9/{wid}", model_name="pd",
                                         engine="vllm", disagg_mode=mode, disagg_meta={"protocol": "nixl"}))
    async with aiohttp.ClientSession() as s:
        doc = await fleet_doc(s, base, headers=None)
        [m] = doc["models"]
        assert m["topology"] == "disaggregated"
        assert m["pd_pairs"] == [{"engine": "vllm", "protocol": "nixl", "prefill": ["p1", "p2"], "decode": ["d1"],
                                  "pairs": 2}]
        assert [w["worker_id"] for w in m["workers"]["prefill"]] == ["p1", "p2"]
        assert doc["server"]["policy"] == "round-robin" and workers_of(doc)["d1"]["kv"] is None
        server.fleet.remove("d1")
        doc = await fleet_doc(s, base, headers=None)
        assert doc["models"][0]["topology"] == "missing_decode" and doc["models"][0]["pd_pairs"] == []
        async with s.get(base + "/dashboard") as r:  # no token: the page is open too
            assert r.status == 200 and r.content_type == "text/html"


async def test_dashboard_sign_in_by_form_only_and_the_cookie_opens_only_the_dashboard(fed_server):
    _, base = await fed_server("--router-policy", "kv-aware", "--admin-token", TOKEN)
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as s:
        async with s.get(base + "/dashboard") as r:
            assert r.status == 401 and r.content_type == "text/html"
            page = await r.text()
            assert '<form method="post" action="dashboard"' in page and TOKEN not in page
        async with s.get(base + "/dashboard", params={"token": "wrong"}, allow_redirects=False) as r:
            assert r.status == 401 and "Set-Cookie" not in r.headers
        async with s.post(base + "/dashboard", data={"token": "wrong"}, allow_redirects=False) as r:
            assert r.status == 401 and "Set-Cookie" not in r.headers
        async with s.get(base + "/dashboard", headers=BEARER) as r:  # a Bearer header opens it too
            assert r.status == 200
        async with s.post(base + "/dashboard", data={"token": TOKEN}, allow_redirects=False) as r:
            assert r.status == 303 and r.headers["Location"] == "dashboard"
            cookie = r.headers["Set-Cookie"]
            assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and TOKEN not in cookie
        async with s.get(base + "/dashboard") as r:  # the jar sends the cookie now
            assert r.status == 200
            page = await r.text()
            assert "v1/fleet" in page and "<script" in page
            assert "default-src 'none'" in r.headers["Content-Security-Policy"]
            assert "http://" not in page and "https://" not in page  # nothing fetched from elsewhere
        async with s.get(base + "/v1/fleet") as r:
            assert r.status == 200 and (await r.json())["object"] == "fleet"
        async with s.get(base + "/v1/admin/cache-view/w1") as r:  # the cookie is not the admin token
            assert r.status == 401
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as s:
        # the token in a URL signs nobody in (issue 27: access logs, proxies, history): just the form
        async with s.get(base + "/dashboard", params={"token": TOKEN}, allow_redirects=False) as r:
            assert r.status == 401 and "Set-Cookie" not in r.headers and "<form" in await r.text()
        async with s.get(base + "/v1/fleet") as r:
            assert r.status == 401
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as s:
        s.cookie_jar.update_cookies({"infera_dashboard": "0" * 64}, response_url=aiohttp.client.URL(base))
        async with s.get(base + "/v1/fleet") as r:  # a forged cookie is not the session
            assert r.status == 401
