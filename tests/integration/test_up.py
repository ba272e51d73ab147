"""``python -m infera.up --smoke``: the main job's one command, on both planes."""
from __future__ import annotations

import asyncio
import sys

import pytest


@pytest.mark.parametrize("plane", ["dev", "nats"])
async def test_up_smoke(plane):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "infera.up", "--smoke", "--port", "0", "--plane", plane, "--speedup", "20",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={"PATH": "/usr/bin:/bin", "KUBERNETES_SERVICE_HOST": "10.96.0.1"})  # a Pod's env must not leak in
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    assert "smoke: ok" in text
    assert ("nats      nats://127.0.0.1:" in text) == (plane == "nats")


@pytest.mark.parametrize("flags", [("--etcd-auth",), ("--etcd-auth", "--etcd-tls", "--sign-records")])
async def test_up_smoke_with_etcd_auth(flags):
    """--etcd-auth: the embedded etcd refuses anonymous clients; the server and workers get the generated
    password in their environment (not on their command lines, not in the output) and still serve.
    --etcd-tls: etcd serves https and demands a client certificate, made for the run and given to them.
    --sign-records: the worker's record is signed, and the server (which then requires it) routes to it."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "infera.up", "--smoke", "--port", "0", "--workers", "1", "--speedup", "20",
        *flags, "--log-level", "debug",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={"PATH": "/usr/bin:/bin", "KUBERNETES_SERVICE_HOST": "10.96.0.1"})
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    assert "smoke: ok" in text and "etcd      authentication on" in text
    assert "INFERA_ETCD_PASSWORD=" not in text and '"token"' not in text
    assert ("etcd      https://127.0.0.1:" in text) == ("--etcd-tls" in flags)
    assert ("records   signed" in text) == ("--sign-records" in flags)
