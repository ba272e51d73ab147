"""Server lifecycle: build fleet + discovery + router + app, serve, shut down cleanly."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Sequence

from aiohttp import web

from infera.discovery.base import Discovery
from infera.heap_trim import limit_malloc_arenas
from infera.runtime import exit_after, install_event_loop, settle_gc, wait_for, wait_for_shutdown_signal
from infera.server.admission import AdmissionMetrics, AdmissionQueue
from infera.server.api_keys import ApiKeys, ApiKeysMetrics
from infera.server.app import ServerState, build_app
from infera.server.app_responses import RESPONSES_STORE_KEY
from infera.server.cli import parse_args
from infera.server.fast_http import fast_front
from infera.server.limits import LimitedAppRunner, LimitsMetrics, ServerLimits, limits_middleware
from infera.server.metrics import ProcessMetrics
from infera.server.responses_store import ResponsesStore, SiblingResponsesStore
from infera.server.responses_store_nats import SharedResponsesStore
from infera.server.routing_stack import RoutingStack
from infera.server.supervisor import ChildContext, Supervisor
from infera.server.tenant_limits import TenantLimiter, TenantLimitsMetrics
from infera.server.tracing import RequestTracer

log = logging.getLogger("infera.server")

CHILD_REGISTRY_WAIT_S = 10.0
CHILD_SYNC_WAIT_S = 5.0
# Draining (aiohttp's 60 s for the requests in flight) and stopping the parts, then exit in any case.
SHUTDOWN_BOUND_S = 90.0


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
        # Fleet, discovery, breaker, NATS, transports, KV events, tokenizers, policy and routers:
        # shared with the GAIE endpoint picker (infera/server/routing_stack.py).
        self.stack = stack = RoutingStack(args, discovery, process, nats_name="infera-server")
        self.fleet, self.discovery, self.breaker = stack.fleet, stack.discovery, stack.breaker
        self.metrics, self.nats, self.transport = stack.metrics, stack.nats, stack.transport
        self.kv, self.tokenizers, self.replica_sync = stack.kv, stack.tokenizers, stack.replica_sync
        self.policy, self.router = stack.policy, stack.router
        # One /metrics for all the processes of a --workers N server, gathered over a private channel.
        self.process_metrics: ProcessMetrics | None = None
        if process is not None:
            self.process_metrics = ProcessMetrics(self.metrics.registry, index=process.index, count=process.count,
                                                  socket_path=process.metrics_socket, restarts=process.generation)
            self.metrics.registry.register(self.process_metrics)
        # The KV self-check over a window: engines' prefix-cache counters against the predictions.
        self.engine_window = stack.engine_window
        if self.engine_window is not None:
            self.metrics.registry.register(self.engine_window)
        self._runner: web.AppRunner | None = None
        self.api_keys: ApiKeys | None = None  # --api-keys-file (infera/server/api_keys.py)
        self.limiter: TenantLimiter | None = None
        if args.api_keys_file:
            self.api_keys = ApiKeys(args.api_keys_file)
            self.api_keys.load()
            self.metrics.registry.register(ApiKeysMetrics(self.api_keys))
            # Per-tenant limits, shared with the other replicas over the replica-sync channel.
            self.limiter = TenantLimiter(stack.replica_sync)
            self.metrics.registry.register(TenantLimitsMetrics(self.limiter, self.api_keys.tenant_label))
        self.admission: AdmissionQueue | None = None  # --max-inflight-per-worker (infera/server/admission.py)
        if args.max_inflight_per_worker and args.router_mode == "auto":
            per_worker, fleet = args.max_inflight_per_worker, self.fleet

            def capacity(model: str) -> int:  # the workers that hold a request for its whole life
                return per_worker * (len(fleet.active(model, "mixed")) + len(fleet.active(model, "decode")))

            self.admission = AdmissionQueue(capacity, timeout_s=args.queue_timeout, max_waiting=args.queue_max_waiting,
                                            reserved_share=args.queue_reserve_per_worker / per_worker)
            self.metrics.registry.register(AdmissionMetrics(self.admission))
            fleet.subscribe(lambda worker_id, record: self.admission.refresh())  # a joined worker frees slots
        self.tracer: RequestTracer | None = None  # --otlp-traces-endpoint (infera/server/tracing.py)
        if args.otlp_traces_endpoint:
            self.tracer = RequestTracer(args.otlp_traces_endpoint, policy=args.router_policy)
        self.limits = ServerLimits.from_args(args)
        self.metrics.registry.register(LimitsMetrics(self.limits))
        self.port: int | None = None
        self.scaler = None  # --enable-scaling-api: resizes this server's InferaDeployment (infera/server/scaling.py)
        if args.enable_scaling_api:
            from infera.server.scaling import DeploymentScaler

            self.scaler = DeploymentScaler(args.k8s_namespace, args.k8s_pod_name)

    async def start(self) -> None:
        await self.stack.start()
        if self.api_keys is not None:
            self.api_keys.start()  # reloads the file when it changes
        if self.limiter is not None:
            self.limiter.start()
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
                                    dashboard_session_s=self.args.dashboard_session_s, scaler=self.scaler,
                                    api_keys=self.api_keys, tracer=self.tracer, limiter=self.limiter,
                                    admission=self.admission))
        # the Responses API's conversations, bounded by the flags (infera/server/responses_store.py)
        store = ResponsesStore(self.args.responses_store_max_bytes, self.args.responses_store_ttl)
        if self.nats is not None:  # shared with the other replicas through a NATS KV bucket
            store = SharedResponsesStore(store, self.nats, self.args.responses_store_bucket)
        elif self.replica_sync is not None:  # --workers N without NATS: sent to the sibling processes
            store = SiblingResponsesStore(store, self.replica_sync)
        app[RESPONSES_STORE_KEY] = store
        app.middlewares.append(limits_middleware(self.limits))  # body timeout, request bytes in flight
        # handler_cancellation: a client that disconnects cancels its handler, which closes the
        # upstream connection, which makes the engine abort the request and free its slot.
        # The front door's own limits (infera/server/limits.py): header, body and keep-alive
        # timeouts, the connection cap, the request bytes in flight; in every --workers process.
        access_log = logging.getLogger("infera.access") if self.args.access_log else None
        front = None
        if self.args.http_fast_path == "on":  # the inference routes' plain requests skip aiohttp's objects
            front = fast_front(app, self.limits, access_log)
        self._runner = LimitedAppRunner(app, self.limits, front=front, handler_cancellation=True,
                                        access_log=access_log)
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
            await wait_for(ready.wait(), timeout)
        except asyncio.TimeoutError:
            log.warning("the worker registry did not answer in %.0f s: listening anyway", timeout)

    async def stop(self) -> None:
        if self.api_keys is not None:
            await self.api_keys.stop()
        if self.limiter is not None:
            await self.limiter.stop()  # its bye goes out before the replica sync closes
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.process_metrics is not None:
            await self.process_metrics.stop()
        if self.scaler is not None:
            await self.scaler.close()
        if self.tracer is not None:
            await self.tracer.shutdown()  # the spans still batched go out
        await self.stack.stop()


async def serve(args: argparse.Namespace, process: ChildContext | None = None) -> None:
    server = InferaServer(args, process=process)
    await server.start()
    settle_gc()  # startup's objects out of the collector's sight; fewer young collections per request
    if process is not None:
        process.notify_ready()
    try:
        await wait_for_shutdown_signal()
    finally:
        log.info("shutting down")
        # armed through asyncio.run's own end too (its cancelled tasks, its executor's threads)
        exit_after(SHUTDOWN_BOUND_S, "shutting down")
        await server.stop()
        if process is not None:
            process.leave()


def main(argv: Sequence[str] | None = None) -> None:
    limit_malloc_arenas(os.environ)  # before any thread has one of its own (infera/heap_trim.py)
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
