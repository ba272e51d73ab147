"""The multinode follower gate end to end: SGLang launchers over the stand-in engine, a real etcd and a
real router. A follower (LWS_WORKER_INDEX > 0) keeps its engine alive, never registers, and stops
its engine on SIGTERM; its leader, with the same flags, registers as usual.
"""
from __future__ import annotations

import asyncio
import base64
import os
import signal
import sys

import aiohttp
import pytest

from tests.conftest import alive, children_of, cmdline, free_port, wait_for
from tests.integration.conftest import Worker, wait_workers


class Launched(Worker):
    engine_pid: int | None = None

    async def find_engine(self) -> int:
        def found() -> bool:
            for pid in children_of(self.proc.pid):
                try:
                    if any(a.endswith("sglang_standin") for a in cmdline(pid)):
                        self.engine_pid = pid
                        return True
                except OSError:
                    pass
            return False

        await wait_for(found, 15, message="the stand-in engine process")
        assert self.engine_pid is not None
        return self.engine_pid


@pytest.fixture
async def spawn(etcd, prefix):
    launched: list[Launched] = []

    async def factory(*engine_args: str, env: dict[str, str] | None = None, discovery: bool = True) -> Launched:
        port = free_port()
        plane = ("--etcd-endpoint", etcd.endpoint, "--etcd-prefix", prefix) if discovery else ()
        cmd = [sys.executable, "-m", "infera.engine.sglang", *plane, "--lease-ttl", "2", "--log-level", "warning",
               "--engine-entrypoint", "python -m infera.engine.sim.sglang_standin",
               "--model-path", "sim-model", "--port", str(port), "--host", "127.0.0.1", "--speedup", "50", *engine_args]
        # No fp8 default: the stand-in takes no --kv-cache-dtype (this test may run on a GPU host).
        full_env = {k: v for k, v in os.environ.items() if k not in ("LWS_WORKER_INDEX", "INFERA_ETCD_ENDPOINT")}
        full_env.update({"INFERA_DEFAULT_KV_FP8": "0", **(env or {})})
        proc = await asyncio.create_subprocess_exec(*cmd, env=full_env, start_new_session=True)
        w = Launched(proc, port)
        launched.append(w)
        return w

    yield factory
    for w in launched:
        if w.proc.returncode is None:
            w.signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(w.proc.wait(), 10)
            except asyncio.TimeoutError:
                os.killpg(w.proc.pid, signal.SIGKILL)
                await w.proc.wait()
        if w.engine_pid is not None and alive(w.engine_pid):
            try:
                os.killpg(w.engine_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


async def etcd_keys(endpoint: str, prefix: str) -> list[str]:
    """Every key under ``prefix``, read from etcd itself (v3 JSON gateway)."""
    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    b64 = lambda s: base64.b64encode(s.encode()).decode()  # noqa: E731
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://{endpoint}/v3/kv/range", json={"key": b64(prefix), "range_end": b64(end)}) as r:
            body = await r.json()
    return [base64.b64decode(kv["key"]).decode() for kv in body.get("kvs", [])]


async def healthy(url: str) -> bool:
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                return r.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return False


async def test_follower_never_registers_keeps_its_engine_and_stops_it_on_sigterm(make_server, spawn, etcd, prefix):
    server = await make_server()
    # Same discovery flags for both. The leader starts only once the follower's engine serves, so
    # by the time the leader (engine start, readiness, registration) is listed, a follower that
    # registered (readiness, registration) would be listed too: "never" is checked after that.
    follower = await spawn(env={"LWS_WORKER_INDEX": "1"})
    engine_pid = await follower.find_engine()
    await wait_for(lambda: healthy(follower.url), 30, message="the follower's engine serving")
    leader = await spawn()
    await wait_workers(server, {leader.worker_id})
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{server.port}/v1/workers") as r:
            listed = {w["worker_id"] for w in (await r.json())["workers"]}
    assert listed == {leader.worker_id}
    keys = await etcd_keys(etcd.endpoint, prefix)
    assert keys and all(follower.worker_id not in k for k in keys) and any(leader.worker_id in k for k in keys)
    assert alive(engine_pid) and follower.proc.returncode is None

    follower.signal(signal.SIGTERM)
    assert await asyncio.wait_for(follower.proc.wait(), 15) == 0
    assert not alive(engine_pid), "the follower's engine outlived its launcher"
    with pytest.raises(ProcessLookupError):
        os.killpg(engine_pid, 0)
    assert {r.worker_id for r in server.fleet.all()} == {leader.worker_id}  # the leader is untouched


async def test_follower_needs_no_discovery_and_ends_with_its_engine(spawn):
    # --node-rank works too (passed to the engine as is) but the stand-in takes no such flag: the env form.
    follower = await spawn(env={"LWS_WORKER_INDEX": "2"}, discovery=False)
    engine_pid = await follower.find_engine()
    await wait_for(lambda: healthy(follower.url), 30, message="the follower's engine serving")
    os.kill(engine_pid, signal.SIGKILL)
    assert await asyncio.wait_for(follower.proc.wait(), 15) == 128 + signal.SIGKILL


async def test_a_bad_worker_index_is_refused_before_anything_starts(spawn):
    w = await spawn(env={"LWS_WORKER_INDEX": "leader"})
    assert await asyncio.wait_for(w.proc.wait(), 15) == 2
    assert not children_of(w.proc.pid)
