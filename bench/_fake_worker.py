"""A minimal fake OpenAI worker for ``bench/router_overhead.py --worker fake``.

Answers at once, with no model and no scheduler, so a benchmark against it measures the HTTP
path alone: ``POST /v1/chat/completions`` and ``/v1/completions`` return a fixed JSON reply, or
(``"stream": true``) ``--tokens`` SSE chunks, a usage chunk and ``data: [DONE]``, each chunk a
separate write like an engine relaying tokens. It registers its worker record in etcd under a
lease (``infera.discovery.etcd.EtcdRegistration``), so a server discovers it like a real worker,
and deregisters on SIGTERM/SIGINT.

With ``--request-transport nats`` it also serves its NATS request subject, in this same process,
with ``infera.transport.nats_request_server.NatsRequestServer`` in front of its own HTTP app (as a
launcher does in front of its engine, though a launcher is a process of its own), and its record
says ``request_transport: nats``.

    python bench/_fake_worker.py --etcd-endpoint http://127.0.0.1:2379 --model fake --port 9001
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time

import msgspec
from aiohttp import web

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from infera.discovery.etcd import EtcdRegistration  # noqa: E402
from infera.discovery.record import WorkerRecord  # noqa: E402

_enc = msgspec.json.Encoder()


class _Req(msgspec.Struct, forbid_unknown_fields=False):
    stream: bool | None = False


_decoder = msgspec.json.Decoder(_Req)


def _replies(model: str, tokens: int) -> tuple[dict[str, bytes], dict[str, list[bytes]]]:
    """Pre-encoded replies per route: unary body, and the stream as a list of SSE frames."""
    created = int(time.time())
    usage = {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": 8 + tokens}
    words = [f" tok{i}" for i in range(tokens)]
    unary: dict[str, bytes] = {}
    streams: dict[str, list[bytes]] = {}

    def sse(obj: dict) -> bytes:
        return b"data: " + _enc.encode(obj) + b"\n\n"

    # chat
    base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": created, "model": model}
    frames = []
    for i, w in enumerate(words):  # exactly `tokens` content chunks; the first carries the role
        delta = {"role": "assistant", "content": w} if i == 0 else {"content": w}
        frames.append(sse({**base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                "finish_reason": "length" if i == tokens - 1 else None}]}))
    frames.append(sse({**base, "choices": [], "usage": usage}))
    frames.append(b"data: [DONE]\n\n")
    streams["chat"] = frames
    unary["chat"] = _enc.encode({
        "id": "chatcmpl-fake", "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(words)},
                     "logprobs": None, "finish_reason": "length"}],
        "usage": usage})
    # completions
    base = {"id": "cmpl-fake", "object": "text_completion", "created": created, "model": model}
    frames = [sse({**base, "choices": [{"index": 0, "text": w, "logprobs": None,
                                        "finish_reason": "length" if i == tokens - 1 else None}]})
              for i, w in enumerate(words)]
    frames.append(sse({**base, "choices": [], "usage": usage}))
    frames.append(b"data: [DONE]\n\n")
    streams["cmpl"] = frames
    unary["cmpl"] = _enc.encode({
        "id": "cmpl-fake", "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": "".join(words), "logprobs": None, "finish_reason": "length"}],
        "usage": usage})
    return unary, streams


def build_app(model: str, tokens: int) -> web.Application:
    unary, streams = _replies(model, tokens)
    sse_headers = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}

    def handler(kind: str):
        async def handle(request: web.Request) -> web.StreamResponse:
            try:
                req = _decoder.decode(await request.read())
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                return web.json_response({"error": {"message": str(exc), "type": "BadRequestError",
                                                    "param": None, "code": 400}}, status=400)
            if not req.stream:
                return web.Response(body=unary[kind], content_type="application/json")
            resp = web.StreamResponse(headers=sse_headers)
            await resp.prepare(request)
            for frame in streams[kind]:
                await resp.write(frame)
            await resp.write_eof()
            return resp

        return handle

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": model, "object": "model", "owned_by": "fake"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler("chat"))
    app.router.add_post("/v1/completions", handler("cmpl"))
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    return app


async def serve(args: argparse.Namespace) -> None:
    runner = web.AppRunner(build_app(args.model, args.tokens), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, backlog=2048, reuse_address=True)
    await site.start()
    worker_id = f"{args.host}:{args.port}"
    url = f"http://{args.host}:{args.port}"
    registration = EtcdRegistration(args.etcd_endpoint, args.etcd_prefix, ttl=args.lease_ttl)
    record = WorkerRecord(worker_id=worker_id, url=url, model_name=args.model,
                          engine="vllm", kv_block_size=16, request_transport=args.request_transport)
    nats = request_server = None
    if args.request_transport == "nats":  # subscribed before the record is registered, like a launcher
        from infera.transport.nats_conn import NatsConnection
        from infera.transport.nats_request_server import NatsRequestServer

        nats = NatsConnection(args.nats_server, name=f"infera-fake-worker {worker_id}")
        await nats.start()
        if not await nats.wait_connected(30):
            raise SystemExit(f"NATS at {args.nats_server} not reachable")
        request_server = NatsRequestServer(nats, worker_id, url)
        await request_server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await registration.register(record)
        await stop.wait()
    finally:
        await registration.deregister()
        await registration.close()
        if request_server is not None:
            await request_server.drain(3)
            await request_server.stop()
        if nats is not None:
            await nats.close()
        await runner.cleanup()


def main() -> None:
    p = argparse.ArgumentParser(prog="bench/_fake_worker.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--etcd-endpoint", required=True)
    p.add_argument("--etcd-prefix", default="/infera/workers/")
    p.add_argument("--lease-ttl", type=float, default=10.0)
    p.add_argument("--model", default="fake")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tokens", type=int, default=16, help="SSE token chunks per streamed reply")
    p.add_argument("--request-transport", choices=("http", "nats"), default="http",
                   help="nats: also serve requests over NATS (NatsRequestServer, in this process)")
    p.add_argument("--nats-server", default="nats://127.0.0.1:4222", help="NATS URL (with --request-transport nats)")
    args = p.parse_args()
    try:
        import uvloop

        uvloop.run(serve(args))
    except ImportError:
        asyncio.run(serve(args))


if __name__ == "__main__":
    main()
