"""Process-level helpers shared by every entry point: the event loop, shutdown signals, background
tasks and the children this process starts."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import os
import signal
import threading
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

_PR_SET_PDEATHSIG = 1
CANCEL_GRACE_S = 1.0  # a cancelled task not gone after this is cancelled again
CANCEL_BOUND_S = 10.0  # ... and one not gone after this is left behind
T = TypeVar("T")
log = logging.getLogger(__name__)


GC_GEN0_THRESHOLD = 20_000  # young collections every this many net allocations (CPython's default: 700)


def settle_gc(gen0_threshold: int = GC_GEN0_THRESHOLD) -> None:
    """Once a long-lived process is up: what its startup built (modules, the app, the fleet) leaves
    the collector's sight (``gc.freeze``), and young collections run less often. A proxied
    request's objects mostly die by reference count before any collection; at CPython's default of
    700 the collector instead rescans the live requests' objects every few requests (3 % of the
    router's CPU in the profile of issue 30, item 8). Survivors are still collected, in larger
    batches; the older generations keep their default ratios."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0_threshold, gen1, gen2)


def install_event_loop() -> None:
    """uvloop where available (Linux/macOS); the stock loop otherwise."""
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass


async def wait_for_shutdown_signal() -> None:
    """Return on the first SIGTERM or SIGINT (handlers removed again afterwards)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


async def wait_for(aw: Awaitable[T], timeout: float | None) -> T:
    """``asyncio.wait_for`` without its lost cancellation: before Python 3.12 it returns the inner
    result (or raises its error) when the task is cancelled in the same moment the inner await
    ends, and a retry loop around it then never stops (a server that hangs on SIGTERM). Built on
    ``asyncio.timeout`` where there is one (3.11+), which cancels within the task itself."""
    timeout_cm = getattr(asyncio, "timeout", None)
    if timeout_cm is None:  # 3.10: only the stdlib's
        return await asyncio.wait_for(aw, timeout)  # noqa: TID251
    async with timeout_cm(timeout):
        return await aw


async def cancel_and_wait(
    task: asyncio.Task[Any] | None, *, grace_s: float = CANCEL_GRACE_S, bound_s: float = CANCEL_BOUND_S
) -> None:
    """Cancel a background task and wait until it has unwound (an error it had already ended
    with is of no interest to whoever stops it). A task still running after ``grace_s`` is
    cancelled again (a cancellation can be lost: a library's ``asyncio.wait_for`` that finished in
    the same moment); one that outlives ``bound_s`` is left behind with a warning, so that a
    shutdown never hangs on it."""
    if task is None:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound_s
    while not task.done():
        task.cancel()
        left = deadline - loop.time()
        if left <= 0:
            log.warning("task %s still runs %.1f s after it was cancelled: left behind", task.get_name(), bound_s)
            return
        await asyncio.wait((task,), timeout=min(grace_s, left))
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        log.debug("task %s had failed: %r", task.get_name(), exc)


async def cancel_all_and_wait(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """``cancel_and_wait`` for each of ``tasks``, side by side."""
    await asyncio.gather(*(cancel_and_wait(task) for task in tasks))


def exit_after(bound_s: float, what: str, exit_: Callable[[int], None] = os._exit) -> threading.Timer:
    """The last bound on a process's way out: unless cancelled, exit with status 1 ``bound_s``
    from now, from a thread of its own, whatever the event loop is stuck on (a task that swallows
    its cancellation, a thread ``asyncio.run`` waits for at its end). A server child whose
    supervisor died has no one else to kill it."""

    def expire() -> None:
        log.error("%s took over %.0f s: exiting now", what, bound_s)
        for handler in logging.getLogger().handlers:
            handler.flush()
        exit_(1)

    timer = threading.Timer(bound_s, expire)
    timer.daemon = True  # never what keeps the process alive
    timer.start()
    return timer


def set_pdeathsig() -> None:
    """Ask Linux to SIGTERM this process when its parent dies. Meant as a child's ``preexec_fn``
    (it runs between fork and exec), so that nothing outlives the process that started it."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass
