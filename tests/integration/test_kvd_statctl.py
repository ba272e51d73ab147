"""statctl against a real daemon, its error exits, and the daemon's Prometheus endpoint."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile

import aiohttp
import pytest

from infera.kvd.client import KvdClient
from tests.conftest import free_port, wait_for
from tests.integration.test_kvd_daemon import ROOT, KvdProcess

pytestmark = pytest.mark.integration


def statctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "infera.kvd.statctl", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


async def test_statctl_prints_stats_and_metrics_split_by_tier(tmp_path):
    port = free_port()
    d = KvdProcess("--max-bytes", "1M", "--shared-arena-bytes", "0", "--metrics-port", str(port),
                   "--long-path", str(tmp_path / "l3"), "--long-bytes", "2M", "--tablespace-container-bytes", "1M",
                   "--tablespace-slot-bytes", "4K", env={"INFERA_KVD_STORAGE_SELFCHECK": "1"}).start()
    try:
        await d.ready()
        assert "L3 self-check" in d.output()
        async with await KvdClient.connect(d.socket) as c:
            await c.set(b"k" * 8, b"v" * 1000, retention="long")
            await c.get(b"k" * 8)
            await c.get(b"x" * 8)
        out = await asyncio.to_thread(statctl, "--socket", d.socket, "--client-id", "statctl")
        assert out.returncode == 0, out.stderr
        stats = json.loads(out.stdout)
        assert stats["sets_total"] == 1 and stats["gets_total"] == 2 and stats["hits_total"] == 1
        assert stats["long_bytes"] == 1000
        async with aiohttp.ClientSession() as s:
            async def scraped() -> str | bool:
                try:
                    async with s.get(f"http://127.0.0.1:{port}/metrics") as r:
                        return await r.text()
                except aiohttp.ClientError:
                    return False
            await wait_for(scraped, 10, message="metrics endpoint")
            text = await scraped()
        assert 'infera_kvd_hits_total{tier="l2"} 1.0' in text
        assert 'infera_kvd_misses_total{tier="l3"} 1.0' in text
        assert 'infera_kvd_bytes{tier="l3"} 1000.0' in text
        assert 'infera_kvd_evictions_total{tier="l2"} 0.0' in text
    finally:
        d.stop()
        shutil.rmtree(d.dir, ignore_errors=True)


def test_statctl_reads_socket_from_env_and_fails_when_nobody_listens():
    d = tempfile.mkdtemp(prefix="kvd")
    try:
        env = {**os.environ, "INFERA_KVD_SOCKET": os.path.join(d, "absent.sock")}
        out = subprocess.run([sys.executable, "-m", "infera.kvd.statctl"], cwd=ROOT, capture_output=True, text=True,
                             timeout=60, env=env)
        assert out.returncode == 1 and "absent.sock" in out.stderr
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_statctl_fails_on_a_protocol_error():
    """A peer that answers with something that is not a kvd frame."""
    d = tempfile.mkdtemp(prefix="kvd")
    path = os.path.join(d, "liar.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)

    def liar() -> None:
        conn, _ = srv.accept()
        conn.recv(4096)
        conn.sendall(b"\x00\x00\x00\x03\xc1\xc1\xc1")
        conn.close()

    import threading
    t = threading.Thread(target=liar, daemon=True)
    t.start()
    try:
        out = statctl("--socket", path, "--timeout", "5")
        assert out.returncode == 1 and "statctl" in out.stderr
    finally:
        srv.close()
        t.join(5)
        shutil.rmtree(d, ignore_errors=True)
