"""Process-level helpers shared by every entry point: the event loop, shutdown signals, background
tasks and the children this process starts."""
from __future__ import annotations

import asyncio
import ctypes
import logging
import signal

_PR_SET_PDEATHSIG = 1


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


async def cancel_and_wait(task: "asyncio.Task | None") -> None:
    """Cancel a background task and wait until it has unwound (an error it had already ended
    with is of no interest to whoever stops it)."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    except Exception as exc:
        logging.getLogger(__name__).debug("task %s had failed: %r", task.get_name(), exc)


def set_pdeathsig() -> None:
    """Ask Linux to SIGTERM this process when its parent dies. Meant as a child's ``preexec_fn``
    (it runs between fork and exec), so that nothing outlives the process that started it."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass
