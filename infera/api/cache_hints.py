"""Cache hints a request carries: how long its prefix is worth keeping, and its images.

Two encodings, both read from one request (an OpenAI body, parsed or a plain dict, or an
Anthropic body as a dict); the retention is the longest either asks for (none < short < long):

* OpenAI: ``prompt_cache_retention`` ∈ {24h, 1h, long} → long; {5m, short} → short;
  {none, off, disabled} → none (explicit); an unknown value is ignored; a ``prompt_cache_key``
  alone → short. The session id is ``prompt_cache_key``, else ``session_id`` (stripped).
* Anthropic ``cache_control`` on any block of ``system[]``, ``tools[]`` or
  ``messages[].content[]`` (OpenAI content parts too, as some clients send them):
  ``{"type": "ephemeral"}`` with a ttl of {1h, 1hr, 60m, 3600s, long} → long, of {5m, 5min, 300s,
  short} or none → short; another type, or a ttl we do not know, is ignored. ``thinking`` and
  ``redacted_thinking`` blocks cannot be cached, so their markers count for nothing.

A multimodal request's text prefix says little about its cache (the images dominate), so it is
routed by image affinity instead: each image is keyed by XXH3-64 of its URL or data, in document
order (``system`` blocks, then messages, then a top-level ``images`` list).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import xxhash

from infera.api.requests import ChatCompletionRequest, CompletionRequest

# Parsed bodies: a field the struct does not declare (session_id, system, tools, audio) was dropped
# by the decoder, so only its declared hint fields and its messages' content can carry a hint.
_PLAIN_STRUCTS = frozenset({ChatCompletionRequest, CompletionRequest})

NONE, SHORT, LONG = 0, 1, 2
RETENTION_NAMES = {NONE: "none", SHORT: "short", LONG: "long"}
RETENTION_BY_NAME = {name: value for value, name in RETENTION_NAMES.items()}
_RETENTION = {"24h": LONG, "1h": LONG, "long": LONG, "5m": SHORT, "short": SHORT,
              "none": NONE, "off": NONE, "disabled": NONE}
_LONG_TTLS = frozenset({"1h", "1hr", "60m", "3600s", "long"})
_SHORT_TTLS = frozenset({"5m", "5min", "300s", "short"})
_UNCACHEABLE_BLOCKS = frozenset({"thinking", "redacted_thinking"})
_MEDIA_TYPES = {"image", "image_url", "input_audio", "document", "file", "video", "audio", "video_url", "audio_url"}


@dataclass(slots=True)
class CacheHints:
    retention: int = NONE
    explicit: bool = False  # the client said something about caching
    multimodal: bool = False
    image_keys: list[int] = field(default_factory=list)
    session_id: str | None = None


def _field(request: Any, name: str) -> Any:
    """A top-level field of a parsed request struct or of a plain dict body."""
    if isinstance(request, dict):
        return request.get(name)
    return getattr(request, name, None)


def _media_ref(part: dict[str, Any]) -> str | None:
    for name in ("image_url", "video_url", "audio_url"):
        v = part.get(name)
        if isinstance(v, str):
            return v
        if isinstance(v, dict) and isinstance(v.get("url"), str):
            return v["url"]
    audio = part.get("input_audio")
    if isinstance(audio, dict) and isinstance(audio.get("data"), str):
        return audio["data"]
    source = part.get("source")
    if isinstance(source, dict):
        for k in ("url", "data"):
            if isinstance(source.get(k), str):
                return source[k]
    for k in ("url", "data"):
        if isinstance(part.get(k), str):
            return part[k]
    return None


def _image_key(ref: str) -> int:
    return xxhash.xxh3_64_intdigest(ref.strip().encode("utf-8", "replace"))


def cache_control_retention(block: Any) -> int | None:
    """The retention one block's ``cache_control`` asks for; None when it asks for nothing."""
    if not isinstance(block, dict):
        return None
    cc = block.get("cache_control")
    if not isinstance(cc, dict) or cc.get("type") != "ephemeral" or block.get("type") in _UNCACHEABLE_BLOCKS:
        return None
    ttl = cc.get("ttl")
    if ttl is None:
        return SHORT
    ttl = ttl.strip().lower() if isinstance(ttl, str) else None
    if ttl in _LONG_TTLS:
        return LONG
    if ttl in _SHORT_TTLS:
        return SHORT
    return None


def _stripped(value: Any) -> str | None:
    if isinstance(value, str):
        value = value.strip()
        return value or None
    return None


class _Scan:
    """One pass over a request's blocks: cache markers and media, in document order."""

    __slots__ = ("hints", "marked")

    def __init__(self, hints: CacheHints) -> None:
        self.hints = hints
        self.marked: int | None = None  # the longest cache_control retention seen

    def block(self, block: Any, media: bool = True) -> None:
        if not isinstance(block, dict):
            return
        if "cache_control" in block:
            asked = cache_control_retention(block)
            if asked is not None and (self.marked is None or asked > self.marked):
                self.marked = asked
        if media and block.get("type") in _MEDIA_TYPES:
            self.hints.multimodal = True
            ref = _media_ref(block)
            if ref:
                self.hints.image_keys.append(_image_key(ref))

    def blocks(self, blocks: Any, media: bool = True) -> None:
        if isinstance(blocks, list):
            for block in blocks:
                self.block(block, media)


#: What a request without any hint gets (shared: never modified).
NO_HINTS = CacheHints()


def parse_cache_hints(request: Any) -> CacheHints:
    """The hints of a parsed request (``infera.api.requests``) or a plain dict body (OpenAI or
    Anthropic). Never raises: odd shapes simply give no hint. The result may be the shared
    ``NO_HINTS``: do not modify it."""
    if type(request) in _PLAIN_STRUCTS and request.prompt_cache_key is None \
            and request.prompt_cache_retention is None and request.images is None:
        # The common case, on every routed request: a parsed body with no hint field, whose
        # messages (if any) are plain strings, so there are no blocks to scan either.
        messages = getattr(request, "messages", None)
        if messages is None:
            return NO_HINTS
        for m in messages:  # (a loop, not any() over a generator: this runs on every request)
            if type(m.content) is list:
                break
        else:
            return NO_HINTS
    hints = CacheHints()
    key = _stripped(_field(request, "prompt_cache_key"))
    hints.session_id = key or _stripped(_field(request, "session_id"))
    retention = _field(request, "prompt_cache_retention")
    retention = retention.strip().lower() if isinstance(retention, str) else None
    if retention in _RETENTION:
        hints.retention, hints.explicit = _RETENTION[retention], True
    elif key:
        hints.retention, hints.explicit = SHORT, True
    scan = _Scan(hints)
    scan.blocks(_field(request, "system"))
    messages = _field(request, "messages")
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else getattr(message, "content", None)
        scan.blocks(content)
    scan.blocks(_field(request, "tools"), media=False)
    images = _field(request, "images")
    if isinstance(images, list):
        for image in images:
            hints.multimodal = True
            if isinstance(image, str):
                hints.image_keys.append(_image_key(image))
    if _field(request, "audio"):
        hints.multimodal = True
    if scan.marked is not None:
        hints.explicit = True
        hints.retention = max(hints.retention, scan.marked)
    return hints
