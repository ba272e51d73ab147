"""LoRA-aware routing on real vLLM-CPU (issue 32 item 3): two engines, one with ``--enable-lora`` and
two tiny adapters built locally (``tiny_lora.py``, PEFT layout), one without. The holder's record
lists the adapters, the server's /v1/models lists them with the base as parent, adapter requests are
only ever served by the holder (the other engine would answer 404), and the kv-aware server predicts
vLLM's ``cached_tokens`` exactly per adapter: the same prompt under the base model and each adapter
is a cold start every time (vLLM folds the adapter into every block hash), then a hit of its own."""
from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.conftest import VllmFleet, WorkerSpec, http_json, wait_until
from tests.e2e.tiny_lora import build_tiny_lora

pytestmark = pytest.mark.e2e
BLOCK = 32  # the fleet's --block-size


@pytest.fixture(scope="module")
def lora_fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-lora")
    sql = build_tiny_lora(tmp / "adapters" / "sql", "tiny", seed=1)
    poet = build_tiny_lora(tmp / "adapters" / "poet", "tiny", seed=2)
    spec = WorkerSpec(engine=["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                              "--lora-modules", f"sql={sql}", f"poet={poet}"],
                      env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    fleet = VllmFleet(tmp, specs=[spec, WorkerSpec()])  # the holder, and an engine without LoRA
    try:
        fleet.start(1)
        yield fleet
    finally:
        fleet.stop()


def ask(base: str, body: dict) -> dict:
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _served(worker) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{worker.port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{"))


def test_records_and_models_list_the_adapters(lora_fleet):
    holder, other = lora_fleet.workers
    adapters = {r["worker_id"]: r["lora_adapters"] for r in lora_fleet.records(lora_fleet.kv_base)}
    assert adapters == {holder.worker_id: ["poet", "sql"], other.worker_id: []}
    listed = {m["id"]: m.get("parent") for m in http_json(lora_fleet.kv_base + "/v1/models", timeout=10)["data"]}
    assert listed == {"tiny": None, "poet": "tiny", "sql": "tiny"}


def test_adapter_requests_are_served_only_by_the_holder(lora_fleet):
    holder, other = lora_fleet.workers
    before = (_served(holder), _served(other))
    for i in range(4):  # round-robin: the base model's requests alternate, an adapter's never leave the holder
        for model in ("sql", "poet"):
            body = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": f"q{i}"}]}
            assert ask(lora_fleet.base, body)["model"] == model
    assert _served(holder) - before[0] == 8 and _served(other) == before[1]


def test_cached_tokens_predicted_exactly_per_adapter_on_vllm(lora_fleet):
    base = lora_fleet.kv_base

    def view() -> dict:  # both engines' views summed (the base model's requests may go to either)
        views = [http_json(f"{base}/v1/admin/cache-view/{w.worker_id}", timeout=5) for w in lora_fleet.workers]
        return {"caught_up": all(v.get("caught_up") for v in views),
                "block_count": sum(v["block_count"] for v in views),
                "prediction": {k: sum(v["prediction"][k] for v in views) for k in ("observations", "exact")}}

    def caught_up() -> bool:
        try:
            return bool(view().get("caught_up"))
        except OSError:
            return False

    wait_until(caught_up, 60, "the engine's KV events followed")
    words = (Path(__file__).resolve().parents[2] / "README.md").read_text().split()[:300]
    results = []
    for model in ("tiny", "tiny", "sql", "sql", "poet", "poet"):
        body = {"model": model, "max_tokens": 2, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "system", "content": "shared: " + " ".join(words)},
                             {"role": "user", "content": "the same question"}]}
        before = view()
        reply = ask(base, body)
        assert reply["model"] == model
        cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        blocks = reply["usage"]["prompt_tokens"] // BLOCK
        wait_until(lambda: view()["prediction"]["observations"] == before["prediction"]["observations"] + 1, 10,
                   "the reply's self-check")
        exact = view()["prediction"]["exact"] - before["prediction"]["exact"]
        results.append((model, cached, exact))
        wait_until(lambda: view()["block_count"] >= before["block_count"] + (0 if cached else blocks - 1), 20,
                   "vLLM's KV events for the new blocks")
    for i, (model, cached, exact) in enumerate(results):
        assert exact == 1, results  # the router predicted vLLM's cached_tokens, adapter or not
        if i % 2 == 0:
            assert cached == 0, results  # the base's (or another adapter's) blocks never hit
        else:
            assert cached >= BLOCK * 5, results  # its own do


def test_dynamic_loading_loads_once_under_concurrent_first_requests(lora_fleet, tmp_path):
    import os
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    from tests.conftest import free_port

    adapters = lora_fleet.tmp / "adapters"
    build_tiny_lora(adapters / "third", "tiny", seed=3)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "dyn-server.log", "wb")
    server = subprocess.Popen([sys.executable, "-m", "infera.server", "--workers", "1", "--host", "127.0.0.1",
                               "--port", str(port), "--etcd-endpoint", lora_fleet.etcd.endpoint,
                               "--router-policy", "round-robin", "--lora-dynamic-loading",
                               "--lora-adapter-dir", str(adapters)],
                              stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        wait_until(lambda: len(lora_fleet.records(base)) == 2, 60, "the loading server to see the engines")
        body = {"model": "third", "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda _: ask(base, body), range(4)))
        assert {r["model"] for r in replies} == {"third"}
        worker = lora_fleet.workers[0]  # (the only engine with --enable-lora)
        listed = {m["id"] for m in http_json(f"http://127.0.0.1:{worker.port}/v1/models", timeout=10)["data"]}
        assert "third" in listed
        loads = worker.log.read_text(errors="replace").count("Loaded new LoRA adapter: name 'third'")
        assert loads == 1  # four concurrent first requests, one load
    finally:
        server.terminate()
        server.wait(15)
