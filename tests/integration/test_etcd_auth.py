"""Hardening discovery against whoever can write to etcd (issue 27, item 1): signed worker records.

A "rogue" record is written straight to a real etcd through its HTTP gateway, as ``etcdctl put``
would. With a fleet key (--fleet-key-file) the server ignores it (logged once) and never routes to
it; a worker launched with the same key is routed to; a server without a key behaves as before.
"""
from __future__ import annotations

import base64
import logging

import aiohttp
import pytest
from aiohttp import web

from infera.discovery.etcd import EtcdDiscovery, EtcdRegistration
from infera.discovery.fleet import Fleet
from infera.discovery.record import FleetKey, WorkerRecord, encode_record
from tests.conftest import wait_for

pytestmark = pytest.mark.integration

KEY_BYTES = b"fleet-secret-for-tests-0123456789"


async def etcd_put(endpoint: str, key: str, value: bytes) -> None:
    """What ``etcdctl put`` does: one unauthenticated write through etcd's v3 gateway."""
    body = {"key": base64.b64encode(key.encode()).decode(), "value": base64.b64encode(value).decode()}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://{endpoint}/v3/kv/put", json=body) as resp:
            assert resp.status == 200, await resp.text()


def rogue(url: str = "http://127.0.0.1:9", worker_id: str = "evil:1", model: str = "sim-model") -> WorkerRecord:
    return WorkerRecord(worker_id=worker_id, url=url, model_name=model)


def rejections(caplog: pytest.LogCaptureFixture, key: str) -> int:
    return sum(1 for r in caplog.records if r.name == "infera.discovery.etcd" and "ignoring worker record at " + key
               in r.getMessage())


async def test_discovery_ignores_unsigned_and_foreign_records(etcd, prefix, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="infera.discovery.etcd")
    key = FleetKey(KEY_BYTES)
    keyed, keyed_fleet = EtcdDiscovery(f"http://{etcd.endpoint}", prefix, backoff_initial=0.05, fleet_key=key), Fleet()
    plain, plain_fleet = EtcdDiscovery(f"http://{etcd.endpoint}", prefix, backoff_initial=0.05), Fleet()
    reg = EtcdRegistration(etcd.endpoint, prefix, 10, fleet_key=key)
    try:
        await etcd_put(etcd.endpoint, prefix + "before", encode_record(rogue(worker_id="before")))  # seen by the list
        await keyed.start(keyed_fleet)
        await plain.start(plain_fleet)
        await reg.register(WorkerRecord(worker_id="good", url="http://127.0.0.1:1", model_name="sim-model"))
        for _ in range(3):  # rewritten: logged once per key, not per watch event
            await etcd_put(etcd.endpoint, prefix + "evil:1", encode_record(rogue()))
        await etcd_put(etcd.endpoint, prefix + "foreign", encode_record(rogue(worker_id="foreign"),
                                                                         FleetKey(b"another-key-0123456789")))
        await wait_for(lambda: {r.worker_id for r in plain_fleet.all()} == {"before", "good", "evil:1", "foreign"}, 10,
                       message="the keyless server sees every record, as before")
        await wait_for(lambda: rejections(caplog, prefix + "foreign") == 1, 10, message="foreign record logged")
        assert {r.worker_id for r in keyed_fleet.all()} == {"good"}
        assert [r.worker_id for r in keyed_fleet.active("sim-model")] == ["good"]
        assert rejections(caplog, prefix + "evil:1") == 1 and rejections(caplog, prefix + "before") == 1
        messages = " ".join(r.getMessage() for r in caplog.records)
        assert "unsigned record" in messages and "another fleet key" in messages
        # A legit worker's record copied over with one field changed (its URL) is no longer signed.
        good = await reg.client.range_prefix(prefix + "good")
        forged = good[1][0][1].replace(b"http://127.0.0.1:1", b"http://127.0.0.1:9")
        await etcd_put(etcd.endpoint, prefix + "good-copy", forged)
        await wait_for(lambda: rejections(caplog, prefix + "good-copy") == 1, 10, message="forged copy logged")
        assert [r.url for r in keyed_fleet.all()] == ["http://127.0.0.1:1"]
    finally:
        await reg.deregister()
        await reg.close()
        await keyed.stop()
        await plain.stop()


async def test_server_with_the_key_never_routes_to_a_rogue_record(etcd, prefix, make_server, spawn_worker, tmp_path,
                                                                  caplog) -> None:
    """The probe: a record put into etcd by hand used to receive 6 of 8 prompts."""
    caplog.set_level(logging.WARNING, logger="infera.discovery.etcd")
    key_file = tmp_path / "fleet.key"
    key_file.write_bytes(KEY_BYTES + b"\n")
    stolen: list[bytes] = []

    async def evil(request: web.Request) -> web.Response:
        stolen.append(await request.read())
        return web.json_response({"error": "gotcha"}, status=500)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", evil)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    evil_url = "http://127.0.0.1:%d" % site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        await etcd_put(etcd.endpoint, prefix + "evil:1", encode_record(rogue(evil_url)))
        server = await make_server("--router-policy", "round-robin", "--fleet-key-file", str(key_file),
                                   "--request-max-retries", "0")
        w = await spawn_worker(launcher_args=("--fleet-key-file", str(key_file)))
        await wait_for(lambda: {r.worker_id for r in server.fleet.all()} == {w.worker_id}, 60,
                       message="the signed worker registered")
        await etcd_put(etcd.endpoint, prefix + "evil:2", encode_record(rogue(evil_url, "evil:2")))
        await wait_for(lambda: rejections(caplog, prefix + "evil:2") == 1, 10, message="the second rogue logged")
        body = {"model": "sim-model", "messages": [{"role": "user", "content": "secret prompt"}], "max_tokens": 4}
        async with aiohttp.ClientSession() as session:
            for _ in range(8):
                async with session.post(f"http://127.0.0.1:{server.port}/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
        assert stolen == []
        assert {r.worker_id for r in server.fleet.all()} == {w.worker_id}
        assert rejections(caplog, prefix + "evil:1") == 1
    finally:
        await runner.cleanup()

