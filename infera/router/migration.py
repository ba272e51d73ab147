"""Request migration: a streamed generation whose worker dies or stalls continues on another.

``StreamTracker`` follows one streamed reply event by event, so that when the stream breaks it
can say how to continue it elsewhere:

* **exact**: the engine reported the prompt's and every output token's ids (vLLM's
  ``return_token_ids``, which the router asks for on vLLM-format workers). The continuation is a
  ``/v1/completions`` request whose prompt is those ids, so the new worker resumes from the very
  token the old one stopped at; its chunks are reshaped into the client's chat-chunk form.
* **text**: no ids. Chat appends what was produced as an assistant message the engine continues
  (``continue_final_message``); completions append it to the prompt. Tokenization of the text
  may differ from the original tokens at the seam, so exact is preferred wherever it exists.

Some streams cannot be continued faithfully and are *poisoned*: ``n`` or ``best_of`` above 1,
several choices in a chunk, a batch prompt, tool-call or reasoning deltas, or an engine error
event. Those end with the SSE error event as without migration.

The client never sees the ids the router asked for (they are stripped, unless it asked itself),
and reads one stream: one id, one role chunk, usage that counts the whole generation.
Parsing every event costs ~10 µs per chunk, which is why migration is off by default.
"""
from __future__ import annotations

import logging
import time
from typing import AsyncIterator, Awaitable, Callable

import msgspec

from infera.api.errors import ApiError
from infera.discovery.record import WorkerRecord
from infera.router.metrics import RouterMetrics
from infera.router.upstream import LegFailure, Opened, Relay, StreamTail, midstream_error_event
from infera.transport.http import UpstreamError

log = logging.getLogger(__name__)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# Chat-only request fields a /v1/completions continuation cannot carry (the exact path then
# falls back to text, which keeps them).
_CHAT_ONLY = ("tools", "functions", "tool_choice", "function_call", "response_format")
# Fields of a chat request a completions continuation drops.
_CHAT_FIELDS = ("messages", "max_completion_tokens", "add_generation_prompt", "continue_final_message",
                "chat_template", "chat_template_kwargs", "documents", "logprobs", "top_logprobs",
                "parallel_tool_calls", "reasoning_effort", "include_reasoning") + _CHAT_ONLY
# Engines that answer ``return_token_ids`` in vLLM's format (the simulator speaks it).
TOKEN_ID_ENGINES = frozenset({"vllm", "sim"})
# Engines whose chat API continues a final assistant message (``continue_final_message``).
CONTINUE_ENGINES = frozenset({"vllm", "sim", "sglang"})

_decode = msgspec.json.decode
_encode = msgspec.json.encode
_DONE = b"[DONE]"


class Poisoned(Exception):
    """This stream cannot be continued elsewhere; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def request_for_migration(route: str, request: dict, engine: str) -> tuple[dict, bool]:
    """The body to send first (ids asked for on engines that report them) and whether the
    router asked for ids (so it strips them from what the client sees)."""
    if engine in TOKEN_ID_ENGINES and not request.get("return_token_ids"):
        body = dict(request)
        body["return_token_ids"] = True
        return body, True
    return request, False


def poison_reason(route: str, request: dict) -> str | None:
    """Why a request can never migrate, known before it starts."""
    if (request.get("n") or 1) > 1 or (request.get("best_of") or 1) > 1:
        return "n_above_1"
    if route == COMPLETIONS:
        prompt = request.get("prompt")
        if isinstance(prompt, list) and not all(isinstance(t, int) for t in prompt):
            return "batch_prompt"
        if request.get("echo"):
            return "echo"
    return None


class StreamTracker:
    """Follows one streamed reply so it can be continued on another worker after a break."""

    def __init__(self, route: str, request: dict, *, strip_ids: bool) -> None:
        self.route = route
        self.request = request  # the client's request, decoded
        self.strip_ids = strip_ids
        self.poisoned: str | None = poison_reason(route, request)
        self.prompt_ids: list[int] | None = None
        self.output_ids: list[int] = []
        self.ids_complete = True  # every event with output carried its ids
        self.text: list[str] = []
        self.events = 0  # content events seen: the token count on the text path
        self.finished = False  # a finish_reason other than "abort" arrived
        # The engine gave up on the request (finish_reason "abort": draining, shutting down): not a
        # finished generation but a break. It and whatever follows from that worker is held back.
        self.aborted = False
        self.done = False  # data: [DONE] arrived
        self.moves = 0
        self._partial = b""
        self._id: str | None = None  # the client's stream id, kept across moves
        self._created: int | None = None
        self._continuing: str | None = None  # None: first worker; "exact" or "text" after a move
        self._prompt_tokens: int | None = None
        self._base_output = 0  # tokens produced before the latest move
        self._pending_mode = "text"

    # -- observing -------------------------------------------------------------------------------
    def feed(self, chunk: bytes) -> bytes:
        """Track ``chunk``; return what the client gets (ids stripped, a continuation reshaped).
        An event split across chunks is held until it is whole."""
        data = self._partial + chunk if self._partial else chunk
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self._partial = data
            return b""
        self._partial = data[cut + 2:]
        out: list[bytes] = []
        for event in data[:cut].split(b"\n\n"):
            out.append(self._event(event))
        return b"".join(out)

    def _event(self, event: bytes) -> bytes:
        raw = event + b"\n\n"
        if self.aborted:
            return b""  # the rest of an aborted attempt (its usage, [DONE]) is not the client's
        if not event.startswith(b"data:"):
            return raw  # comments, keep-alives
        payload = event[5:].strip()
        if payload == _DONE:
            self.done = True
            return raw
        try:
            obj = _decode(payload)
        except (msgspec.DecodeError, RecursionError):  # RecursionError: msgspec's, for JSON nested too deep
            self.poisoned = self.poisoned or "malformed_event"
            return raw
        if not isinstance(obj, dict):
            self.poisoned = self.poisoned or "malformed_event"
            return raw
        if "error" in obj:
            self.poisoned = self.poisoned or "engine_error"
            return raw
        changed = False
        if self._continuing is not None:
            obj = self._reshape(obj)
            changed = True
        elif self._id is None:
            self._id, self._created = obj.get("id"), obj.get("created")
        choices = obj.get("choices") or []
        if len(choices) > 1:
            self.poisoned = self.poisoned or "several_choices"
        if "prompt_token_ids" in obj:  # chat: top level of the first chunk
            ids = obj.get("prompt_token_ids")
            if self._continuing is None and isinstance(ids, list):
                self.prompt_ids = ids
            if self.strip_ids or self._continuing is not None:
                del obj["prompt_token_ids"]
                changed = True
        if self.strip_ids and "prompt_text" in obj and obj.get("prompt_text") is None:  # comes with the ids
            del obj["prompt_text"]
            changed = True
        for choice in choices:
            changed |= self._choice(choice)
        if self.aborted:
            return b""
        usage = obj.get("usage")
        if isinstance(usage, dict):
            if self._continuing is None:
                self._prompt_tokens = usage.get("prompt_tokens")
            else:
                changed |= self._fix_usage(usage)
        if not changed:
            return raw
        return b"data: " + _encode(obj) + b"\n\n"

    def _choice(self, choice: dict) -> bool:
        changed = False
        if "prompt_token_ids" in choice:  # completions: in the choice of the first content chunk
            ids = choice.get("prompt_token_ids")
            if self._continuing is None and isinstance(ids, list):
                self.prompt_ids = ids
            if self.strip_ids or self._continuing is not None:
                del choice["prompt_token_ids"]
                changed = True
        delta = choice.get("delta")
        if isinstance(delta, dict):
            if delta.get("tool_calls"):
                self.poisoned = self.poisoned or "tool_calls"
            if delta.get("reasoning_content") or delta.get("reasoning"):
                self.poisoned = self.poisoned or "reasoning"
            text = delta.get("content")
        else:
            text = choice.get("text")
        ids = choice.get("token_ids")
        if "token_ids" in choice and self.strip_ids:
            del choice["token_ids"]
            changed = True
        if isinstance(ids, list):
            self.output_ids.extend(ids)
        elif text:
            self.ids_complete = False
        if text:
            self.text.append(text)
            self.events += 1
        reason = choice.get("finish_reason")
        if reason == "abort" and self.poisoned is None:
            self.aborted = True
        elif reason is not None:
            self.finished = True
        return changed

    # -- continuing ------------------------------------------------------------------------------
    @property
    def produced(self) -> int:
        return len(self.output_ids) if self.ids_complete and self.output_ids else self.events

    def can_migrate(self) -> str | None:
        """None when the stream can be continued; else the reason it cannot."""
        if self.poisoned:
            return self.poisoned
        if self.done or self.finished:
            return "finished"  # nothing left to generate: the client just misses [DONE]
        return None

    def continuation(self, engine: str) -> tuple[str, bytes]:
        """The route and body that continue this generation on a worker of ``engine``; nothing
        changes until ``commit()`` (the first pick may fail before its first byte)."""
        req = {k: v for k, v in self.request.items() if k not in ("return_token_ids",)}
        remaining = self._remaining()
        exact = (self.prompt_ids is not None and self.ids_complete and engine in TOKEN_ID_ENGINES
                 and not any(k in req for k in _CHAT_ONLY))
        if exact:
            body = {k: v for k, v in req.items() if k not in _CHAT_FIELDS}
            body["prompt"] = list(self.prompt_ids) + self.output_ids  # type: ignore[arg-type]
            body["max_tokens"] = remaining
            body["return_token_ids"] = True
            body.pop("echo", None)
            body["stream"] = True
            mode, route = "exact", COMPLETIONS
        else:
            produced = "".join(self.text)
            body = dict(req)
            if self.route == CHAT:
                body["messages"] = list(req["messages"]) + [{"role": "assistant", "content": produced}]
                if engine in CONTINUE_ENGINES:
                    body["continue_final_message"] = True
                    body["add_generation_prompt"] = False
                if "max_completion_tokens" in body:
                    body["max_completion_tokens"] = remaining
                else:
                    body["max_tokens"] = remaining
            else:
                prompt = req.get("prompt")
                if not isinstance(prompt, str):
                    raise Poisoned("token_prompt_without_ids")
                body["prompt"] = prompt + produced
                body["max_tokens"] = remaining
            if engine in TOKEN_ID_ENGINES:
                body["return_token_ids"] = True
            mode, route = "text", self.route
        self._pending_mode = mode
        return route, _encode(body)

    def commit(self) -> None:
        """The continuation from the last ``continuation()`` call is the stream from now on."""
        self._continuing = self._pending_mode
        self.aborted = False
        self.moves += 1
        self._base_output = self.produced  # what the new worker reports is counted from here
        self._partial = b""  # half an event from the dead worker is dropped

    def _remaining(self) -> int:
        req = self.request
        asked = req.get("max_completion_tokens") if self.route == CHAT else None
        if asked is None:
            asked = req.get("max_tokens")
        if asked is None:
            asked = 16 if self.route == COMPLETIONS else 1 << 20  # the engine caps by context
        return max(1, int(asked) - self.produced)

    def _reshape(self, obj: dict) -> dict:
        """A continuation's chunk in the client's form: its id, and chat chunks for chat."""
        if self._id is not None:
            obj["id"] = self._id
        if self._created is not None:
            obj["created"] = self._created
        if self.route == CHAT and obj.get("object") == "text_completion":
            obj["object"] = "chat.completion.chunk"
            for choice in obj.get("choices") or []:
                text = choice.pop("text", None)
                choice.pop("logprobs", None)
                choice.pop("prompt_logprobs", None)
                choice["delta"] = {"content": text} if text else {}
                choice["logprobs"] = None
        elif self.route == CHAT:
            for choice in obj.get("choices") or []:  # a text-path chat continuation: no second role
                delta = choice.get("delta")
                if isinstance(delta, dict) and "role" in delta:
                    del delta["role"]
        return obj

    def _fix_usage(self, usage: dict) -> bool:
        """Usage as if one worker had done it all: the original prompt, every output token."""
        base = self._base_output
        completion = usage.get("completion_tokens")
        if isinstance(completion, int):
            usage["completion_tokens"] = completion + base
        prompt = self._prompt_tokens if self._prompt_tokens is not None else (
            len(self.prompt_ids) if self.prompt_ids is not None else None)
        if prompt is not None:
            usage["prompt_tokens"] = prompt
        if isinstance(usage.get("prompt_tokens"), int) and isinstance(usage.get("completion_tokens"), int):
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return True


# -- the relay ------------------------------------------------------------------------------------
Reopen = Callable[[StreamTracker, set], Awaitable["tuple[WorkerRecord, Opened, Callable[[], None]]"]]


class MigratingRelay(Relay):
    """A worker's stream relayed through a ``StreamTracker``: when it breaks (the connection dies,
    the worker stalls past the idle timeout, or aborts the request) the generation moves to
    another worker, up to ``limit`` times, and the client reads on. ``reopen`` picks and opens the
    next worker (``MixedRouter._migrate``). Like ``Relay``, each worker's reply and slot are
    released exactly once."""

    __slots__ = ("_tracker", "_reopen", "_limit", "_tried")

    def __init__(self, opened: Opened, worker: WorkerRecord, tracker: StreamTracker, reopen: Reopen,
                 metrics: RouterMetrics, done: Callable[[], None], on_tail: Callable[[bytes], None] | None, limit: int) -> None:
        self._tracker, self._reopen, self._limit = tracker, reopen, limit
        self._tried = {worker.worker_id}
        super().__init__(opened, worker, metrics, done, on_tail)

    async def _chunks(self) -> AsyncIterator[bytes]:
        tracker, on_tail = self._tracker, self._on_tail
        tail = StreamTail()
        try:
            out = tracker.feed(self._opened.first)
            if out:
                if on_tail is not None:
                    tail.add(out)
                yield out
            while True:
                resp = self._opened.resp
                error: UpstreamError | None = None
                try:
                    chunk = await resp.next_chunk()  # type: ignore[union-attr]
                except UpstreamError as exc:
                    chunk, error = b"", exc
                if chunk:
                    out = tracker.feed(chunk)
                    if out:
                        if on_tail is not None:
                            tail.add(out)
                        yield out
                    if not tracker.aborted:
                        continue
                if error is None and tracker.done:
                    break  # finished
                wid = self._worker.worker_id
                if error is None and tracker.finished:  # all generated; only [DONE] was lost
                    yield b"data: [DONE]\n\n"
                    break
                log.warning("worker %s failed mid-stream: %s", wid, error or (
                    "the engine aborted the request" if tracker.aborted else "the stream ended without [DONE]"))
                self._metrics.count_midstream_failure(wid)
                why = tracker.can_migrate() or ("limit" if tracker.moves >= self._limit else None)
                if why is not None:
                    self._metrics.count_migration_failed(why)
                    yield midstream_error_event(wid, error)
                    return
                reason = "worker_aborted" if tracker.aborted else "stream_broken"
                started = time.perf_counter()
                self._finish()  # the broken stream's connection is closed and its slot freed
                try:
                    worker, opened, done = await self._reopen(tracker, self._tried)
                except (LegFailure, ApiError) as exc:
                    reason = "no_candidate" if getattr(exc, "reason", getattr(exc, "code", "")) == "no_candidate" \
                        else "no_first_byte"
                    log.warning("request could not move off worker %s: %s", wid, exc)
                    self._metrics.count_migration_failed(reason)
                    yield midstream_error_event(wid, error)
                    return
                tracker.commit()
                self._opened, self._worker, self._done, self._finished = opened, worker, done, False
                self._metrics.count_migration(reason, time.perf_counter() - started)
                log.info("stream moved from worker %s to %s after %d tokens (move %d)", wid, worker.worker_id,
                         tracker.produced, tracker.moves)
                out = tracker.feed(opened.first)
                if out:
                    if on_tail is not None:
                        tail.add(out)
                    yield out
            if on_tail is not None:
                on_tail(tail.bytes())
        finally:
            self._finish()
