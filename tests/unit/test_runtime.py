"""infera.runtime: the bounded wait that keeps a cancellation, and the cancel that never hangs a
shutdown. The race: a retry loop's task is cancelled in the same loop turn the inner await ends
(a sibling's connection closing as the server stops); asyncio.wait_for before 3.12 hands back the
inner outcome and the loop never learns it was cancelled."""
from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any, Awaitable, Callable

import pytest

from infera.runtime import cancel_and_wait, wait_for

Waiter = Callable[[Awaitable[Any], float], Awaitable[Any]]


async def _retry_loop_cancelled_as_its_wait_ends(wait: Waiter) -> str:
    """A loop that retries on the inner error is cancelled in the turn its wait ends: 'cancelled'
    when the cancellation reached it, 'lost' when it went on retrying."""
    loop = asyncio.get_running_loop()
    inner: asyncio.Future[None] = loop.create_future()
    retries = 0

    async def retry_forever() -> str:
        nonlocal retries
        while True:
            try:
                await wait(inner, 10)
            except ConnectionError:
                pass
            retries += 1
            await asyncio.sleep(0)
            if retries > 3:
                return "lost"

    task = loop.create_task(retry_forever())
    await asyncio.sleep(0)  # it waits on `inner`
    inner.set_exception(ConnectionError("the writer went"))
    task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        return "cancelled"


async def test_a_cancellation_that_comes_as_the_wait_ends_is_kept() -> None:
    assert await _retry_loop_cancelled_as_its_wait_ends(wait_for) == "cancelled"


async def test_asyncio_wait_for_the_control() -> None:
    # what infera.runtime.wait_for replaces (and the test above could fail): the stdlib's loses the
    # cancellation before 3.12, and keeps it since (it is built on asyncio.timeout there)
    expected = "lost" if sys.version_info < (3, 12) else "cancelled"
    assert await _retry_loop_cancelled_as_its_wait_ends(asyncio.wait_for) == expected  # noqa: TID251


async def _value_later(value: Any, delay: float) -> Any:
    await asyncio.sleep(delay)
    return value


async def _fail_later(delay: float) -> None:
    await asyncio.sleep(delay)
    raise ConnectionError("refused")


@pytest.mark.parametrize("make, timeout, expected", [
    (lambda: _value_later("done", 0), 1.0, "done"),
    (lambda: _value_later("done", 0.01), None, "done"),  # no bound
    (lambda: _value_later(None, 0), 0.5, None),
    (lambda: _fail_later(0), 1.0, ConnectionError),
    (lambda: _value_later("late", 5), 0.02, TimeoutError),
    (lambda: _value_later("late", 5), 0, TimeoutError),  # a bound already spent
])
async def test_wait_for_outcomes(make: Callable[[], Awaitable[Any]], timeout: float | None, expected: Any) -> None:
    if isinstance(expected, type) and issubclass(expected, BaseException):
        with pytest.raises(expected):
            await wait_for(make(), timeout)
    else:
        assert await wait_for(make(), timeout) == expected


async def test_wait_for_timing_out_cancels_the_inner_future() -> None:
    inner: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    with pytest.raises(asyncio.TimeoutError):
        await wait_for(inner, 0.01)
    assert inner.cancelled()


async def test_wait_for_lets_an_outer_cancellation_through_not_as_a_timeout() -> None:
    started = asyncio.Event()

    async def waits() -> None:
        started.set()
        await wait_for(asyncio.sleep(10), 5)

    task = asyncio.ensure_future(waits())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


# -- cancel_and_wait -------------------------------------------------------------------------------------------


async def test_cancel_and_wait_stops_a_task_that_lost_its_first_cancellation() -> None:
    cancels = 0

    async def swallows_one() -> None:
        nonlocal cancels
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                cancels += 1
                if cancels > 1:
                    raise
                # as a library's wait_for does: the cancellation is gone, the loop goes on

    task = asyncio.ensure_future(swallows_one())
    await asyncio.sleep(0)
    await wait_for(cancel_and_wait(task, grace_s=0.02, bound_s=5), 2)
    assert task.cancelled() and cancels == 2


async def test_cancel_and_wait_leaves_a_task_that_never_stops_behind_with_a_warning(caplog) -> None:
    stubborn = True

    async def never_stops() -> None:
        while stubborn:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                pass

    task = asyncio.ensure_future(never_stops())
    task.set_name("stubborn")
    await asyncio.sleep(0)
    with caplog.at_level(logging.WARNING, logger="infera.runtime"):
        await wait_for(cancel_and_wait(task, grace_s=0.01, bound_s=0.05), 2)
    assert not task.done()
    assert any("stubborn" in r.getMessage() for r in caplog.records)
    stubborn = False  # the test leaves nothing running
    task.cancel()
    await asyncio.wait((task,), timeout=2)
    assert task.done()


@pytest.mark.parametrize("outcome", ["failed", "returned", "cancelled", "running"])
async def test_cancel_and_wait_any_task_state(outcome: str) -> None:
    async def body() -> None:
        if outcome == "failed":
            raise ConnectionError("refused")
        if outcome == "running":
            await asyncio.sleep(10)

    task = asyncio.ensure_future(body())
    if outcome == "cancelled":
        task.cancel()
    if outcome != "running":
        await asyncio.wait((task,))
    else:
        await asyncio.sleep(0)
    await cancel_and_wait(task)  # never raises what the task ended with
    assert task.done()
    assert task.cancelled() == (outcome in ("cancelled", "running"))
    await cancel_and_wait(None)


# -- exit_after: the process's last bound -------------------------------------------------------------------

STUCK = """
import asyncio, logging, sys
from infera.runtime import exit_after
logging.basicConfig(level=logging.INFO)

async def main():
    async def swallows_every_cancellation():
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass
    timer = exit_after(float(sys.argv[1]), "the test's shutdown")
    if sys.argv[2] == "stops":
        timer.cancel()
        await asyncio.sleep(3 * float(sys.argv[1]))  # past the bound: a timer still armed would end us
        print("stopped in time", flush=True)
        return
    stuck = asyncio.ensure_future(swallows_every_cancellation())
    await asyncio.sleep(0)
    stuck.cancel()
    await stuck  # never ends

asyncio.run(main())
"""


@pytest.mark.parametrize("how, code, says", [("hangs", 1, "the test's shutdown took over 0 s: exiting now"),
                                             ("stops", 0, "stopped in time")])
async def test_exit_after_bounds_a_process_whatever_its_loop_waits_on(how: str, code: int, says: str) -> None:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", STUCK, "0.3", how,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await wait_for(proc.communicate(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
    assert proc.returncode == code
    assert says in out.decode()


def test_settle_gc_freezes_startup_and_spaces_young_collections():
    import gc

    from infera.runtime import GC_GEN0_THRESHOLD, settle_gc

    before = gc.get_threshold()
    try:
        gc.unfreeze()
        settle_gc()
        assert gc.get_freeze_count() > 0  # what was alive is out of the collector's sight
        assert gc.get_threshold() == (GC_GEN0_THRESHOLD, before[1], before[2])
        assert gc.get_count()[0] < GC_GEN0_THRESHOLD
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
