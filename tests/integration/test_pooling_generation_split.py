"""Chat and completions never land on a pooling worker (issue 32 item 2, with the chat router's
generation filter in infera/router/dispatch.py): a model served by generative and embedding
workers sends generation to the former only, and a model served by embedders alone is a 400."""
from __future__ import annotations

import aiohttp
import pytest

from infera.discovery.record import WorkerRecord
from infera.engine.sim.server import SimServer, parse_args

pytestmark = pytest.mark.integration


async def test_generation_goes_only_to_generative_workers(fed_server):
    sims = [SimServer(parse_args(["--model", m, "--host", "127.0.0.1", "--port", "0", "--speedup", "1000", *flags]))
            for m, flags in (("m", []), ("m", ["--convert", "embed"]), ("emb", ["--convert", "embed"]))]
    for s in sims:
        await s.start()
    try:
        server, base = await fed_server()
        server.fleet.upsert(WorkerRecord(worker_id="gen", url=sims[0].url, model_name="m"))
        server.fleet.upsert(WorkerRecord(worker_id="emb-m", url=sims[1].url, model_name="m", tasks=["embed", "score"]))
        server.fleet.upsert(WorkerRecord(worker_id="emb", url=sims[2].url, model_name="emb", tasks=["embed", "score"]))
        async with aiohttp.ClientSession() as s:
            for i in range(6):
                async with s.post(base + "/v1/completions", json={"model": "m", "prompt": f"p {i}", "max_tokens": 2}) as r:
                    assert r.status == 200, await r.text()
            async with s.post(base + "/v1/chat/completions",
                              json={"model": "emb", "messages": [{"role": "user", "content": "hi"}]}) as r:
                body = await r.json()
                assert r.status == 400 and body["error"]["code"] == "task_not_supported"
                assert "'generate'" in body["error"]["message"]
        served = {w for (route, status, w) in server.metrics.requests if route == "/v1/completions" and status == "200"}
        assert served == {"gen"}
    finally:
        for s in sims:
            await s.stop()
