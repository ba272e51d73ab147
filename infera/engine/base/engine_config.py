"""Engine flag values the launchers read back: JSON configs and HTTP readiness."""
from __future__ import annotations

import json
from typing import Any

import aiohttp


def parse_json_flag(raw: str | None, flag: str, prog: str) -> dict[str, Any] | None:
    """A JSON-object flag value (e.g. ``--kv-transfer-config``); a clear exit on bad input."""
    if raw is None:
        return None
    try:
        cfg = json.loads(raw)
    except ValueError as exc:
        raise SystemExit(f"{prog}: {flag} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise SystemExit(f"{prog}: {flag} must be a JSON object")
    return cfg


async def http_ready(session: aiohttp.ClientSession, base_url: str, *, require_model: bool = False) -> bool:
    """``/health`` answers 200 and ``/v1/models`` answers (listing a model when ``require_model``)."""
    timeout = aiohttp.ClientTimeout(total=5)
    async with session.get(base_url + "/health", timeout=timeout) as resp:
        if resp.status != 200:
            return False
    async with session.get(base_url + "/v1/models", timeout=timeout) as resp:
        if resp.status != 200:
            return False
        return bool((await resp.json()).get("data")) if require_model else True
