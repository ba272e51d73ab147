"""gRPC health (grpc.health.v1) for the endpoint picker: the ``inference-extension`` service and
the server as a whole (``""``), as GAIE's EPP reports them."""
from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

INFERENCE_EXTENSION_SERVICE = "inference-extension"
HEALTH_SERVICES = (INFERENCE_EXTENSION_SERVICE, "")


class EppHealth:
    """One health servicer, added to every gRPC server of the picker so they answer alike."""

    def __init__(self) -> None:
        self.servicer = health.aio.HealthServicer()

    def add_to(self, server: grpc.aio.Server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in HEALTH_SERVICES:
            await self.servicer.set(service, status)
