"""The entry point of the benchmarks that run one asyncio coroutine: uvloop when it is there (as
the server runs), Ctrl-C reported as 130 with the fleet already stopped by the coroutine's own
cleanup, a cancelled run as 143 (SIGTERM)."""
from __future__ import annotations

import asyncio
import sys
from typing import Coroutine


def run_bench(name: str, coroutine: Coroutine[object, object, int]) -> int:
    """Run ``coroutine`` (the benchmark, returning its exit status) and return that status."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        return asyncio.run(coroutine)
    except KeyboardInterrupt:
        print(f"{name}: interrupted; fleet stopped", file=sys.stderr)
        return 130
    except asyncio.CancelledError:
        return 143
