"""The router and the lower KV tiers end to end: sim workers with a host tier publish it over real
ZMQ KV events, the router scores it and reports it (GET /v1/kv-stats), and POST /v1/cache/prewarm
reaches a real ``python -m infera.kvd`` process."""
from __future__ import annotations

import aiohttp
import pytest

from infera.api.errors import ApiError
from infera.discovery.record import WorkerRecord
from infera.engine.base.prom import sample_sum
from infera.kvd.client import KvdClient
from infera.server.kv_tiers import handle_prewarm
from tests.conftest import free_port, wait_for
from tests.integration.conftest import wait_workers
from tests.integration.test_kvd_daemon import KvdProcess
from tests.integration.test_kv_routing import chat, post

pytestmark = pytest.mark.integration

ADMIN_TOKEN = "kv-tiers-test-admin"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture
async def kvd_with_metrics():
    port = free_port()
    d = KvdProcess("--max-bytes", "1M", "--shared-arena-bytes", "0", "--metrics-port", str(port)).start()
    await d.ready()
    d.metrics_url = f"http://127.0.0.1:{port}/metrics"
    yield d
    d.stop()


async def get_json(s: aiohttp.ClientSession, url: str, headers: dict | None = None) -> tuple[int, dict]:
    async with s.get(url, headers=headers) as r:
        return r.status, await r.json()


async def test_host_tier_is_seen_scored_and_reported(make_server, spawn_worker):
    server = await make_server("--admin-token", ADMIN_TOKEN)
    # a GPU cache of 96 blocks: four conversations' prefixes do not fit, the host tier keeps them
    w = await spawn_worker("--num-gpu-blocks", "96", "--max-model-len", "1536", "--kv-offload-blocks", "4096")
    await wait_workers(server, {w.worker_id})
    base = f"http://127.0.0.1:{server.port}"
    async with aiohttp.ClientSession() as s:
        await wait_for(lambda: server.kv.subscriber.stats(w.worker_id).get("connected"), 10, message="subscribed")
        for g in range(4):
            await post(s, base, chat(g, "first question"))
        await wait_for(lambda: server.kv.index.tier_block_counts(w.worker_id).get("CPU", 0) > 0, 10,
                       message="the host tier in the router's view")
        # kv-stats: behind the admin token, per host, per tier
        async with s.get(base + "/v1/kv-stats") as r:
            assert r.status == 401
            assert (await r.json())["error"]["code"] == "invalid_admin_token"
        status, stats = await get_json(s, base + "/v1/kv-stats", ADMIN)
        assert status == 200 and stats["kvd"] is None and stats["kv_view"] is True
        [host] = stats["hosts"].values()
        [target] = host["workers"][0]["targets"]
        assert target["route_key"] == w.worker_id and target["tiers"]["CPU"] > 0 and target["tiers"]["GPU"] > 0
        assert host["tiers"] == target["tiers"]
        # group 0 left the GPU: its prefix is loaded back from the host, reported as cached
        _, reply = await post(s, base, chat(0, "second question"))
        cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 16 * 10, reply["usage"]
        # the engine counts them as loaded by its connector, not as GPU hits
        assert await w.engine_metric(s, "vllm:external_prefix_cache_hits_total") >= cached - 16
        # the router predicted them (GPU + lower tier), as the engine reported
        async with s.get(f"{base}/v1/admin/cache-view/{w.worker_id}", headers=ADMIN) as r:
            view = await r.json()
        assert view["prediction"]["observations"] == 5
        assert view["prediction"]["exact"] == 5, view["prediction"]


async def test_prewarm_sends_one_hint_to_the_local_kvd(make_server, kvd_with_metrics):
    kvd = kvd_with_metrics
    server = await make_server("--kvd-socket-path", kvd.socket)
    base = f"http://127.0.0.1:{server.port}"
    key_in_ram, key_absent = b"\x11" * 16, b"\x22" * 16
    client = await KvdClient.connect(kvd.socket)
    try:
        await client.set(key_in_ram, b"v" * 64, model="m", compat_key="c")
    finally:
        await client.close()
    async with aiohttp.ClientSession() as s:
        body = {"model": "m", "compat_key": "c", "block_hashes": [key_in_ram.hex(), key_absent.hex()],
                "deadline_ms": 5000}
        async with s.post(base + "/v1/cache/prewarm", json=body) as r:
            assert r.status == 202, await r.text()
            assert await r.json() == {"accepted": True, "n_keys": 2}

        async def outcomes() -> tuple[float, float]:
            async with s.get(kvd.metrics_url) as r:
                text = await r.text()
            return (sample_sum(text, "infera_kvd_prefetch_keys_total", 'outcome="in_ram"'),
                    sample_sum(text, "infera_kvd_prefetch_keys_total", 'outcome="absent"'))

        async def both_seen() -> bool:
            return await outcomes() == (1.0, 1.0)

        await wait_for(both_seen, 10, message="kvd handled the hint")
        # an empty list is accepted without a hint
        async with s.post(base + "/v1/cache/prewarm", json={"model": "m", "block_hashes": []}) as r:
            assert r.status == 202 and await r.json() == {"accepted": True, "n_keys": 0}
        # kv-stats carries the kvd's counters (no admin token on this server: open)
        status, stats = await get_json(s, base + "/v1/kv-stats")
        assert status == 200 and stats["kvd"]["reachable"] is True and stats["kvd"]["socket_path"] == kvd.socket
        assert "prefetch_dropped_total" in stats["kvd"]["stats"]
        # the daemon goes away: 503, and kv-stats says it is unreachable
        kvd.stop()
        async with s.post(base + "/v1/cache/prewarm", json=body) as r:
            assert r.status == 503
            err = (await r.json())["error"]
            assert err["code"] == "kvd_unavailable" and kvd.socket not in err["message"]  # (the path: logs only)
        status, stats = await get_json(s, base + "/v1/kv-stats")
        assert status == 200 and stats["kvd"]["reachable"] is False


BAD_BODIES = [
    pytest.param(b"{not json", "", id="bad-json"),
    pytest.param(b"[]", "", id="not-an-object"),
    pytest.param(b'{"block_hashes": []}', "model", id="no-model"),
    pytest.param(b'{"model": "m", "block_hashes": "00"}', "block_hashes", id="hashes-not-a-list"),
    pytest.param(b'{"model": "m", "block_hashes": ["zz"]}', "block_hashes", id="bad-hex"),
    pytest.param(b'{"model": "m", "block_hashes": [1]}', "block_hashes", id="hash-not-a-string"),
    pytest.param(b'{"model": "m", "block_hashes": [], "compat_key": 3}', "compat_key", id="compat-key-not-str"),
    pytest.param(b'{"model": "m", "block_hashes": [], "deadline_ms": 0}', "deadline_ms", id="deadline-0"),
    pytest.param(b'{"model": "m", "block_hashes": [], "deadline_ms": true}', "deadline_ms", id="deadline-bool"),
    pytest.param(b'{"model": "m", "block_hashes": [], "worker_id": ""}', "worker_id", id="worker-id-empty"),
]


async def test_prewarm_validation_and_configuration(make_server):
    server = await make_server()  # no --kvd-socket-path
    base = f"http://127.0.0.1:{server.port}"
    async with aiohttp.ClientSession() as s:
        for case in BAD_BODIES:
            raw, param = case.values
            async with s.post(base + "/v1/cache/prewarm", data=raw,
                              headers={"Content-Type": "application/json"}) as r:
                assert r.status == 400, (case.id, await r.text())
                err = (await r.json())["error"]
                assert set(err) >= {"message", "type", "code"} and err["code"] == "invalid_request", case.id
                if param:
                    assert err.get("param") == param, case.id
        async with s.post(base + "/v1/cache/prewarm", json={"model": "m", "block_hashes": ["00ff"]}) as r:
            assert r.status == 503
            assert (await r.json())["error"]["code"] == "kvd_not_configured"
        # a worker id the fleet does not know
        async with s.post(base + "/v1/cache/prewarm",
                          json={"model": "m", "block_hashes": ["00"], "worker_id": "nope"}) as r:
            assert r.status == 404


async def test_prewarm_worker_id_must_be_on_this_host(make_server, spawn_worker, kvd_with_metrics):
    kvd = kvd_with_metrics
    server = await make_server("--kvd-socket-path", kvd.socket)
    w = await spawn_worker()  # on 127.0.0.1: this host
    await wait_workers(server, {w.worker_id})
    base = f"http://127.0.0.1:{server.port}"
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/v1/cache/prewarm",
                          json={"model": "sim-model", "block_hashes": ["01"], "worker_id": w.worker_id}) as r:
            assert r.status == 202, await r.text()
    # a worker on another host: its kvd is not this router's to reach
    remote = WorkerRecord(worker_id="far", url="http://10.200.0.9:8000", model_name="m", kv_block_size=16)
    with pytest.raises(ApiError) as err:
        await handle_prewarm(b'{"model": "m", "block_hashes": ["01"], "worker_id": "far"}', kvd.socket,
                             {"far": remote}.get)
    assert err.value.status == 400 and "only the kvd on its own host" in err.value.message


async def test_prewarm_goes_to_the_kvd_the_named_worker_registered(kvd_with_metrics):
    """No --kvd-socket-path on the router: a local worker whose record names its kvd gets the hint
    there; one that names none is a 503 that says what to configure."""
    kvd = kvd_with_metrics
    with_kvd = WorkerRecord(worker_id="w-kvd", url="http://127.0.0.1:8000", model_name="m", kv_block_size=16,
                            kvd_socket=kvd.socket)
    without = WorkerRecord(worker_id="w-plain", url="http://127.0.0.1:8001", model_name="m", kv_block_size=16)
    fleet = {w.worker_id: w for w in (with_kvd, without)}.get
    body = b'{"model": "m", "block_hashes": ["0102"], "worker_id": "w-kvd", "deadline_ms": 5000}'
    assert await handle_prewarm(body, None, fleet) == b'{"accepted":true,"n_keys":1}'

    async def absent_seen() -> bool:
        async with aiohttp.ClientSession() as s, s.get(kvd.metrics_url) as r:
            return sample_sum(await r.text(), "infera_kvd_prefetch_keys_total", 'outcome="absent"') == 1.0

    await wait_for(absent_seen, 10, message="the worker's kvd handled the hint")
    with pytest.raises(ApiError) as err:
        await handle_prewarm(body.replace(b"w-kvd", b"w-plain"), None, fleet)
    assert err.value.status == 503 and err.value.code == "kvd_not_configured"
