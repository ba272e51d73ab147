#!/usr/bin/env python3
"""The floor of any grpcio endpoint picker: an Envoy ext_proc server that picks nothing.

``bench/gaie.py``'s ``epp-floor`` path runs it behind the same Envoy bootstrap as the real picker
(``python -m infera.gaie --print-envoy-config``, run unchanged): every request still opens one
ext_proc stream and exchanges the same messages, but the answer is a fixed header mutation
(round-robin over the workers' ``host:port``), built once. No parsing, no policy, no accounting.
What this path adds over Envoy round-robin is therefore what grpcio (``grpc.aio`` on uvloop, the
picker's own stack) and Envoy's ext_proc client cost per request, before the picker does any work:
if the floor alone misses a latency goal, no picker written on this stack can meet it.

    python bench/_ext_proc_floor.py --grpc-port 9002 --worker 127.0.0.1:8001 --worker 127.0.0.1:8002 [--tls]
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import sys

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from infera.gaie.picker import DESTINATION_HEADER, WORKER_HEADER  # noqa: E402
from infera.gaie.tls import self_signed_cert  # noqa: E402
from infera.runtime import install_event_loop  # noqa: E402

CONTINUE_HEADERS = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
CONTINUE_REPLY = pb.ProcessingResponse(response_headers=pb.HeadersResponse())


def pick_answer(destination: str, worker_id: str) -> pb.ProcessingResponse:
    """The request body's answer: the destination header set, the route cache cleared (as the picker does)."""
    headers = [base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v.encode()),
                                          append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)
               for k, v in ((DESTINATION_HEADER, destination), (WORKER_HEADER, worker_id))]
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
        header_mutation=pb.HeaderMutation(set_headers=headers), clear_route_cache=True)))


class FloorProcessor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, workers: list[str]) -> None:
        self._answers = itertools.cycle([pick_answer(w, f"floor-{i}") for i, w in enumerate(workers)])

    async def Process(self, request_iterator, context):
        async for msg in request_iterator:
            kind = msg.WhichOneof("request")
            if kind == "request_headers":
                yield CONTINUE_HEADERS
            elif kind == "request_body":
                yield next(self._answers)
            elif kind == "response_headers":
                yield CONTINUE_REPLY


async def serve(args: argparse.Namespace) -> None:
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(FloorProcessor(args.worker), server)
    address = f"127.0.0.1:{args.grpc_port}"
    if args.tls:
        key, cert = self_signed_cert()
        server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
    else:
        server.add_insecure_port(address)
    await server.start()
    print(f"ext_proc floor on {address} ({'TLS' if args.tls else 'plaintext'}), {len(args.worker)} workers",
          flush=True)
    await server.wait_for_termination()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--grpc-port", type=int, required=True)
    p.add_argument("--worker", action="append", required=True, help="host:port of a worker (repeat)")
    p.add_argument("--tls", action="store_true", help="serve TLS with a self-signed certificate, as the picker does")
    args = p.parse_args()
    install_event_loop()  # uvloop, as python -m infera.gaie
    try:
        asyncio.run(serve(args))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
