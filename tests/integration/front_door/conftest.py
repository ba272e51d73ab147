"""The front door's protocol tests run on the stock loop and on uvloop, the server's own
(``runtime.install_event_loop``): the fast path swaps the protocol under the loop's transport."""
from __future__ import annotations

import asyncio

import uvloop


def pytest_asyncio_loop_factories(config, item):
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
