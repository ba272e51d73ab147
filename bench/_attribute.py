#!/usr/bin/env python3
"""Run ``python -m infera.server`` with the router's per-request and per-batch calls timed by the
thread's CPU clock, and write the totals to a JSON file when it exits (``kv_routing.py
--attribute``).

    python bench/_attribute.py OUT.json -m infera.server --router-policy kv-aware ...

Why: py-spy samples wall time (an idle ``epoll_wait`` looks busy to it) and an in-process replay
runs with warm caches, so neither says what a call costs *inside the server*, between the HTTP
work of other requests. There the kv-aware policy's walks over a prompt's blocks cost 5-20 times
their replayed figure. Each timed call adds ~1.2 us (two ``thread_time`` reads); ``calls`` says
how many to subtract. Nested timers overlap: a row includes the rows called under it.
"""
from __future__ import annotations

import atexit
import functools
import gc
import importlib.abc
import importlib.machinery
import inspect
import json
import runpy
import sys
import time
from typing import Any, Callable

# module -> [(class, method)]: what is timed
TIMED: dict[str, list[tuple[str, str]]] = {
    "infera.router.kv_aware": [("KvAwarePolicy", n) for n in (
        "prepare_cached", "prepare", "pick", "on_started", "on_finished", "_land", "_count_in", "_count_out",
        "_with_landed", "_charge", "_hashes")]
    + [("Horizon", "reached"), ("BlockHashCache", "hashes")],
    "infera.router.round_robin": [("RoundRobinPolicy", n) for n in ("pick", "on_started", "on_finished")],
    # (KvIndex is the index in use: the C accelerator's, or the Python one)
    "infera.kv.index": [("KvIndex", n) for n in ("match", "match_one", "first_unheld", "apply", "apply_payload")],
    "infera.kv.prompt": [("PromptTokenizer", n) for n in ("lookup", "token_ids", "_parts_now", "_key_and_work")]
    + [("ByteLRU", "get"), ("ByteLRU", "put")],
    "infera.kv.tokenizer": [("BuiltinTokenizer", "encode")],
    "infera.transport.zmtp": [("ZmtpSubProtocol", "data_received")],
    "infera.transport.kv_events_zmq": [("ZmqKvEventSubscriber", "_on_frames")],
    "infera.server.kv": [("KvEventsBridge", n) for n in ("_on_batch", "observe_usage", "record_pick")],
}

totals: dict[str, list[float]] = {}  # label -> [seconds, calls]


def _timed(f: Callable, label: str) -> Callable:
    clock = time.thread_time
    entry = totals.setdefault(label, [0.0, 0])
    if inspect.iscoroutinefunction(f):
        @functools.wraps(f)
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            # the thread's CPU while this coroutine is suspended counts too: the timed async
            # calls here only suspend for long prompts (a tokenizer slice at a time)
            started = clock()
            try:
                return await f(*args, **kwargs)
            finally:
                entry[0] += clock() - started
                entry[1] += 1
        return timed_async

    @functools.wraps(f)
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = clock()
        try:
            return f(*args, **kwargs)
        finally:
            entry[0] += clock() - started
            entry[1] += 1
    return timed


def _instrument(module: Any) -> None:
    for cls_name, attr in TIMED[module.__name__]:
        owner = getattr(module, cls_name)
        setattr(owner, attr, _timed(getattr(owner, attr), f"{cls_name}.{attr}"))


class _Finder(importlib.abc.MetaPathFinder):
    """Times a module's functions right after it is executed, before anything can bind them."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in TIMED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        execute = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            execute(module)
            _instrument(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[2] != "-m":
        sys.exit("usage: python bench/_attribute.py OUT.json -m MODULE [ARGS...]")
    out, module = sys.argv[1], sys.argv[3]

    def dump() -> None:
        with open(out, "w") as f:
            json.dump({name: {"seconds": s, "calls": n} for name, (s, n) in totals.items()}, f)

    # The collector's pauses too (gc.gen0/1/2): a policy that allocates more pays them more often.
    started: list[float] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[:] = [time.thread_time()]
        elif started:
            entry = totals.setdefault(f"gc.gen{info['generation']}", [0.0, 0])
            entry[0] += time.thread_time() - started[0]
            entry[1] += 1

    gc.callbacks.append(on_gc)
    atexit.register(dump)
    sys.meta_path.insert(0, _Finder())
    sys.argv = [module, *sys.argv[4:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
