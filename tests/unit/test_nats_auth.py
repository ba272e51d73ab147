"""NATS credentials: redaction of URLs and messages, the plane flags (flag > env > default), and
what each client is handed. The broker-backed checks are in tests/integration/test_nats_auth.py."""
from __future__ import annotations

import argparse
import logging

import pytest

from infera.config import add_plane_flags
from infera.transport.nats_auth import NatsAuth, redact, redact_servers, redact_url
from infera.transport.nats_conn import NatsConnection
from infera.transport.nats_core import NatsCoreClient


@pytest.mark.parametrize("url, shown", [
    ("nats://alice:s3cret@host:4222", "nats://***@host:4222"),
    ("nats://tok3n@host", "nats://***@host"),
    ("tls://a%40b:p%3Aw@10.0.0.1:4443/x", "tls://***@10.0.0.1:4443/x"),
    ("alice:s3cret@host:4222", "***@host:4222"),
    ("nats://host:4222", "nats://host:4222"),
])
def test_redact_url(url, shown):
    assert redact_url(url) == shown


def test_redact_servers_and_text():
    assert redact_servers("nats://u:p1@a:1, nats://b:2,nats://t0k@c") == "nats://***@a:1,nats://b:2,nats://***@c"
    msg = "nats: cannot connect to nats://u:hunter22@a:1 (password hunter22)"
    assert redact(msg, ("hunter22",)) == "nats: cannot connect to nats://***@a:1 (password ***)"


def _args(argv, environ):
    p = argparse.ArgumentParser()
    add_plane_flags(p, environ)
    return p.parse_args(argv)


def test_flags_env_and_files(tmp_path):
    pw = tmp_path / "pw"
    pw.write_text("from-file\n")
    env = {"INFERA_NATS_USER": "env-user", "INFERA_NATS_PASSWORD": "from-env"}
    auth = NatsAuth.from_args(_args([], env), env)
    assert (auth.user, auth.password) == ("env-user", "from-env")
    auth = NatsAuth.from_args(_args(["--nats-user", "flag-user", "--nats-password-file", str(pw)], env), env)
    assert (auth.user, auth.password) == ("flag-user", "from-file")  # flag > env
    assert "from-file" not in repr(auth)
    assert auth.nats_py_options() == {"user": "flag-user", "password": "from-file"}
    assert NatsAuth.from_args(_args([], {}), {}) == NatsAuth()  # default: none
    assert _args([], {"INFERA_NATS_CREDS": ""}).nats_creds is None  # an empty env variable is unset
    with pytest.raises(ValueError, match="password"):
        NatsAuth(user="u")
    with pytest.raises(ValueError, match="go together"):
        NatsAuth(tls_cert=str(pw))
    with pytest.raises(ValueError, match="no user JWT"):
        NatsAuth(creds_file=str(pw))


def test_the_core_client_sends_the_configured_credentials_and_signs_the_nonce(tmp_path):
    nkeys = pytest.importorskip("nkeys")
    seed = nkeys.encode_seed(b"\x01" * 32, nkeys.PREFIX_BYTE_USER)
    (tmp_path / "u.nk").write_bytes(seed)
    fields = NatsAuth(nkey_seed_file=str(tmp_path / "u.nk")).sign_nonce("abc")
    kp = nkeys.from_seed(bytearray(seed))
    assert fields["nkey"] == kp.public_key.decode()
    import base64

    sig = base64.urlsafe_b64decode(fields["sig"] + "=" * (-len(fields["sig"]) % 4))
    assert kp.verify(b"abc", sig)
    creds = tmp_path / "u.creds"
    creds.write_text("-----BEGIN NATS USER JWT-----\neyJhbGc.eyJzdWIi.sig\n------END NATS USER JWT------\n\n"
                     "-----BEGIN USER NKEY SEED-----\n" + seed.decode() + "\n------END USER NKEY SEED------\n")
    fields = NatsAuth(creds_file=str(creds)).sign_nonce("abc")
    assert fields["jwt"] == "eyJhbGc.eyJzdWIi.sig" and "nkey" not in fields and "sig" in fields


async def test_connection_shows_no_credentials(caplog):
    caplog.set_level(logging.DEBUG)
    conn = NatsConnection("nats://alice:hunter22@127.0.0.1:1,nats://t0ken-xyz@127.0.0.1:2", reconnect_wait=0.05)
    assert conn.servers == ["nats://***@127.0.0.1:1", "nats://***@127.0.0.1:2"]
    assert "hunter22" not in conn._scrub("failed: nats://alice:hunter22@x hunter22 t0ken-xyz")
    await conn.start()
    conn.core()
    import asyncio

    await asyncio.sleep(0.3)
    await conn.close()
    assert "cannot reach NATS" in caplog.text
    assert "hunter22" not in caplog.text and "t0ken-xyz" not in caplog.text
    with pytest.raises(ValueError) as e:
        NatsCoreClient("http://alice:hunter22@host:1")
    assert "hunter22" not in str(e.value)
