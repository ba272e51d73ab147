"""The ZMQ KV-event subscriber's per-key Wake: set wakes the waiter, a wait can time out, a set with
nobody waiting is dropped, and a cancelled wait leaves nothing behind (its timer too)."""
from __future__ import annotations

import asyncio

import pytest

from infera.transport.kv_events_zmq_state import Wake


async def test_set_wakes_the_waiter():
    wake = Wake()
    waiter = asyncio.ensure_future(wake.wait(30.0))
    await asyncio.sleep(0)
    wake.set()
    assert await asyncio.wait_for(waiter, 5) is True


async def test_wait_times_out():
    wake = Wake()
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await wake.wait(0.05) is False
    assert loop.time() - started >= 0.04


async def test_set_without_waiter_is_dropped():
    wake = Wake()
    wake.set()
    assert await wake.wait(0.02) is False


async def test_wait_without_timeout_waits_for_set():
    wake = Wake()
    waiter = asyncio.ensure_future(wake.wait(None))
    await asyncio.sleep(0.02)
    assert not waiter.done()
    wake.set()
    assert await asyncio.wait_for(waiter, 5) is True


async def test_cancelled_wait_leaves_no_timer_or_future():
    wake = Wake()
    loop = asyncio.get_running_loop()
    timers_before = len(getattr(loop, "_scheduled", []))
    waiter = asyncio.ensure_future(wake.wait(30.0))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert wake._fut is None
    if hasattr(loop, "_scheduled"):  # the default loop: the timer is cancelled (uvloop keeps its own)
        assert sum(not h.cancelled() for h in loop._scheduled) <= timers_before
    wake.set()  # nobody waits: a no-op
