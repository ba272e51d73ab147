"""The Envoy ext_proc exchange of one HTTP request (``envoy.service.ext_proc.v3``).

Request headers: remembered; answered at once (CONTINUE) in BUFFERED mode, held in
FULL_DUPLEX_STREAMED (Envoy streams the body without waiting, and the headers' answer is the one
that carries the pick, so it can only go once the body is complete). Request body: collected up to
``max_body_bytes`` (413 above), then one pick and one answer: header mutations
(``x-gateway-destination-endpoint``, ``x-worker-instance-id``, ``x-prefill-instance-id`` for PD,
``x-data-parallel-rank``), ``clear_route_cache`` and, in FULL_DUPLEX_STREAMED, the body echoed as
streamed body mutations ending with ``end_of_stream``. A refused pick (bad JSON, no worker) is an
``immediate_response`` in the OpenAI error shape. Reply headers and body chunks pass through
(echoed chunk by chunk in FULL_DUPLEX_STREAMED); the in-flight charge is released exactly once:
at the reply's end of stream, or when the gRPC stream ends, breaks or is cancelled.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import AsyncIterator, Callable

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from infera.api.errors import ApiError
from infera.gaie.envoy_config import CONNECT_FAILURE_HEADER
from infera.gaie.picker import DESTINATION_HEADER, PREFILL_HEADER, WORKER_HEADER, EndpointPick, EndpointPicker
from infera.router.dispatch import reported_cached_tokens

log = logging.getLogger(__name__)

# Envoy's FULL_DUPLEX_STREAMED body mutations go back in pieces of at most this size (GAIE's EPP
# uses the same bound: one gRPC message per piece stays well under the message size limits).
STREAMED_CHUNK_BYTES = 62_000
# The reply's tail kept for its usage (``cached_tokens`` comes last).
USAGE_TAIL_BYTES = 4096
FULL_DUPLEX = 4  # ProcessingMode.BodySendMode.FULL_DUPLEX_STREAMED
# A request whose picked worker refused the connection is retried by Envoy under the same
# x-request-id: its refused workers are remembered this long (and this many requests at most).
REFUSED_TTL_S = 60.0
REFUSED_MAX = 10_000


class RefusedPicks:
    """Per request id, the workers that refused its connection: a retry picks among the others
    (the server's rule: never the same worker twice for one request). Bounded in time and size."""

    def __init__(self, ttl_s: float = REFUSED_TTL_S, max_entries: int = REFUSED_MAX,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self.max_entries, self._clock = ttl_s, max_entries, clock
        self._entries: OrderedDict[str, tuple[float, frozenset[str]]] = OrderedDict()

    def add(self, request_id: str, worker_id: str) -> None:
        now = self._clock()
        _, ids = self._entries.pop(request_id, (0.0, frozenset()))
        self._entries[request_id] = (now + self.ttl_s, ids | {worker_id})
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, request_id: str) -> frozenset[str]:
        entry = self._entries.get(request_id)
        if entry is None:
            return frozenset()
        if entry[0] < self._clock():
            del self._entries[request_id]
            return frozenset()
        return entry[1]


def _header_value(header: base_pb2.HeaderValue) -> str:
    return header.raw_value.decode("utf-8", "replace") if header.raw_value else header.value


def header_map(headers: pb.HttpHeaders) -> dict[str, str]:
    return {h.key.lower(): _header_value(h) for h in headers.headers.headers}


def header_mutation(set_headers: dict[str, str], remove: tuple[str, ...] = ()) -> pb.HeaderMutation:
    return pb.HeaderMutation(
        set_headers=[base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=k, raw_value=v.encode()),
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD) for k, v in set_headers.items()],
        remove_headers=list(remove))


def immediate(exc: ApiError) -> pb.ProcessingResponse:
    """An error answered by Envoy without an upstream, in the OpenAI error shape."""
    headers = {"content-type": "application/json", **{k.lower(): v for k, v in exc.headers.items()}}
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=exc.status), headers=header_mutation(headers), body=exc.body(),
        details=exc.code or "infera_epp"))


def streamed_body(body: bytes, end_of_stream: bool, *, request: bool) -> list[pb.ProcessingResponse]:
    """``body`` as FULL_DUPLEX_STREAMED body mutations (pieces of ``STREAMED_CHUNK_BYTES``)."""
    pieces = [body[i:i + STREAMED_CHUNK_BYTES] for i in range(0, len(body), STREAMED_CHUNK_BYTES)] or [b""]
    out = []
    for n, piece in enumerate(pieces):
        last = n == len(pieces) - 1
        mutation = pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(body=piece,
                                                                             end_of_stream=end_of_stream and last))
        body_response = pb.BodyResponse(response=pb.CommonResponse(body_mutation=mutation))
        out.append(pb.ProcessingResponse(request_body=body_response) if request
                   else pb.ProcessingResponse(response_body=body_response))
    return out


class Exchange:
    """One HTTP request's ext_proc stream: ``handle`` answers each message (zero or more
    responses); ``close`` releases the pick (once) whatever happened."""

    def __init__(self, picker: EndpointPicker, max_body_bytes: int, refused: RefusedPicks | None = None) -> None:
        self.picker = picker
        self.max_body_bytes = max_body_bytes
        self.refused = refused if refused is not None else RefusedPicks()
        self.full_duplex: bool | None = None  # from the stream's protocol_config (None: not told)
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.body_size = 0
        self.picked: EndpointPick | None = None
        self.status: int | None = None
        self.tail = b""
        self.blame: str | None = None  # the worker a refused connection names
        self.done = False  # the request was answered with an immediate response

    def _body_full_duplex(self) -> bool:
        return bool(self.full_duplex)

    async def handle(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if msg.HasField("protocol_config"):
            self.full_duplex = msg.protocol_config.request_body_mode == FULL_DUPLEX
        kind = msg.WhichOneof("request")
        if kind == "request_headers":
            self.headers = header_map(msg.request_headers)
            if msg.request_headers.end_of_stream:  # no body to pick with
                self.done = True
                return [immediate(ApiError(400, "the endpoint picker needs a JSON request body with a model",
                                           "invalid_json"))]
            if self._body_full_duplex():
                return []  # answered with the pick, once the body is complete
            return [pb.ProcessingResponse(request_headers=pb.HeadersResponse())]
        if kind == "request_body":
            body = msg.request_body
            self.chunks.append(body.body)
            self.body_size += len(body.body)
            if self.body_size > self.max_body_bytes:
                self.done = True
                return [immediate(ApiError(413, f"request body larger than the {self.max_body_bytes}-byte limit",
                                           "request_too_large"))]
            if self._body_full_duplex() and not body.end_of_stream:
                return []
            return await self._pick()
        if kind == "request_trailers":
            if self._body_full_duplex() and self.picked is None:
                out = await self._pick()
                if out and out[0].HasField("immediate_response"):
                    return out
                return out + [pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
            return [pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        if kind == "response_headers":
            reply = header_map(msg.response_headers)
            status = reply.get(":status", "")
            self.status = int(status) if status.isdigit() else None
            if CONNECT_FAILURE_HEADER in reply and self.picked is not None:
                # Envoy could not connect to the pick (the mark holds its address), or the sidecar
                # could not reach a worker of the pair (the mark names it): that worker's failure;
                # Envoy retries, and the retry's pick leaves it out.
                picked = self.picked.picked
                marked = reply[CONNECT_FAILURE_HEADER]
                self.blame = picked.worker.worker_id
                if picked.prefill is not None and marked == picked.prefill.worker_id:
                    self.blame = marked
                self.status = 503
                self.refused.add(self.picked.request.request_id, self.blame)
                log.warning("request %s: worker %s could not be reached (%s): Envoy retries on another pick",
                            self.picked.request.request_id, self.blame, marked)
            if msg.response_headers.end_of_stream:
                self.finish()
            return [pb.ProcessingResponse(response_headers=self._reply_headers())]
        if kind == "response_body":
            body = msg.response_body
            self.tail = (self.tail + body.body)[-USAGE_TAIL_BYTES:]
            if body.end_of_stream:
                self.finish()
            if self.full_duplex:
                return streamed_body(body.body, body.end_of_stream, request=False)
            return [pb.ProcessingResponse(response_body=pb.BodyResponse())]
        if kind == "response_trailers":
            self.finish()
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        return []

    def _reply_headers(self) -> pb.HeadersResponse:
        """The reply names the worker(s) that served it (as ``infera.server`` does)."""
        picked = self.picked
        if picked is None:
            return pb.HeadersResponse()
        named = {WORKER_HEADER: picked.set_headers[WORKER_HEADER]}
        if PREFILL_HEADER in picked.set_headers:
            named[PREFILL_HEADER] = picked.set_headers[PREFILL_HEADER]
        return pb.HeadersResponse(response=pb.CommonResponse(header_mutation=header_mutation(named)))

    async def _pick(self) -> list[pb.ProcessingResponse]:
        body = b"".join(self.chunks)
        self.chunks = [body]
        try:
            request_id = self.headers.get("x-request-id", "")
            exclude = self.refused.get(request_id) if request_id else frozenset()
            self.picked = await self.picker.pick(self.headers.get(":path", ""), body, self.headers, exclude=exclude)
        except ApiError as exc:
            self.done = True
            return [immediate(exc)]
        picked = self.picked
        common = pb.CommonResponse(header_mutation=header_mutation(picked.set_headers, picked.remove_headers),
                                   clear_route_cache=True)
        # GAIE's protocol also names the endpoint in dynamic metadata (envoy.lb), for gateways that read it there.
        metadata = struct_pb2.Struct()
        metadata.update({"envoy.lb": {DESTINATION_HEADER: picked.destination}})
        if self._body_full_duplex():
            return [pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common),
                                          dynamic_metadata=metadata),
                    *streamed_body(body, True, request=True)]
        return [pb.ProcessingResponse(request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata)]

    def finish(self, *, ended: bool = True) -> None:
        """Release the pick (once). ``ended``: the reply ended (its usage is read from the tail);
        else the stream did first. A reply whose headers said < 400 counts as served either way
        (the engine computed the prompt), as the server counts it at the first byte."""
        picked = self.picked
        if picked is None or picked.picked.finished:
            return
        picked.picked.finish(self.status, self.blame)
        observer = self.picker.usage_observer
        if ended and observer is not None and self.status == 200 and picked.picked.prefill is None:
            observer(picked.picked.worker, picked.request, reported_cached_tokens(self.tail))

    def close(self) -> None:
        self.finish(ended=False)


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    """The ext_proc gRPC service: one ``Exchange`` per stream."""

    def __init__(self, picker: EndpointPicker, max_body_bytes: int) -> None:
        self.picker = picker
        self.max_body_bytes = max_body_bytes
        self.refused = RefusedPicks()

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingResponse]:
        exchange = Exchange(self.picker, self.max_body_bytes, self.refused)
        try:
            async for msg in request_iterator:
                for response in await exchange.handle(msg):
                    yield response
                if exchange.done:
                    return
        finally:
            # The reply's end released it already; else the stream ended first (client gone, Envoy
            # reset, the picker cancelled): released now, without a verdict on the worker.
            exchange.close()
