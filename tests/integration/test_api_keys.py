"""--api-keys-file end to end: the real ``openai`` and ``anthropic`` SDKs, each with its own auth
header, through the router to a sim over loopback: 401 and 403 in each API's own error shape,
/v1/models per key, a reload by replacing the file, the per-tenant series."""
from __future__ import annotations

import hashlib
import os

import aiohttp
import anthropic
import openai
import pytest

from infera.discovery.record import BUILTIN_TOKENIZER, WorkerRecord
from infera.engine.sim.server import SimServer, parse_args
from tests.conftest import wait_for

pytestmark = pytest.mark.integration

MODEL = "sim-model"


def entry(key: str, tenant: str, models: str = '["*"]') -> str:
    return f"  - sha256: {hashlib.sha256(key.encode()).hexdigest()}\n    tenant: {tenant}\n    models: {models}\n"


@pytest.fixture
async def sim():
    server = SimServer(parse_args(["--model", MODEL, "--host", "127.0.0.1", "--port", "0", "--speedup", "1000"]))
    async with server:
        yield server


@pytest.fixture
async def keyed(fed_server, sim, tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text("keys:\n" + entry("sk-team-a", "team-a") + entry("sk-team-b", "team-b", '["another-model"]'))
    server, base = await fed_server("--api-keys-file", str(path))
    server.fleet.upsert(WorkerRecord(worker_id="sim-0", url=sim.url, model_name=MODEL, tokenizer=BUILTIN_TOKENIZER))
    return server, base, path


async def test_openai_sdk_with_a_bearer_key(keyed):
    server, base, _ = keyed
    good = openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-team-a", max_retries=0)
    reply = await good.chat.completions.create(model=MODEL, max_tokens=4,
                                               messages=[{"role": "user", "content": "hello"}])
    assert reply.choices[0].message.content
    stream = await good.completions.create(model=MODEL, prompt="hello", max_tokens=3, stream=True)
    assert [c async for c in stream]
    assert [m.id for m in (await good.models.list()).data] == [MODEL]

    bad = openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        await bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    assert err.value.body["type"] == "authentication_error"

    other = openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-team-b", max_retries=0)
    with pytest.raises(openai.PermissionDeniedError) as err:
        await other.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 403 and err.value.body["code"] == "model_not_allowed"
    assert (await other.models.list()).data == []  # team-b sees no model it may use
    for c in (good, bad, other):
        await c.close()


async def test_anthropic_sdk_with_x_api_key(keyed):
    _, base, _ = keyed
    good = anthropic.AsyncAnthropic(base_url=base, api_key="sk-team-a", max_retries=0)
    msg = await good.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hello"}])
    assert msg.type == "message" and msg.content[0].text
    bad = anthropic.AsyncAnthropic(base_url=base, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        await bad.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hello"}])
    assert err.value.status_code == 401 and err.value.body["type"] == "error"
    assert err.value.body["error"]["type"] == "authentication_error"
    other = anthropic.AsyncAnthropic(base_url=base, api_key="sk-team-b", max_retries=0)
    with pytest.raises(anthropic.PermissionDeniedError) as err:
        await other.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hello"}])
    assert err.value.body["error"]["type"] == "permission_error"
    for c in (good, bad, other):
        await c.close()


async def test_no_key_is_a_401_before_the_body_and_the_open_routes_stay_open(keyed):
    server, base, _ = keyed
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/v1/chat/completions", data=b"not even json") as r:
            assert r.status == 401 and (await r.json())["error"]["code"] == "missing_api_key"
            assert r.headers["WWW-Authenticate"].startswith("Bearer")
        async with s.get(base + "/health") as r:
            assert r.status == 200  # load balancers need no key
        async with s.get(base + "/metrics") as r:
            text = await r.text()
    assert 'infera_api_key_rejections_total{reason="missing"} 1.0' in text


async def test_replacing_the_file_reloads_the_keys(keyed):
    server, base, path = keyed
    server.api_keys.poll_s = 0.05
    new = path.with_suffix(".new")
    new.write_text("keys:\n" + entry("sk-rotated", "team-a"))
    os.replace(new, path)  # as a Secret update swaps the file
    await wait_for(lambda: server.api_keys.reloads == 1, 10, message="the keys file reloaded")
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-rotated", max_retries=0) as rotated:
        await rotated.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}])
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-team-a", max_retries=0) as old:
        with pytest.raises(openai.AuthenticationError):
            await old.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert server.api_keys.requests[("team-a", "2xx")] == 1
