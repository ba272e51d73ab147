"""The multinode follower gate: the decision table, and a follower's lifecycle with a real engine process."""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

import pytest

from infera.engine.atom.adapter import AtomAdapter
from infera.engine.base.follower import NodeRankError, is_follower, node_rank
from infera.engine.base.launcher import EngineProcessSpec, Launcher, build_launcher_parser, launcher_node_rank
from infera.engine.sglang.adapter import SglangAdapter
from infera.engine.sim.launcher import SimAdapter
from infera.engine.vllm.adapter import VllmAdapter
from tests.conftest import alive, wait_for

SGLANG = SglangAdapter.node_rank_flags
VLLM = VllmAdapter.node_rank_flags


@pytest.mark.parametrize(
    "argv, flags, env, rank",
    [
        ([], SGLANG, {}, 0),  # nothing says otherwise: the leader
        (["--model-path", "m", "--node-rank", "1"], SGLANG, {}, 1),
        (["--node-rank=2", "--nnodes", "4"], SGLANG, {}, 2),
        (["--node-rank", "0"], SGLANG, {}, 0),
        (["--node-rank", "0"], SGLANG, {"LWS_WORKER_INDEX": "3"}, 0),  # the flag wins over the env
        (["--node-rank", "2"], SGLANG, {"LWS_WORKER_INDEX": "0"}, 2),
        ([], SGLANG, {"LWS_WORKER_INDEX": "1"}, 1),
        ([], SGLANG, {"LWS_WORKER_INDEX": "0"}, 0),
        ([], SGLANG, {"LWS_WORKER_INDEX": " 2 "}, 2),
        ([], SGLANG, {"LWS_WORKER_INDEX": ""}, 0),  # set but empty: as unset
        ([], VLLM, {"LWS_WORKER_INDEX": "1"}, 1),
        ([], VLLM, {}, 0),
        (["--node-rank", "1"], VLLM, {}, 0),  # vLLM's own --node-rank is not part of the gate
        (["--node-rankx", "1"], SGLANG, {}, 0),  # another flag
    ],
)
def test_node_rank_table(argv, flags, env, rank):
    got, _ = node_rank(argv, flags, env)
    assert got == rank
    assert is_follower(got) == (rank > 0)


@pytest.mark.parametrize(
    "argv, env, message",
    [
        (["--node-rank", "one"], {}, "--node-rank must be a non-negative integer"),
        (["--node-rank", "-1"], {}, "--node-rank must be a non-negative integer, got '-1'"),
        (["--node-rank=1.5"], {}, "--node-rank must be a non-negative integer"),
        (["--node-rank"], {}, "--node-rank needs a value"),
        (["--node-rank", "--tp", "2"], {}, "--node-rank needs a value"),
        ([], {"LWS_WORKER_INDEX": "abc"}, "LWS_WORKER_INDEX must be a non-negative integer"),
        ([], {"LWS_WORKER_INDEX": "-2"}, "LWS_WORKER_INDEX must be a non-negative integer"),
    ],
)
def test_bad_node_ranks_are_errors_not_leaders(argv, env, message):
    with pytest.raises(NodeRankError, match=message):
        node_rank(argv, SGLANG, env)


def test_launcher_turns_a_bad_rank_into_a_usage_error(capsys):
    parser = build_launcher_parser(SglangAdapter(), "t", environ={})
    with pytest.raises(SystemExit) as exc:
        launcher_node_rank(SglangAdapter(), ["--node-rank", "x"], {}, parser)
    assert exc.value.code == 2
    assert "--node-rank must be a non-negative integer" in capsys.readouterr().err


@pytest.mark.parametrize("adapter, argv, env, rank", [
    (SglangAdapter(), ["--node-rank", "1"], {}, 1),
    (VllmAdapter(), [], {"LWS_WORKER_INDEX": "2"}, 2),
    (AtomAdapter(), ["--node-rank", "1"], {"LWS_WORKER_INDEX": "1"}, 0),  # ATOM is outside the gate
    (SimAdapter(), [], {"LWS_WORKER_INDEX": "1"}, 1),  # a sim LeaderWorkerSet's follower
    (SimAdapter(), [], {}, 0),
])
def test_which_engines_take_part(adapter, argv, env, rank):
    parser = build_launcher_parser(adapter, "t", environ={})
    assert launcher_node_rank(adapter, argv, env, parser) == rank


# -- a follower's lifecycle, with a real engine process ----------------------------------------------

class SleeperAdapter:
    """An engine that is a plain process: sleeps, or exits with a code."""

    engine = "sleeper"
    node_rank_flags = ()

    def __init__(self, exit_code: int | None = None) -> None:
        self.exit_code = exit_code
        self.prepared = 0
        self.probed = 0  # ready() / describe() calls: a leader's, never a follower's

    def add_flags(self, parser):
        pass

    def prepare(self, engine_argv, args):
        self.prepared += 1
        code = "import time; time.sleep(60)" if self.exit_code is None else f"import sys; sys.exit({self.exit_code})"
        return EngineProcessSpec(cmd=[sys.executable, "-c", code], port=1)

    async def ready(self, session, base_url):
        self.probed += 1
        raise AssertionError("a follower never probes readiness")

    async def describe(self, *a):
        self.probed += 1
        raise AssertionError("a follower never builds a record")

    def inflight(self, metrics_text):
        raise AssertionError("a follower never drains")


class NoRegistration:
    def __getattr__(self, name):
        raise AssertionError(f"a follower touched discovery ({name})")


def _follower(adapter) -> Launcher:
    args = argparse.Namespace(engine_stop_timeout=5.0, drain_timeout=30.0, ready_timeout=1.0,
                              discovery_backend="etcd", etcd_endpoint=None)
    return Launcher(adapter, args, ["--model", "m"], registration=NoRegistration(), node_rank=1)


def _signal_when_waiting_on_the_engine(launcher: Launcher) -> asyncio.Event:
    """An event set when the launcher first awaits its engine's exit: a follower does that right
    after starting the engine; a leader only after ready() and describe() (or when it stops it)."""
    waiting = asyncio.Event()
    start_engine = launcher.start_engine

    async def start_and_watch() -> None:
        await start_engine()
        proc_wait = launcher.proc.wait

        async def wait():
            waiting.set()
            return await proc_wait()

        launcher.proc.wait = wait

    launcher.start_engine = start_and_watch
    return waiting


async def test_follower_keeps_its_engine_until_sigterm_then_stops_it():
    adapter = SleeperAdapter()
    launcher = _follower(adapter)
    waiting = _signal_when_waiting_on_the_engine(launcher)
    run = asyncio.ensure_future(launcher.run())
    try:
        # The barrier: the launcher is parked on its engine's exit (or a signal). A leader could
        # only get there through a readiness probe, which counts (and raises) here.
        await asyncio.wait_for(waiting.wait(), 10)
        pid = launcher.proc.pid
        assert adapter.probed == 0 and alive(pid) and not run.done()
        os.kill(os.getpid(), signal.SIGTERM)  # through the launcher's own handler
        assert await asyncio.wait_for(run, 10) == 0
        assert not alive(pid) and adapter.probed == 0
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)
    finally:
        if not run.done():
            run.cancel()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


async def test_follower_exits_with_its_engine_s_code():
    launcher = _follower(SleeperAdapter(exit_code=3))
    try:
        assert await asyncio.wait_for(launcher.run(), 10) == 3
    finally:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
