"""The NATS request client's worker liveness check (infera/transport/nats_request.py): a worker
whose heartbeats stopped has its requests failed, but a check that runs late because the router's
own loop was held up (its heartbeats may be waiting unread) judges only after they are read."""
from __future__ import annotations

import asyncio

import pytest

from infera.transport.nats_request import LIVENESS_LATE_S, NatsRequestClient


class _Core:
    connected = True


class _Pending:
    def __init__(self, loop: asyncio.AbstractEventLoop, token: bytes, sent_at: float) -> None:
        self.token, self.sent_at, self.alive_at, self.worker_id = token, sent_at, None, "w"
        self._headers = loop.create_future()
        self.failed: list[Exception] = []

    def _fail(self, exc: Exception) -> None:
        self.failed.append(exc)


def _client(stale_for: float) -> tuple[NatsRequestClient, _Pending, float]:
    loop = asyncio.get_running_loop()
    now = loop.time()
    client = NatsRequestClient(None, dead_after=3.5)  # type: ignore[arg-type]
    client._core = _Core()
    pending = _Pending(loop, b"tok", now - 10)
    client._pending = {b"inbox.1": pending}  # type: ignore[dict-item]
    client._alive[b"tok"] = now - stale_for
    return client, pending, now


@pytest.mark.parametrize("late, stale_for, fails", [
    (0.0, 5.0, True),                        # on time, silent past dead_after: the worker is gone
    (0.0, 1.0, False),                       # on time, heard from a second ago
    (LIVENESS_LATE_S + 1.5, 5.0, False),     # late: put off until queued heartbeats are read
])
async def test_one_check(late, stale_for, fails):
    client, pending, now = _client(stale_for)
    client._liveness_due = now - late
    client._check_liveness()
    assert bool(pending.failed) is fails
    assert client.liveness_checks_deferred == (1 if late else 0)
    assert client._liveness is not None  # checks go on while requests are pending
    await client.close()


async def test_a_late_check_sees_the_heartbeats_read_after_it():
    client, pending, now = _client(5.0)
    client._liveness_due = now - 2.0  # the loop was stalled for two seconds
    client._check_liveness()
    client._on_alive(b"infera.alive.tok", b"", b"", 0)  # what was waiting in the socket
    loop = asyncio.get_running_loop()
    client._liveness.cancel()
    client._liveness_due = loop.time()
    client._check_liveness()
    assert not pending.failed
    await client.close()


async def test_a_loop_that_stays_stalled_still_judges_every_other_check():
    client, pending, now = _client(5.0)
    client._liveness_due = now - 2.0
    client._check_liveness()
    assert not pending.failed
    client._liveness.cancel()
    client._liveness_due = asyncio.get_running_loop().time() - 2.0  # late again
    client._check_liveness()
    assert len(pending.failed) == 1 and "no heartbeat" in str(pending.failed[0])
    await client.close()
