"""Whether an engine serves Anthropic's Messages API itself, asked of the engine once it is ready
(the record's ``anthropic_messages``): the router then passes ``/v1/messages`` through to it.

Probed, not assumed from a version: ``POST /v1/messages/count_tokens`` with a one-word prompt, the
cheapest request vLLM's Messages router answers (it only renders and tokenizes), served by the same
handler as ``/v1/messages``. A 200 with an integer ``input_tokens`` is a yes; a 404 (an engine
without the route), vLLM's "does not support Messages API" error (a pooling model), a timeout or
anything else is a no, so a worker is never sent a body its engine cannot read.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

log = logging.getLogger(__name__)

COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
PROBE_TIMEOUT_S = 10.0


async def serves_anthropic_messages(
    session: aiohttp.ClientSession, base_url: str, model: str, timeout: float = PROBE_TIMEOUT_S
) -> bool:
    body = {"model": model, "messages": [{"role": "user", "content": "ping"}]}
    try:
        async with session.post(
            base_url + COUNT_TOKENS_PATH, json=body, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            if resp.status != 200:
                log.info(
                    "the engine does not serve Anthropic's Messages API (%s answered %d): /v1/messages "
                    "is translated to chat for it",
                    COUNT_TOKENS_PATH,
                    resp.status,
                )
                return False
            answer = await resp.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        log.info(
            "the engine did not answer %s (%s): /v1/messages is translated to chat for it",
            COUNT_TOKENS_PATH,
            exc or type(exc).__name__,
        )
        return False
    tokens = answer.get("input_tokens") if isinstance(answer, dict) else None
    served = isinstance(tokens, int) and not isinstance(tokens, bool)
    log.info(
        "the engine serves Anthropic's Messages API: %s",
        "yes, /v1/messages is passed through to it" if served else "no (count_tokens answered without input_tokens)",
    )
    return served
