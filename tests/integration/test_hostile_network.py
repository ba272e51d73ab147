"""Issue 27 (a hostile network), items 3, 4, 6, 11, against a real server over loopback: prewarm
behind the admin token and capped; /v1/workers, /metrics and the detailed /health behind a token;
error replies that name no worker address; count_tokens capped as routing is; the dashboard token
kept out of URLs and its session expiring on the server."""
from __future__ import annotations

import socket
import time

import aiohttp
import pytest

from infera.discovery.record import BUILTIN_TOKENIZER, WorkerRecord
from infera.server.dashboard import COOKIE_NAME, session_value
from tests.conftest import wait_for

pytestmark = pytest.mark.integration

ADMIN = "hostile-admin-token"
SCRAPER = "hostile-metrics-token"
MODEL = "m"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def openai_error(payload: dict, code: str | None = None) -> dict:
    err = payload["error"]
    assert set(err) >= {"message", "type", "code"}
    if code is not None:
        assert err["code"] == code, err
    return err


def refused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed again: connecting is refused


# -- item 3: prewarm ---------------------------------------------------------------------------------------

async def test_prewarm_needs_the_admin_token_and_its_503_names_no_socket(fed_server, tmp_path):
    sock = str(tmp_path / "no-kvd-here.sock")
    _, base = await fed_server("--admin-token", ADMIN, "--kvd-socket-path", sock)
    body = {"model": MODEL, "block_hashes": ["00ff"]}
    async with aiohttp.ClientSession() as s:
        for headers in ({}, bearer("wrong"), bearer(SCRAPER)):
            async with s.post(base + "/v1/cache/prewarm", json=body, headers=headers) as r:
                assert r.status == 401, await r.text()
                openai_error(await r.json(), "invalid_admin_token")
        async with s.post(base + "/v1/cache/prewarm", json=body, headers=bearer(ADMIN)) as r:
            assert r.status == 503
            err = openai_error(await r.json(), "kvd_unavailable")
            assert sock not in err["message"] and str(tmp_path) not in err["message"]


async def test_prewarm_key_count_key_size_and_deadline_are_capped(fed_server):
    _, base = await fed_server()  # no kvd: a body past the caps is refused before one is needed
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/v1/cache/prewarm", json={"model": MODEL, "block_hashes": ["00"] * 65_537}) as r:
            assert r.status == 413
            assert openai_error(await r.json(), "too_many_keys")["param"] == "block_hashes"
        for bad, param in (({"block_hashes": ["00"], "deadline_ms": 60_001}, "deadline_ms"),
                           ({"block_hashes": ["ab" * 65]}, "block_hashes")):
            async with s.post(base + "/v1/cache/prewarm", json={"model": MODEL, **bad}) as r:
                assert r.status == 400, bad
                assert openai_error(await r.json(), "invalid_request")["param"] == param
        async with s.post(base + "/v1/cache/prewarm",  # at the caps: past the checks (no kvd: 503)
                          json={"model": MODEL, "block_hashes": ["ab" * 64], "deadline_ms": 60_000}) as r:
            assert r.status == 503
            openai_error(await r.json(), "kvd_not_configured")


# -- item 4: what the fleet's addresses are shown to ------------------------------------------------------

def _record(port: int) -> WorkerRecord:
    return WorkerRecord(worker_id=f"127.0.0.1:{port}", url=f"http://127.0.0.1:{port}", model_name=MODEL,
                        tokenizer=BUILTIN_TOKENIZER, kvd_socket="/run/secret/kvd.sock",
                        kv_events_endpoint=f"tcp://127.0.0.1:{port + 1}")


async def test_with_a_token_workers_metrics_and_health_details_need_one(fed_server):
    server, base = await fed_server("--router-policy", "kv-aware", "--admin-token", ADMIN, "--metrics-token", SCRAPER)
    port = refused_port()
    server.fleet.upsert(_record(port))
    async with aiohttp.ClientSession() as s:
        for path in ("/v1/workers", "/metrics"):
            for headers in ({}, bearer("wrong"), {"Authorization": f"Basic {ADMIN}"}):
                async with s.get(base + path, headers=headers) as r:
                    assert r.status == 401, (path, headers)
                    text = await r.text()
                    openai_error(await r.json(), "invalid_token")
                    assert str(port) not in text and r.headers["WWW-Authenticate"].startswith("Bearer")
            for token in (ADMIN, SCRAPER):
                async with s.get(base + path, headers=bearer(token)) as r:
                    assert r.status == 200, (path, token)
                    assert str(port) in await r.text()  # the details are there for whoever holds a token
        # /health: a load balancer's answer without a token, no addresses, paths or pids
        async with s.get(base + "/health") as r:
            assert r.status == 200
            raw = await r.text()
            body = await r.json()
        assert body == {"status": "ok", "active_workers": 1, "workers": 1}
        assert str(port) not in raw and "kvd" not in raw
        async with s.get(base + "/health", headers=bearer(SCRAPER)) as r:
            assert r.status == 200 and "kv_routing" in await r.json()  # the detailed one


async def test_the_metrics_token_alone_closes_them_too_and_no_token_keeps_dev_mode(fed_server):
    _, base = await fed_server("--router-policy", "kv-aware", "--metrics-token", SCRAPER)
    _, open_base = await fed_server("--router-policy", "kv-aware")
    async with aiohttp.ClientSession() as s:
        for path in ("/v1/workers", "/metrics"):
            async with s.get(base + path) as r:
                assert r.status == 401, path
            async with s.get(base + path, headers=bearer(SCRAPER)) as r:
                assert r.status == 200, path
            async with s.get(open_base + path) as r:  # no token configured at all: open, as before
                assert r.status == 200, path
        async with s.get(open_base + "/health") as r:
            assert "kv_routing" in await r.json()


async def test_error_replies_name_no_worker_address(fed_server):
    server, base = await fed_server("--request-max-retries", "0")
    port = refused_port()
    server.fleet.upsert(WorkerRecord(worker_id=f"127.0.0.1:{port}", url=f"http://127.0.0.1:{port}", model_name=MODEL))
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    async with aiohttp.ClientSession() as s:
        for stream in (False, True):
            async with s.post(base + "/v1/chat/completions", json={**chat, "stream": stream}) as r:
                assert r.status == 502
                raw = await r.text()
                err = openai_error(await r.json(), "unreachable")
            assert "unreachable" in err["message"]
            assert str(port) not in raw and "127.0.0.1" not in raw, raw


# -- item 6: count_tokens ----------------------------------------------------------------------------------

async def test_count_tokens_is_capped_as_routing_is(fed_server):
    server, base = await fed_server("--router-policy", "kv-aware", "--router-prefix-chars", "65536")
    server.fleet.upsert(WorkerRecord(worker_id="w0", url=f"http://127.0.0.1:{refused_port()}", model_name=MODEL,
                                     tokenizer=BUILTIN_TOKENIZER))
    await wait_for(lambda: server.tokenizers.prompts_for(MODEL) is not None, 10, message="the router tokenizer")
    url = base + "/v1/messages/count_tokens"

    def body(chars: int) -> dict:
        return {"model": MODEL, "messages": [{"role": "user", "content": "word " * (chars // 5)}]}

    async with aiohttp.ClientSession() as s:
        counts = []
        for chars in (100, 20_000):  # inline, and in the tokenizer threads
            async with s.post(url, json=body(chars)) as r:
                assert r.status == 200, await r.text()
                counts.append((await r.json())["input_tokens"])
        assert 0 < counts[0] < counts[1]
        started = time.monotonic()
        async with s.post(url, json=body(70_000)) as r:  # past --router-prefix-chars: refused, not tokenized
            assert r.status == 413
            reply = await r.json()
        assert reply["type"] == "error" and reply["error"]["type"] == "request_too_large"
        assert "--router-prefix-chars" in reply["error"]["message"]
        big = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 2_000_000}]}  # 10 MB
        async with s.post(url, json=big) as r:  # over 8x the cap: refused before it is even read
            assert r.status == 413 and "8x" in (await r.json())["error"]["message"]
        assert time.monotonic() - started < 5  # (the old handler tokenized all 10 MB first)


# -- item 11: the dashboard's door -------------------------------------------------------------------------

async def test_the_dashboard_takes_no_token_from_the_url_and_its_session_expires(fed_server):
    _, base = await fed_server("--admin-token", ADMIN, "--dashboard-session-s", "600")
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as s:
        async with s.get(f"{base}/dashboard?token={ADMIN}", allow_redirects=False) as r:
            assert r.status == 401 and "Set-Cookie" not in r.headers  # the sign-in form, not a session
            assert 'method="post"' in await r.text()
        async with s.post(base + "/dashboard", data={"token": ADMIN}, allow_redirects=False) as r:
            assert r.status == 303
            set_cookie = r.headers["Set-Cookie"]
        assert "Max-Age=600" in set_cookie and "HttpOnly" in set_cookie and "SameSite=Strict" in set_cookie
        value = set_cookie.split(";")[0].split("=", 1)[1]
        assert ADMIN not in value
        async with s.get(base + "/v1/fleet", headers={"Cookie": f"{COOKIE_NAME}={value}"}) as r:
            assert r.status == 200
        expired = session_value(ADMIN, time.time() - 1)
        for path in ("/v1/fleet", "/dashboard"):
            async with s.get(base + path, headers={"Cookie": f"{COOKIE_NAME}={expired}"}) as r:
                assert r.status == 401, path
