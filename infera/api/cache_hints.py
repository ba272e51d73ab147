"""Cache hints a request carries: how long its prefix is worth keeping, and its images.

OpenAI ``prompt_cache_retention`` ∈ {24h, 1h, long} → long; {5m, short} → short;
{none, off, disabled} → none (explicit); a ``prompt_cache_key`` alone → short. A multimodal
request's text prefix says little about its cache (the images dominate), so it is routed by
image affinity instead: each image is keyed by XXH3-64 of its URL or data.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import xxhash

NONE, SHORT, LONG = 0, 1, 2
RETENTION_NAMES = {NONE: "none", SHORT: "short", LONG: "long"}
_RETENTION = {"24h": LONG, "1h": LONG, "long": LONG, "5m": SHORT, "short": SHORT,
              "none": NONE, "off": NONE, "disabled": NONE}
_MEDIA_TYPES = {"image", "image_url", "input_audio", "document", "file", "video", "audio", "video_url", "audio_url"}


@dataclass(slots=True)
class CacheHints:
    retention: int = NONE
    explicit: bool = False  # the client said something about caching
    multimodal: bool = False
    image_keys: list[int] = field(default_factory=list)


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


def parse_cache_hints(parsed: Any) -> CacheHints:
    """Never raises: odd shapes simply give no hint."""
    hints = CacheHints()
    retention = getattr(parsed, "prompt_cache_retention", None)
    if isinstance(retention, str) and retention.strip().lower() in _RETENTION:
        hints.retention = _RETENTION[retention.strip().lower()]
        hints.explicit = True
    elif getattr(parsed, "prompt_cache_key", None):
        hints.retention, hints.explicit = SHORT, True
    for message in getattr(parsed, "messages", None) or ():
        content = message.content
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") in _MEDIA_TYPES:
                    hints.multimodal = True
                    ref = _media_ref(part)
                    if ref:
                        hints.image_keys.append(xxhash.xxh3_64_intdigest(ref.strip().encode("utf-8", "replace")))
    for image in getattr(parsed, "images", None) or ():
        hints.multimodal = True
        if isinstance(image, str):
            hints.image_keys.append(xxhash.xxh3_64_intdigest(image.strip().encode("utf-8", "replace")))
    return hints
