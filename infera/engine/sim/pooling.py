"""The simulated engine as a pooling model: vLLM's ``--runner`` and ``--convert`` flags, and the
routes vLLM 0.32 serves under them, with deterministic results in vLLM's shapes.

``--runner pooling`` (``--convert embed``, the default for a causal LM, or ``--convert classify``)
turns the engine into a pooling model: no ``/v1/chat/completions`` or ``/v1/completions`` (a 404,
as vLLM registers no such route), and instead ``/v1/embeddings`` + ``/score``, ``/v1/score``,
``/rerank``, ``/v1/rerank``, ``/v2/rerank`` (embed: scores are cosine similarities, vLLM's
bi-encoder) or ``/classify`` (classify: two labels, ``LABEL_0``/``LABEL_1``, as a converted causal
LM has). A generative engine serves none of them (404). ``/tokenize``, ``/detokenize`` and
``/openapi.json`` (the paths served: what a launcher reads the tasks from) are always there.

An input's embedding is the L2-normalised sum of one pseudo-random vector per token (seeded by
``--seed``): the same text always embeds the same, and texts sharing tokens score closer. Each
request takes the modelled prefill time of its tokens (divided by ``--speedup``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import math
import struct
import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from .scheduler import prefill_time_ms
from .schemas import ENGINE_KEY, ApiError

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
EMBED_DIM = 64  # the sim's "hidden size": every embedding has this many floats
NUM_LABELS = 2
SCORE_ROUTES = ("/score", "/v1/score")
RERANK_ROUTES = ("/rerank", "/v1/rerank", "/v2/rerank")
_json_encode = msgspec.json.Encoder().encode


def add_pooling_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--runner",
        choices=RUNNERS,
        default="auto",
        help="vLLM's runner: generate, or pooling (embeddings, scores, classification); auto: "
        "pooling when --convert embed|classify is given, else generate",
    )
    parser.add_argument(
        "--convert",
        choices=CONVERTS,
        default="auto",
        help="vLLM's model conversion for a pooling runner: embed (/v1/embeddings, /score, rerank) "
        "or classify (/classify); auto: embed under --runner pooling",
    )


def pooling_task(args: argparse.Namespace) -> str | None:
    """``embed`` or ``classify`` for a pooling engine, None for a generative one (vLLM's rules: a
    pooling --convert implies the pooling runner; --runner pooling alone converts a causal LM to embed)."""
    runner, convert = getattr(args, "runner", "auto"), getattr(args, "convert", "auto")
    if convert in ("embed", "classify"):
        if runner == "generate":
            raise ValueError(f"--convert {convert} needs --runner pooling (or auto), not --runner generate")
        return convert
    if runner == "pooling":
        if convert == "none":
            raise ValueError("--runner pooling needs a pooling model: --convert embed or classify (or auto)")
        return "embed"
    return None


def served_routes(args: argparse.Namespace) -> tuple[str, ...]:
    """The task routes an engine with these flags serves (beyond the ones every engine serves)."""
    task = pooling_task(args)
    if task == "embed":
        return ("/v1/embeddings", *SCORE_ROUTES, *RERANK_ROUTES)
    if task == "classify":
        return ("/classify",)
    return ("/v1/chat/completions", "/v1/completions")


# -- the deterministic model ------------------------------------------------------------------------
def _token_vector(seed: int, token_id: int) -> list[float]:
    digest = hashlib.blake2b(struct.pack("<qq", seed, token_id), digest_size=EMBED_DIM).digest()
    return [b / 127.5 - 1.0 for b in digest]


def embed_tokens(seed: int, token_ids: list[int]) -> list[float]:
    """The L2-normalised sum of the tokens' vectors (a zero vector for no tokens)."""
    total = [0.0] * EMBED_DIM
    for t in token_ids:
        for i, v in enumerate(_token_vector(seed, t)):
            total[i] += v
    norm = math.sqrt(sum(v * v for v in total))
    return [v / norm for v in total] if norm > 0 else total


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b))  # both normalised


def classify_probs(seed: int, embedding: list[float]) -> list[float]:
    logits = [
        4.0 * cosine(embedding, _token_vector(seed ^ 0x5EED, -1 - k)) / math.sqrt(EMBED_DIM) for k in range(NUM_LABELS)
    ]
    top = max(logits)
    exps = [math.exp(v - top) for v in logits]
    return [e / sum(exps) for e in exps]


# -- request helpers --------------------------------------------------------------------------------
async def _body(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"JSON decode error: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "Invalid request: expected a JSON object")
    request.app[ENGINE_KEY].check_model(body.get("model"))
    return body


def _inputs(value: Any, field: str) -> list[str | list[int]]:
    """vLLM's prompt forms: a string, a list of strings, a token list, or a list of token lists."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(v, int) for v in value):
            return [value]
        if all(isinstance(v, str) for v in value) or all(
            isinstance(v, list) and all(isinstance(t, int) for t in v) for v in value
        ):
            return list(value)
    raise ApiError(
        400,
        f"Invalid request: '{field}' must be a non-empty string, list of strings, token list or list of token lists",
        param=field,
    )


async def _tokens(request: web.Request, item: str | list[int]) -> list[int]:
    engine = request.app[ENGINE_KEY]
    if isinstance(item, list):
        ids = item
    else:
        ids = await engine.run_tokenizer(len(item), engine.tokenizer.encode, item, True)
    if len(ids) > engine.max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {engine.max_model_len} tokens. However, you "
            f"requested {len(ids)} tokens in the input. Please reduce the length of the input.",
        )
    return ids


async def _embed_all(request: web.Request, items: list[str | list[int]]) -> tuple[list[list[float]], int]:
    """(embeddings, prompt tokens), after the modelled prefill time of those tokens."""
    engine = request.app[ENGINE_KEY]
    seed = engine.args.seed
    token_lists = [await _tokens(request, item) for item in items]
    n = sum(len(t) for t in token_lists)
    await asyncio.sleep(prefill_time_ms(n) / 1000.0 / engine.args.speedup)
    return [embed_tokens(seed, t) for t in token_lists], n


def _usage(n: int) -> dict[str, Any]:
    return {
        "prompt_tokens": n,
        "total_tokens": n,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def _reply(body: dict[str, Any]) -> web.Response:
    return web.Response(body=_json_encode(body), content_type="application/json")


def _text_of(item: Any) -> str | list[int]:
    if isinstance(item, dict):  # a content part ({"type": "text", "text": ...})
        item = item.get("text")
    if isinstance(item, str) or (isinstance(item, list) and all(isinstance(t, int) for t in item)):
        return item
    raise ApiError(400, "Invalid request: score and rerank inputs must be strings (or text parts)")


# -- handlers ---------------------------------------------------------------------------------------
async def _embeddings(request: web.Request) -> web.Response:
    body = await _body(request)
    items = _inputs(body.get("input"), "input")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise ApiError(400, f"Invalid request: encoding_format {fmt!r} is not supported", param="encoding_format")
    if body.get("dimensions") is not None:
        raise ApiError(
            400,
            f"Model '{request.app[ENGINE_KEY].model_name}' does not support Matryoshka embeddings; "
            f"dimensions must be unset (received dimensions={body['dimensions']}).",
        )
    vectors, n = await _embed_all(request, items)
    engine = request.app[ENGINE_KEY]

    def encoded(v: list[float]) -> Any:
        return v if fmt == "float" else base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode()

    return _reply(
        {
            "id": f"embd-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": engine.model_name,
            "data": [{"index": i, "object": "embedding", "embedding": encoded(v)} for i, v in enumerate(vectors)],
            "usage": _usage(n),
        }
    )


def _pairs(body: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    for first, second in (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2")):
        if first in body and second in body:
            a, b = body[first], body[second]
            a = a if isinstance(a, list) and a and not all(isinstance(t, int) for t in a) else [a]
            b = b if isinstance(b, list) and b and not all(isinstance(t, int) for t in b) else [b]
            if len(a) != 1 and len(a) != len(b):
                raise ApiError(400, "Input lengths must be either 1:1, 1:N or N:N")
            return [_text_of(x) for x in a], [_text_of(x) for x in b]
    raise ApiError(400, "Invalid request: give queries and documents (or data_1 and data_2, text_1 and text_2)")


async def _score(request: web.Request) -> web.Response:
    body = await _body(request)
    first, second = _pairs(body)
    vectors, n = await _embed_all(request, [*first, *second])
    left, right = vectors[: len(first)], vectors[len(first) :]
    scores = [cosine(left[0 if len(left) == 1 else i], r) for i, r in enumerate(right)]
    return _reply(
        {
            "id": f"score-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": request.app[ENGINE_KEY].model_name,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": _usage(n),
        }
    )


async def _rerank(request: web.Request) -> web.Response:
    body = await _body(request)
    if "query" not in body or "documents" not in body:
        raise ApiError(400, "Invalid request: 'query' and 'documents' are required")
    documents = body["documents"] if isinstance(body["documents"], list) else [body["documents"]]
    if not documents:
        raise ApiError(400, "Invalid request: 'documents' must not be empty", param="documents")
    top_n = body.get("top_n") or 0
    if not isinstance(top_n, int) or top_n < 0:
        raise ApiError(400, "Invalid request: top_n must be a non-negative integer", param="top_n")
    query = _text_of(body["query"])
    texts = [_text_of(d) for d in documents]
    vectors, n = await _embed_all(request, [query, *texts])
    scores = [cosine(vectors[0], v) for v in vectors[1:]]
    order = sorted(range(len(texts)), key=lambda i: -scores[i])
    results = [
        {
            "index": i,
            "document": {"text": texts[i] if isinstance(texts[i], str) else None, "multi_modal": None},
            "relevance_score": scores[i],
        }
        for i in order
    ]
    return _reply(
        {
            "id": f"score-{uuid.uuid4().hex}",
            "model": request.app[ENGINE_KEY].model_name,
            "usage": {"prompt_tokens": n, "total_tokens": n},
            "results": results[:top_n] if top_n else results,
        }
    )


async def _classify(request: web.Request) -> web.Response:
    body = await _body(request)
    items = _inputs(body.get("input"), "input")
    vectors, n = await _embed_all(request, items)
    seed = request.app[ENGINE_KEY].args.seed
    data = []
    for i, v in enumerate(vectors):
        probs = classify_probs(seed, v)
        label = max(range(NUM_LABELS), key=lambda k: probs[k])
        data.append({"index": i, "label": f"LABEL_{label}", "probs": probs, "num_classes": NUM_LABELS})
    return _reply(
        {
            "id": f"classify-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": request.app[ENGINE_KEY].model_name,
            "data": data,
            "usage": _usage(n),
        }
    )


async def _detokenize(request: web.Request) -> web.Response:
    body = await _body(request)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and t >= 0 for t in tokens):
        raise ApiError(400, "Invalid request: 'tokens' must be a list of token ids", param="tokens")
    tok = request.app[ENGINE_KEY].tokenizer
    decode = getattr(tok, "decode", None)
    return _reply({"prompt": decode(tokens) if decode is not None else tok.decode_output(tokens)})


async def _openapi(request: web.Request) -> web.Response:
    """The paths served, as FastAPI's /openapi.json lists them (all a launcher reads)."""
    paths = sorted({r.canonical for r in request.app.router.resources()})
    return _reply(
        {"openapi": "3.1.0", "info": {"title": "infera sim", "version": "0"}, "paths": {p: {} for p in paths}}
    )


def install(app: web.Application, args: argparse.Namespace) -> None:
    """The pooling runner's routes (by ``--convert``), ``/detokenize`` and ``/openapi.json``."""
    task = pooling_task(args)
    if task == "embed":
        app.router.add_post("/v1/embeddings", _embeddings)
        for route in SCORE_ROUTES:
            app.router.add_post(route, _score)
        for route in RERANK_ROUTES:
            app.router.add_post(route, _rerank)
    elif task == "classify":
        app.router.add_post("/classify", _classify)
    app.router.add_post("/detokenize", _detokenize)
    app.router.add_get("/openapi.json", _openapi)
