"""A worker told to stop while it is still starting stops at once, whatever step it is in.

Found by the Kubernetes end-to-end test: a worker Pod deleted with the rest of its deployment got
SIGTERM after its engine was ready but while it waited for NATS (whose Pod was being deleted too),
and waited out the NATS timeout (``--ready-timeout``, meant for cold starts of tens of minutes)
before it looked at the signal: the Pod stayed until the kubelet's SIGKILL at the end of the grace
period. Here NATS is a port nobody listens on, so that wait would never end on its own.
"""
from __future__ import annotations

import asyncio
import signal
import sys
import time

import pytest

from tests.conftest import free_port, stop_process_group, wait_for

pytestmark = pytest.mark.integration


async def test_sigterm_while_waiting_for_nats_after_the_engine_is_ready_exits_promptly(etcd, prefix) -> None:
    cmd = [sys.executable, "-m", "infera.engine.sim", "--discovery-backend", "etcd", "--etcd-endpoint", etcd.endpoint,
           "--etcd-prefix", prefix, "--request-transport", "nats", "--kv-event-transport", "zmq",
           "--nats-server", f"nats://127.0.0.1:{free_port()}", "--ready-timeout", "600", "--log-level", "info",
           "--host", "127.0.0.1", "--port", str(free_port()), "--model", "sim-model"]
    proc = await asyncio.create_subprocess_exec(*cmd, stderr=asyncio.subprocess.PIPE, start_new_session=True)
    lines: list[str] = []

    async def read() -> None:
        assert proc.stderr is not None
        async for line in proc.stderr:
            lines.append(line.decode(errors="replace"))
    reader = asyncio.create_task(read())
    try:
        # The launcher logs the engine's tokenizer after the engine is ready, just before NATS.
        await wait_for(lambda: any("engine tokenizer" in line for line in lines), 60,
                       message="the engine ready and the launcher past it")
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 15)
        took = time.monotonic() - sent
        await reader
        assert code == 0, "".join(lines)
        assert took < 10, f"exit took {took:.1f}s after SIGTERM"
        assert any("stopped during startup" in line for line in lines), "".join(lines)
        assert not any("registered sim" in line for line in lines), "".join(lines)
    finally:
        reader.cancel()
        if proc.returncode is None:
            await stop_process_group(proc)
