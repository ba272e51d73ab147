"""The endpoint picker process: the server's routing stack (``RoutingStack``), the ext_proc gRPC
server (with gRPC health, TLS by default) and a plaintext gRPC health server for probes."""
from __future__ import annotations

import argparse
import logging

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from infera.discovery.base import Discovery
from infera.gaie.ext_proc import ExternalProcessor
from infera.gaie.health import EppHealth
from infera.gaie.picker import EndpointPicker
from infera.gaie.tls import self_signed_cert
from infera.server.routing_stack import RoutingStack

log = logging.getLogger("infera.gaie")

STOP_GRACE_S = 5.0


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
        await self.health.set_serving(True)
        log.info("infera endpoint picker: ext_proc on %s:%s (%s), health on %s:%s (discovery=%s, policy=%s, "
                 "destination port %s)", self.args.host, self.grpc_port,
                 "TLS, self-signed" if self.args.secure_serving else "plaintext", self.args.host, self.health_port,
                 self.args.discovery_backend, self.args.router_policy,
                 self.args.destination_port or "the worker's own")

    async def stop(self) -> None:
        await self.health.set_serving(False)
        for server in (self._grpc, self._health_grpc):
            if server is not None:
                await server.stop(STOP_GRACE_S)
        self._grpc = self._health_grpc = None
        await self.stack.stop()
