"""Engine profiler fan-out: ``POST /v1/admin/profile/start`` and ``/stop`` (``--enable-profiling``).

One call starts (or stops) the profiler of every selected worker's engine, concurrently, and
reports each worker's outcome in one JSON object. Workers are selected by ``worker_id``, ``model``
and ``role`` (mixed, prefill, decode), read from the query string (which wins) or the JSON body;
only ACTIVE workers are. The body's other keys go to each engine as its profiler's options
(vLLM: ``profile_prefix``, ``delay_iterations``, ``max_iterations``; SGLang: ``output_dir``,
``num_steps``, ``activities``...), and no body at all when there are none.

The engines' endpoints: ``POST /start_profile`` and ``POST /stop_profile`` on vLLM (only when it
was started with a profiler configured, else 404), SGLang and the sim. Workers that share one
engine (the DP ranks behind one URL) are called once.

These are admin endpoints (``/v1/admin/``): the admin-token check of ``infera.server.app`` runs
first. Profiling off: 404 in the OpenAI error shape.
"""
from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass
from typing import Any, Iterable

import aiohttp
import msgspec
from aiohttp import web

from infera.api.errors import ApiError, error_body
from infera.api.requests import json_structure_problem
from infera.discovery.fleet import Fleet
from infera.discovery.record import WorkerRecord

ACTIONS = {"start": "/start_profile", "stop": "/stop_profile"}
ROLES = ("mixed", "prefill", "decode")
SELECTORS = ("worker_id", "model", "role")
REQUEST_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 10.0
DETAIL_CHARS = 500

_encode = msgspec.json.Encoder().encode


@dataclass(slots=True)
class WorkerResult:
    worker_id: str
    url: str
    engine: str
    status_code: int | None  # None: no HTTP answer (unreachable, timed out)
    ok: bool
    detail: str  # the engine's answer (or why there was none), at most DETAIL_CHARS
    error: str | None = None  # set when not ok


@dataclass(slots=True)
class Selection:
    worker_ids: tuple[str, ...] = ()
    model: str | None = None
    role: str | None = None
    options: dict[str, Any] | None = None  # what each engine's profiler is given


def _selector_values(name: str, value: Any) -> tuple[str, ...]:
    values = value if isinstance(value, list) else [value]
    if not values or not all(isinstance(v, str) and v.strip() for v in values):
        kinds = "a non-empty string" + (" or a list of them" if name == "worker_id" else "")
        raise ApiError(400, f"{name} must be {kinds}", "invalid_request", param=name)
    if name != "worker_id" and len(values) > 1:
        raise ApiError(400, f"{name} must be one string", "invalid_request", param=name)
    return tuple(v.strip() for v in values)


def parse_selection(query: Any, raw_body: bytes) -> Selection:
    """Selectors from ``query`` (a multidict, as aiohttp's; wins) and the JSON object ``raw_body``
    (may be empty); the body's other keys are the profiler options. Any problem is a 400."""
    body: dict[str, Any] = {}
    if raw_body.strip():
        problem = json_structure_problem(raw_body)
        if problem is not None:
            raise ApiError(400, problem, "json_too_complex")
        try:
            decoded = msgspec.json.decode(raw_body)
        except msgspec.DecodeError as exc:
            raise ApiError(400, f"malformed JSON body: {exc}", "invalid_json") from None
        if not isinstance(decoded, dict):
            raise ApiError(400, "the body must be a JSON object (selectors and profiler options)", "invalid_request")
        body = decoded
    picked: dict[str, tuple[str, ...]] = {}
    for name in SELECTORS:
        if name in query:
            raw = query.getall(name)
            if name == "worker_id":  # several: ?worker_id=a&worker_id=b or ?worker_id=a,b
                raw = [part for value in raw for part in value.split(",")]
            picked[name] = _selector_values(name, raw)
        elif body.get(name) is not None:
            picked[name] = _selector_values(name, body[name])
    role = picked.get("role", (None,))[0]
    if role is not None and role not in ROLES:
        raise ApiError(400, f"role must be one of {', '.join(ROLES)}, not {role!r}", "invalid_role", param="role")
    options = {k: v for k, v in body.items() if k not in SELECTORS}
    return Selection(worker_ids=picked.get("worker_id", ()), model=picked.get("model", (None,))[0], role=role,
                     options=options or None)


def select_workers(fleet: Fleet, selection: Selection) -> list[WorkerRecord]:
    """The ACTIVE workers the selection names (all of them when it names none), by worker id."""
    workers = fleet.active(selection.model, selection.role)
    if selection.worker_ids:
        wanted = set(selection.worker_ids)
        workers = tuple(w for w in workers if w.worker_id in wanted)
    return list(workers)


def _no_match(selection: Selection) -> ApiError:
    named = [f"{k}={v}" for k, v in (("worker_id", ",".join(selection.worker_ids)), ("model", selection.model),
                                     ("role", selection.role)) if v]
    return ApiError(404, "no active worker matches " + (" ".join(named) if named else "(the fleet is empty)"),
                    "worker_not_found")


class ProfilerFanout:
    """Sends one profiler action to many engines at once."""

    def __init__(self, *, timeout_s: float = REQUEST_TIMEOUT_S, connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, connect=connect_timeout_s)

    async def run(self, action: str, workers: Iterable[WorkerRecord],
                  options: dict[str, Any] | None) -> list[WorkerResult]:
        route = ACTIONS[action]
        payload = _encode(options) if options else None
        workers = list(workers)
        # An admin call, rare: a session of its own, closed with the call.
        async with aiohttp.ClientSession(timeout=self.timeout) as session:
            calls: dict[str, asyncio.Task] = {}
            for w in workers:  # one call per engine: DP ranks behind one URL share it
                url = w.url.rstrip("/")
                if url not in calls:
                    calls[url] = asyncio.ensure_future(self._call(session, url + route, payload))
            outcomes = dict(zip(calls, await asyncio.gather(*calls.values())))
        results = []
        for w in workers:
            status, detail, error = outcomes[w.url.rstrip("/")]
            results.append(WorkerResult(w.worker_id, w.url, w.engine, status, error is None, detail, error))
        return results

    async def _call(self, session: aiohttp.ClientSession, url: str,
                    payload: bytes | None) -> tuple[int | None, str, str | None]:
        headers = {"Content-Type": "application/json"} if payload is not None else None
        try:
            async with session.post(url, data=payload, headers=headers) as resp:
                text = (await resp.text(errors="replace")).strip()[:DETAIL_CHARS]
                if 200 <= resp.status < 300:
                    return resp.status, text, None
                return resp.status, text, f"engine answered HTTP {resp.status}" + (": " + text if text else "")
        except asyncio.TimeoutError:
            reason = f"no answer within {self.timeout.total:g} s"
            return None, reason, reason
        except aiohttp.ClientError as exc:
            reason = f"unreachable: {exc}"[:DETAIL_CHARS]
            return None, reason, reason


async def handle(request: web.Request, fleet: Fleet, action: str, *, enabled: bool,
                 fanout: ProfilerFanout | None = None) -> web.Response:
    """The whole endpoint: 404 when off, 400 on a bad selector, 404 when nothing matches; else
    the report, 200 when every engine said yes, else 502 with an OpenAI ``error`` beside it."""
    if not enabled:
        raise ApiError(404, "profiling is disabled: start the server with --enable-profiling (or "
                       "INFERA_ENABLE_PROFILING=1)", "profiling_disabled")
    selection = parse_selection(request.query, await request.read())
    workers = select_workers(fleet, selection)
    if not workers:
        raise _no_match(selection)
    results = await (fanout or ProfilerFanout()).run(action, workers, selection.options)
    succeeded = sum(r.ok for r in results)
    report: dict[str, Any] = {"action": action, "requested": len(results), "succeeded": succeeded,
                              "results": [asdict(r) for r in results]}
    status = 200
    if succeeded < len(results):
        status = 502
        failed = [f"{r.worker_id} ({r.error})" for r in results if not r.ok]
        report.update(error_body(f"{len(failed)} of {len(results)} workers failed to {action} profiling: "
                                 + "; ".join(failed), status, "profile_failed"))
    return web.Response(status=status, body=_encode(report), content_type="application/json")
