"""Server lifecycle: build fleet + discovery + router + app, serve, shut down cleanly."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Sequence

from aiohttp import web

from infera.discovery import discovery_options, make_discovery
from infera.discovery.base import Discovery
from infera.discovery.fleet import Fleet
from infera.discovery.record import WorkerRecord
from infera.router.auto import AutoRouter
from infera.router.breaker import CircuitBreaker
from infera.router.disagg import DisaggRouter
from infera.router.dispatch import MixedRouter
from infera.router.engine_hints import EngineHints
from infera.api.cache_hints import RETENTION_BY_NAME
from infera.router.pd import protocol_registry
from infera.router.policy import make_policy
from infera.server.app import ServerState, build_app
from infera.kv.index import KvIndex
from infera.runtime import install_event_loop, wait_for_shutdown_signal
from infera.server.cli import parse_args
from infera.server.kv import KvEventsBridge
from infera.server.engine_scrape import EngineHitWindow
from infera.server.tokenizers import RouterTokenizers
from infera.server.limits import LimitedAppRunner, LimitsMetrics, ServerLimits, limits_middleware
from infera.server.metrics import NatsMetrics, ProcessMetrics, ReplicaSyncMetrics, ServerMetrics, drop_worker_keys
from infera.server.supervisor import ChildContext, Supervisor
from infera.transport.http import HttpTransport
from infera.transport.nats_conn import NatsConnection
from infera.transport.nats_request import NatsRequestClient
from infera.transport.request import RequestTransports

log = logging.getLogger("infera.server")

CHILD_REGISTRY_WAIT_S = 10.0
CHILD_SYNC_WAIT_S = 5.0


class InferaServer:
    """One server replica. Tests build it in-process; ``main`` runs it from the CLI, or one per
    child of a ``--workers N`` supervisor (``process``: its place among them)."""

    def __init__(self, args: argparse.Namespace, discovery: Discovery | None = None,
                 process: ChildContext | None = None) -> None:
        if args.replica_sync == "local" and process is None:
            # A server built in-process is one process: there are no siblings to share with.
            args = argparse.Namespace(**{**vars(args), "replica_sync": "off"})
        self.args = args
        self.process = process
        # A worker this server cannot reach (NATS-only, no NATS here) stays listed but never routed.
        self.fleet = Fleet(unroutable=lambda record: self.transport.unreachable_reason(record))
        self.discovery = discovery or make_discovery(args.discovery_backend, etcd_endpoint=args.etcd_endpoint,
                                                     etcd_prefix=args.etcd_prefix, k8s_namespace=args.k8s_namespace,
                                                     k8s_label_selector=args.k8s_label_selector,
                                                     **discovery_options(args))
        # One breaker for mixed and PD dispatch: a worker's verdict holds whichever router sent to it.
        self.breaker = CircuitBreaker(failure_threshold=args.breaker_failure_threshold,
                                      cooldown_s=args.breaker_cooldown_s, max_cooldown_s=args.breaker_max_cooldown_s,
                                      is_member=lambda worker_id: self.fleet.get(worker_id) is not None)
        self.metrics = ServerMetrics(self.fleet, breaker=self.breaker)
        # One NATS connection for every NATS use, opened only when a flag asks for the broker plane.
        self.nats: NatsConnection | None = None
        if "nats" in (args.request_transport, args.kv_event_transport) or args.replica_sync == "nats":
            self.nats = NatsConnection.from_args(args, name="infera-server")
        nats_requests = None
        if args.request_transport == "nats":
            assert self.nats is not None
            nats_requests = NatsRequestClient(self.nats, idle_timeout=args.nats_req_idle_timeout,
                                              max_duration=args.nats_req_max_duration,
                                              max_pending=args.nats_req_max_pending)
        self.transport = RequestTransports(HttpTransport(first_byte_timeout=args.request_first_byte_timeout,
                                                         idle_timeout=args.request_idle_timeout,
                                                         max_reply_bytes=args.max_upstream_reply_bytes),
                                           nats_requests)
        self.kv: KvEventsBridge | None = None
        self.tokenizers: RouterTokenizers | None = None  # kv-aware only
        usage_observer = None
        self.replica_sync = None  # a ReplicaSync: kv-aware replicas share what only each one knows
        if args.router_policy == "kv-aware":
            replica_id = (process.replica_id or None) if process is not None else None
            if args.replica_sync == "nats":
                from infera.transport.replica_sync_nats import NatsReplicaSync

                assert self.nats is not None
                self.replica_sync = NatsReplicaSync(self.nats, replica_id=replica_id)
            elif args.replica_sync == "local":
                from infera.transport.replica_sync_local import LocalReplicaSync

                assert process is not None
                self.replica_sync = LocalReplicaSync(process.runtime_dir, process.index, process.count,
                                                     replica_id=replica_id)
            index = KvIndex()
            self.kv = KvEventsBridge(self.fleet, index, nats=self.nats if args.kv_event_transport == "nats" else None)
            self.metrics.registry.register(self.kv)
            # The tokenizer per model: --router-tokenizer-path, else the one the model's workers name.
            self.tokenizers = RouterTokenizers(self.fleet, args.router_tokenizer_path, self_check=self.kv)
            self.metrics.registry.register(self.tokenizers)
            # Routing prefix cap and token-cache budget (infera/kv/prompt.py) of every router tokenizer.
            self.tokenizers.configure(prefix_chars=args.router_prefix_chars,
                                      cache_bytes=args.router_tokenizer_cache_bytes)
            self.policy = make_policy("kv-aware", index=index, prompts=self.tokenizers,
                                      overlap_weight=args.kv_overlap_weight,
                                      prefill_overlap_weight=args.kv_prefill_overlap_weight,
                                      decode_overlap_weight=args.kv_decode_overlap_weight, observer=self.kv,
                                      replica_sync=self.replica_sync, inflight_weight=args.kv_inflight_weight,
                                      lower_tier_weight=args.kv_lower_tier_weight)
            usage_observer = self.kv.observe_usage
            self.kv.active_blocks = getattr(self.policy, "active_blocks", None)  # infera_policy_active_blocks
            self.kv.balance = getattr(self.policy, "balance", None)  # infera_policy_inflight_weight
        else:
            self.policy = make_policy(args.router_policy)
        direct = args.router_mode == "direct"
        # What each engine is told about a request's cache retention (--router-default-retention).
        engine_hints = EngineHints(RETENTION_BY_NAME[args.router_default_retention],
                                   allow_client_priority=args.allow_client_priority)
        mixed = MixedRouter(self.fleet, self.policy, self.transport, self.metrics,
                            max_retries=args.request_max_retries, direct=direct, usage_observer=usage_observer,
                            breaker=self.breaker, migration_limit=args.migration_limit,
                            engine_hints=engine_hints)
        disagg = DisaggRouter(self.fleet, self.policy, self.transport, self.metrics, protocol_registry(),
                              max_retries=args.request_max_retries, prefill_timeout=args.pd_prefill_timeout,
                              breaker=self.breaker, engine_hints=engine_hints)
        self.router = AutoRouter(self.fleet, mixed, disagg, direct=direct)
        if self.nats is not None:
            self.metrics.registry.register(NatsMetrics(self.nats, nats_requests))
        if self.replica_sync is not None:
            self.metrics.registry.register(ReplicaSyncMetrics(self.replica_sync))
        # One /metrics for all the processes of a --workers N server, gathered over a private channel.
        self.process_metrics: ProcessMetrics | None = None
        if process is not None:
            self.process_metrics = ProcessMetrics(self.metrics.registry, index=process.index, count=process.count,
                                                  socket_path=process.metrics_socket, restarts=process.generation)
            self.metrics.registry.register(self.process_metrics)
        # The KV self-check over a window: engines' prefix-cache counters against the predictions.
        self.engine_window: EngineHitWindow | None = None
        if self.kv is not None and args.engine_scrape_interval > 0:
            self.engine_window = EngineHitWindow(self.fleet, self.kv.hit_totals,
                                                 interval_s=args.engine_scrape_interval,
                                                 window_s=args.engine_scrape_window)
            self.metrics.registry.register(self.engine_window)
        self._workers: dict[str, WorkerRecord] = {}
        self.fleet.subscribe(self._on_fleet_change)
        self._runner: web.AppRunner | None = None
        self.limits = ServerLimits.from_args(args)
        self.metrics.registry.register(LimitsMetrics(self.limits))
        self.port: int | None = None
        self.scaler = None  # --enable-scaling-api: resizes this server's InferaDeployment (infera/server/scaling.py)
        if args.enable_scaling_api:
            from infera.server.scaling import DeploymentScaler

            self.scaler = DeploymentScaler(args.k8s_namespace, args.k8s_pod_name)

    def _on_fleet_change(self, worker_id: str, record) -> None:
        if record is None or not record.is_active:
            self.policy.forget(worker_id)
            self.breaker.forget(worker_id)
            self.metrics.forget_worker(worker_id)
        if record is None:
            if self.kv is not None:  # its kv-aware pick counters (the metrics drop their own series)
                drop_worker_keys(self.kv.picks, worker_id, 1)
            old = self._workers.pop(worker_id, None)
            if old is not None:
                self.transport.forget(old)
        else:
            self._workers[worker_id] = record

    async def start(self) -> None:
        if self.nats is not None:
            await self.nats.start()  # in the background: a broker that comes up later is fine
        await self.transport.start()
        if self.kv is not None:
            await self.kv.start()
        if self.engine_window is not None:
            await self.engine_window.start()
        if self.replica_sync is not None:
            await self.replica_sync.start()
        await self.discovery.start(self.fleet)  # returns at once; converges in the background
        if self.process_metrics is not None:
            await self.process_metrics.start()
        if self.process is not None:
            await self._wait_for_registry()
            wait_siblings = getattr(self.replica_sync, "wait_siblings", None)
            if wait_siblings is not None and not await wait_siblings(CHILD_SYNC_WAIT_S):
                log.warning("replica sync: not connected to every sibling after %.0f s: listening anyway",
                            CHILD_SYNC_WAIT_S)
        app = build_app(ServerState(self.fleet, self.router, self.metrics, self.args.max_request_bytes, kv=self.kv,
                                    nats=self.nats, tokenizers=self.tokenizers,
                                    admin_token=self.args.admin_token,
                                    allow_client_kv_transfer_params=self.args.allow_client_kv_transfer_params,
                                    process=self.process.info() if self.process is not None else None,
                                    metrics_gather=self.process_metrics,
                                    enable_profiling=self.args.enable_profiling,
                                    kvd_socket_path=self.args.kvd_socket_path,
                                    metrics_token=self.args.metrics_token,
                                    dashboard_session_s=self.args.dashboard_session_s, scaler=self.scaler))
        app.middlewares.append(limits_middleware(self.limits))  # body timeout, request bytes in flight
        # handler_cancellation: a client that disconnects cancels its handler, which closes the
        # upstream connection, which makes the engine abort the request and free its slot.
        # The front door's own limits (infera/server/limits.py): header, body and keep-alive
        # timeouts, the connection cap, the request bytes in flight; in every --workers process.
        self._runner = LimitedAppRunner(app, self.limits, handler_cancellation=True,
                                        access_log=logging.getLogger("infera.access") if self.args.access_log else None)
        await self._runner.setup()
        # The children of a --workers N server share the port: the kernel spreads connections over them.
        site = web.TCPSite(self._runner, self.args.host, self.args.port, backlog=2048, reuse_address=True,
                           reuse_port=self.process is not None)
        await site.start()
        server = site._server  # bound socket: the real port when --port 0 was asked for
        self.port = server.sockets[0].getsockname()[1] if server and server.sockets else self.args.port
        if self.process is not None:
            log.info("server process %d/%d listening on %s:%s (pid %d)", self.process.index, self.process.count,
                     self.args.host, self.port, os.getpid())
        else:
            log.info("infera server listening on %s:%s (discovery=%s, policy=%s, mode=%s)", self.args.host,
                     self.port, self.args.discovery_backend, self.args.router_policy, self.args.router_mode)

    async def _wait_for_registry(self, timeout: float = CHILD_REGISTRY_WAIT_S) -> None:
        """A child of a --workers N server takes its share of the port's connections the moment it
        listens: it first lists the registry (bounded), so that a child restarted under load does
        not answer 503 for a fleet its siblings serve."""
        ready = getattr(self.discovery, "ready", None)
        if ready is None:
            return
        try:
            await asyncio.wait_for(ready.wait(), timeout)
        except asyncio.TimeoutError:
            log.warning("the worker registry did not answer in %.0f s: listening anyway", timeout)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.process_metrics is not None:
            await self.process_metrics.stop()
        await self.router.close()
        if self.scaler is not None:
            await self.scaler.close()
        await self.discovery.stop()
        if self.replica_sync is not None:
            await self.replica_sync.stop()
        if self.engine_window is not None:
            await self.engine_window.stop()
        if self.kv is not None:
            await self.kv.stop()
        if self.tokenizers is not None:
            self.tokenizers.close()
        await self.transport.close()
        if self.nats is not None:
            await self.nats.close()


async def serve(args: argparse.Namespace, process: ChildContext | None = None) -> None:
    server = InferaServer(args, process=process)
    await server.start()
    if process is not None:
        process.notify_ready()
    try:
        await wait_for_shutdown_signal()
    finally:
        log.info("shutting down")
        await server.stop()
        if process is not None:
            process.leave()


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    child = ChildContext.take(os.environ)  # set by a --workers N supervisor: this is one of its processes
    where = f" [{child.index}]" if child is not None else ""
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s{where}: %(message)s")
    install_event_loop()
    if child is not None:
        args.port = child.port  # the one port every child binds (--port 0 resolved by the supervisor)
        asyncio.run(serve(args, child))
    elif args.workers > 1:
        sys.exit(asyncio.run(Supervisor(args, argv).run()))
    else:
        asyncio.run(serve(args))
