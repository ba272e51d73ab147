"""Request shapes of the outside benchmark clients, sent through the router to sim workers exactly as
the clients send them.

``sglang.bench_serving --backend sglang-oai`` (the reference's benchmark methodology, always through
the router): a streamed ``/v1/completions`` with ``ignore_eos`` and ``stream_options.include_usage``.
Its parser reads ``choices[0].text`` of each chunk and ``usage.completion_tokens``; the output length
must be exactly ``max_tokens`` (ignore_eos), the usage chunk must come last, before ``[DONE]``."""
from __future__ import annotations

import json

import aiohttp
import pytest

from tests.conftest import wait_for
from tests.integration.conftest import wait_workers

pytestmark = pytest.mark.integration

OUTPUT_LEN = 24


def sglang_oai_payload(prompt: str) -> dict:
    return {"model": "sim-model", "prompt": prompt, "temperature": 0.0, "best_of": 1, "max_tokens": OUTPUT_LEN,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}


def sse_events(raw: bytes) -> list[str]:
    events = []
    for line in raw.decode().splitlines():
        line = line.strip()
        if line:
            assert line.startswith("data: "), line
            events.append(line[len("data: "):])
    return events


async def test_sglang_oai_streamed_completions_with_ignore_eos_and_usage(make_server, spawn_worker):
    server = await make_server()  # kv-aware: the usage chunk also feeds the router's self-check
    w = await spawn_worker()
    await wait_workers(server, {w.worker_id})
    base = f"http://127.0.0.1:{server.port}"
    prompt = " ".join(f"benchmark{i}" for i in range(120))
    async with aiohttp.ClientSession() as s:
        await wait_for(lambda: server.kv.subscriber.stats(w.worker_id).get("connected"), 10, message="subscribed")
        for turn in range(2):  # the second: the same prompt, now cached on the worker
            async with s.post(base + "/v1/completions", json=sglang_oai_payload(prompt)) as r:
                assert r.status == 200, await r.text()
                assert r.headers["Content-Type"].startswith("text/event-stream")
                events = sse_events(await r.read())
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            text_chunks = [c for c in chunks if c.get("choices") and c["choices"][0].get("text")]
            usage_chunks = [c for c in chunks if c.get("usage")]
            assert len(usage_chunks) == 1 and chunks[-1] is usage_chunks[0], "usage must be the last chunk"
            assert chunks[-1]["choices"] == []
            usage = usage_chunks[0]["usage"]
            # ignore_eos: exactly max_tokens generated, one streamed token per chunk
            assert usage["completion_tokens"] == OUTPUT_LEN == len(text_chunks)
            assert usage["prompt_tokens"] > 100
            assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
            assert all(c["object"] == "text_completion" and c["model"] == "sim-model" for c in chunks)
            assert all(c["usage"] is None for c in chunks[:-1] if "usage" in c)
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            assert (cached == 0) if turn == 0 else (cached > 0)
            if turn == 0:
                await wait_for(lambda: server.kv.index.block_count(w.worker_id) > 0, 10, message="blocks stored")
    # Both usage chunks reached the self-check, and the router counted both replies' prompts.
    view = server.kv.cache_view(w.worker_id, None)["prediction"]
    assert view["observations"] == 2 and view["exact"] == 2, view
    predicted, prompt_tokens = server.kv.hit_totals(w.worker_id)
    assert prompt_tokens == 2 * usage["prompt_tokens"] and predicted == cached
