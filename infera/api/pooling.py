"""The pooling and utility endpoints (embeddings, rerank, score, classify, tokenize, detokenize):
which task each route needs, which workers serve a task (their record's ``tasks``), how a task is
read from the routes an engine serves or from vLLM's ``--runner``/``--convert`` flags, and the
door's light parse of such a request (its ``model``; the body itself goes to the engine verbatim).

Tasks are the endpoint families a worker serves: ``embed`` (/v1/embeddings), ``classify``
(/classify), ``score`` (/score and every rerank route: vLLM enables them for embedding models and
for single-label classifiers) and ``generate``. A record with no tasks is a generative worker (what
every launcher meant before records carried tasks). /tokenize and /detokenize need no task: every
vLLM worker serves them, generative or pooling.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec

from infera.api.errors import ApiError
from infera.api.requests import MAX_JSON_CONTAINERS, MAX_JSON_DEPTH, duplicate_key_problem, json_structure_problem

EMBED, CLASSIFY, SCORE, GENERATE = "embed", "classify", "score", "generate"
POOLING_TASKS = (EMBED, CLASSIFY, SCORE)

# route -> the task a worker must serve for it (None: any worker of the model)
ROUTE_TASKS: Mapping[str, str | None] = {
    "/v1/embeddings": EMBED,
    "/v1/rerank": SCORE,
    "/rerank": SCORE,
    "/v2/rerank": SCORE,
    "/score": SCORE,
    "/v1/score": SCORE,
    "/classify": CLASSIFY,
    "/tokenize": None,
    "/detokenize": None,
}
POOLING_ROUTES = frozenset(ROUTE_TASKS)

# The routes an engine serves (its /openapi.json paths) that say it serves a task.
_PATH_TASKS: Mapping[str, str] = {
    "/v1/embeddings": EMBED,
    "/classify": CLASSIFY,
    "/score": SCORE,
    "/v1/score": SCORE,
    "/rerank": SCORE,
    "/v1/rerank": SCORE,
    "/v2/rerank": SCORE,
    "/v1/chat/completions": GENERATE,
    "/v1/completions": GENERATE,
}


def worker_tasks(record_tasks: Iterable[str]) -> frozenset[str]:
    """What a worker serves: its record's tasks, or ``generate`` alone when it lists none."""
    tasks = frozenset(record_tasks)
    return tasks or frozenset({GENERATE})


def serves(record_tasks: Iterable[str], task: str | None) -> bool:
    """Whether a worker with these record tasks serves ``task`` (None: any worker does)."""
    return task is None or task in worker_tasks(record_tasks)


class WorkersForTask:
    """The workers of a fleet tuple (``Fleet.active``: a new tuple whenever the fleet changes) that
    serve ``task``, kept per model while that tuple is the same object: one filter per fleet change,
    not per request. Bounded: past ``cap`` models the cache starts over."""

    def __init__(self, task: str | None, cap: int = 1024) -> None:
        self.task = task
        self._cap = cap
        self._cache: dict[str, tuple[Sequence[Any], tuple[Any, ...]]] = {}

    def __call__(self, model: str, workers: Sequence[Any]) -> Sequence[Any]:
        if self.task is None:
            return workers
        cached = self._cache.get(model)
        if cached is not None and cached[0] is workers:
            return cached[1]
        serving = tuple(w for w in workers if serves(w.tasks, self.task))
        if len(self._cache) >= self._cap:
            self._cache.clear()
        self._cache[model] = (workers, serving)
        return serving


def task_unserved(fleet: Any, model: str, task: str | None, active: Sequence[Any]) -> ApiError:
    """The error for ``model`` whose active workers (``active``, not empty) serve no ``task``: a 503
    while a draining or unreachable worker of it does (it may come back), else a 400 naming the task
    and what the model's workers serve. ``fleet``: the ``Fleet`` (its ``all()`` records)."""
    if any(r.model_name == model and serves(r.tasks, task) for r in fleet.all()):
        return ApiError(
            503,
            f"no active worker of model {model!r} serves {task!r} right now; retry shortly",
            "no_active_worker",
            headers={"Retry-After": "1"},
        )
    offered = sorted(set().union(*(worker_tasks(w.tasks) for w in active)))
    hint = (
        "start a worker of it without --runner pooling"
        if task == GENERATE
        else f"start a worker of it with vLLM's --runner pooling --convert {task if task != SCORE else EMBED}"
    )
    return ApiError(
        400,
        f"model {model!r} is served by no worker for the {task!r} task (its workers serve: "
        f"{', '.join(offered)}); {hint}, or send another model",
        "task_not_supported",
        param="model",
    )


def record_tasks(served: Iterable[str]) -> list[str]:
    """The record's ``tasks`` for a worker serving ``served``: empty for generation alone (what an
    older launcher's record says), else every task, sorted (``generate`` included when it is one)."""
    tasks = set(served)
    if not tasks & set(POOLING_TASKS):
        return []
    return sorted(tasks)


def tasks_from_paths(paths: Iterable[str]) -> list[str]:
    """The record's tasks from the routes an engine serves (vLLM registers a pooling route only
    for the tasks its model supports, so its /openapi.json says exactly what it serves)."""
    return record_tasks(_PATH_TASKS[p] for p in paths if p in _PATH_TASKS)


def tasks_from_flags(runner: str | None, convert: str | None) -> list[str] | None:
    """The record's tasks from vLLM's ``--runner`` and ``--convert``; None when the flags leave it
    to the model's architecture (``--runner auto``/``pooling`` without ``--convert``).

    ``--convert embed`` serves embeddings and scores (a bi-encoder: cosine similarity);
    ``--convert classify`` serves classification (score too only for a single-label head, which
    the flags cannot tell: the engine's routes can)."""
    if convert == "embed":
        return [EMBED, SCORE]
    if convert == "classify":
        return [CLASSIFY]
    if runner == "generate" or (convert == "none" and runner != "pooling"):
        return []
    return None


class _ModelOnly(msgspec.Struct):
    model: str | None = None


_model_decoder = msgspec.json.Decoder(_ModelOnly)


def request_model(body: bytes, *, max_depth: int = MAX_JSON_DEPTH, max_containers: int = MAX_JSON_CONTAINERS) -> str:
    """The ``model`` of a pooling or utility request body (a 400 in the OpenAI shape when the body
    is no JSON object, too complex, has duplicate keys, or names no model); the rest is the engine's
    to validate, and its 4xx goes back to the client as it wrote it."""
    if not body:
        raise ApiError(400, "request body is empty; expected a JSON object", "invalid_json")
    problem = json_structure_problem(body, max_depth, max_containers)
    if problem is not None:
        raise ApiError(400, problem, "json_too_complex")
    try:
        parsed = _model_decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise ApiError(400, f"invalid request: {exc}", "invalid_request", param="model") from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"malformed JSON body: {exc}", "invalid_json") from None
    except RecursionError:
        raise ApiError(400, "JSON nested too deep", "json_too_complex") from None
    duplicate = duplicate_key_problem(body)
    if duplicate is not None:
        raise ApiError(400, duplicate[0], "duplicate_key", param=duplicate[1] or None)
    if not parsed.model:
        raise ApiError(400, "'model' is required", "invalid_request", param="model")
    return parsed.model
