"""The worker launcher lifecycle shared by every engine.

start engine (own process group) → wait until ready (deadline) → register under a lease →
keep alive → on SIGTERM/SIGINT: deregister first (stop receiving), drain in-flight (bounded),
stop the engine (SIGTERM, then SIGKILL after a grace), exit 0. If the engine dies on its own:
deregister and exit with its code. The engine also gets PDEATHSIG so even a SIGKILLed launcher
leaves no orphan.

A follower (node rank > 0 of a multi-node engine, see ``follower.py``) runs the same engine
command but only keeps the engine alive: no readiness wait (its node serves no API), no
registration, no NATS plane; SIGTERM/SIGINT stops the engine, and its death ends the launcher.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence

import aiohttp

from infera.config import add_flag, add_plane_flags, choice_of, non_negative_float, positive_float
from infera.discovery import discovery_options, make_registration
from infera.discovery.base import Registration
from infera.discovery.record import WorkerRecord
from infera.engine.base.follower import NodeRankError, is_follower, node_rank
from infera.engine.base.lora_watch import LoraWatch, start_lora_watch
from infera.engine.base.preflight import PdSetup, pd_preflight
from infera.engine.base.tokenizer_source import tokenizer_fields
from infera.runtime import install_event_loop, set_pdeathsig, wait_for
from infera.transport.nats_conn import NatsConnection

log = logging.getLogger("infera.launcher")


@dataclass
class EngineProcessSpec:
    """How to start one engine process and where it will listen."""

    cmd: list[str]
    port: int
    host: str = "127.0.0.1"  # where the launcher itself reaches the engine
    env: dict[str, str] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)  # the engine argv as finally passed (user + added)


class EngineAdapter(Protocol):
    """What differs per engine (vLLM, SGLang, ATOM, sim); the lifecycle is shared."""

    engine: str

    def add_flags(self, parser: argparse.ArgumentParser) -> None:
        """Engine-specific Infera flags (consumed, not passed to the engine)."""

    def prepare(self, engine_argv: list[str], args: argparse.Namespace) -> EngineProcessSpec:
        """The engine command (user argv verbatim + defaults where the user gave none)."""

    async def ready(self, session: aiohttp.ClientSession, base_url: str) -> bool:
        """One readiness probe."""

    async def describe(self, session: aiohttp.ClientSession, base_url: str, engine_argv: list[str],
                       args: argparse.Namespace) -> dict:
        """Record fields learned from the running engine (model_name, kv_block_size, …)."""

    def inflight(self, metrics_text: str) -> int | None:
        """Requests running + waiting, from the engine's /metrics; None if unreadable."""

    # Optional: ``node_rank_flags``, the engine's own node-rank flags (SGLang: ("--node-rank",)).
    # An adapter that has the attribute (even empty) takes part in the multinode follower gate
    # (``LWS_WORKER_INDEX`` too); one without it (ATOM, sim) is never a follower.


def build_launcher_parser(adapter: EngineAdapter, prog: str, environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    # allow_abbrev=False: a prefix of one of our flags must reach the engine untouched.
    p = argparse.ArgumentParser(prog=prog, add_help=True, allow_abbrev=False,
                                description=f"Infera {adapter.engine} worker. Flags not listed here go to the engine verbatim.")
    f = lambda *a, **k: add_flag(p, *a, environ=environ, **k)  # noqa: E731
    add_plane_flags(p, environ)
    f("--k8s-pod-name", env="POD_NAME", default=None,
      help="kubernetes discovery: this worker's own Pod, whose annotation carries its record")
    f("--lease-ttl", env="INFERA_LEASE_TTL", default=10.0, type=positive_float,
      help="registration lease TTL in seconds (keepalive every TTL/3)")
    f("--advertise-host", env="INFERA_ADVERTISE_HOST", default=(os.environ if environ is None else environ).get("POD_IP"),
      help="host the router uses to reach this worker (default: POD_IP inside a Pod, else the engine's "
           "--host, or 127.0.0.1 when that is a wildcard; set it on multi-host fleets)")
    f("--ready-timeout", env="INFERA_ENGINE_READY_TIMEOUT", default=1800.0, type=positive_float,
      help="seconds to wait for the engine to become ready")
    f("--drain-timeout", env="INFERA_DRAIN_TIMEOUT", default=30.0, type=non_negative_float,
      help="seconds in-flight requests get to finish after deregistration (0 = don't wait)")
    f("--drain-settle", env="INFERA_DRAIN_SETTLE", default=1.0, type=non_negative_float,
      help="the engine must stay idle this long before the drain is done (covers requests "
           "routed just before the router saw the deregistration)")
    f("--engine-stop-timeout", env="INFERA_ENGINE_STOP_TIMEOUT", default=30.0, type=non_negative_float,
      help="grace between SIGTERM and SIGKILL of the engine's process group")
    f("--engine-entrypoint", env="INFERA_ENGINE_ENTRYPOINT", default=None,
      help="command that replaces the engine's own entry point (e.g. 'python -m my.stand_in'); the "
           "engine argv is appended to it. For stand-ins and custom builds")
    f("--disaggregation-allow-tcp", env="INFERA_DISAGGREGATION_ALLOW_TCP", default=False,
      action=argparse.BooleanOptionalAction,
      help="PD workers: skip the RDMA and routable-host preflight (single-host tests and benchmarks)")
    f("--log-level", env="INFERA_LOG_LEVEL", default="info", type=choice_of("debug", "info", "warning", "error"),
      help="the launcher's log level (the engine keeps its own)")
    adapter.add_flags(p)
    return p


def engine_command(args: argparse.Namespace, default_module: str, engine_argv: Sequence[str]) -> list[str]:
    """``python -m <default_module> <argv>``, or ``--engine-entrypoint`` + argv when given."""
    import shlex

    if args.engine_entrypoint:
        prefix = shlex.split(args.engine_entrypoint)
        if prefix and prefix[0] in ("python", "python3"):
            prefix[0] = sys.executable  # the launcher's own interpreter, not whatever is on PATH
        return [*prefix, *engine_argv]
    return [sys.executable, "-m", default_module, *engine_argv]


WILDCARD_HOSTS = ("", "*", "0.0.0.0", "::", "[::]")


def default_advertise_host(engine_host: str | None) -> str:
    """The engine's bind host, or loopback for a wildcard bind: where this machine reaches it."""
    if engine_host and engine_host not in WILDCARD_HOSTS:
        return engine_host
    return "127.0.0.1"


class Launcher:
    def __init__(self, adapter: EngineAdapter, args: argparse.Namespace, engine_argv: list[str],
                 registration: Registration | None = None, node_rank: int = 0) -> None:
        self.adapter = adapter
        self.args = args
        self.engine_argv = engine_argv
        self.registration = registration
        self.node_rank = node_rank  # > 0: a follower (see follower.py)
        self.proc: asyncio.subprocess.Process | None = None
        self.spec: EngineProcessSpec | None = None
        self.record: WorkerRecord | None = None
        self._stop = asyncio.Event()
        self._signals = 0
        self._registering = False  # register() has been called (a stop must then deregister)
        # The NATS plane's sidecars: the request server (proxies NATS requests to the engine's
        # HTTP API) and the KV-event relay (engine ZMQ → JetStream). None on the dev plane.
        self.nats: NatsConnection | None = None
        self.request_server = None  # NatsRequestServer
        self.lora_watch: LoraWatch | None = None  # a --enable-lora engine's adapters, followed into the record
        self.kv_relay = None

    # -- engine process ------------------------------------------------------------------------------
    async def start_engine(self) -> None:
        self.spec = self.adapter.prepare(list(self.engine_argv), self.args)
        env = {**os.environ, **self.spec.env}
        log.info("starting %s engine: %s", self.adapter.engine, " ".join(self.spec.cmd))
        kwargs = {"preexec_fn": set_pdeathsig} if sys.platform.startswith("linux") else {}
        self.proc = await asyncio.create_subprocess_exec(*self.spec.cmd, env=env, start_new_session=True, **kwargs)

    @property
    def engine_url(self) -> str:
        assert self.spec is not None
        return f"http://{self.spec.host}:{self.spec.port}"

    async def wait_ready(self, session: aiohttp.ClientSession) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.args.ready_timeout
        next_progress = time.monotonic() + 30
        while True:
            if self.proc.returncode is not None:
                raise EngineExited(self.proc.returncode, "engine exited before becoming ready")
            try:
                if await self.adapter.ready(session, self.engine_url):
                    return
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                pass
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"engine not ready after {self.args.ready_timeout:.0f}s")
            if now > next_progress:
                log.info("waiting for the engine to become ready (%.0fs left)", deadline - now)
                next_progress = now + 30
            try:  # wakes early if the engine dies
                await wait_for(asyncio.shield(self.proc.wait()), timeout=0.25)
            except asyncio.TimeoutError:
                pass

    async def stop_engine(self) -> int | None:
        """Stop the engine's whole process group: SIGTERM, then SIGKILL after the grace.

        Also when the engine's main process is already dead: its children (vLLM's EngineCore,
        SGLang's schedulers…) stay in the group and must not outlive us.
        """
        proc = self.proc
        if proc is None:
            return None
        if proc.returncode is None:
            self._killpg(signal.SIGTERM)
            try:
                await wait_for(proc.wait(), timeout=self.args.engine_stop_timeout)
            except asyncio.TimeoutError:
                log.warning("engine did not stop within %.0fs; killing its process group", self.args.engine_stop_timeout)
                self._killpg(signal.SIGKILL)
                await proc.wait()
        if self._group_alive():
            self._killpg(signal.SIGTERM)
            deadline = time.monotonic() + min(self.args.engine_stop_timeout, 10.0)
            while self._group_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            self._killpg(signal.SIGKILL)
        return proc.returncode

    def _group_alive(self) -> bool:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def _killpg(self, sig: int) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    # -- drain ---------------------------------------------------------------------------------------
    async def drain(self, session: aiohttp.ClientSession) -> None:
        if not getattr(self.adapter, "drains", True):
            return  # the engine has no in-flight metric (ATOM): deregistered, so just stop it
        timeout = self.args.drain_timeout
        if timeout <= 0:
            return
        deadline = time.monotonic() + timeout
        idle_since: float | None = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.returncode is not None:
                return
            try:
                async with session.get(self.engine_url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                    text = await resp.text() if resp.status == 200 else ""
                n = self.adapter.inflight(text) if text else None
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                n = None
            if n is None:
                log.warning("cannot read in-flight requests from the engine's /metrics; not waiting for a drain")
                return
            now = time.monotonic()
            if n == 0:
                idle_since = idle_since if idle_since is not None else now
                if now - idle_since >= self.args.drain_settle:
                    log.info("drained")
                    return
            else:
                idle_since = None
            await asyncio.sleep(0.1)
        log.warning("drain timed out after %.0fs; stopping the engine with requests in flight", timeout)

    # -- whole lifecycle -------------------------------------------------------------------------------
    def _on_signal(self, sig: int) -> None:
        self._signals += 1
        if self._signals == 1:
            what = "stopping the engine" if is_follower(self.node_rank) else \
                "deregistering, draining, then stopping the engine"
            log.info("received %s: %s", signal.Signals(sig).name, what)
            self._stop.set()
        else:
            log.warning("second signal: stopping the engine now")
            self.args.drain_timeout = 0
            if self.proc is not None and self.proc.returncode is None:
                self._killpg(signal.SIGTERM)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        if is_follower(self.node_rank):
            return await self.run_follower()
        if self.registration is None:
            a = self.args
            self.registration = make_registration(a.discovery_backend, etcd_endpoint=a.etcd_endpoint,
                                                  etcd_prefix=a.etcd_prefix, lease_ttl=a.lease_ttl,
                                                  k8s_namespace=a.k8s_namespace, k8s_pod_name=a.k8s_pod_name,
                                                  **discovery_options(a))
        registered = False
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            try:
                # A signal during startup ends it, whichever step it is in: waiting for the engine,
                # for NATS (gone, say, with the rest of its deployment) or for the registry. Nothing
                # is left registered (a registration cut short is withdrawn in the finally).
                startup = asyncio.ensure_future(self._start_and_register(session))
                stop_wait = asyncio.ensure_future(self._stop.wait())
                await asyncio.wait({startup, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
                registered = self._registering
                if not startup.done():
                    startup.cancel()
                    await asyncio.wait({startup})
                    log.info("stopped during startup: nothing was left registered")
                    return 0
                stop_wait.cancel()
                startup.result()
                assert self.record is not None
                log.info("registered %s as %s (model=%s)", self.adapter.engine, self.record.worker_id,
                         self.record.model_name)
                assert self.proc is not None
                engine_exit = asyncio.ensure_future(self.proc.wait())
                stop_wait = asyncio.ensure_future(self._stop.wait())
                await asyncio.wait({engine_exit, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
                if engine_exit.done():
                    stop_wait.cancel()
                    code = self.proc.returncode
                    log.error("engine exited on its own with code %s; deregistering", code)
                    await self.stop_lora_watch()
                    await self.registration.deregister()
                    registered = False
                    return _exit_code(code)
                engine_exit.cancel()
                # Graceful: stop receiving first, then let in-flight requests finish.
                await self.stop_lora_watch()
                await self.registration.deregister()
                registered = False
                if self.request_server is not None:
                    await self.request_server.drain(self.args.drain_timeout)
                await self.drain(session)
                await self.stop_nats_plane()
                await self.stop_engine()
                return 0
            except EngineExited as exc:
                log.error("%s (code %s)", exc.message, exc.code)
                return _exit_code(exc.code) or 1
            except Exception as exc:
                log.error("launcher failed: %s", exc)
                return 1
            finally:
                await self.stop_lora_watch()
                if registered:
                    await self.registration.deregister()
                await self.stop_nats_plane()
                await self.stop_engine()
                await self.registration.close()

    async def run_follower(self) -> int:
        """Node rank > 0: start the engine, keep it alive until signalled, then stop it (§7.4).

        The engine command is the leader's translation (same defaults), so every node runs the
        engine with the same settings; the engine's API, if any, is never registered here.
        """
        log.info("node rank %d: follower of a multi-node %s engine; it is not registered and serves no "
                 "routed traffic (the node-0 launcher does)", self.node_rank, self.adapter.engine)
        try:
            await self.start_engine()
            assert self.proc is not None
            engine_exit = asyncio.ensure_future(self.proc.wait())
            stop_wait = asyncio.ensure_future(self._stop.wait())
            await asyncio.wait({engine_exit, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            if engine_exit.done():
                stop_wait.cancel()
                log.error("engine exited on its own with code %s", self.proc.returncode)
                return _exit_code(self.proc.returncode)
            engine_exit.cancel()
            await self.stop_engine()
            return 0
        except Exception as exc:
            log.error("follower launcher failed: %s", exc)
            return 1
        finally:
            await self.stop_engine()

    async def _start_and_register(self, session: aiohttp.ClientSession) -> None:
        """Start the engine, wait until it is ready, describe it, open the NATS plane, register."""
        await self.start_engine()
        await self.wait_ready(session)
        assert self.spec is not None
        fields = await self.adapter.describe(session, self.engine_url, self.spec.argv or self.engine_argv, self.args)
        fields = {**await self.tokenizer_fields(), **fields}  # an adapter's own say wins
        self.record = self._make_record(fields)
        await self.start_nats_plane()
        self._registering = True  # from here a stop must withdraw what may have been written
        await self.registration.register(self.record)
        self.lora_watch = start_lora_watch(self, session)

    async def stop_lora_watch(self) -> None:
        watch, self.lora_watch = self.lora_watch, None
        if watch is not None:
            await watch.stop()

    # -- NATS plane --------------------------------------------------------------------------------------
    async def start_nats_plane(self) -> None:
        """Subscribe the worker's request subject and start the KV relay before registering: a
        router that sees the record must find the worker there."""
        a, record = self.args, self.record
        assert record is not None
        wants_kv_relay = a.kv_event_transport == "nats" and bool(record.kv_events_endpoint)
        if a.request_transport != "nats" and not wants_kv_relay:
            return
        self.nats = NatsConnection.from_args(a, name=f"infera-worker {record.worker_id}")
        await self.nats.start()
        if not await self.nats.wait_connected(a.ready_timeout):
            raise TimeoutError(f"NATS at {','.join(self.nats.servers)} not reachable after {a.ready_timeout:.0f}s "
                               "(--nats-server, and its credentials: --nats-user, --nats-creds, --nats-tls-ca, ...)")
        if a.request_transport == "nats":
            from infera.transport.nats_request_server import NatsRequestServer

            self.request_server = NatsRequestServer(self.nats, record.worker_id, self.engine_url,
                                                    idle_timeout=a.nats_req_idle_timeout,
                                                    max_duration=a.nats_req_max_duration,
                                                    max_pending=a.nats_req_max_pending)
            await self.request_server.start()
        if wants_kv_relay:
            from infera.transport.kv_relay_nats import KvEventNatsRelay

            self.kv_relay = KvEventNatsRelay(self.nats, record)
            await self.kv_relay.start()

    async def stop_nats_plane(self) -> None:
        if self.request_server is not None:
            await self.request_server.stop()
            self.request_server = None
        if self.kv_relay is not None:
            await self.kv_relay.stop()  # flushes what the engine published last
            self.kv_relay = None
        if self.nats is not None:
            await self.nats.close()
            self.nats = None

    async def tokenizer_fields(self) -> dict:
        """The record's ``tokenizer``/``tokenizer_sha256`` from the engine argv (hashes a file: in a
        thread). Never fatal: a worker without them is still served, its server just can't tell."""
        argv = (self.spec.argv if self.spec is not None else None) or self.engine_argv
        try:
            fields = await asyncio.to_thread(tokenizer_fields, self.adapter.engine, argv,
                                             getattr(self.args, "engine_entrypoint", None))
        except Exception as exc:
            log.warning("cannot tell which tokenizer the engine uses (%s): the record names none", exc)
            return {}
        if fields:
            log.info("engine tokenizer: %s (tokenizer.json sha256 %s)", fields["tokenizer"],
                     fields["tokenizer_sha256"] or "unknown: not readable here")
        return fields

    def _make_record(self, fields: dict) -> WorkerRecord:
        assert self.spec is not None
        bind_host = fields.pop("bind_host", None)
        host = self.args.advertise_host or default_advertise_host(bind_host)
        worker_id = f"{host}:{self.spec.port}"
        return WorkerRecord(worker_id=worker_id, url=f"http://{host}:{self.spec.port}", engine=self.adapter.engine,
                            request_transport=self.args.request_transport,
                            kv_event_transport=self.args.kv_event_transport if fields.get("kv_events_endpoint") else "zmq",
                            **fields)


class EngineExited(Exception):
    def __init__(self, code: int | None, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _exit_code(code: int | None) -> int:
    if code is None:
        return 1
    return 128 - code if code < 0 else code  # killed by signal N → 128+N, like a shell


def pd_preflight_problems(adapter: EngineAdapter, args: argparse.Namespace, engine_argv: list[str],
                          rdma_devices: list[str] | None = None) -> list[str]:
    """Why this PD worker must not start (see ``preflight.py``); empty for mixed workers."""
    setup_fn = getattr(adapter, "pd_setup", None)
    if setup_fn is None:
        return []
    setup: PdSetup = setup_fn(engine_argv)
    advertise = args.advertise_host or default_advertise_host(setup.bind_host)
    return pd_preflight(setup, advertise, allow_tcp=args.disaggregation_allow_tcp, rdma_devices=rdma_devices)


def launcher_node_rank(adapter: EngineAdapter, engine_argv: list[str], environ: Mapping[str, str],
                       parser: argparse.ArgumentParser) -> int:
    """This launcher's node rank for the follower gate (0 for engines outside it); a malformed
    one is a usage error."""
    flags = getattr(adapter, "node_rank_flags", None)
    if flags is None:
        return 0
    try:
        return node_rank(engine_argv, flags, environ)[0]
    except NodeRankError as exc:
        parser.error(str(exc))


def console_prog(module_form: str) -> str:
    """The name usage lines show: the console script's (``infera-vllm``) when run as one, else the
    ``python -m`` form."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return name if name.startswith("infera-") else module_form


def launch(adapter: EngineAdapter, prog: str, argv: Sequence[str] | None = None) -> None:
    """Entry point body of ``python -m infera.engine.<engine>``."""
    parser = build_launcher_parser(adapter, prog)
    args, engine_argv = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    rank = launcher_node_rank(adapter, engine_argv, os.environ, parser)
    if not is_follower(rank):  # a follower never registers: it needs no discovery settings
        if args.discovery_backend == "etcd" and not args.etcd_endpoint:
            parser.error("--etcd-endpoint (or INFERA_ETCD_ENDPOINT) is required with --discovery-backend etcd")
        if args.discovery_backend == "kubernetes" and not args.k8s_pod_name:
            parser.error("--k8s-pod-name (or POD_NAME, set from the Downward API) is required with "
                         "--discovery-backend kubernetes: the worker's record goes on its own Pod")
        try:
            discovery_options(args)  # fleet key, etcd credentials: read at start, a bad file stops here
        except ValueError as exc:
            parser.error(str(exc))
    problems = pd_preflight_problems(adapter, args, engine_argv)
    if problems:
        parser.error("PD preflight refused this worker:\n  - " + "\n  - ".join(problems))
    if "nats" in (args.request_transport, args.kv_event_transport):
        from infera.transport.nats_auth import NatsAuth

        try:  # NATS credentials and TLS files are read at start: a bad one stops the worker here
            NatsAuth.from_args(args)
        except ValueError as exc:
            parser.error(str(exc))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_event_loop()
    code = asyncio.run(Launcher(adapter, args, engine_argv, node_rank=rank).run())
    sys.exit(code)
