"""Hardening discovery against whoever can write to etcd (issue 27, item 1).

Signed worker records: a "rogue" record is written straight to a real etcd through its HTTP gateway,
as ``etcdctl put`` would. With a fleet key (--fleet-key-file) the server ignores it (logged once) and
never routes to it; a worker launched with the same key is routed to; a server without a key behaves
as before.

etcd authentication: a real etcd with users (enabled through the v3 gateway's /v3/auth/* calls, no
etcdctl) and one serving TLS with --client-cert-auth (certificates made with the openssl CLI): the
right credentials register and are discovered, none or wrong ones are refused with a clear error.
"""
from __future__ import annotations

import asyncio
import base64
import logging
import os
import shutil
import subprocess
import time

import aiohttp
import msgspec
import pytest
from aiohttp import web

from infera.discovery.embedded_etcd import EmbeddedEtcd, EtcdServerTls
from infera.discovery.etcd import (EtcdAuth, EtcdAuthError, EtcdClient, EtcdDiscovery, EtcdRegistration,
                                   EtcdTlsError)
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
    return sum(1 for r in caplog.records if r.name == "infera.discovery.etcd" and f"ignoring worker record at {key!r}"
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
        # Nothing a writer controls reaches the log raw: a key with a line break, a forged key id.
        forged_kid = msgspec.json.decode(encode_record(rogue(worker_id="x"), key))
        forged_kid["signature"]["kid"] = "x\nCRITICAL fake log line"
        await etcd_put(etcd.endpoint, prefix + "line\nbreak", msgspec.json.encode(forged_kid))
        await wait_for(lambda: rejections(caplog, prefix + "line\nbreak") == 1, 10, message="injected key logged")
        assert not any("\n" in r.getMessage() for r in caplog.records if r.name == "infera.discovery.etcd")
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


@pytest.mark.parametrize("keyed", [False, True])
async def test_discovery_survives_a_record_nested_too_deeply(etcd, prefix, keyed) -> None:
    """One record nested past msgspec's limit raised RecursionError out of every re-list: the fleet froze."""
    key = FleetKey(KEY_BYTES) if keyed else None
    deep = b'{"worker_id":"deep","url":"http://x","model_name":"m","disagg_meta":{"x":' + b"[" * 50_000 + b"]" * 50_000
    await etcd_put(etcd.endpoint, prefix + "deep", deep + b"}}")
    await etcd_put(etcd.endpoint, prefix + "good", encode_record(rogue(worker_id="good"), key))
    discovery, fleet = EtcdDiscovery(f"http://{etcd.endpoint}", prefix, backoff_initial=0.05, fleet_key=key), Fleet()
    await discovery.start(fleet)
    try:
        await wait_for(lambda: {r.worker_id for r in fleet.all()} == {"good"}, 10, message="the good worker listed")
        await etcd_put(etcd.endpoint, prefix + "deep2", deep + b"}}")  # and through the watch
        await etcd_put(etcd.endpoint, prefix + "good2", encode_record(rogue(worker_id="good2"), key))
        await wait_for(lambda: {r.worker_id for r in fleet.all()} == {"good", "good2"}, 10, message="good2 watched")
        assert discovery.relists == 1
    finally:
        await discovery.stop()

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



# -- etcd users and passwords ---------------------------------------------------------------------

def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


async def gateway(url: str, path: str, body: dict, token: str | None = None) -> dict:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + path, json=body, headers={"Authorization": token} if token else {}) as resp:
            answer = await resp.json(content_type=None)
            assert resp.status == 200, answer
            return answer


async def add_prefix_user(url: str, root_password: str, user: str, password: str, prefix: str) -> None:
    """A least-privilege user: read/write on ``prefix`` only (what a fleet's server and workers need)."""
    token = (await gateway(url, "/v3/auth/authenticate", {"name": "root", "password": root_password}))["token"]
    await gateway(url, "/v3/auth/role/add", {"name": user}, token)
    await gateway(url, "/v3/auth/role/grant", {"name": user, "perm": {
        "permType": "READWRITE", "key": b64(prefix), "range_end": b64(prefix[:-1] + chr(ord(prefix[-1]) + 1))}}, token)
    await gateway(url, "/v3/auth/user/add", {"name": user, "password": password}, token)
    await gateway(url, "/v3/auth/user/grant", {"user": user, "role": user}, token)


async def test_etcd_user_password(prefix, caplog, tmp_path) -> None:
    caplog.set_level(logging.DEBUG, logger="infera")
    etcd = EmbeddedEtcd(unsafe_no_fsync=True, extra_args=["--auth-token-ttl", "1"])  # tokens expire after 1 s idle
    await etcd.start()
    closers = []
    try:
        root_password = await etcd.enable_auth()
        password = "worker-secret-Pa55"
        await add_prefix_user(etcd.url, root_password, "infera", password, prefix)
        auth = EtcdAuth(user="infera", password=password)
        discovery, fleet = EtcdDiscovery(etcd.url, prefix, backoff_initial=0.05, backoff_max=0.3, etcd_auth=auth), Fleet()
        reg = EtcdRegistration(etcd.url, prefix, 10, etcd_auth=auth)
        closers += [discovery.stop, reg.close]
        await discovery.start(fleet)
        await reg.register(WorkerRecord(worker_id="w1", url="http://127.0.0.1:1", model_name="m"))
        await wait_for(lambda: {r.worker_id for r in fleet.all()} == {"w1"}, 10, message="w1 discovered")

        await asyncio.sleep(2.5)  # both tokens expire (1 s ttl, checked each second): authenticate again
        assert await reg.update(WorkerRecord(worker_id="w1", url="http://127.0.0.1:1", model_name="m",
                                             status="draining"))
        await wait_for(lambda: fleet.active("m") == () and len(fleet) == 1, 10, message="w1 draining")
        assert reg.client.authentications >= 2
        await asyncio.sleep(2.5)
        await reg.deregister()
        await wait_for(lambda: len(fleet) == 0, 10, message="w1 gone")

        # No credentials, or wrong ones: refused at once (not retried for first_timeout), with a clear error.
        for bad in (None, EtcdAuth(user="infera", password="wrong")):
            anon = EtcdRegistration(etcd.url, prefix, 10, etcd_auth=bad, first_timeout=30)
            closers.append(anon.close)
            started = time.monotonic()
            with pytest.raises(EtcdAuthError) as info:
                await anon.register(WorkerRecord(worker_id="anon", url="http://127.0.0.1:9", model_name="m"))
            assert time.monotonic() - started < 5
            assert ("no credentials" if bad is None else "authentication failed") in str(info.value)
        # The prefix user may not write elsewhere.
        outside = EtcdClient(etcd.url, auth=auth)
        closers.append(outside.close)
        with pytest.raises(EtcdAuthError, match="permission denied"):
            await outside.put("/elsewhere/x", b"1")

        text = " ".join(r.getMessage() for r in caplog.records)
        assert "authenticating again" in text  # the expiry was seen and handled
        assert password not in text and root_password not in text
        assert reg.client._token is None or reg.client._token not in text
        assert password not in repr(auth)
    finally:
        for close in reversed(closers):
            await close()
        await etcd.stop()


def test_etcd_credential_flags(tmp_path) -> None:
    from infera.discovery import discovery_options
    from infera.server.cli import parse_args

    pw = tmp_path / "etcd.pw"
    pw.write_text("from-a-file\n")
    args = parse_args(["--etcd-endpoint", "h:1", "--etcd-user", "infera", "--etcd-password-file", str(pw)], environ={})
    auth = discovery_options(args)["etcd_auth"]
    assert (auth.user, auth.password) == ("infera", "from-a-file")
    env = {"INFERA_ETCD_USER": "infera", "INFERA_ETCD_PASSWORD": "from-env"}
    assert discovery_options(parse_args(["--etcd-endpoint", "h:1"], environ=env), env)["etcd_auth"].password == "from-env"
    assert "etcd_auth" not in discovery_options(parse_args(["--etcd-endpoint", "h:1"], environ={}), {})
    for argv in (["--etcd-user", "infera"],  # no password anywhere
                 ["--etcd-user", "infera", "--etcd-password-file", str(tmp_path / "missing")],
                 ["--etcd-cert", str(pw)]):  # a certificate without its key
        with pytest.raises(SystemExit):
            parse_args(["--etcd-endpoint", "h:1", *argv], environ={})


# -- etcd TLS with client certificates ------------------------------------------------------------

def make_certs(folder) -> dict[str, str]:
    """A CA, and a server and a client certificate it signed (SAN 127.0.0.1), with the openssl CLI."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl CLI")
    run = lambda *a: subprocess.run(["openssl", *a], cwd=folder, check=True, capture_output=True)  # noqa: E731
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=infera-test-ca")
    for who in ("server", "client"):
        (folder / f"{who}.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                           "extendedKeyUsage=serverAuth,clientAuth\n")
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{who}.key", "-out", f"{who}.csr", "-subj", f"/CN={who}")
        run("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{who}.pem", "-days", "2", "-extfile", f"{who}.ext")
    return {name: os.path.join(folder, name) for name in ("ca.pem", "server.pem", "server.key", "client.pem",
                                                           "client.key")}


async def test_etcd_tls_client_certificates(prefix, tmp_path) -> None:
    c = make_certs(tmp_path)
    etcd = EmbeddedEtcd(unsafe_no_fsync=True, tls=EtcdServerTls(
        cert=c["server.pem"], key=c["server.key"], ca=c["ca.pem"], client_ca=c["ca.pem"],
        client_cert=c["client.pem"], client_key=c["client.key"]))
    await etcd.start()
    closers = []
    try:
        assert etcd.url.startswith("https://")
        from infera.discovery import discovery_options
        from infera.server.cli import parse_args

        args = parse_args(["--etcd-endpoint", etcd.url, "--etcd-prefix", prefix, "--etcd-cacert", c["ca.pem"],
                           "--etcd-cert", c["client.pem"], "--etcd-key", c["client.key"]], environ={})
        auth = discovery_options(args)["etcd_auth"]
        discovery, fleet = EtcdDiscovery(etcd.url, prefix, backoff_initial=0.05, etcd_auth=auth), Fleet()
        reg = EtcdRegistration(etcd.url, prefix, 10, etcd_auth=auth)
        closers += [discovery.stop, reg.close]
        await discovery.start(fleet)
        await reg.register(WorkerRecord(worker_id="tls", url="http://127.0.0.1:1", model_name="m"))
        await wait_for(lambda: {r.worker_id for r in fleet.all()} == {"tls"}, 10, message="worker over TLS")

        for bad, hint in ((EtcdAuth(cacert=c["ca.pem"]), "BAD_CERTIFICATE"),  # etcd wants a client certificate
                          (None, "CERTIFICATE_VERIFY_FAILED")):  # etcd's certificate is not trusted
            anon = EtcdRegistration(etcd.url, prefix, 10, etcd_auth=bad, first_timeout=30)
            closers.append(anon.close)
            started = time.monotonic()
            with pytest.raises(EtcdTlsError, match="--etcd-cert") as info:
                await anon.register(WorkerRecord(worker_id="anon", url="http://127.0.0.1:9", model_name="m"))
            assert hint in str(info.value) and time.monotonic() - started < 5
        assert {r.worker_id for r in fleet.all()} == {"tls"}
    finally:
        for close in reversed(closers):
            await close()
        await etcd.stop()


@pytest.mark.parametrize("flags, message", [
    (("--fleet-key-file", "/nonexistent/fleet.key"), "cannot read the fleet key file"),
    (("--etcd-user", "infera"), "needs both a user"),
])
async def test_launcher_refuses_unusable_credentials_at_start(flags, message) -> None:
    """A worker whose key or etcd credentials are unusable stops at once with a usage error (exit 2),
    before starting its engine."""
    import sys

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "infera.engine.sim", "--etcd-endpoint", "127.0.0.1:1", *flags, "--model", "m",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp")})
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2, out.decode(errors="replace")[-2000:]
    assert message in out.decode(errors="replace")
