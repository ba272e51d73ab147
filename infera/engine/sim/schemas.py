"""The simulated engine's request schemas and what its HTTP handlers share: vLLM's error shape
(:class:`ApiError`), the request bodies (msgspec structs; unknown fields are accepted and ignored),
vLLM's input checks, the SSE headers and the app key under which the handlers find the engine.
The handlers (``server.py``) and the forced tool calls (``tool_calls.py``) both import this
module; it imports neither at run time.
"""
from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
from aiohttp import web

if TYPE_CHECKING:
    from infera.engine.sim.scheduler import Sequence
    from infera.engine.sim.server import SimEngine

SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}

# Where the handlers find the engine (``build_app`` sets it).
ENGINE_KEY: web.AppKey[SimEngine] = web.AppKey("sim_engine")

_json_encode = msgspec.json.Encoder().encode


class ApiError(Exception):
    """An error response in vLLM's shape: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, err_type: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param

    def response(self) -> web.Response:
        body = {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.status}}
        return web.Response(status=self.status, body=_json_encode(body), content_type="application/json")


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _SamplingRequest(msgspec.Struct, kw_only=True):
    """Fields shared by chat and completions. Unknown fields are accepted and ignored."""

    model: str | None = None
    max_tokens: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    n: int | None = 1
    user: str | None = None
    # vLLM >= 0.10.2: the prompt's and each output token's ids in the reply (request migration reads them).
    return_token_ids: bool | None = False
    # P/D legs: vLLM's NixlConnector hand-off, SGLang's bootstrap room (see pd.py).
    kv_transfer_params: dict[str, Any] | None = None
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    disagg_prefill_dp_rank: int | None = None
    # vLLM's per-request prefix-cache isolation: folded into the first block's hash (cache.py).
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        salt = self.cache_salt
        # vLLM 0.32's validate_cache_salt, message for message
        if salt is not None and (not salt or len(salt) > 128 or any(c in "@/\\\0" for c in salt)):
            raise ValueError("Parameter 'cache_salt' must be at most 128 characters and "
                             "must not contain '@', '/', '\\\\', or NUL." if salt else
                             "Parameter 'cache_salt' must be a non-empty string if provided.")


class ChatCompletionRequest(_SamplingRequest, kw_only=True):
    messages: list[Any]
    max_completion_tokens: int | None = None


class CompletionRequest(_SamplingRequest, kw_only=True):
    prompt: Any
    max_tokens: int | None = 16  # OpenAI/vLLM default for completions


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: Any = None
    messages: list[Any] | None = None
    add_special_tokens: bool | None = None


_Req = TypeVar("_Req")


async def _decode_body(request: web.Request, typ: type[_Req]) -> _Req:
    body = await request.read()
    try:
        return msgspec.json.decode(body, type=typ)
    except msgspec.ValidationError as e:
        raise ApiError(400, f"Invalid request: {e}") from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"JSON decode error: {e}") from None


def _check_sampling(req: _SamplingRequest) -> None:
    if req.n is not None and req.n != 1:
        raise ApiError(400, f"n={req.n} is not supported by the simulated engine; only n=1 is.")
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "Stream options can only be defined when `stream=True`.")


def _stop_strings(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [s for s in ([stop] if isinstance(stop, str) else stop) if s]


def _resolve_max_tokens(engine: SimEngine, prompt_len: int, max_tokens: int | None, param: str) -> int:
    """vLLM's input validation: context length, then the max_tokens range."""
    limit = engine.max_model_len
    if prompt_len >= limit:
        raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, your request "
                            f"has {prompt_len} input tokens. Please reduce the length of the input messages.")
    if max_tokens is None:
        return limit - prompt_len
    if max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}.")
    if prompt_len + max_tokens > limit:
        raise ApiError(400, f"'{param}' is too large: {max_tokens}. This model's maximum context length is "
                            f"{limit} tokens and your request has {prompt_len} input tokens "
                            f"({max_tokens} > {limit} - {prompt_len}).")
    return max_tokens


def _completion_prompt_ids(prompt: Any) -> tuple[str | None, list[int] | None]:
    """Completions ``prompt``: text or token ids; batched prompts are rejected."""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list):
        if len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            return _completion_prompt_ids(prompt[0])
        if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if any(t < 0 for t in prompt):
                raise ApiError(400, "Token ids must be non-negative.")
            return None, list(prompt)
        if len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
            raise ApiError(400, "Batched prompts (a list of several prompts) are not supported by the "
                                "simulated engine; send one prompt per request.")
    raise ApiError(400, "prompt must be a string, a list with one string, or a list of token ids.")


def _request_id(request: web.Request) -> str:
    return request.headers.get("X-Request-Id") or uuid.uuid4().hex


def _usage(seq: Sequence) -> dict[str, Any]:
    completion = len(seq.output_token_ids)
    return {
        "prompt_tokens": seq.prompt_len,
        "total_tokens": seq.prompt_len + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": max(seq.num_cached_tokens, 0)},
    }


class StartProfileRequest(msgspec.Struct, kw_only=True):
    """vLLM's optional /start_profile body (unknown fields ignored); SGLang's options pass as extras."""

    profile_prefix: str | None = None
    delay_iterations: int | None = None
    max_iterations: int | None = None
