"""Admin endpoints (everything under /v1/admin/) need --admin-token (issue 11, item 4): off (403)
without one, then ``Authorization: Bearer <token>`` (401 otherwise). Real server over loopback."""
from __future__ import annotations

import logging

import aiohttp
import pytest

from infera.server.cli import parse_args

TOKEN = "s3cret-admin-token-for-tests"


def error_of(payload: dict) -> dict:
    err = payload["error"]
    assert set(err) >= {"message", "type", "code"}
    return err


@pytest.mark.parametrize("path", ["/v1/admin/cache-view/w1", "/v1/admin/cache-view/w1?dp_rank=0",
                                  "/v1/admin/no-such-endpoint", "/v1/admin", "/v1/%61dmin/cache-view/w1"])
async def test_admin_endpoints_are_off_without_a_token(fed_server, path):
    server, base = await fed_server("--router-policy", "kv-aware")
    async with aiohttp.ClientSession() as s:
        async with s.get(base + path, headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            assert r.status == 403  # today: the cache view answered anyone
            err = error_of(await r.json())
            assert err["code"] == "admin_disabled" and "--admin-token" in err["message"]
            assert "INFERA_ADMIN_TOKEN" in err["message"] and r.headers["X-Infera-Request-Id"]


@pytest.mark.parametrize("authorization", [None, "", "Bearer", "Bearer ", "Bearer wrong", f"Basic {TOKEN}",
                                           f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}", "Bearer é-non-ascii"])
async def test_a_wrong_or_missing_token_is_401(fed_server, authorization):
    _, base = await fed_server("--router-policy", "kv-aware", "--admin-token", TOKEN)
    headers = {} if authorization is None else {"Authorization": authorization}
    async with aiohttp.ClientSession() as s:
        async with s.get(base + "/v1/admin/cache-view/w1", headers=headers) as r:
            assert r.status == 401
            assert error_of(await r.json())["code"] == "invalid_admin_token"
            assert r.headers["WWW-Authenticate"].startswith("Bearer")


async def test_the_token_opens_them_and_nothing_else_needs_it(fed_server, caplog):
    caplog.set_level(logging.DEBUG)
    _, base = await fed_server("--router-policy", "kv-aware", "--admin-token", TOKEN)
    async with aiohttp.ClientSession() as s:
        for scheme in ("Bearer", "bearer"):
            async with s.get(base + "/v1/admin/cache-view/w1", headers={"Authorization": f"{scheme} {TOKEN}"}) as r:
                assert r.status == 404  # past the door: the handler says there is no such worker
                assert error_of(await r.json())["code"] == "worker_not_found"
        async with s.get(base + "/v1/admin/cache-view/w1?dp_rank=z", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            assert r.status == 400
        async with s.get(base + "/v1/admin/nope", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            assert r.status == 404
        for path in ("/health", "/v1/models"):  # not admin: open as before
            async with s.get(base + path) as r:
                assert r.status == 200, path
        for path in ("/v1/workers", "/metrics"):  # every worker's address: a token is set, so they need it
            async with s.get(base + path) as r:
                assert r.status == 401, path
            async with s.get(base + path, headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                assert r.status == 200, path
    assert TOKEN not in caplog.text


async def test_under_round_robin_the_view_still_says_why(fed_server):
    _, base = await fed_server("--admin-token", TOKEN)  # round-robin: no cache view
    async with aiohttp.ClientSession() as s:
        async with s.get(base + "/v1/admin/cache-view/w1", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            assert r.status == 503 and error_of(await r.json())["code"] == "kv_aware_disabled"


@pytest.mark.parametrize("argv, environ, expected", [
    ([], {}, None),
    ([], {"INFERA_ADMIN_TOKEN": TOKEN}, TOKEN),
    ([], {"INFERA_ADMIN_TOKEN": ""}, None),  # empty: off
    (["--admin-token", " other "], {"INFERA_ADMIN_TOKEN": TOKEN}, "other"),  # flag > env; blanks dropped
])
def test_admin_token_flag_and_env(argv, environ, expected):
    assert parse_args(["--etcd-endpoint", "e", *argv], environ=environ).admin_token == expected


@pytest.mark.parametrize("argv, environ, expected", [
    ([], {}, False),
    ([], {"INFERA_ALLOW_CLIENT_KV_TRANSFER_PARAMS": "1"}, True),
    (["--allow-client-kv-transfer-params"], {}, True),
])
def test_allow_client_kv_transfer_params_flag_and_env(argv, environ, expected):
    assert parse_args(["--etcd-endpoint", "e", *argv], environ=environ).allow_client_kv_transfer_params is expected


async def test_client_kv_transfer_params_reach_engines_only_when_allowed(fed_server):
    from aiohttp import web

    from infera.discovery.record import WorkerRecord
    from tests.integration.conftest import LoopbackEngine

    class Engine(LoopbackEngine):
        bodies: list = []

        async def handle(self, request):
            self.bodies.append(await request.json())
            return web.json_response({"id": "x", "choices": [{"message": {"content": "ok"}}]})

    engine = await Engine().start()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.6.6.6", "remote_port": 1}}
    try:
        async with aiohttp.ClientSession() as s:
            for flags, status in (((), 400), (("--allow-client-kv-transfer-params",), 200)):
                server, base = await fed_server(*flags)
                server.fleet.upsert(WorkerRecord(worker_id="w", url=f"http://127.0.0.1:{engine.port}", model_name="m"))
                async with s.post(base + "/v1/chat/completions", json=body) as r:
                    assert r.status == status, await r.text()
                    if status == 400:
                        err = error_of(await r.json())
                        assert err["code"] == "kv_transfer_params_not_allowed" and err["param"] == "kv_transfer_params"
        assert len(Engine.bodies) == 1 and Engine.bodies[0]["kv_transfer_params"]["remote_host"] == "10.6.6.6"
    finally:
        await engine.stop()
