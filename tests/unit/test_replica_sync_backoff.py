"""The replica sync's retry loops back off and log once per state change (issue 27 item 2): a
subscription that cannot be made logged a WARNING every 0.5 s, and a tick that kept failing a
traceback every 0.1 s, forever (fd exhaustion makes both fail at once)."""
from __future__ import annotations

import asyncio
import errno
import logging

from infera.transport import replica_sync as mod
from tests.conftest import wait_for

LOGGER = "infera.transport.replica_sync"


class FailingSync(mod.ReplicaSync):
    transport = "test"

    def __init__(self, open_failures: int = 0, tick_failures: int = 0) -> None:
        super().__init__(flush_interval_s=0.001)
        self.open_failures, self.tick_failures = open_failures, tick_failures
        self.opens = self.ticks = 0

    @property
    def connected(self) -> bool:
        return True

    async def _open(self) -> None:
        self.opens += 1
        if self.opens <= self.open_failures:
            raise OSError(errno.EMFILE, "Too many open files")

    async def _send(self, subject: str, data: bytes) -> None:
        pass

    async def tick(self, now: float, heartbeat: bool = False) -> None:
        self.ticks += 1
        self._wake.set()  # keep the loop going as a busy replica would
        if self.ticks <= self.tick_failures:
            raise OSError(errno.EMFILE, "Too many open files")


def fast(monkeypatch) -> list[float]:
    """The backoff, 50 times shorter; returns the delays asked for."""
    delays: list[float] = []
    orig = getattr(mod, "retry_delay", None)

    def quick(failures: int, first: float, cap: float) -> float:
        delays.append(orig(failures, first, cap))
        return delays[-1] / 50

    monkeypatch.setattr(mod, "retry_delay", quick, raising=False)
    return delays


def lines(caplog, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


async def test_subscribing_backs_off_and_logs_one_warning(monkeypatch, caplog):
    delays = fast(monkeypatch)
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    sync = FailingSync(open_failures=8)
    await sync.start()
    try:
        await wait_for(lambda: sync.subscribed, 10, message="subscribed")
        assert sync.opens == 9
        assert len(lines(caplog, logging.WARNING)) == 1
        assert len(delays) == 8 and delays[0] < 0.7 and delays[-1] > 10 * delays[0]
        assert max(delays) <= mod.RETRY_MAX_S * 1.25
        assert len(lines(caplog, logging.DEBUG)) >= 7
        assert any("subscribed after 8" in m for m in lines(caplog, logging.INFO))
    finally:
        await sync.stop()


async def test_a_failing_tick_backs_off_and_logs_one_traceback(monkeypatch, caplog):
    delays = fast(monkeypatch)
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    sync = FailingSync(tick_failures=6)
    await sync.start()
    try:
        await wait_for(lambda: sync.ticks > 7, 10, message="ticking again")
        assert len(delays) == 6 and delays[-1] > delays[0] * 8
        errors = lines(caplog, logging.ERROR)
        assert len(errors) == 1 and "tick failed" in errors[0]
        assert any("ticks again after 6" in m for m in lines(caplog, logging.INFO))
    finally:
        await sync.stop()


async def test_old_style_floods_are_gone_in_real_time(caplog):
    """Unpatched: a tick failing for 1 s logs one traceback, not one per 0.1 s."""
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    sync = FailingSync(tick_failures=10**9)
    await sync.start()
    try:
        await asyncio.sleep(1.0)
        assert len(lines(caplog, logging.ERROR)) == 1
        assert sync.ticks <= 5  # 0.1, 0.2, 0.4 (+-25%) ...
    finally:
        await sync.stop()
