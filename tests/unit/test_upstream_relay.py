"""The relay of a worker's stream releases its connection and accounting exactly once, however it
ends — including when the client is gone before the first chunk was ever written."""
from __future__ import annotations

import asyncio
import json

import pytest

from infera.discovery.fleet import Fleet
from infera.discovery.record import WorkerRecord
from infera.router.upstream import Opened, Relay
from infera.server.metrics import ServerMetrics
from infera.transport.http import UpstreamError

WORKER = WorkerRecord(worker_id="w", url="http://w:1", model_name="m")


class FakeResponse:
    def __init__(self, chunks, fail_after=None):
        self.chunks = list(chunks)
        self.fail_after = fail_after
        self.released = 0

    async def next_chunk(self):
        if self.fail_after is not None and not self.chunks:
            raise UpstreamError("reset")
        return self.chunks.pop(0) if self.chunks else b""

    def release(self):
        self.released += 1


def relay(resp, on_tail=None):
    done = []
    r = Relay(Opened(200, "text/event-stream", resp=resp, first=b"data: 1\n\n"), WORKER, ServerMetrics(Fleet()),
              lambda: done.append(1), on_tail)
    return r, done


async def read_all(r):
    return [c async for c in r]


@pytest.mark.parametrize("iterate", [False, True])
def test_closed_relay_releases_once(iterate):
    resp = FakeResponse([b"data: 2\n\n", b"data: [DONE]\n\n"])
    r, done = relay(resp)

    async def main():
        if iterate:
            assert await read_all(r) == [b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]
        await r.aclose()
        await r.aclose()

    asyncio.run(main())
    assert done == [1] and resp.released >= 1


def test_finished_stream_hands_its_tail_over():
    tails = []
    usage = b'data: {"usage":{"prompt_tokens_details":{"cached_tokens":32}}}\n\n'
    r, done = relay(FakeResponse([usage, b"data: [DONE]\n\n"]), tails.append)
    asyncio.run(read_all(r))
    assert done == [1] and tails and tails[0].endswith(usage + b"data: [DONE]\n\n")


def test_broken_stream_ends_with_an_error_event():
    metrics_fleet = Fleet()
    resp = FakeResponse([], fail_after=0)
    done = []
    r = Relay(Opened(200, "text/event-stream", resp=resp, first=b"data: 1\n\n"), WORKER,
              ServerMetrics(metrics_fleet), lambda: done.append(1))
    chunks = asyncio.run(read_all(r))
    assert chunks[0] == b"data: 1\n\n"
    assert json.loads(chunks[-1][5:])["error"]["code"] == "worker_failed_midstream"
    assert done == [1] and resp.released == 1


@pytest.mark.parametrize("sizes", [[10], [3000], [100] * 50, [5, 2047, 1, 1], [2048, 2048], [0, 7, 0], [1] * 4000])
def test_stream_tail_is_the_last_bytes_whatever_the_chunking(sizes):
    from infera.router.upstream import TAIL_BYTES, StreamTail

    chunks = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
    tail = StreamTail()
    for c in chunks:
        tail.add(c)
    assert tail.bytes() == b"".join(chunks)[-TAIL_BYTES:]
    assert len(tail.chunks) <= 1 + TAIL_BYTES  # only what the tail needs is kept
