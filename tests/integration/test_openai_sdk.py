"""The real ``openai`` SDK through the router to a sim worker over loopback HTTP: what the SDK's
users rely on beyond the basics in test_fleet.py (chat/completions, stream usage, models): ``stop``,
``n``, ``logprobs`` and other sampling fields reach the engine untouched, the engine's own
refusals reach the SDK as its exception types, and a stream's usage chunk arrives last."""
from __future__ import annotations

import openai
import pytest

from infera.discovery.record import WorkerRecord
from infera.engine.sim.server import SimServer, parse_args
from tests.integration.sim_recording import EngineBodies

pytestmark = pytest.mark.integration

MODEL = "sim-model"
FIXED = {"ignore_eos": True}


@pytest.fixture
async def engine():
    bodies = EngineBodies()
    server = SimServer(parse_args(["--model", MODEL, "--host", "127.0.0.1", "--port", "0", "--speedup", "1000"]))
    server.app.middlewares.append(bodies.record)
    async with server:
        yield server, bodies


@pytest.fixture
async def client(fed_server, engine):
    server, base = await fed_server()
    server.fleet.upsert(WorkerRecord(worker_id="sim-0", url=engine[0].url, model_name=MODEL))
    c = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    yield c
    await c.close()


async def test_models(client):
    models = (await client.models.list()).data
    assert [(m.id, m.object, m.owned_by) for m in models] == [(MODEL, "model", "infera")] and models[0].created > 0


async def test_chat_sampling_fields_reach_the_engine(client, engine):
    chat = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0.3, top_p=0.9, seed=7,
        logprobs=True, top_logprobs=2, n=1, user="u-1", extra_body=FIXED)
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 4
    sent = engine[1].bodies[-1]
    assert {k: sent[k] for k in ("temperature", "top_p", "seed", "logprobs", "top_logprobs", "n", "user",
                                 "ignore_eos")} == {"temperature": 0.3, "top_p": 0.9, "seed": 7, "logprobs": True,
                                                    "top_logprobs": 2, "n": 1, "user": "u-1", "ignore_eos": True}
    comp = await client.completions.create(model=MODEL, prompt="once", max_tokens=3, logprobs=2, echo=False,
                                           extra_body=FIXED)
    assert comp.usage.completion_tokens == 3
    assert engine[1].bodies[-1]["logprobs"] == 2 and engine[1].bodies[-1]["echo"] is False


async def test_n_is_the_engines_to_refuse(client, engine):
    """The router forwards ``n``; the sim serves only n=1, and its 400 reaches the SDK as is."""
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=2, n=2)
    assert "n=2" in info.value.message and engine[1].bodies[-1]["n"] == 2
    with pytest.raises(openai.BadRequestError) as info:  # the router's own check: before any engine
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=2, n=0)
    assert info.value.body["param"] == "n" and engine[1].bodies[-1]["n"] == 2


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_stop(client, stream):
    base = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "words"}],
                                                max_tokens=12, extra_body=FIXED)
    text = base.choices[0].message.content
    stop = " " + text.split()[3]
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "words"}], max_tokens=12,
                  stop=[stop, "never-there"], extra_body=FIXED)
    if stream:
        chunks = [c async for c in await client.chat.completions.create(stream=True, **kwargs)]
        got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        choice = (await client.chat.completions.create(**kwargs)).choices[0]
        got, finish = choice.message.content, choice.finish_reason
    assert got == text[: text.index(stop)] and finish == "stop"


async def test_stream_usage_chunk_comes_last(client, engine):
    chunks = [c async for c in await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "count"}], max_tokens=5, stream=True,
        stream_options={"include_usage": True}, extra_body=FIXED)]
    assert engine[1].bodies[-1]["stream_options"] == {"include_usage": True}
    *content, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 5 and last.usage.prompt_tokens > 0
    assert all(c.usage is None for c in content)
    assert len("".join(c.choices[0].delta.content or "" for c in content).split()) == 5
    # Without include_usage there is no usage chunk.
    plain = [c async for c in await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "count"}], max_tokens=2, stream=True, extra_body=FIXED)]
    assert all(c.usage is None for c in plain) and plain[-1].choices[0].finish_reason == "length"


async def test_completions_stream_with_usage_and_stop(client):
    base = await client.completions.create(model=MODEL, prompt="list", max_tokens=10, extra_body=FIXED)
    text = base.choices[0].text
    stop = " " + text.split()[2]
    chunks = [c async for c in await client.completions.create(
        model=MODEL, prompt="list", max_tokens=10, stop=stop, stream=True, stream_options={"include_usage": True},
        extra_body=FIXED)]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text[: text.index(stop)]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


async def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as info:
        await client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}], max_tokens=1)
    assert info.value.body["code"] == "model_not_found" and info.value.body["type"] == "not_found_error"
