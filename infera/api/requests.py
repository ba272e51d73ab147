"""Parse and validate OpenAI request bodies once, at the door.

Only the fields the router reads are typed strictly; everything else passes through to the
engine untouched (the original bytes are forwarded, never re-encoded).

Hostile input is stopped here, before anything recursive touches it: msgspec decodes nesting
recursively (a body nested ~1000 deep raises RecursionError, and one nested 500 deep decodes but
breaks the PD legs' ``copy.deepcopy`` later), so nesting depth and container count are checked
first by ``json_structure_problem``, which never recurses and runs in C (bytes.translate, replace,
split; itertools over builtins).
"""
from __future__ import annotations

import itertools
import json
import operator
import re
from typing import Any, Optional, Union

import msgspec

from infera.api.errors import ApiError

# Deeper than any real request (a chat message with content parts and a tool schema is < 20).
MAX_JSON_DEPTH = 64


class StreamOptions(msgspec.Struct, forbid_unknown_fields=False):
    include_usage: Optional[bool] = None


class _Common(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    model: Optional[str] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: Optional[int] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    user: Optional[str] = None
    # cache hints (OpenAI prompt caching): steer how hard the router favours cache locality
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    images: Optional[list[Any]] = None
    # PD handoff the engine acts on (vLLM's KV connectors pull KV from the host it names): the
    # router writes it; a client's is refused unless the operator allows it (see parse_request).
    kv_transfer_params: Optional[dict[str, Any]] = None
    # vLLM's per-request prefix-cache isolation, as the client sent it (its key spelled with escapes
    # or given twice: the value the engine's parser would keep). UNSET: absent, where a null is
    # present (and would win over a salt written before it). The server writes an isolated
    # tenant's own and routing hashes with it (infera/server/request_salt.py).
    cache_salt: Union[Any, msgspec.UnsetType] = msgspec.UNSET


class ChatMessage(msgspec.Struct, forbid_unknown_fields=False):
    role: str
    content: Union[str, list[dict[str, Any]], None] = None


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None


class CompletionRequest(_Common, kw_only=True):
    # str | list[str] | list[int] | list[list[int]] (msgspec allows one array type per union)
    prompt: Union[str, list[Union[int, str, list[int]]]]


_decoders = {
    "/v1/chat/completions": msgspec.json.Decoder(ChatCompletionRequest),
    "/v1/completions": msgspec.json.Decoder(CompletionRequest),
}

# -- nesting depth and size without recursion ---------------------------------------------------------
# More arrays/objects than any real request holds (a long agent transcript has a few thousand); it
# also bounds what a body can make msgspec allocate (32 MiB of "[[]]," in a list[Any] field took
# seconds of event loop) and the exact depth pass below.
MAX_JSON_CONTAINERS = 100_000

_KEEP = b'[]{}"'
_DROP = bytes(b for b in range(256) if b not in _KEEP)
_SQUARE = bytes.maketrans(b"{}", b"[]")  # one bracket kind: nesting is all that matters here
_DROP_ESC = bytes(b for b in range(256) if b not in _KEEP + b'\\/bfnrtu')  # + escapes: \\ \" \/ \b \f \n \r \t \u


def json_structure_problem(body: bytes, max_depth: int = MAX_JSON_DEPTH,
                           max_containers: int = MAX_JSON_CONTAINERS) -> str | None:
    """Why ``body`` nests too deep or holds too many arrays/objects; None when it is fine.

    Never recurses, and every pass runs in C. Exact for valid JSON; for invalid JSON it never
    misses a deep prefix (what a recursive decoder would descend into before failing). Cost: one
    ``bytes.translate`` of the body (~0.4 ns a byte) when the body holds at most ``max_depth``
    brackets, the usual case; else a few more linear passes, the last over at most
    ``2 * max_containers`` brackets.
    """
    s = body.translate(_SQUARE, _DROP)  # brackets (one kind) and quotes
    if s.count(b"[") <= max_depth:
        return None
    escapes = body.translate(None, _DROP_ESC) if b"\\" in body else b""
    if b'\\"' in escapes:
        # An escaped quote is text: drop escaped backslashes first (so ``\\"`` still ends its
        # string), then escaped quotes; no other escape hides a quote or a bracket. Done on the
        # body less the bytes no escape involves (about a third of a text's are left): the letters
        # escapes use are kept, so an escaped n before a closing quote is not an escaped quote.
        s = escapes.replace(b"\\\\", b"").replace(b'\\"', b"").translate(_SQUARE, _DROP)
    # Adjacent quotes end one string and start the next (or make an empty one): dropping them
    # joins strings and keeps every quote's parity, and makes the split below small.
    s = s.replace(b'""', b"")
    quotes = s.count(b'"')
    if quotes:
        # Two strings left apart have an outer bracket between them, so there are at most ~2 quotes
        # per bracket here; past that there are too many brackets anyway.
        if quotes > 4 * max_containers + 2:
            return f"JSON holds more than {max_containers} arrays/objects"
        s = b"".join(s.split(b'"')[::2])  # brackets inside strings are text
    opens = s.count(b"[")
    if opens <= max_depth:
        return None
    if len(s) > 2 * max_containers:  # opens + closes: also bounds the pass below on unbalanced input
        return f"JSON holds more than {max_containers} arrays/objects"
    # Depth just before the i-th close = the opens so far - i (map/accumulate/any over builtins:
    # no bytecode per bracket), stopping at the first level too deep.
    depths = map(operator.sub, itertools.accumulate(map(len, s.split(b"]"))), itertools.count())
    if any(map(operator.lt, itertools.repeat(max_depth), depths)):
        return f"JSON nested deeper than {max_depth} levels"
    return None


# -- duplicate keys -----------------------------------------------------------------------------------
# Top-level keys whose value the router acts on (routing, the relay's mode, bounds, the PD handoff,
# the queue priority, the retention it writes). msgspec keeps the last of duplicate keys, and so do
# the Python engines, but the body is forwarded as received: an engine (or a hop before it) that
# kept the first would act on a value the router never checked. So such a key given twice is a 400.
GUARDED_KEYS = ("model", "stream", "n", "max_tokens", "max_completion_tokens", "kv_transfer_params", "priority",
                "infera_retention")
_GUARDED_BYTES = tuple(b'"' + k.encode() + b'"' for k in GUARDED_KEYS)
# Every quoted guarded name in one pass (the regex engine jumps between quotes: ~0.3 ns a byte on
# text, more where the text is full of quotes); a substring count per name was a pass each.
_GUARDED_NAMES = re.compile(rb'"(' + b"|".join(re.escape(k.encode()) for k in GUARDED_KEYS) + rb')"')
# A \u escape of an ASCII character (U+0020-U+007F): how a key could spell a guarded name without
# its literal bytes. Text escapes (non-ASCII, \u00e9, \u4e2d, ...) do not match.
_ESCAPED_ASCII = re.compile(rb"\\u00[2-7][0-9A-Fa-f]")


def duplicate_key_problem(body: bytes) -> tuple[str, str] | None:
    """(message, key) when a guarded top-level key is given twice, or spelled with escapes (which
    the router's byte checks, e.g. engine_hints' priority scan, would not see); None when fine.

    Cost: one regex pass collecting the quoted guarded names, and a find for ``\\u00``; only a
    body where a guarded name occurs twice (anywhere: a message may quote one) or that holds an
    escaped ASCII character is parsed again, in Python, to decide."""
    names = _GUARDED_NAMES.findall(body)
    if len(names) == len(set(names)) and (b"\\u00" not in body or _ESCAPED_ASCII.search(body) is None):
        return None
    top: list[tuple[str, Any]] = []

    def pairs(members: list[tuple[str, Any]]) -> None:  # every object, the top-level one last
        nonlocal top
        top = members

    try:
        json.loads(body, object_pairs_hook=pairs)
    except (ValueError, RecursionError):  # msgspec accepted it; refuse what the check cannot read
        return "malformed JSON body", ""
    seen: dict[str, int] = {}
    for key, _ in top:
        seen[key] = seen.get(key, 0) + 1
    for key, name in zip(GUARDED_KEYS, _GUARDED_BYTES):
        count = seen.get(key, 0)
        if count > 1:
            return f"duplicate key '{key}' in the request body", key
        if count and name not in body:
            return f"key '{key}' spelled with escapes in the request body; write it plainly", key
    return None


# -- validation ---------------------------------------------------------------------------------------
_AT_PATH = re.compile(r" - at `\$\.?([^`]*)`$")
_MISSING = re.compile(r"missing required field `([^`]+)`")


def _param_of(message: str) -> str | None:
    """The JSON path msgspec names (``messages[0].role``), or the missing field."""
    m = _AT_PATH.search(message) or _MISSING.search(message)
    return (m.group(1) or None) if m else None


# Upper bounds a client cannot exceed whatever the model: n copies of a reply, each up to max_tokens
# (OpenAI caps n at 128; no served context reaches 2**20 tokens). Engines check the model's own
# context; these only stop a request that would pin an engine or a relay for nothing.
MAX_N = 128
MAX_TOKENS = 1 << 20  # 1,048,576


def _at_least_one(value: Any, name: str, most: int | None = None) -> None:
    if value is not None and value < 1:
        raise ApiError(400, f"{name} must be at least 1", "invalid_request", param=name)
    if value is not None and most is not None and value > most:
        raise ApiError(400, f"{name} must be at most {most}", "invalid_request", param=name)


def parse_request(route: str, body: bytes, *, max_depth: int = MAX_JSON_DEPTH,
                  max_containers: int = MAX_JSON_CONTAINERS,
                  allow_kv_transfer_params: bool = False) -> ChatCompletionRequest | CompletionRequest:
    """Decode + validate; any problem is a 400 in the OpenAI error shape (never another error).

    ``allow_kv_transfer_params``: let a client's own ``kv_transfer_params`` through to the
    engine (``--allow-client-kv-transfer-params``). Off, a request carrying one is refused: it
    tells a vLLM KV connector which host to pull KV from, so it is the router's to write.
    """
    if not body:
        raise ApiError(400, "request body is empty; expected a JSON object", "invalid_json")
    problem = json_structure_problem(body, max_depth, max_containers)
    if problem is not None:
        raise ApiError(400, problem, "json_too_complex")
    try:
        req = _decoders[route].decode(body)
    except msgspec.ValidationError as exc:
        message = str(exc)
        raise ApiError(400, f"invalid request: {message}", "invalid_request", param=_param_of(message)) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"malformed JSON body: {exc}", "invalid_json") from None
    except RecursionError:  # unreachable below max_depth; kept so no input is ever a 500
        raise ApiError(400, "JSON nested too deep", "json_too_complex") from None
    duplicate = duplicate_key_problem(body)
    if duplicate is not None:
        raise ApiError(400, duplicate[0], "duplicate_key", param=duplicate[1] or None)
    if not req.model:
        raise ApiError(400, "'model' is required", "invalid_request", param="model")
    _at_least_one(req.max_tokens, "max_tokens", MAX_TOKENS)
    _at_least_one(req.n, "n", MAX_N)
    if isinstance(req, ChatCompletionRequest):
        _at_least_one(req.max_completion_tokens, "max_completion_tokens", MAX_TOKENS)
        if not req.messages:
            raise ApiError(400, "'messages' must hold at least one message", "invalid_request", param="messages")
    elif isinstance(req.prompt, list) and not req.prompt:
        raise ApiError(400, "'prompt' must not be an empty list", "invalid_request", param="prompt")
    if req.kv_transfer_params is not None and not allow_kv_transfer_params:
        raise ApiError(400, "kv_transfer_params is set by the router for PD transfers, not by clients (an operator "
                       "can allow it with --allow-client-kv-transfer-params)", "kv_transfer_params_not_allowed",
                       param="kv_transfer_params")
    return req
