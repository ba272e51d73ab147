"""EtcdRegistration's keepalive loop against a scripted client: how soon a failed keepalive is
tried again, and that a lapsed lease is re-granted."""
from __future__ import annotations

import asyncio

import pytest

import infera.discovery.etcd as etcd
from infera.discovery.etcd import EtcdConnectionError, EtcdRegistration
from infera.discovery.record import WorkerRecord


class ScriptedClient:
    """Answers keepalives from a script: an exception is raised, an int is the TTL returned."""

    base_url = "http://scripted:2379"

    def __init__(self, script: list) -> None:
        self.script = script
        self.keepalives: list[float] = []  # loop time of each call
        self.grants = 0

    async def grant(self, ttl: int, *, timeout: float | None = None) -> int:
        self.grants += 1
        return 100 + self.grants

    async def put(self, key: str, value: bytes, lease: int | None = None, *, timeout: float | None = None) -> int:
        return 1

    async def keepalive(self, lease_id: int, *, timeout: float | None = None) -> int:
        self.keepalives.append(asyncio.get_running_loop().time())
        step = self.script.pop(0) if self.script else 30
        if isinstance(step, Exception):
            raise step
        return step

    async def delete(self, key: str, *, timeout: float | None = None) -> int:
        return 1

    async def revoke(self, lease_id: int, *, timeout: float | None = None) -> bool:
        return True

    async def close(self) -> None:
        pass


def record() -> WorkerRecord:
    return WorkerRecord(worker_id="w1", url="http://127.0.0.1:1", model_name="m")


@pytest.mark.parametrize(
    ("script", "grants"),
    [
        # etcd unreachable twice, then back: the lease is kept, nothing re-granted
        ([EtcdConnectionError("refused"), EtcdConnectionError("refused"), 30, 30], 1),
        # etcd back, but the lease lapsed meanwhile (TTL 0): re-granted once
        ([EtcdConnectionError("timeout"), 0, 30], 2),
    ],
)
async def test_a_failed_keepalive_is_retried_soon_not_a_whole_interval_later(monkeypatch, script, grants):
    monkeypatch.setattr(etcd, "KEEPALIVE_RETRY_S", 0.02)
    client = ScriptedClient(list(script))
    registration = EtcdRegistration(None, "/w/", ttl=30, client=client)  # type: ignore[arg-type]
    registration.keepalive_interval = 0.4  # the normal cadence, ttl/3, scaled down
    await registration.register(record())
    try:
        n = len(script)
        deadline = asyncio.get_running_loop().time() + 5
        while len(client.keepalives) < n and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        assert len(client.keepalives) >= n
        gaps = [b - a for a, b in zip(client.keepalives, client.keepalives[1:n])]
        failed_before = [isinstance(step, Exception) for step in script[:n - 1]]
        for gap, after_failure in zip(gaps, failed_before):
            if after_failure:
                assert gap < 0.2, f"retried {gap:.2f}s after a failure (the cadence is 0.4s)"
            else:
                assert gap >= 0.35, f"a healthy lease was kept alive after {gap:.2f}s, not its cadence"
        assert client.grants == grants
        assert registration.reregistrations == grants - 1
    finally:
        await registration.deregister()
