"""Two real vLLM-CPU workers launched by ``python -m infera.engine.vllm``, served through the router.

Tests share one fleet (engines take ~30 s to start); the lifecycle tests at the end consume it.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import anthropic
import openai
import pytest

from infera.engine.base.prom import sample_sum
from tests.conftest import alive, process_group_members, requests_by_worker
from tests.e2e.conftest import http_json, urlopen_text, wait_until

pytestmark = pytest.mark.e2e


def test_workers_register_with_resolved_block_size_and_events(vllm_fleet):
    records = {r["worker_id"]: r for r in vllm_fleet.records()}
    assert set(records) == {w.worker_id for w in vllm_fleet.workers}
    for r in records.values():
        assert r["engine"] == "vllm" and r["model_name"] == "tiny" and r["status"] == "active"
        assert r["kv_block_size"] == 32  # read back from vllm:cache_config_info
        assert r["kv_events_endpoint"].startswith("tcp://127.0.0.1:")
        assert r["kv_events_replay_endpoint"].startswith("tcp://127.0.0.1:")
        assert r["disagg_mode"] == "mixed"
    # Mixed planes: worker 0 on HTTP + ZMQ, worker 1 on requests and KV events over NATS; both
    # servers run on the NATS plane and reach both (the routed tests below are served by both).
    dev, prod = (records[w.worker_id] for w in vllm_fleet.workers)
    assert (dev["request_transport"], dev["kv_event_transport"]) == ("http", "zmq")
    assert (prod["request_transport"], prod["kv_event_transport"]) == ("nats", "nats")
    assert all(r["routable"] for r in records.values())


def test_openai_client_chat_and_completions_through_the_router(vllm_fleet):
    client = openai.OpenAI(base_url=vllm_fleet.base + "/v1", api_key="none", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello there"}],
                                          max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 8 and chat.choices[0].message.content
    assert chat.usage.prompt_tokens_details is not None  # --enable-prompt-tokens-details was injected

    pieces, usage = [], None
    for chunk in client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=6, temperature=0, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert "".join(pieces) and usage.completion_tokens == 6

    comp = client.completions.create(model="tiny", prompt="def main():", max_tokens=5, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert comp.usage.completion_tokens == 5
    text = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="def main():", max_tokens=5, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    assert text == comp.choices[0].text  # greedy: the same through either path

    # round-robin spread these over both engines
    for _ in range(4):
        http_json(vllm_fleet.base + "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1})
    served = requests_by_worker(urlopen_text(vllm_fleet.base + "/metrics"))
    assert set(served) == {w.worker_id for w in vllm_fleet.workers}


def test_the_engine_joins_the_routers_trace(vllm_fleet):
    """--otlp-traces-endpoint on the round-robin server and on worker 0's vLLM: vLLM's span of a
    request is a child of the router's span, which continues the client's traceparent."""
    client = openai.OpenAI(base_url=vllm_fleet.base + "/v1", api_key="none", max_retries=0, timeout=120)
    traces = [f"{i + 1:032x}" for i in range(4)]
    for trace in traces:  # round-robin: two of them reach worker 0, the traced engine
        client.completions.create(model="tiny", prompt="trace me", max_tokens=2,
                                  extra_headers={"traceparent": f"00-{trace}-{'ab' * 8}-01"})
    spans = vllm_fleet.otlp.spans

    def joined() -> list:  # (router span, engine span) of this test's traces (earlier tests made others)
        router = {span.trace_id.hex(): span for service, span in spans
                  if service == "infera-server" and span.trace_id.hex() in traces}
        return [(router[span.trace_id.hex()], span) for service, span in spans
                if service != "infera-server" and span.trace_id.hex() in router]

    wait_until(lambda: len(joined()) >= 2, 60, "vLLM spans in the router's traces")
    for router_span, engine_span in joined():
        assert router_span.parent_span_id.hex() == "ab" * 8  # the router continued the client's trace
        assert engine_span.parent_span_id == router_span.span_id  # the engine got the router's span as parent


def anthropic_modes(base: str) -> dict[str, float]:
    """A server's ``infera_anthropic_messages_total`` by mode."""
    text = urlopen_text(base + "/metrics")
    return {mode: sample_sum(text, "infera_anthropic_messages_total", f'mode="{mode}"')
            for mode in ("passthrough", "translated")}


def test_anthropic_client_messages_passed_through_to_vllm(vllm_fleet):
    """The anthropic SDK against real vLLM, which serves /v1/messages itself: the launchers' probe
    marks both records, and the router passes the request through (vLLM's own message: its
    ``chatcmpl-`` id, where the translation writes ``msg_``), unary and streamed, over both planes
    (round-robin: one request to each worker, HTTP and NATS), with usage and stop reasons from the
    engine. (Tool calls and the translation are tested against the sims: a random-weights model
    answers a named tool_choice with text.)"""
    assert all(r["anthropic_messages"] for r in vllm_fleet.records())
    before = anthropic_modes(vllm_fleet.base)
    client = anthropic.Anthropic(base_url=vllm_fleet.base, api_key="none", max_retries=0, timeout=120)
    msg = client.messages.create(model="tiny", max_tokens=8, system="You are terse.",
                                 messages=[{"role": "user", "content": "hello there"}],
                                 extra_body={"ignore_eos": True, "temperature": 0})
    assert msg.id.startswith("chatcmpl-")  # vLLM's message, relayed unchanged
    assert msg.type == "message" and msg.role == "assistant" and msg.stop_reason == "max_tokens"
    assert msg.content[0].type == "text" and msg.content[0].text
    assert msg.usage.output_tokens == 8 and msg.usage.input_tokens > 0

    with client.messages.stream(model="tiny", max_tokens=6, messages=[{"role": "user", "content": "hi"}],
                                extra_body={"ignore_eos": True, "temperature": 0}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.id.startswith("chatcmpl-")
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_delta" in kinds and "message_delta" in kinds
    assert final.usage.output_tokens == 6 and final.stop_reason == "max_tokens" and final.content[0].text
    after = anthropic_modes(vllm_fleet.base)
    assert after["passthrough"] - before["passthrough"] == 2 and after["translated"] == before["translated"]

    # the same greedy prompt through the OpenAI route gives the same text
    chat = openai.OpenAI(base_url=vllm_fleet.base + "/v1", api_key="none", max_retries=0, timeout=120)
    same = chat.chat.completions.create(model="tiny", messages=[{"role": "system", "content": "You are terse."},
                                                                {"role": "user", "content": "hello there"}],
                                        max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert same.choices[0].message.content == msg.content[0].text


def test_count_tokens_by_vllm_equals_the_routers_count(vllm_fleet):
    """count_tokens on the round-robin server (no router tokenizer) is vLLM's own, asked of a worker
    serving the Messages API (random picks, the other tried if one cannot answer); the kv-aware
    server counts with its tokenizer; the two agree."""
    ask = {"model": "tiny", "system": "You are terse.", "messages": [{"role": "user", "content": "count these words"},
                                                                     {"role": "assistant", "content": "one two"},
                                                                     {"role": "user", "content": "and these"}]}
    by_engine = anthropic.Anthropic(base_url=vllm_fleet.base, api_key="none", max_retries=0, timeout=120)
    by_router = anthropic.Anthropic(base_url=vllm_fleet.kv_base, api_key="none", max_retries=0, timeout=120)
    routers = by_router.messages.count_tokens(**ask).input_tokens
    engines = {by_engine.messages.count_tokens(**ask).input_tokens for _ in range(4)}
    assert routers > 10 and engines == {routers}


def test_kv_aware_reads_the_cached_tokens_of_a_passed_through_reply(vllm_fleet):
    """The kv-aware server hashes a passed-through request's rendered prompt as always, and reads
    what the engine cached from vLLM's own Anthropic usage (``cache_read_input_tokens``): the same
    long prompt twice, the second a hit that the router's reported-cached counter records exactly."""
    client = anthropic.Anthropic(base_url=vllm_fleet.kv_base, api_key="none", max_retries=0, timeout=120)
    system = " ".join(f"passthrough{i}" for i in range(300))

    def reported() -> float:
        return sample_sum(urlopen_text(vllm_fleet.kv_base + "/metrics"), "infera_kv_reported_cached_tokens_total")

    first = client.messages.create(model="tiny", max_tokens=2, system=system, extra_body={"ignore_eos": True},
                                   messages=[{"role": "user", "content": "q"}])
    assert first.id.startswith("chatcmpl-")
    start = reported()
    with client.messages.stream(model="tiny", max_tokens=2, system=system, extra_body={"ignore_eos": True},
                                messages=[{"role": "user", "content": "q"}]) as stream:
        second = stream.get_final_message()
    cached = second.usage.cache_read_input_tokens
    assert second.id.startswith("chatcmpl-") and cached and cached >= 32  # at least a block of 32
    wait_until(lambda: reported() - start == cached, 10, "the router's reported cached tokens")


def engine_prefix_hits(port: int) -> float:
    text = urlopen_text(f"http://127.0.0.1:{port}/metrics")
    return sample_sum(text, "vllm:prefix_cache_hits_total")


def test_kv_aware_sends_shared_prefixes_to_their_holder(vllm_fleet):
    """Through the kv-aware replica: real vLLM KV events fill the router's views; follow-up turns
    of a conversation land on the engine holding its prefix; vLLM's own metrics confirm the hits;
    the router's predicted cached tokens equal what vLLM reports (within one block)."""
    base = vllm_fleet.kv_base
    # Varied prose the tiny tokenizer was trained on (README.md is in its corpus); /metrics text,
    # used before, grew label-heavy lines that tokenized past max-model-len.
    words = (Path(__file__).resolve().parents[2] / "README.md").read_text().split()[:400]
    for w in vllm_fleet.workers:
        wait_until(lambda: _view(base, w.worker_id) is not None, 30, f"a cache view for {w.worker_id}")

    def ask(group: int, turn: int) -> dict:
        system = f"group {group}: " + " ".join(words[group * 150:group * 150 + 300])
        return http_json(base + "/v1/chat/completions", {
            "model": "tiny", "max_tokens": 2, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"question {turn}"}]})

    hits_before = {w.worker_id: engine_prefix_hits(w.port) for w in vllm_fleet.workers}
    # The fleet is shared: earlier tests' kv-aware requests were observed too, so count from here.
    observed_before, exact_before = _prediction_totals(base, vllm_fleet)
    cached = []
    def view_blocks() -> int:
        return sum(_view(base, w.worker_id)["block_count"] for w in vllm_fleet.workers)

    for group in (0, 1):
        before = view_blocks()
        cold = ask(group, 0)  # cold: stores the prefix on one engine
        full_blocks = cold["usage"]["prompt_tokens"] // 32
        wait_until(lambda: view_blocks() >= before + full_blocks, 10,
                   "the router's views to hold the new prefix (from vLLM's KV events)")
        for turn in (1, 2):
            cached.append(ask(group, turn)["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert all(c >= 32 * 5 for c in cached), cached  # every follow-up hit its group's prefix
    gained = {wid: engine_prefix_hits(w.port) - hits_before[wid] for w in vllm_fleet.workers
              for wid in [w.worker_id]}
    assert sum(gained.values()) >= sum(cached), (gained, cached)  # vLLM's own counters agree
    views = [_view(base, w.worker_id) for w in vllm_fleet.workers]
    observed, exact = _prediction_totals(base, vllm_fleet)
    assert observed - observed_before == 6, views
    for v in views:
        if v["prediction"]["observations"]:
            assert v["prediction"]["mean_error_blocks"] <= 1, v
    assert exact - exact_before >= 5, views
    assert not any(v["events_silent"] for v in views)
    # Both engines have served (round-robin above, this test's groups): the NATS worker's view was
    # fed through its launcher's JetStream relay, the other's over ZMQ.
    assert all(v["block_count"] > 0 for v in views), views


def _prediction_totals(base: str, fleet) -> tuple[int, int]:
    """(observations, exact predictions) summed over the fleet's views."""
    views = [_view(base, w.worker_id) for w in fleet.workers]
    return (sum(v["prediction"]["observations"] for v in views if v),
            sum(v["prediction"]["exact"] for v in views if v))


def _view(base: str, worker_id: str) -> dict | None:
    import urllib.error

    try:
        return http_json(f"{base}/v1/admin/cache-view/{worker_id}", timeout=5)
    except urllib.error.HTTPError:
        return None


# Long enough to still be running when the engines' gauges are read: 400 tokens were sometimes
# all generated by then (the stream ended before an engine could be stalled).
STALL_TOKENS = 1800


def test_a_stream_whose_engine_stalls_moves_to_the_other_worker_and_gets_every_token(vllm_fleet):
    """Real vLLM, the exact path: the tracker has the prompt's and every output token's ids, so when
    the serving engine freezes (SIGSTOP) the continuation is a /v1/completions request from those ids
    on the other worker (other plane, too), reshaped into chat chunks. Checked by content: the
    client's text and token ids equal an unbroken greedy run of the same request on the engine that
    continued it, so a seam that repeated or dropped a token fails even with the right count.
    (The client asks for the ids itself here, which the router passes on verbatim; that the ids the
    router asks for itself stay with it is checked on the sims, test_migration.py.)"""
    client = openai.OpenAI(base_url=f"{vllm_fleet.base}/v1", api_key="none", max_retries=0, timeout=180)
    request = dict(model="tiny", messages=[{"role": "user", "content": "Tell me a long story."}],
                   max_tokens=STALL_TOKENS, temperature=0)
    got: dict = {"content": [], "token_ids": [], "ids": set(), "usage": None, "error": None, "finish": None}
    started = threading.Event()

    def stream() -> None:
        try:
            for chunk in client.chat.completions.create(
                    **request, stream=True, stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True, "return_token_ids": True}):
                got["ids"].add(chunk.id)
                if chunk.usage is not None:
                    got["usage"] = chunk.usage
                for c in chunk.choices:
                    got["token_ids"].extend((c.model_extra or {}).get("token_ids") or [])
                    if c.delta.content:
                        got["content"].append(c.delta.content)
                        if len(got["content"]) >= 5:
                            started.set()
                    if c.finish_reason:
                        got["finish"] = c.finish_reason
        except Exception as exc:  # recorded and asserted below
            got["error"] = exc
            started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(120) and got["error"] is None

    def running() -> list:
        assert got["finish"] is None, "the stream ended before an engine could be stalled"
        return [w for w in vllm_fleet.workers
                if sample_sum(urlopen_text(f"http://127.0.0.1:{w.port}/metrics"), "vllm:num_requests_running") > 0]

    # The engines' gauges follow their steps' stats, which may lag the first tokens a little.
    serving = wait_until(running, 30, "an engine's vllm:num_requests_running to show the stream", interval=0.05)
    assert len(serving) == 1, "exactly one engine runs the stream"
    stalled = serving[0].engine_pid()

    os.killpg(stalled, signal.SIGSTOP)  # the engine and its EngineCore freeze; the launcher lives
    try:
        t.join(180)
    finally:
        os.killpg(stalled, signal.SIGCONT)
    assert not t.is_alive() and got["error"] is None, got["error"]
    assert got["finish"] == "length" and len(got["ids"]) == 1
    assert got["usage"] is not None and got["usage"].completion_tokens == STALL_TOKENS
    moved = sample_sum(urlopen_text(vllm_fleet.base + "/metrics"), "infera_migrations_total")
    assert moved >= 1

    # The reference: the same request, greedy and unbroken, on the engine that continued the stream.
    (other,) = [w for w in vllm_fleet.workers if w is not serving[0]]
    ref = http_json(f"http://127.0.0.1:{other.port}/v1/chat/completions",
                    {**request, "ignore_eos": True, "return_token_ids": True}, timeout=180)["choices"][0]
    assert len(ref["token_ids"]) == STALL_TOKENS
    assert got["token_ids"] == ref["token_ids"], first_difference(got["token_ids"], ref["token_ids"])
    assert "".join(got["content"]) == ref["message"]["content"]


def first_difference(a: list, b: list) -> str:
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"lengths {len(a)} and {len(b)}, first difference at {i}: {a[max(i - 2, 0):i + 3]} != {b[max(i - 2, 0):i + 3]}"


def test_sigterm_with_a_stream_in_flight_drains_after_deregistering(vllm_fleet):
    worker = vllm_fleet.workers[1]
    engine_pid = worker.engine_pid()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{worker.port}/v1", api_key="none", max_retries=0, timeout=120)
    got: dict = {"chunks": 0, "finish": None, "error": None}
    started = threading.Event()

    def stream() -> None:  # straight to this engine, so the stream surely runs on the draining worker
        try:
            # The engine is frozen after the first chunk (below): 400 tokens outlast those few ms.
            for chunk in client.completions.create(model="tiny", prompt="def f():", max_tokens=400, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True}):
                got["chunks"] += 1
                started.set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    got["finish"] = chunk.choices[0].finish_reason
        except Exception as exc:  # recorded and asserted below
            got["error"] = exc
            started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60) and got["error"] is None
    # Frozen while the record goes, so the stream is surely still in flight then: on an idle box the
    # tiny model once streamed all 1800 tokens before the deletion showed in the fleet.
    os.killpg(engine_pid, signal.SIGSTOP)
    try:
        assert got["finish"] is None, "the stream ended before the engine could be frozen"
        worker.proc.send_signal(signal.SIGTERM)
        # The record goes first, while the engine is still up with the stream in flight.
        wait_until(lambda: worker.worker_id not in {r["worker_id"] for r in vllm_fleet.records()}, 10,
                   "the record deleted on SIGTERM")
        assert alive(engine_pid), "the engine stopped before the record was deleted"
        assert got["finish"] is None
    finally:
        os.killpg(engine_pid, signal.SIGCONT)  # the drain waits for it: the stream must still complete
    t.join(120)
    assert got["error"] is None and got["finish"] == "length"
    assert worker.proc.wait(60) == 0
    assert not alive(engine_pid)
    assert process_group_members(engine_pid) == [], "engine processes outlived the launcher"


def test_sigkill_of_the_engine_deregisters_and_exits_nonzero(vllm_fleet):
    worker = vllm_fleet.workers[0]
    engine_pid = worker.engine_pid()
    killed = time.monotonic()

    os.kill(engine_pid, signal.SIGKILL)
    # Deregistered by the launcher at once, not by lease expiry (TTL 30 s). (The launcher itself
    # exits later: it first stops what is left of the engine's process group, vLLM's EngineCore,
    # which on a loaded box takes seconds.)
    wait_until(lambda: worker.worker_id not in {r["worker_id"] for r in vllm_fleet.records()}, 10,
               "the record deleted after the engine died")
    assert time.monotonic() - killed < 10
    code = worker.proc.wait(60)
    assert code != 0 and code == 128 + signal.SIGKILL
    wait_until(lambda: process_group_members(engine_pid) == [], 30, "the engine's process group to be empty")
