"""NATS credentials and TLS against a real nats-server: user/password (flag, file and env), an
NKey seed, TLS with a CA and a client certificate; both NATS clients (nats-py for JetStream, the
lean core client for requests) connect with them, anonymous clients are refused, and no log line
carries the password. Also the embedded NATS of ``python -m infera.up``, which refuses anonymous
clients."""
from __future__ import annotations

import asyncio
import glob
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile

import nats
import pytest

from infera.server.cli import parse_args
from infera.transport.nats_auth import NatsAuth
from infera.transport.nats_conn import NatsConnection
from tests.conftest import NatsProcess, free_port, stop_process_group
from tests.integration.conftest import wait_workers

PASSWORD = "pw-Zq8r7xT2-never-logged"
USER = "infera-svc"


async def _connects(conn: NatsConnection, timeout: float = 10.0) -> bool:
    """Both the JetStream connection and the request (core) connection come up."""
    await conn.start()
    core = conn.core()
    ok = await conn.wait_connected(timeout) and await core.wait_connected(timeout)
    if ok:  # a round trip on each: the server took CONNECT
        await conn.nc.flush(timeout=5)
        await core.flush(timeout=5)
    return ok


async def _refused(conn: NatsConnection, wait: float = 1.5) -> bool:
    await conn.start()
    core = conn.core()
    await asyncio.sleep(wait)
    return not conn.nc.is_connected and not core.connected


@pytest.fixture(scope="module")
def password_nats():
    n = NatsProcess(extra_conf=f'authorization {{ user: "{USER}", password: "{PASSWORD}" }}')
    n.start()
    yield n
    n.cleanup()


async def test_user_password_from_a_file_or_env_connects_and_anonymous_is_refused(password_nats, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    pw_file = tmp_path / "pw"
    pw_file.write_text(PASSWORD + "\n")
    base = ["--etcd-endpoint", "127.0.0.1:2379", "--request-transport", "nats", "--nats-server", password_nats.url]
    by_file = parse_args(base + ["--nats-user", USER, "--nats-password-file", str(pw_file)], environ={})
    by_env = parse_args(base, environ={"INFERA_NATS_USER": USER, "INFERA_NATS_PASSWORD": PASSWORD})
    conns = [NatsConnection.from_args(by_file, name="t-file"),
             NatsConnection(password_nats.url, name="t-env", auth=NatsAuth.from_args(
                 by_env, {"INFERA_NATS_PASSWORD": PASSWORD}))]
    anonymous = NatsConnection(password_nats.url, name="t-anon", reconnect_wait=0.2)
    wrong = NatsConnection(password_nats.url, name="t-wrong", reconnect_wait=0.2,
                           auth=NatsAuth(user=USER, password="not-" + PASSWORD))
    try:
        for c in conns:
            assert await _connects(c), c.name
        assert await _refused(anonymous)
        assert await _refused(wrong)
    finally:
        for c in [*conns, anonymous, wrong]:
            await c.close()
    assert PASSWORD not in caplog.text
    assert "Authorization" in caplog.text or "authorization" in caplog.text  # the refusal was said


async def test_credentials_in_the_url_never_reach_a_log_line_or_an_error(password_nats, caplog):
    caplog.set_level(logging.DEBUG)
    url = f"nats://{USER}:{PASSWORD}@127.0.0.1:{password_nats.port}"
    conn = NatsConnection(url, name="t-url")
    bad = NatsConnection(f"nats://{USER}:{PASSWORD}@127.0.0.1:{free_port()}", name="t-url-down", reconnect_wait=0.2)
    try:
        assert await _connects(conn)
        await bad.start()
        bad.core()
        await asyncio.sleep(0.6)  # the "cannot reach" warnings
        assert PASSWORD not in ",".join(conn.servers) and "***@127.0.0.1" in conn.servers[0]
    finally:
        await conn.close()
        await bad.close()
    assert "connected to NATS at 127.0.0.1" in caplog.text
    assert "cannot reach NATS" in caplog.text
    assert PASSWORD not in caplog.text


def test_an_unreadable_credentials_file_is_a_usage_error_at_start(tmp_path, capsys):
    base = ["--etcd-endpoint", "127.0.0.1:2379", "--request-transport", "nats"]
    for flag in ("--nats-creds", "--nats-nkey-seed", "--nats-tls-ca", "--nats-password-file"):
        with pytest.raises(SystemExit):
            parse_args(base + [flag, str(tmp_path / "missing")], environ={})
        assert "missing" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a user without a password
        parse_args(base + ["--nats-user", USER], environ={})
    assert "password" in capsys.readouterr().err
    cert = tmp_path / "c.pem"
    cert.write_text("not a certificate")
    with pytest.raises(SystemExit):
        parse_args(base + ["--nats-tls-ca", str(cert)], environ={})
    assert "TLS" in capsys.readouterr().err


# -- a server and a sim worker through the password-protected broker -------------------------------
async def test_server_and_worker_route_through_an_authenticated_nats(password_nats, make_server, etcd, prefix,
                                                                     tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    import aiohttp

    pw_file = tmp_path / "pw"
    pw_file.write_text(PASSWORD)
    nats_flags = ["--request-transport", "nats", "--kv-event-transport", "nats", "--nats-server", password_nats.url]
    port = free_port()
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        # The worker takes its password from the environment, the server from a file.
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "infera.engine.sim", "--etcd-endpoint", etcd.endpoint, "--etcd-prefix", prefix,
            "--lease-ttl", "2", "--log-level", "debug", *nats_flags, "--nats-user", USER,
            "--model", "sim-model", "--port", str(port), "--host", "127.0.0.1", "--speedup", "50",
            stdout=log, stderr=log, start_new_session=True,
            env={**os.environ, "INFERA_NATS_PASSWORD": PASSWORD})
    try:
        server = await make_server(*nats_flags, "--nats-user", USER, "--nats-password-file", str(pw_file),
                                   "--log-level", "debug")
        await wait_workers(server, {f"127.0.0.1:{port}"})
        async with aiohttp.ClientSession() as http:
            async with http.post(f"http://127.0.0.1:{server.port}/v1/chat/completions",
                                 json={"model": "sim-model", "max_tokens": 4,
                                       "messages": [{"role": "user", "content": "hi"}]}) as resp:
                assert resp.status == 200, await resp.text()
        assert server.transport.nats is not None and server.transport.nats.sent == 1
    finally:
        await stop_process_group(proc, 30, group_term=True)
    worker_log = log_path.read_text(errors="replace")
    assert "connected to NATS at 127.0.0.1" in worker_log, worker_log[-3000:]
    assert PASSWORD not in worker_log
    assert "connected to NATS at 127.0.0.1" in caplog.text
    assert PASSWORD not in caplog.text


# -- NKey -------------------------------------------------------------------------------------------
async def test_nkey_seed_connects_and_a_client_without_it_is_refused(tmp_path, caplog):
    nkeys = pytest.importorskip("nkeys")  # a test dependency (pyproject's test extra)
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    public = nkeys.from_seed(bytearray(seed)).public_key.decode()
    seed_file = tmp_path / "user.nk"
    seed_file.write_bytes(seed + b"\n")
    n = NatsProcess(extra_conf=f'authorization {{ users = [ {{ nkey: "{public}" }} ] }}')
    n.start()
    args = parse_args(["--etcd-endpoint", "127.0.0.1:2379", "--request-transport", "nats", "--nats-server", n.url,
                       "--nats-nkey-seed", str(seed_file)], environ={})
    conn = NatsConnection.from_args(args, name="t-nkey")
    other_seed = tmp_path / "other.nk"
    other_seed.write_bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))
    other = NatsConnection(n.url, name="t-nkey-other", reconnect_wait=0.2, auth=NatsAuth(nkey_seed_file=str(other_seed)))
    anonymous = NatsConnection(n.url, name="t-anon", reconnect_wait=0.2)
    try:
        assert await _connects(conn)
        assert await _refused(anonymous)
        assert await _refused(other)
    finally:
        for c in (conn, other, anonymous):
            await c.close()
        n.cleanup()
    assert seed.decode() not in caplog.text


# -- a NATS JWT .creds file (operator mode, accounts preloaded in memory) and a token ----------------------
def _b64(b: bytes) -> str:
    import base64

    return base64.urlsafe_b64encode(b).decode().rstrip("=")


def _jwt(signer, iss: str, sub: str, nats_claims: dict) -> str:
    """A NATS JWT (v2) signed with an nkey, as nsc writes them."""
    import hashlib
    import json
    import time

    claims = {"jti": "", "iat": int(time.time()), "iss": iss, "name": sub[:8], "sub": sub, "nats": nats_claims}
    claims["jti"] = _b64(hashlib.sha256(json.dumps(claims).encode()).digest())
    head = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    body = _b64(json.dumps(claims).encode())
    return f"{head}.{body}." + _b64(signer.sign(f"{head}.{body}".encode()))


def make_operator(d, nkeys) -> tuple[str, str, str]:
    """(nats-server config lines, a user's .creds path, another operator's user's .creds path)."""
    def keypair(prefix):
        seed = nkeys.encode_seed(os.urandom(32), prefix)
        kp = nkeys.from_seed(bytearray(seed))
        return seed.decode(), kp, kp.public_key.decode()

    limits = {"subs": -1, "conn": -1, "leaf": -1, "imports": -1, "exports": -1, "data": -1, "payload": -1,
              "wildcards": True}
    user_claims = {"type": "user", "version": 2, "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1}
    out = []
    for name in ("ours", "foreign"):
        _, op, op_pub = keypair(nkeys.PREFIX_BYTE_OPERATOR)
        _, acc, acc_pub = keypair(nkeys.PREFIX_BYTE_ACCOUNT)
        user_seed, _, user_pub = keypair(nkeys.PREFIX_BYTE_USER)
        creds = d / f"{name}.creds"
        creds.write_text(f"-----BEGIN NATS USER JWT-----\n{_jwt(acc, acc_pub, user_pub, user_claims)}\n"
                         "------END NATS USER JWT------\n\n-----BEGIN USER NKEY SEED-----\n"
                         f"{user_seed}\n------END USER NKEY SEED------\n")
        (d / f"{name}-op.jwt").write_text(_jwt(op, op_pub, op_pub, {"type": "operator", "version": 2}))
        acc_jwt = _jwt(op, op_pub, acc_pub, {"type": "account", "version": 2, "limits": limits})
        _, _, sys_pub = keypair(nkeys.PREFIX_BYTE_ACCOUNT)  # JetStream needs a system account
        sys_jwt = _jwt(op, op_pub, sys_pub, {"type": "account", "version": 2, "limits": limits})
        out.append((f'operator: "{d / f"{name}-op.jwt"}"\nresolver: MEMORY\nsystem_account: {sys_pub}\n'
                     f'resolver_preload: {{ {acc_pub}: "{acc_jwt}", {sys_pub}: "{sys_jwt}" }}', str(creds)))
    return out[0][0], out[0][1], out[1][1]


async def test_a_creds_file_connects_and_a_foreign_or_missing_one_is_refused(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    nkeys = pytest.importorskip("nkeys")  # a test dependency (pyproject's test extra)
    conf, creds, foreign = make_operator(tmp_path, nkeys)
    n = NatsProcess(extra_conf=conf)
    n.start()
    args = parse_args(["--etcd-endpoint", "127.0.0.1:2379", "--request-transport", "nats", "--nats-server", n.url],
                      environ={"INFERA_NATS_CREDS": creds})  # env: flag > env > default
    conn = NatsConnection.from_args(args, name="t-creds")
    other = NatsConnection(n.url, name="t-creds-foreign", reconnect_wait=0.2, auth=NatsAuth(creds_file=foreign))
    anonymous = NatsConnection(n.url, name="t-anon", reconnect_wait=0.2)
    try:
        assert await _connects(conn)
        assert await _refused(other)
        assert await _refused(anonymous)
    finally:
        for c in (conn, other, anonymous):
            await c.close()
        n.cleanup()
    seed = re.search(r"BEGIN USER NKEY SEED-+\n(\S+)", open(creds).read()).group(1)
    assert seed not in caplog.text


async def test_a_token_from_a_file_connects_and_a_wrong_one_is_refused(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    token = "tok-" + os.urandom(12).hex()
    n = NatsProcess(extra_conf=f'authorization {{ token: "{token}" }}')
    n.start()
    (tmp_path / "token").write_text(token + "\n")
    args = parse_args(["--etcd-endpoint", "127.0.0.1:2379", "--request-transport", "nats", "--nats-server", n.url,
                       "--nats-token-file", str(tmp_path / "token")], environ={"INFERA_NATS_TOKEN": "env-loses"})
    conn = NatsConnection.from_args(args, name="t-token")
    assert NatsAuth.from_args(args, {"INFERA_NATS_TOKEN": "env-loses"}).token == token  # the file flag wins
    wrong = NatsConnection(n.url, name="t-token-wrong", reconnect_wait=0.2, auth=NatsAuth(token="nope-" + token))
    try:
        assert await _connects(conn)
        assert await _refused(wrong)
    finally:
        await conn.close()
        await wrong.close()
        n.cleanup()
    assert token not in caplog.text


# -- TLS with a CA of the test's own and a client certificate -----------------------------------------
def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(d) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate (EC P-256)."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=infera-test-ca",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=d)
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"),
                      ("client", "extendedKeyUsage=clientAuth\n")):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=infera-{name}", cwd=d)
        (d / f"{name}.ext").write_text("basicConstraints=CA:FALSE\nsubjectKeyIdentifier=hash\n"
                                       "authorityKeyIdentifier=keyid,issuer\n" + ext)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)
    return {k: str(d / k) for k in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


async def test_tls_with_a_custom_ca_and_a_client_certificate(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    pki = make_pki(tmp_path)
    n = NatsProcess(extra_conf=(f'tls {{ cert_file: "{pki["server.pem"]}", key_file: "{pki["server.key"]}", '
                                f'ca_file: "{pki["ca.pem"]}", verify: true, timeout: 2 }}'))
    n.start()
    args = parse_args(["--etcd-endpoint", "127.0.0.1:2379", "--request-transport", "nats", "--nats-server", n.url,
                       "--nats-tls-ca", pki["ca.pem"], "--nats-tls-cert", pki["client.pem"],
                       "--nats-tls-key", pki["client.key"]], environ={})
    conn = NatsConnection.from_args(args, name="t-tls")
    no_cert = NatsConnection(n.url, name="t-tls-nocert", reconnect_wait=0.2, auth=NatsAuth(tls_ca=pki["ca.pem"]))
    no_ca = NatsConnection(n.url, name="t-tls-noca", reconnect_wait=0.2)  # the system CAs don't know ours
    try:
        assert await _connects(conn)
        assert conn.core()._proto.transport.get_extra_info("ssl_object") is not None  # really TLS
        assert await _refused(no_cert)
        assert await _refused(no_ca)
    finally:
        for c in (conn, no_cert, no_ca):
            await c.close()
        n.cleanup()


# -- python -m infera.up: the embedded NATS wants the per-run password -----------------------------------
async def test_up_embedded_nats_refuses_an_anonymous_client():
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "infera.up", "--port", "0", "--plane", "nats", "--speedup", "20", "--workers", "1",
        "--log-level", "info", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={"PATH": "/usr/bin:/bin", "KUBERNETES_SERVICE_HOST": "10.96.0.1"})
    lines: list[str] = []
    password = "\0 (not read)"
    try:
        async def until_serving() -> None:
            while True:
                raw = await proc.stdout.readline()
                if not raw:
                    raise AssertionError("infera.up exited:\n" + "".join(lines)[-3000:])
                lines.append(raw.decode(errors="replace"))
                if "Serving." in lines[-1]:
                    return
        await asyncio.wait_for(until_serving(), 120)
        text = "".join(lines)
        port = int(re.search(r"nats\s+nats://127\.0\.0\.1:(\d+)", text).group(1))
        url = f"nats://127.0.0.1:{port}"
        with pytest.raises(Exception, match="(?i)authorization"):
            await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=3)
        # The run's password is in the embedded server's 0600 config only: it works, and was never printed.
        confs = [c for c in glob.glob(os.path.join(tempfile.gettempdir(), "infera-nats-*", "nats.conf")) if f"127.0.0.1:{port}" in open(c).read()]
        assert len(confs) == 1 and os.stat(confs[0]).st_mode & 0o077 == 0
        password = re.search(r'password: "([^"]+)"', open(confs[0]).read()).group(1)
        nc = await nats.connect(url, user="infera", password=password, allow_reconnect=False, connect_timeout=3)
        await nc.close()
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGINT)
        rest, _ = await asyncio.wait_for(proc.communicate(), 90)
        lines.append(rest.decode(errors="replace"))
    assert password not in "".join(lines)
    assert "connected to NATS at 127.0.0.1" in "".join(lines)
