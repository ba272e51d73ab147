"""A ZMQ KV-event reader that keeps failing backs off (issue 27 item 2): fd exhaustion made the
replay DEALER's creation fail at once ("Too many open files"), and the reader restarted at once,
forever: 118,986 tracebacks and 110 MB of log in 30 s, and the view reset each time. Now the
restarts double up to a cap, one ERROR line marks the failing state (repeats are DEBUG), the view is
reset once, and one INFO line marks the recovery."""
from __future__ import annotations

import asyncio
import errno
import logging

import zmq
import zmq.asyncio

from infera.transport import kv_events_zmq as mod
from infera.transport.kv_events_zmq import ZmqKvEventSubscriber
from tests.conftest import wait_for

LOGGER = "infera.transport.kv_events_zmq"


class ExhaustedContext:
    """A zmq context whose sockets cannot be had (EMFILE) until ``healthy`` is set."""

    def __init__(self) -> None:
        self.attempts = 0
        self.healthy = False
        self.real = zmq.asyncio.Context()

    def socket(self, kind):
        self.attempts += 1
        if not self.healthy:
            raise zmq.ZMQError(errno.EMFILE)
        return self.real.socket(kind)


async def test_a_reader_failing_at_once_backs_off_logs_once_and_recovers(monkeypatch, caplog):
    monkeypatch.setattr(mod, "_RECOVER_MIN_S", 0.01, raising=False)
    monkeypatch.setattr(mod, "_RECOVER_MAX_S", 0.16, raising=False)
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    ctx = ExhaustedContext()
    resets: list[str] = []
    sub = ZmqKvEventSubscriber(lambda key, seq, payload: None, resets.append, context=ctx, replay_timeout=0.1)
    # Nothing listens on port 1: the SUB reconnects on its own (its own backoff); the replay is what fails.
    sub.add("w1", "tcp://127.0.0.1:1", "tcp://127.0.0.1:1")
    await sub.start()
    try:
        await asyncio.sleep(1.2)
        # 0.01 + 0.02 + 0.04 + 0.08 + 0.16 ... (+-25%): about 10 tries in 1.2 s, not tens of thousands
        assert 3 <= ctx.attempts <= 16, ctx.attempts
        records = [r for r in caplog.records if r.name == LOGGER]
        errors = [r for r in records if r.levelno >= logging.WARNING]
        assert len(errors) == 1, [r.getMessage() for r in errors]
        assert "reader failed" in errors[0].getMessage() and errors[0].exc_info is not None
        assert sum(r.levelno == logging.DEBUG and "failed again" in r.getMessage() for r in records) == \
            ctx.attempts - 1
        assert resets == ["w1"]  # the view is reset when the failing starts, not at every try
        assert sub.stats("w1")["resets"] == 1

        caplog.clear()
        ctx.healthy = True  # descriptors are back: the next try gets its socket (the replay then times out)

        def recovered() -> bool:
            return any("recovered" in r.getMessage() for r in caplog.records if r.name == LOGGER)

        await wait_for(recovered, 5, message="the reader's recovery line")
        lines = [r for r in caplog.records if r.name == LOGGER and "recovered" in r.getMessage()]
        assert len(lines) == 1 and lines[0].levelno == logging.INFO
        assert sub.stats("w1")["caught_up"]
    finally:
        await sub.stop()
        ctx.real.destroy(linger=0)
