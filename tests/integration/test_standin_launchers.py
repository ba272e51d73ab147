"""The SGLang and ATOM launchers end to end, with stand-in engines, a real etcd and a real router.

``--engine-entrypoint "python -m infera.engine.sim.<engine>_standin"`` replaces the real engine
(which cannot run here); everything else is the production path: argv translation, readiness,
registration under a lease, routing, SIGTERM handling and engine stop.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time

import aiohttp
import pytest

from tests.conftest import alive, children_of, cmdline, free_port, wait_for
from tests.integration.conftest import Worker, wait_workers

CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 6}


class Launched(Worker):
    engine_pid: int | None = None

    async def find_engine(self) -> int:
        """The stand-in: the launcher's child running ``infera.engine.sim.*_standin``."""
        def found() -> bool:
            for pid in children_of(self.proc.pid):
                try:
                    if any(a.endswith("_standin") for a in cmdline(pid)):
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

    async def factory(engine: str, *engine_args: str, launcher_args: tuple[str, ...] = ()) -> Launched:
        port = free_port()
        port_flag = "--port" if engine == "sglang" else "--server-port"
        cmd = [sys.executable, "-m", f"infera.engine.{engine}", "--etcd-endpoint", etcd.endpoint,
               "--etcd-prefix", prefix, "--lease-ttl", "2", "--drain-settle", "0.3", "--log-level", "warning",
               "--engine-entrypoint", f"python -m infera.engine.sim.{engine}_standin", *launcher_args,
               port_flag, str(port), "--host", "127.0.0.1", "--speedup", "50", *engine_args]
        proc = await asyncio.create_subprocess_exec(*cmd, start_new_session=True)
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
        for pid in (w.engine_pid,):  # nothing may outlive the test
            if pid is not None and alive(pid):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


async def _stop_and_check(server, w: Launched, within: float) -> float:
    """SIGTERM the launcher: record gone, exit 0 within ``within`` s, no stand-in left."""
    engine_pid = w.engine_pid or await w.find_engine()
    t0 = time.monotonic()
    w.signal(signal.SIGTERM)
    await wait_for(lambda: w.worker_id not in {r.worker_id for r in server.fleet.all()}, 5,
                   message="record deleted on SIGTERM")
    assert await asyncio.wait_for(w.proc.wait(), within) == 0
    took = time.monotonic() - t0
    assert not alive(engine_pid), "the stand-in engine outlived its launcher"
    try:
        os.killpg(engine_pid, 0)
        pytest.fail("the engine's process group still has members")
    except ProcessLookupError:
        pass
    return took


# -- SGLang -------------------------------------------------------------------------------------------------

async def test_sglang_worker_registers_serves_and_stops(make_server, spawn):
    server = await make_server()
    w = await spawn("sglang", "--model-path", "sim-model", "--page-size", "4", "--dp-size", "2",
                    "--enable-dp-attention", "--trust-remote-code")
    await wait_workers(server, {w.worker_id})
    rec = server.fleet.get(w.worker_id)
    assert (rec.engine, rec.model_name, rec.url) == ("sglang", "sim-model", w.url)
    assert (rec.kv_block_size, rec.dp_size, rec.dp_rank) == (4, 2, None)
    assert (rec.disagg_mode, rec.disagg_meta) == ("mixed", {})
    assert rec.kv_events_endpoint and rec.kv_events_endpoint.startswith("tcp://127.0.0.1:")

    # What the engine really runs with: the user's flags, then the injected ones.
    argv = cmdline(await w.find_engine())
    assert argv[argv.index("--page-size") + 1] == "4" and "--enable-metrics" in argv
    kv_cfg = json.loads(argv[argv.index("--kv-events-config") + 1])
    # bound to the advertise address only (libzmq's "src;addr" form, which the engine's "*" rule still binds)
    assert kv_cfg == {"publisher": "zmq", "endpoint": "tcp://*:0;127.0.0.1:" + rec.kv_events_endpoint.rsplit(":", 1)[1],
                      "topic": "kv-events"}

    base = f"http://127.0.0.1:{server.port}"
    async with aiohttp.ClientSession() as s:
        for _ in range(3):
            async with s.post(base + "/v1/chat/completions", json={**CHAT, "model": "sim-model"}) as r:
                assert r.status == 200, await r.text()
                body = await r.json()
            assert body["model"] == "sim-model" and body["usage"]["completion_tokens"] > 0
        async with s.get(w.url + "/metrics") as r:
            text = await r.text()
    assert 'sglang:num_running_reqs{model_name="sim-model"} 0.0' in text

    await _stop_and_check(server, w, within=15)


async def test_sglang_pd_roles(make_server, spawn):
    server = await make_server()
    boot = free_port()
    # One host, loopback: the PD preflight (no RDMA, non-routable host) is waived on purpose.
    p = await spawn("sglang", "--model-path", "sim-pd", "--disaggregation-mode", "prefill",
                    "--disaggregation-bootstrap-port", str(boot), launcher_args=("--disaggregation-allow-tcp",))
    d = await spawn("sglang", "--model", "sim-pd", "--disaggregation-mode", "decode",
                    launcher_args=("--no-enable-kv-events", "--disaggregation-allow-tcp"))
    await wait_workers(server, {p.worker_id, d.worker_id})
    pr, dr = server.fleet.get(p.worker_id), server.fleet.get(d.worker_id)
    assert (pr.engine, pr.disagg_mode, pr.kv_block_size) == ("sglang", "prefill", 1)
    assert pr.disagg_meta == {"protocol": "sglang-bootstrap", "params": {"bootstrap_addr": f"127.0.0.1:{boot}"}}
    assert pr.kv_events_endpoint and pr.kv_events_endpoint.startswith("tcp://127.0.0.1:")
    assert (dr.disagg_mode, dr.disagg_meta) == ("decode", {"protocol": "sglang-bootstrap", "params": {}})
    assert dr.kv_events_endpoint is None
    assert "--kv-events-config" not in cmdline(await d.find_engine())
    await asyncio.gather(_stop_and_check(server, p, within=15), _stop_and_check(server, d, within=15))


# -- ATOM ---------------------------------------------------------------------------------------------------

async def test_atom_workers_register_serve_and_stop_without_draining(make_server, spawn):
    server = await make_server()
    prod = await spawn("atom", "--model", "atom-pd", "--kv-transfer-config",
                       '{"kv_connector":"mooncake","kv_role":"kv_producer"}', launcher_args=("--disaggregation-allow-tcp",))
    # A drain would hold this one for 20 s (the engine must stay idle that long); ATOM has none.
    mixed = await spawn("atom", "--model", "sim-model", "--block-size", "32",
                        launcher_args=("--drain-settle", "20", "--drain-timeout", "30"))
    await wait_workers(server, {prod.worker_id, mixed.worker_id})
    pr, mr = server.fleet.get(prod.worker_id), server.fleet.get(mixed.worker_id)
    assert (pr.engine, pr.model_name, pr.disagg_mode) == ("atom", "atom-pd", "prefill")
    assert pr.disagg_meta == {"protocol": "atom-mooncake",
                              "params": {"host": "127.0.0.1", "http_port": prod.port, "handshake_port": 6301,
                                         "tp_size": 1, "dp_size": 1}}
    assert (mr.engine, mr.disagg_mode, mr.disagg_meta, mr.kv_block_size) == ("atom", "mixed", {}, 32)
    assert mr.kv_events_endpoint is None
    argv = cmdline(await mixed.find_engine())
    assert "--port" in argv and argv[argv.index("--port") + 1] != str(mixed.port)  # free MASTER_PORT added

    base = f"http://127.0.0.1:{server.port}"
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/v1/completions",
                          json={"model": "sim-model", "prompt": "once upon a time", "max_tokens": 4}) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["usage"]["completion_tokens"] > 0
        async with s.post(base + "/v1/chat/completions", json={**CHAT, "model": "sim-model"}) as r:
            assert r.status == 200, await r.text()

    took = await _stop_and_check(server, mixed, within=15)
    assert took < 10, f"ATOM launcher took {took:.1f}s to stop: did it drain?"
    await _stop_and_check(server, prod, within=15)
