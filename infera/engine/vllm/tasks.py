"""What a vLLM (or sim) worker serves besides generation, for its record's ``tasks``.

Read first from the engine itself: vLLM registers a pooling route only for the tasks its model
supports (``--runner pooling``, ``--convert embed|classify``, or what it infers from the model's
architecture), so the paths of its ``/openapi.json`` say exactly what it serves. When that cannot
be read (``--disable-fastapi-docs``), from the flags; when the flags leave it to the model too, the
worker is recorded as generative, with a warning.
"""

from __future__ import annotations

import logging

import aiohttp

from infera.api.pooling import tasks_from_flags, tasks_from_paths
from infera.engine.base.argv import flag_value

log = logging.getLogger("infera.launcher.tasks")

OPENAPI_TIMEOUT_S = 10.0


def flag_tasks(engine_argv: list[str]) -> list[str] | None:
    return tasks_from_flags(flag_value(engine_argv, "--runner"), flag_value(engine_argv, "--convert"))


async def probe_tasks(session: aiohttp.ClientSession, base_url: str, engine_argv: list[str]) -> list[str]:
    """The record's ``tasks``: from the engine's /openapi.json, else its flags (empty: generative)."""
    try:
        async with session.get(
            base_url + "/openapi.json", timeout=aiohttp.ClientTimeout(total=OPENAPI_TIMEOUT_S)
        ) as resp:
            doc = await resp.json(content_type=None) if resp.status == 200 else None
            paths = doc.get("paths") if isinstance(doc, dict) else None
            if isinstance(paths, dict):
                return tasks_from_paths(paths)
            why = f"it answered {resp.status} without paths"
    except Exception as exc:  # best effort: any failure to read the routes falls back to the flags
        why = f"{type(exc).__name__}: {exc}"
    tasks = flag_tasks(engine_argv)
    if tasks is None:
        log.warning(
            "cannot read the engine's routes from /openapi.json (%s) and --runner/--convert leave its tasks to "
            "the model: recorded as a generative worker; give --convert embed|classify to route pooling "
            "requests to it",
            why,
        )
        return []
    return tasks
