"""POST /v1/admin/profile/start and /stop: a real router fanning out to simulated engines' profiler
endpoints over loopback HTTP, each engine recording the calls it got (reference §2.2)."""
from __future__ import annotations

import contextlib

import aiohttp
import pytest

from infera.discovery.record import WorkerRecord
from infera.engine.sim.server import SimServer, parse_args
from infera.server.cli import parse_args as server_args
from tests.conftest import free_port

pytestmark = pytest.mark.integration

TOKEN = "profiling-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
async def sims():
    async with contextlib.AsyncExitStack() as stack:
        async def start(model: str = "m") -> SimServer:
            return await stack.enter_async_context(
                SimServer(parse_args(["--model", model, "--host", "127.0.0.1", "--port", "0", "--speedup", "1000"])))

        yield start


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


def rec(worker_id: str, sim: SimServer | str, model: str = "m", **fields) -> WorkerRecord:
    url = sim if isinstance(sim, str) else sim.url
    return WorkerRecord(worker_id=worker_id, url=url, model_name=model, **fields)


async def call(http, base: str, action: str, *, query: str = "", json=None, data=None, headers=AUTH):
    async with http.post(f"{base}/v1/admin/profile/{action}{query}", json=json, data=data, headers=headers) as r:
        return r.status, await r.json()


@pytest.fixture
async def fleet(fed_server, sims):
    """A profiling-enabled router over a mixed sim of model m, a PD pair of model m, and a mixed
    sim of model n; returns (base, {worker_id: sim})."""
    server, base = await fed_server("--enable-profiling", "--admin-token", TOKEN)
    mixed, prefill, decode, other = await sims(), await sims(), await sims(), await sims("n")
    server.fleet.replace_all([
        rec("m-mixed", mixed), rec("m-prefill", prefill, disagg_mode="prefill"),
        rec("m-decode", decode, disagg_mode="decode"), rec("n-mixed", other, model="n"),
    ])
    return base, {"m-mixed": mixed, "m-prefill": prefill, "m-decode": decode, "n-mixed": other}


def calls(sims: dict[str, SimServer]) -> dict[str, list]:
    return {wid: list(s.engine.profile_calls) for wid, s in sims.items()}


async def test_start_and_stop_every_active_worker(fleet, http):
    base, sims = fleet
    status, report = await call(http, base, "start")
    assert status == 200
    assert (report["action"], report["requested"], report["succeeded"]) == ("start", 4, 4)
    assert [r["worker_id"] for r in report["results"]] == ["m-decode", "m-mixed", "m-prefill", "n-mixed"]
    first = report["results"][0]
    assert first == {"worker_id": "m-decode", "url": sims["m-decode"].url, "engine": "sim", "status_code": 200,
                     "ok": True, "detail": "", "error": None}
    assert calls(sims) == {wid: [("start", {})] for wid in sims}
    status, report = await call(http, base, "stop")
    assert status == 200 and report["succeeded"] == 4
    assert calls(sims) == {wid: [("start", {}), ("stop", {})] for wid in sims}


@pytest.mark.parametrize("query, body, selected", [
    ("?model=m", None, {"m-mixed", "m-prefill", "m-decode"}),
    ("", {"model": "n"}, {"n-mixed"}),
    ("?role=prefill", None, {"m-prefill"}),
    ("", {"role": "mixed"}, {"m-mixed", "n-mixed"}),
    ("?model=m&role=decode", None, {"m-decode"}),
    ("?worker_id=m-mixed,n-mixed", None, {"m-mixed", "n-mixed"}),
    ("?worker_id=m-mixed&worker_id=m-decode", None, {"m-mixed", "m-decode"}),
    ("", {"worker_id": ["m-prefill", "n-mixed"]}, {"m-prefill", "n-mixed"}),
    ("", {"worker_id": "m-prefill"}, {"m-prefill"}),
    ("?role=decode", {"role": "prefill", "model": "n"}, set()),  # the query's role wins, the body's model holds
    ("?role=decode", {"role": "prefill"}, {"m-decode"}),
    ("?worker_id=n-mixed", {"worker_id": "m-mixed"}, {"n-mixed"}),
])
async def test_selectors(fleet, http, query, body, selected):
    base, sims = fleet
    status, report = await call(http, base, "start", query=query, json=body)
    if not selected:
        assert status == 404 and report["error"]["code"] == "worker_not_found"
        assert all(not c for c in calls(sims).values())
        return
    assert status == 200 and {r["worker_id"] for r in report["results"]} == selected
    assert {wid for wid, c in calls(sims).items() if c} == selected


async def test_other_body_keys_are_the_profilers_options(fleet, http):
    base, sims = fleet
    options = {"profile_prefix": "run-1", "max_iterations": 5, "num_steps": 3}  # vLLM's and SGLang's
    status, _ = await call(http, base, "start", query="?worker_id=m-mixed", json={"role": "mixed", **options})
    assert status == 200
    assert sims["m-mixed"].engine.profile_calls == [("start", options)]


@pytest.mark.parametrize("query, body, code", [
    ("?role=leader", None, "invalid_role"),
    ("", {"role": "everything"}, "invalid_role"),
    ("", {"model": 5}, "invalid_request"),
    ("", {"worker_id": []}, "invalid_request"),
    ("?model=m&model=n", None, "invalid_request"),
    ("", [1, 2], "invalid_request"),
])
async def test_bad_selectors_are_400(fleet, http, query, body, code):
    base, sims = fleet
    status, reply = await call(http, base, "start", query=query, json=body)
    assert status == 400 and reply["error"]["code"] == code and reply["error"]["type"] == "invalid_request_error"
    assert all(not c for c in calls(sims).values())


async def test_malformed_json_is_400(fleet, http):
    base, _ = fleet
    status, reply = await call(http, base, "start", data=b"{not json", headers={**AUTH,
                                                                                "Content-Type": "application/json"})
    assert status == 400 and reply["error"]["code"] == "invalid_json"


async def test_no_match_is_404(fleet, http):
    base, _ = fleet
    status, reply = await call(http, base, "stop", query="?worker_id=ghost")
    assert status == 404 and reply["error"]["code"] == "worker_not_found" and "ghost" in reply["error"]["message"]


async def test_draining_workers_are_not_profiled(fed_server, sims, http):
    server, base = await fed_server("--enable-profiling", "--admin-token", TOKEN)
    live, leaving = await sims(), await sims()
    server.fleet.replace_all([rec("live", live), rec("leaving", leaving, status="draining")])
    status, report = await call(http, base, "start")
    assert status == 200 and [r["worker_id"] for r in report["results"]] == ["live"]
    assert leaving.engine.profile_calls == []


async def test_failures_are_reported_per_worker_as_502(fed_server, sims, http):
    """One engine answers, one is unreachable, one has no profiler endpoint (a vLLM started without a
    profiler config answers 404): the report says which, under an OpenAI error."""
    server, base = await fed_server("--enable-profiling", "--admin-token", TOKEN)
    good = await sims()
    no_profiler = aiohttp.web.Application()
    runner = aiohttp.web.AppRunner(no_profiler)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        bare = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        server.fleet.replace_all([rec("a-good", good), rec("b-gone", f"http://127.0.0.1:{free_port()}"),
                                  rec("c-bare", bare, engine="vllm")])
        status, report = await call(http, base, "start")
    finally:
        await runner.cleanup()
    assert status == 502 and report["error"]["code"] == "profile_failed"
    assert report["error"]["type"] == "server_error" and "2 of 3" in report["error"]["message"]
    assert (report["requested"], report["succeeded"]) == (3, 1)
    good_r, gone, bare_r = report["results"]
    assert good_r["ok"] and good.engine.profile_calls == [("start", {})]
    assert (gone["ok"], gone["status_code"]) == (False, None) and gone["error"].startswith("unreachable")
    assert (bare_r["ok"], bare_r["status_code"], bare_r["engine"]) == (False, 404, "vllm")
    assert bare_r["error"].startswith("engine answered HTTP 404")


async def test_dp_ranks_behind_one_url_share_one_call(fed_server, sims, http):
    server, base = await fed_server("--enable-profiling", "--admin-token", TOKEN)
    sim = await sims()
    server.fleet.replace_all([rec(f"dp-{r}", sim, dp_rank=r, dp_size=2) for r in range(2)])
    status, report = await call(http, base, "start")
    assert status == 200 and report["succeeded"] == 2 and sim.engine.profile_calls == [("start", {})]


# -- off, and behind the admin token ------------------------------------------------------------------------

async def test_off_without_the_flag_is_404(fed_server, sims, http):
    server, base = await fed_server("--admin-token", TOKEN)
    sim = await sims()
    server.fleet.upsert(rec("w", sim))
    for action in ("start", "stop"):
        status, reply = await call(http, base, action)
        assert status == 404 and reply["error"]["code"] == "profiling_disabled"
        assert "--enable-profiling" in reply["error"]["message"] and reply["error"]["type"] == "not_found_error"
    assert sim.engine.profile_calls == []


async def test_behind_the_admin_token(fed_server, sims, http):
    server, base = await fed_server("--enable-profiling", "--admin-token", TOKEN)
    sim = await sims()
    server.fleet.upsert(rec("w", sim))
    status, reply = await call(http, base, "start", headers={"Authorization": "Bearer wrong"})
    assert status == 401 and reply["error"]["code"] == "invalid_admin_token"
    _, open_base = await fed_server("--enable-profiling")  # no token: every admin endpoint is off
    status, reply = await call(http, open_base, "start", headers={})
    assert status == 403 and reply["error"]["code"] == "admin_disabled"
    assert sim.engine.profile_calls == []


@pytest.mark.parametrize("argv, environ, enabled", [
    ([], {}, False),
    ([], {"INFERA_ENABLE_PROFILING": "1"}, True),
    ([], {"INFERA_ENABLE_PROFILING": "yes"}, True),
    ([], {"INFERA_ENABLE_PROFILING": "0"}, False),
    (["--enable-profiling"], {"INFERA_ENABLE_PROFILING": "0"}, True),
])
def test_flag_env_default(argv, environ, enabled):
    assert server_args(["--etcd-endpoint", "x:1", *argv], environ=environ).enable_profiling is enabled
