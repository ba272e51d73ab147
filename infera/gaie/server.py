"""The endpoint picker process: the server's routing stack (``RoutingStack``), the ext_proc gRPC
server (with gRPC health, TLS by default) and a plaintext gRPC health server for probes."""
from __future__ import annotations

import argparse
import hmac
import logging

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from infera.discovery.base import Discovery
from infera.gaie.ext_proc import ExternalProcessor
from infera.gaie.health import EppHealth
from infera.gaie.picker import EndpointPicker
from infera.gaie.tls import self_signed_cert
from infera.server.routing_stack import RoutingStack

log = logging.getLogger("infera.gaie")



class EppServer:
    """``start`` binds both ports (0: any free port; ``grpc_port`` / ``health_port`` hold the
    real ones after it); ``stop`` hands back every resource."""

    def __init__(self, args: argparse.Namespace, discovery: Discovery | None = None) -> None:
        self.args = args
        self.stack = RoutingStack(args, discovery, nats_name="infera-epp")
        self.picker = EndpointPicker(self.stack.router, destination_port=args.destination_port,
                                     allow_kv_transfer_params=args.allow_client_kv_transfer_params,
                                     usage_observer=self.stack.usage_observer)
        self.processor = ExternalProcessor(self.picker, args.max_request_bytes)
        self.health = EppHealth()
        self._grpc: grpc.aio.Server | None = None
        self._health_grpc: grpc.aio.Server | None = None
        self.grpc_port: int | None = None
        self.health_port: int | None = None
        self.metrics_port: int | None = None  # --metrics-port (0: off)
        self._metrics_runner: web.AppRunner | None = None

    async def start(self) -> None:
        await self.stack.start()
        self._grpc = grpc.aio.server()
        pb_grpc.add_ExternalProcessorServicer_to_server(self.processor, self._grpc)
        self.health.add_to(self._grpc)
        address = f"{self.args.host}:{self.args.grpc_port}"
        if self.args.secure_serving:
            key, cert = self_signed_cert()
            self.grpc_port = self._grpc.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
        else:
            self.grpc_port = self._grpc.add_insecure_port(address)
        # Kubernetes gRPC probes speak plaintext: the health port never serves TLS.
        self._health_grpc = grpc.aio.server()
        self.health.add_to(self._health_grpc)
        self.health_port = self._health_grpc.add_insecure_port(f"{self.args.host}:{self.args.grpc_health_port}")
        await self._grpc.start()
        await self._health_grpc.start()
        if self.args.metrics_port:
            await self._start_metrics()
        await self.health.set_serving(True)
        log.info("infera endpoint picker: ext_proc on %s:%s (%s), health on %s:%s (discovery=%s, policy=%s, "
                 "destination port %s)", self.args.host, self.grpc_port,
                 "TLS, self-signed" if self.args.secure_serving else "plaintext", self.args.host, self.health_port,
                 self.args.discovery_backend, self.args.router_policy,
                 self.args.destination_port or "the worker's own")

    async def _start_metrics(self) -> None:
        tokens = [t.encode() for t in (self.args.admin_token, self.args.metrics_token) if t]

        async def metrics(request: web.Request) -> web.Response:
            # as the server's /metrics: per-worker series name every worker's address
            if tokens:
                scheme, _, given = request.headers.get("Authorization", "").partition(" ")
                raw = given.strip().encode("utf-8", "surrogateescape")
                if scheme.lower() != "bearer" or not any([hmac.compare_digest(raw, t) for t in tokens]):
                    return web.Response(status=401, text="/metrics needs 'Authorization: Bearer <the "
                                                          "--metrics-token or --admin-token>'")
            return web.Response(body=await self.stack.metrics.render_off_loop(),
                                headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        self._metrics_runner = web.AppRunner(app, access_log=None)
        await self._metrics_runner.setup()
        site = web.TCPSite(self._metrics_runner, self.args.host, self.args.metrics_port, reuse_address=True)
        await site.start()
        self.metrics_port = self.args.metrics_port

    async def stop(self) -> None:
        """Health NOT_SERVING first, then up to ``--drain-timeout`` for the open ext_proc streams
        (in FULL_DUPLEX_STREAMED every reply streams through the picker) while refusing new ones."""
        await self.health.set_serving(False)
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
            self._metrics_runner = None
        if self._grpc is not None:
            await self._grpc.stop(self.args.drain_timeout)
        if self._health_grpc is not None:
            await self._health_grpc.stop(0)
        self._grpc = self._health_grpc = None
        await self.stack.stop()
