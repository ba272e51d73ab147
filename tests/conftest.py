"""Shared test helpers: waiting on conditions with deadlines, free ports."""
from __future__ import annotations

import asyncio
import socket
import time
from typing import Awaitable, Callable

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_for(predicate: Callable[[], "bool | Awaitable[bool]"], timeout: float, interval: float = 0.05,
                   message: str = "condition") -> float:
    """Poll ``predicate`` until true; returns the seconds it took. Fails the test at the deadline."""
    start = time.monotonic()
    deadline = start + timeout
    while True:
        result = predicate()
        if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
            result = await result
        if result:
            return time.monotonic() - start
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {message}")
        await asyncio.sleep(interval)
