"""The simulated vLLM engine over real HTTP: aiohttp client, the official openai client, a subprocess."""
from __future__ import annotations

import asyncio
import gc
import json
import signal
import socket
import sys
from pathlib import Path
from typing import Any, Awaitable, Callable

import aiohttp
import openai
import pytest

from infera.engine.sim.scheduler import greedy_output, prose_run
from infera.engine.sim.server import SimServer, parse_args

pytestmark = pytest.mark.integration

MODEL = "sim-model"
REPO_ROOT = Path(__file__).resolve().parents[2]
LONG_PROMPT = " ".join(f"word{i % 37} of the long shared prefix number {i}." for i in range(60))


def sim_args(*extra: str, speedup: float = 1000):
    return parse_args(["--model", MODEL, "--host", "127.0.0.1", "--port", "0", "--speedup", str(speedup), *extra])


@pytest.fixture
async def server():
    async with SimServer(sim_args()) as s:
        yield s


@pytest.fixture
async def http(server):
    async with aiohttp.ClientSession(base_url=server.url) as session:
        yield session


@pytest.fixture
async def client(server):
    c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    yield c
    await c.close()


def chat_body(content: str = "Hello there", **kw: Any) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}


async def read_sse(resp: aiohttp.ClientResponse) -> list[Any]:
    """Every ``data:`` payload, JSON-decoded (``"[DONE]"`` kept as a string)."""
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events: list[Any] = []
    async for raw in resp.content:
        line = raw.rstrip(b"\n")
        if not line:
            continue
        assert line.startswith(b"data: "), line
        payload = line[len(b"data: "):]
        events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return events


async def metric_value(http: aiohttp.ClientSession, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    async with http.get("/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    total = 0.0
    found = False
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        series, value = line.rsplit(" ", 1)
        sample_name = series.split("{", 1)[0]
        if sample_name == name and all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
            found = True
    assert found, f"{name} not in /metrics"
    return total


async def wait_until(predicate: Callable[[], Awaitable[bool]], timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not met before the deadline")
        await asyncio.sleep(0.01)


# ----------------------------------------------------------------- basics


async def test_health_and_models(http, server):
    async with http.get("/health") as resp:
        assert resp.status == 200 and await resp.read() == b""
    async with http.get("/v1/models") as resp:
        body = await resp.json()
    assert body["object"] == "list"
    [card] = body["data"]
    assert card["id"] == MODEL and card["object"] == "model" and card["owned_by"] == "vllm"
    assert card["root"] == MODEL and card["parent"] is None and card["max_model_len"] == 8192
    assert isinstance(card["created"], int)


async def test_chat_non_stream_shape(http):
    async with http.post("/v1/chat/completions", json=chat_body(max_tokens=5)) as resp:
        assert resp.status == 200
        body = await resp.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["model"] == MODEL and isinstance(body["created"], int)
    assert body["prompt_logprobs"] is None and body["kv_transfer_params"] is None
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": choice["message"]["content"], "refusal": None,
                                 "tool_calls": [], "reasoning_content": None}
    assert (choice["index"], choice["logprobs"]) == (0, None)
    assert (choice["finish_reason"], choice["stop_reason"]) == ("length", None)
    assert len(choice["message"]["content"].split()) == 5
    usage = body["usage"]
    assert usage["completion_tokens"] == 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_chat_stream_frames(http):
    body = chat_body(max_tokens=6, stream=True, stream_options={"include_usage": True})
    async with http.post("/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        events = await read_sse(resp)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = chunks[1:-1]
    assert len(content) == 6
    assert all(c["choices"][0]["finish_reason"] is None for c in content[:-1])
    assert content[-1]["choices"][0]["finish_reason"] == "length"  # the last content chunk carries it
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    streamed = "".join(c["choices"][0]["delta"]["content"] for c in content)
    # Same request, non-streamed: same deterministic text.
    async with http.post("/v1/chat/completions", json=chat_body(max_tokens=6)) as resp:
        assert (await resp.json())["choices"][0]["message"]["content"] == streamed


async def test_completions_stream_without_usage(http):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "stream": True}
    async with http.post("/v1/completions", json=body) as resp:
        events = await read_sse(resp)
    assert events[-1] == "[DONE]" and len(events) == 5
    for chunk in events[:-1]:
        assert chunk["id"].startswith("cmpl-") and chunk["object"] == "text_completion" and "usage" not in chunk
        [choice] = chunk["choices"]
        assert set(choice) == {"index", "text", "logprobs", "finish_reason", "stop_reason"}
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]] == [None, None, None, "length"]


async def test_openai_client_chat_and_completions(client):
    chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=7)
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 7
    stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=7, stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7

    comp = await client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=5)
    assert comp.object == "text_completion" and comp.choices[0].finish_reason == "length"
    assert comp.usage.completion_tokens == 5 and len(comp.choices[0].text.split()) == 5
    stream = await client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=5, stream=True,
                                             stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == comp.choices[0].text
    assert chunks[-1].usage.total_tokens == comp.usage.total_tokens


async def test_completions_default_max_tokens_and_token_id_prompt(client):
    comp = await client.completions.create(model=MODEL, prompt=[101, 202, 303, 404], extra_body={"ignore_eos": True})
    assert comp.usage.prompt_tokens == 4 and comp.usage.completion_tokens == 16


async def test_ignore_eos_and_natural_stop(server, client):
    natural = await client.completions.create(model=MODEL, prompt="Tell me a story", max_tokens=300,
                                              extra_body={"return_token_ids": True})
    choice = natural.choices[0]
    assert choice.finish_reason == "stop"
    # The model's own stop: 8..256 tokens of prose, counting the prompt's trailing output words
    # (" story" is one), exactly as the scheduler's reference says.
    prompt_ids, ids = choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
    assert (ids, "stop") == greedy_output(0, prompt_ids, server.engine.tokenizer.output_token_ids, 300)
    prose = prose_run(prompt_ids, frozenset(server.engine.tokenizer.output_token_ids))
    assert prose == 1 and 8 - prose <= natural.usage.completion_tokens <= 256 - prose
    assert choice.text == server.engine.tokenizer.decode_output(ids)
    forced = await client.completions.create(model=MODEL, prompt="Tell me a story", max_tokens=300,
                                             extra_body={"ignore_eos": True})
    assert forced.choices[0].finish_reason == "length" and forced.usage.completion_tokens == 300
    assert forced.choices[0].text.startswith(natural.choices[0].text)


@pytest.mark.parametrize("ignore_eos", [False, True])
async def test_a_chat_answer_continued_from_its_ids_is_the_unbroken_answer(http, ignore_eos):
    """What request migration sends: /v1/completions from the chat prompt's ids + the first k
    output ids continues with exactly the unbroken answer's remaining ids and text, and stops
    where it did."""
    body = chat_body("Tell me a long story", max_tokens=300, ignore_eos=ignore_eos, return_token_ids=True)
    async with http.post("/v1/chat/completions", json=body) as r:
        full = await r.json()
    prompt_ids, ids = full["prompt_token_ids"], full["choices"][0]["token_ids"]
    text, reason = full["choices"][0]["message"]["content"], full["choices"][0]["finish_reason"]
    assert reason == ("length" if ignore_eos else "stop") and len(ids) > 20
    for k in (1, 7, len(ids) // 2, len(ids) - 1):
        cont = {"model": MODEL, "prompt": prompt_ids + ids[:k], "max_tokens": 300 - k, "ignore_eos": ignore_eos,
                "return_token_ids": True}
        async with http.post("/v1/completions", json=cont) as r:
            rest = (await r.json())["choices"][0]
        assert rest["token_ids"] == ids[k:] and rest["finish_reason"] == reason, k
        head = await (await http.post("/v1/completions", json={**cont, "max_tokens": k, "prompt": prompt_ids,
                                                             "ignore_eos": True})).json()
        assert head["choices"][0]["text"] + rest["text"] == text, k


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_strings(client, stream):
    base = await client.completions.create(model=MODEL, prompt="List some words", max_tokens=20,
                                           extra_body={"ignore_eos": True})
    text = base.choices[0].text
    stop = " " + text.split()[5]
    expected = text[: text.index(stop)]
    kwargs = dict(model=MODEL, prompt="List some words", max_tokens=20, stop=["no-such-stop", stop],
                  extra_body={"ignore_eos": True})
    if stream:
        chunks = [c async for c in await client.completions.create(stream=True, **kwargs)]
        assert "".join(c.choices[0].text for c in chunks) == expected
        final = chunks[-1].choices[0]
    else:
        final = (await client.completions.create(**kwargs)).choices[0]
        assert final.text == expected
    assert final.finish_reason == "stop"
    assert final.model_extra["stop_reason"] == stop


async def test_unknown_model_is_404(http, client):
    async with http.post("/v1/chat/completions", json={**chat_body(), "model": "nope"}) as resp:
        assert resp.status == 404
        assert await resp.json() == {"error": {"message": "The model `nope` does not exist.",
                                               "type": "NotFoundError", "param": "model", "code": 404}}
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="nope", prompt="hi")


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", b"{not json"),
    ("/v1/chat/completions", b""),
    ("/v1/chat/completions", {"model": MODEL}),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}),
    ("/v1/chat/completions", chat_body(max_tokens=0)),
    ("/v1/chat/completions", chat_body(max_tokens="5")),
    ("/v1/chat/completions", chat_body(max_completion_tokens=9000)),
    ("/v1/chat/completions", chat_body(n=2)),
    ("/v1/chat/completions", chat_body(stream_options={"include_usage": True})),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "bogus"}]}]}),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}),
    ("/v1/completions", {"model": MODEL, "prompt": 5}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 8192}),
    ("/v1/completions", {"model": MODEL, "prompt": "x " * 9000}),
])
async def test_bad_requests_are_400(http, path, body):
    kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
    async with http.post(path, **kwargs) as resp:
        assert resp.status == 400
        err = (await resp.json())["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400 and err["param"] is None and err["message"]


async def test_repeated_long_prompt_hits_prefix_cache(client, http):
    first = await client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2)
    second = await client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0 and cached >= first.usage.prompt_tokens - 16
    assert await metric_value(http, "vllm:prefix_cache_hits_total") == cached
    assert await metric_value(http, "vllm:prefix_cache_queries_total") == 2 * first.usage.prompt_tokens


async def test_metrics_names(http, client):
    await client.completions.create(model=MODEL, prompt="hi", max_tokens=3)
    async with http.get("/metrics") as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total"]:
        assert f'{name}{{model_name="{MODEL}"' in text or f"{name}{{finished_reason" in text, name
    assert ('vllm:cache_config_info{block_size="16",enable_prefix_caching="True",num_gpu_blocks="4096"} 1.0'
            in text)
    assert await metric_value(http, "vllm:request_success_total", finished_reason="length") == 1
    assert await metric_value(http, "vllm:generation_tokens_total") == 3


async def test_tokenize_matches_usage(http, client):
    messages = [{"role": "user", "content": "count my tokens please"}]
    async with http.post("/tokenize", json={"model": MODEL, "messages": messages}) as resp:
        tok = await resp.json()
    chat = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert tok["count"] == len(tok["tokens"]) == chat.usage.prompt_tokens
    assert tok["max_model_len"] == 8192


async def test_served_model_names():
    async with SimServer(sim_args("--served-model-name", "alpha", "beta")) as s:
        async with aiohttp.ClientSession(base_url=s.url) as http:
            async with http.get("/v1/models") as resp:
                assert [c["id"] for c in (await resp.json())["data"]] == ["alpha", "beta"]
            for name, status in [("alpha", 200), ("beta", 200), (MODEL, 404)]:
                body = {"model": name, "prompt": "hi", "max_tokens": 2}
                async with http.post("/v1/completions", json=body) as resp:
                    assert resp.status == status, name
                    if status == 200:
                        assert (await resp.json())["model"] == "alpha"  # the first name is reported


async def test_tokenizer_directory_model(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": 0, "<s>": 1, "user": 2, "assistant": 3, "hi": 4, "there": 5}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.add_special_tokens(["<s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    template = "{{ bos_token }}{% for m in messages %}{{ m.role }} {{ m.content }} {% endfor %}assistant"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": "<s>"}))
    args = parse_args(["--model", str(tmp_path), "--served-model-name", "tiny", "--port", "0",
                       "--host", "127.0.0.1", "--speedup", "1000"])
    async with SimServer(args) as s, aiohttp.ClientSession(base_url=s.url) as http:
        messages = [{"role": "user", "content": [{"type": "text", "text": "hi there"}]}]
        async with http.post("/tokenize", json={"messages": messages}) as resp:
            assert (await resp.json())["tokens"] == [1, 2, 4, 5, 3]
        async with http.post("/v1/chat/completions", json={"model": "tiny", "messages": messages,
                                                           "max_tokens": 3}) as resp:
            body = await resp.json()
        assert body["usage"]["prompt_tokens"] == 5 and len(body["choices"][0]["message"]["content"].split()) == 3
        async with http.get("/v1/models") as resp:
            assert (await resp.json())["data"][0]["root"] == str(tmp_path)


# ------------------------------------------------------------- disconnects


async def test_client_disconnect_aborts_the_sequence():
    # Slow enough (speedup 10: ~0.6 ms/token) that the request is still generating when we leave.
    async with SimServer(sim_args(speedup=10)) as s, aiohttp.ClientSession(base_url=s.url) as http:
        running = lambda: metric_value(http, "vllm:num_requests_running")  # noqa: E731

        # Streaming: read a few chunks, then drop the connection.
        async with aiohttp.ClientSession(base_url=s.url) as leaver:
            body = chat_body(max_tokens=4000, ignore_eos=True, stream=True)
            resp = await leaver.post("/v1/chat/completions", json=body)
            for _ in range(3):
                assert (await resp.content.readline()).startswith(b"data: ")
                await resp.content.readline()
            assert await running() == 1
            resp.close()
        await wait_until(lambda: _equals(running(), 0))
        assert await metric_value(http, "vllm:request_success_total", finished_reason="abort") == 1
        assert await metric_value(http, "vllm:kv_cache_usage_perc") == 0

        # Non-streaming: the client gives up while the server is still generating.
        async with aiohttp.ClientSession(base_url=s.url) as leaver:
            request = asyncio.ensure_future(leaver.post("/v1/completions", json={
                "model": MODEL, "prompt": "long one", "max_tokens": 4000, "ignore_eos": True}))
            await wait_until(lambda: _equals(running(), 1))
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request
        await wait_until(lambda: _equals(running(), 0))
        assert await metric_value(http, "vllm:request_success_total", finished_reason="abort") == 2


async def _equals(value: Awaitable[float], expected: float) -> bool:
    return await value == expected


# ---------------------------------------------------------------- process


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_subprocess_serves_and_exits_zero_on_sigterm():
    port = _free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "infera.engine.sim.server", "--port", str(port), "--host", "127.0.0.1",
        "--speedup", "100", "--model", "m",
        cwd=REPO_ROOT, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    try:
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}") as http:
            async def healthy() -> bool:
                assert proc.returncode is None, "server exited early"
                try:
                    async with http.get("/health") as resp:
                        return resp.status == 200
                except aiohttp.ClientConnectionError:
                    return False

            await wait_until(healthy, timeout=20)
            async with http.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 3}) as resp:
                assert resp.status == 200 and (await resp.json())["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), timeout=10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_unknown_flag_exits_2():
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "infera.engine.sim.server", "--model", "m", "--no-such-flag",
        cwd=REPO_ROOT, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), timeout=20)
    assert proc.returncode == 2
    assert b"unrecognized arguments: --no-such-flag" in err


async def test_a_kv_event_port_in_use_fails_start_and_closes_what_startup_opened():
    # The KV-event publisher binds in the app's startup: its failure must not leak the loopback
    # client sessions other startup steps opened (CI saw "Unclosed client session" after it).
    leaks: list[dict] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: leaks.append(context))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                          "endpoint": f"tcp://*:0;127.0.0.1:{port}", "topic": "kv-events"})
        server = SimServer(sim_args("--kv-events-config", cfg, "--serve-anthropic"))
        with pytest.raises(OSError, match="KV events"):
            await server.start()
    del server
    gc.collect()
    await asyncio.sleep(0)
    loop.set_exception_handler(None)
    assert not [c for c in leaks if "Unclosed" in c.get("message", "")], leaks
