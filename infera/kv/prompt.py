"""Prompt → token ids the way the engine computes them, cached so a repeated prompt is free.

Chat: the model's chat template is rendered (``add_generation_prompt=True``) and the text is
encoded without special tokens, as vLLM does for chat. Completions: a string prompt is encoded
with the tokenizer's special-token handling; a token-id prompt is used as is.
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
from collections import OrderedDict
from typing import Any

import msgspec
import xxhash

from infera.kv.tokenizer import SimTokenizer, load_tokenizer, normalize_messages

log = logging.getLogger(__name__)

# Above this many characters tokenization moves to a worker thread (it would stall the loop).
_THREAD_THRESHOLD_CHARS = 4096
_encode_json = msgspec.json.Encoder().encode


def resolve_tokenizer_path(path: str) -> str:
    """A folder, a ``tokenizer.json`` file (→ its folder), or a hub id (only if the hub is reachable)."""
    if os.path.isfile(path):
        return os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "tokenizer.json")):
            raise ValueError(f"router tokenizer folder {path!r} has no tokenizer.json")
        return path
    try:
        from huggingface_hub import snapshot_download  # optional: only for hub ids
    except ImportError:
        raise ValueError(f"router tokenizer {path!r} is not a local folder or file (and huggingface_hub is "
                         "not installed to resolve it as a hub id)") from None
    try:
        return snapshot_download(path, allow_patterns=["tokenizer*", "chat_template*", "special_tokens_map.json"])
    except Exception as exc:  # offline, unknown id, …
        raise ValueError(f"cannot resolve router tokenizer {path!r}: {exc}") from None


# Segment-wise encoding is checked against whole-text encoding on the first prompts, then on a
# sample; any difference turns it off for good.
_VERIFY_FIRST = 16
_VERIFY_EVERY = 64


class PromptTokenizer:
    """Whole prompts are cached by content; chat prompts are also encoded piece by piece between
    special tokens, with each piece cached, so a shared system prompt or an earlier turn is not
    re-tokenized when a conversation grows (every turn is a new prompt)."""

    def __init__(self, tokenizer: SimTokenizer, cache_size: int = 8192, segment_cache_size: int = 65536) -> None:
        self.tokenizer = tokenizer
        self.cache_size = cache_size
        self._cache: OrderedDict[bytes, list[int]] = OrderedDict()
        self.hits = 0
        self.misses = 0
        separators = tokenizer.segment_separators()
        self._splitter = re.compile("(" + "|".join(re.escape(t) for t in sorted(separators, key=len, reverse=True))
                                    + ")") if separators else None
        self._segments: OrderedDict[bytes, list[int]] = OrderedDict()
        self.segment_cache_size = segment_cache_size
        self.segment_hits = 0
        self._chat_prompts = 0

    @classmethod
    def from_path(cls, path: str | None) -> "PromptTokenizer":
        """``None``: the built-in tokenizer (matches simulated engines serving a model *name*)."""
        return cls(load_tokenizer(resolve_tokenizer_path(path)) if path else load_tokenizer(""))

    def _key_and_work(self, route: str, parsed: Any) -> tuple[bytes | None, Any]:
        if route == "/v1/chat/completions":
            raw = _encode_json(parsed.messages)
            return xxhash.xxh3_128_digest(raw) + b"c", ("chat", parsed.messages)
        prompt = parsed.prompt
        if isinstance(prompt, list):
            if prompt and all(isinstance(t, int) for t in prompt):
                return None, ("ids", prompt)
            if len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            else:
                return None, ("none", None)  # batched prompts: not routed by prefix
        return xxhash.xxh3_128_digest(prompt.encode("utf-8", "surrogatepass")) + b"p", ("text", prompt)

    def _encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        tok = self.tokenizer
        text = tok.render_chat(normalize_messages(messages))
        if self._splitter is None:
            return tok.encode(text, add_special_tokens=False)
        ids: list[int] = []
        segments = self._segments
        for piece in self._splitter.split(text):
            if not piece:
                continue
            key = xxhash.xxh3_128_digest(piece.encode("utf-8", "surrogatepass"))
            cached = segments.get(key)
            if cached is None:
                cached = segments[key] = tok.encode(piece, add_special_tokens=False)
                if len(segments) > self.segment_cache_size:
                    segments.popitem(last=False)
            else:
                segments.move_to_end(key)
                self.segment_hits += 1
            ids.extend(cached)
        self._chat_prompts += 1
        if self._chat_prompts <= _VERIFY_FIRST or self._chat_prompts % _VERIFY_EVERY == 0:
            whole = tok.encode(text, add_special_tokens=False)
            if whole != ids:
                log.info("piecewise tokenization differs from whole-prompt tokenization for this tokenizer; "
                         "encoding whole prompts from now on")
                self._splitter = None
                return whole
        return ids

    def _compute(self, work: Any) -> list[int]:
        kind, value = work
        if kind == "chat":
            messages = [{"role": m.role, "content": m.content if m.content is not None else ""} for m in value]
            return self._encode_chat(messages)
        if kind == "text":
            return self.tokenizer.encode(value, add_special_tokens=True)
        if kind == "ids":
            return list(value)
        return []

    async def tokens(self, route: str, parsed: Any) -> list[int]:
        """Token ids of the request's prompt; [] when it cannot be tokenized (routing then
        degrades to load only, never an error)."""
        key, work = self._key_and_work(route, parsed)
        if key is not None:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return cached
        self.misses += 1
        try:
            size = len(work[1]) if work[0] == "text" else 0  # chat pieces are mostly cached: inline
            if size > _THREAD_THRESHOLD_CHARS:
                ids = await asyncio.to_thread(self._compute, work)
            else:
                ids = self._compute(work)
        except Exception as exc:  # template errors, odd content: route by load, let the engine answer
            log.debug("router tokenization failed: %s", exc)
            ids = []
        if key is not None:
            self._cache[key] = ids
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return ids
