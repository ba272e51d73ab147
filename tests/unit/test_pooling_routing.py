"""Pooling and utility endpoints: which task a route needs, which workers serve it, how launchers
read a worker's tasks, the least-loaded pick, and the errors for a model no worker serves a task of."""
from __future__ import annotations

import argparse

import pytest
from aiohttp import web

from infera.api.errors import ApiError
from infera.api.pooling import (ROUTE_TASKS, WorkersForTask, record_tasks, request_model, serves, task_unserved,
                                tasks_from_flags, tasks_from_paths, worker_tasks)
from infera.discovery.fleet import Fleet
from infera.discovery.record import WorkerRecord
from infera.engine.sim import pooling as sim_pooling
from infera.engine.vllm.tasks import probe_tasks
from infera.router.pooling import LeastLoadedPolicy, TaskRouter
from infera.router.policy import RoutedRequest


@pytest.mark.parametrize("route,task", [
    ("/v1/embeddings", "embed"), ("/v1/rerank", "score"), ("/rerank", "score"), ("/v2/rerank", "score"),
    ("/score", "score"), ("/v1/score", "score"), ("/classify", "classify"), ("/tokenize", None), ("/detokenize", None),
])
def test_route_tasks(route, task):
    assert ROUTE_TASKS[route] == task


@pytest.mark.parametrize("tasks,task,expected", [
    ([], "generate", True),          # an older launcher's record: generative
    ([], "embed", False),
    ([], None, True),                # tokenize: any worker
    (["embed", "score"], "embed", True),
    (["embed", "score"], "score", True),
    (["embed", "score"], "classify", False),
    (["embed", "score"], "generate", False),  # a pooling worker lists no generate
    (["embed", "score"], None, True),
    (["classify"], "score", False),
    (["classify", "generate"], "generate", True),
])
def test_serves(tasks, task, expected):
    assert serves(tasks, task) is expected


@pytest.mark.parametrize("paths,expected", [
    (["/v1/chat/completions", "/v1/completions", "/tokenize"], []),
    (["/v1/embeddings", "/score", "/v1/rerank", "/tokenize"], ["embed", "score"]),
    (["/classify", "/pooling"], ["classify"]),
    (["/classify", "/score", "/rerank"], ["classify", "score"]),  # a single-label classifier scores too
    (["/v1/embeddings", "/v1/completions"], ["embed", "generate"]),
    ([], []),
])
def test_tasks_from_paths(paths, expected):
    assert tasks_from_paths(paths) == expected


@pytest.mark.parametrize("runner,convert,expected", [
    ("pooling", "embed", ["embed", "score"]),
    (None, "embed", ["embed", "score"]),
    ("pooling", "classify", ["classify"]),
    ("generate", None, []),
    (None, None, None),          # auto: the model's architecture decides
    ("pooling", None, None),
    ("pooling", "auto", None),
    (None, "none", []),
])
def test_tasks_from_flags(runner, convert, expected):
    assert tasks_from_flags(runner, convert) == expected


def test_record_tasks_and_worker_tasks():
    assert record_tasks(["generate"]) == []
    assert record_tasks(["score", "embed", "embed"]) == ["embed", "score"]
    assert worker_tasks([]) == {"generate"}


@pytest.mark.parametrize("body,status,code", [
    (b"", 400, "invalid_json"),
    (b"{not json", 400, "invalid_json"),
    (b"[1, 2]", 400, "invalid_request"),
    (b'{"input": "x"}', 400, "invalid_request"),
    (b'{"model": "", "input": "x"}', 400, "invalid_request"),
    (b'{"model": 3}', 400, "invalid_request"),
    (b'{"model": "a", "model": "b"}', 400, "duplicate_key"),
    (b"[" * 100 + b"]" * 100, 400, "json_too_complex"),
])
def test_request_model_errors(body, status, code):
    with pytest.raises(ApiError) as err:
        request_model(body)
    assert (err.value.status, err.value.code) == (status, code)


def test_request_model_ignores_the_rest():
    assert request_model(b'{"model": "e5", "input": ["a", "b"], "encoding_format": "base64"}') == "e5"


def _rec(worker_id: str, model: str, tasks=(), status="active", mode="mixed") -> WorkerRecord:
    return WorkerRecord(worker_id=worker_id, url=f"http://{worker_id}", model_name=model, tasks=list(tasks),
                        status=status, disagg_mode=mode)


def _req(model: str) -> RoutedRequest:
    return RoutedRequest(route="/v1/embeddings", body=b"{}", parsed=None, model=model, stream=False, request_id="r")


def test_least_loaded_picks_the_idlest_and_takes_ties_in_turn():
    policy = LeastLoadedPolicy()
    a, b, c = _rec("a", "m"), _rec("b", "m"), _rec("c", "m")
    req = _req("m")
    picks = [policy.pick([a, b, c], req).worker_id for _ in range(6)]
    assert sorted(picks) == ["a", "a", "b", "b", "c", "c"]  # idle: each in turn
    policy.on_started(a, req)
    policy.on_started(a, req)
    policy.on_started(b, req)
    assert {policy.pick([a, b, c], req).worker_id for _ in range(4)} == {"c"}
    policy.on_started(c, req)
    assert {policy.pick([a, b, c], req).worker_id for _ in range(4)} <= {"b", "c"}
    policy.on_finished(a, req)
    policy.on_finished(a, req)
    assert policy.load("a") == 0 and {policy.pick([a, b, c], req).worker_id for _ in range(3)} == {"a"}
    policy.forget("b")
    assert policy.load("b") == 0
    policy.on_finished(b, req)  # a request that ends after its worker was forgotten: no negative load
    assert policy.load("b") == 0


class _NoTransport:
    def forget(self, record) -> None:  # pragma: no cover - never reached by candidates()
        pass


def _router(task, *records) -> TaskRouter:
    fleet = Fleet()
    for r in records:
        fleet.upsert(r)
    return TaskRouter(task, fleet, LeastLoadedPolicy(), _NoTransport(), metrics=None)  # type: ignore[arg-type]


GEN = _rec("g1", "llm")
EMB1 = _rec("e1", "emb", ["embed", "score"])
EMB2 = _rec("e2", "emb", ["embed", "score"])
CLS = _rec("c1", "cls", ["classify"])
EMB_DRAINING = _rec("e3", "mix", ["embed", "score"], status="draining")
MIX_GEN = _rec("g2", "mix")


@pytest.mark.parametrize("task,model,records,expected", [
    ("embed", "emb", (GEN, EMB1, EMB2, CLS), {"e1", "e2"}),
    ("score", "emb", (GEN, EMB1, EMB2, CLS), {"e1", "e2"}),
    ("classify", "cls", (GEN, EMB1, CLS), {"c1"}),
    (None, "llm", (GEN, EMB1), {"g1"}),      # tokenize: generative workers too
    (None, "emb", (GEN, EMB1, EMB2), {"e1", "e2"}),  # and pooling ones
    ("embed", "nope", (GEN, EMB1), (404, "model_not_found")),
    ("embed", "llm", (GEN, EMB1), (400, "task_not_supported")),
    ("classify", "emb", (GEN, EMB1), (400, "task_not_supported")),
    ("score", "cls", (CLS,), (400, "task_not_supported")),  # a two-label classifier does not score
    ("embed", "mix", (MIX_GEN, EMB_DRAINING), (503, "no_active_worker")),  # the embedder may come back
    ("embed", "emb", (), (503, "no_active_worker")),
    (None, "nope", (GEN,), (404, "model_not_found")),
])
def test_task_router_candidates(task, model, records, expected):
    router = _router(task, *records)
    if isinstance(expected, set):
        assert {w.worker_id for w in router.candidates(model)} == expected
        return
    with pytest.raises(ApiError) as err:
        router.candidates(model)
    assert (err.value.status, err.value.code) == expected
    if expected[1] == "task_not_supported":
        assert repr(task) in err.value.message and repr(model) in err.value.message


def test_task_router_follows_fleet_changes():
    router = _router("embed", GEN, EMB1)
    assert [w.worker_id for w in router.candidates("emb")] == ["e1"]
    router.fleet.upsert(EMB2)
    assert [w.worker_id for w in router.candidates("emb")] == ["e1", "e2"]
    router.fleet.remove("e1")
    assert [w.worker_id for w in router.candidates("emb")] == ["e2"]


@pytest.mark.parametrize("runner,convert,task", [
    ("auto", "auto", None), ("generate", "auto", None), ("pooling", "auto", "embed"), ("pooling", "embed", "embed"),
    ("auto", "embed", "embed"), ("auto", "classify", "classify"), ("pooling", "classify", "classify"),
])
def test_sim_pooling_task(runner, convert, task):
    assert sim_pooling.pooling_task(argparse.Namespace(runner=runner, convert=convert)) == task


@pytest.mark.parametrize("runner,convert", [("generate", "embed"), ("pooling", "none")])
def test_sim_pooling_flags_that_contradict(runner, convert):
    with pytest.raises(ValueError):
        sim_pooling.pooling_task(argparse.Namespace(runner=runner, convert=convert))


def test_sim_embeddings_are_deterministic_and_normalised():
    a = sim_pooling.embed_tokens(0, [5, 6, 7])
    assert a == sim_pooling.embed_tokens(0, [5, 6, 7])
    assert a != sim_pooling.embed_tokens(1, [5, 6, 7])
    assert abs(sum(v * v for v in a) - 1.0) < 1e-9 and len(a) == sim_pooling.EMBED_DIM
    near, far = sim_pooling.embed_tokens(0, [5, 6, 8]), sim_pooling.embed_tokens(0, [9, 10, 11])
    assert sim_pooling.cosine(a, near) > sim_pooling.cosine(a, far)
    probs = sim_pooling.classify_probs(0, a)
    assert len(probs) == sim_pooling.NUM_LABELS and abs(sum(probs) - 1.0) < 1e-9


async def _serve(routes: dict[str, web.Response]):
    app = web.Application()
    for path, response in routes.items():
        async def handler(request: web.Request, r=response) -> web.Response:
            return r

        app.router.add_get(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


@pytest.mark.parametrize("served,argv,expected", [
    ({"/openapi.json": web.json_response({"paths": {"/v1/embeddings": {}, "/score": {}, "/tokenize": {}}})},
     ["--model", "m"], ["embed", "score"]),
    ({"/openapi.json": web.json_response({"paths": {"/v1/completions": {}}})},
     ["--model", "m", "--convert", "embed"], []),  # the engine's own routes win over the flags
    ({}, ["--model", "m", "--runner", "pooling", "--convert", "classify"], ["classify"]),  # docs off: the flags
    ({}, ["--model", "m", "--runner", "pooling"], []),  # nothing to go by: generative, with a warning
    ({"/openapi.json": web.json_response(["not", "a", "doc"])}, ["--model", "m", "--convert=embed"], ["embed", "score"]),
])
async def test_probe_tasks(served, argv, expected):
    import aiohttp

    runner, url = await _serve(served)
    try:
        async with aiohttp.ClientSession() as session:
            assert await probe_tasks(session, url, argv) == expected
    finally:
        await runner.cleanup()


def test_workers_for_task_filters_once_per_fleet_tuple():
    embedders = WorkersForTask("embed", cap=2)
    fleet_tuple = (GEN, EMB1, EMB2)
    first = embedders("emb", fleet_tuple)
    assert [w.worker_id for w in first] == ["e1", "e2"]
    assert embedders("emb", fleet_tuple) is first  # the same tuple: the cached answer
    assert embedders("emb", (GEN, EMB2)) == (EMB2,)  # a new tuple (the fleet changed): filtered again
    assert embedders("a", ()) == () and embedders("b", (EMB1,)) == (EMB1,)  # past the cap: starts over, still right
    assert WorkersForTask(None)("m", fleet_tuple) is fleet_tuple  # no task: every worker
    assert WorkersForTask("generate")("m", fleet_tuple) == (GEN,)


def test_task_unserved_for_generation_names_the_task():
    fleet = Fleet()
    fleet.upsert(EMB1)
    err = task_unserved(fleet, "emb", "generate", (EMB1,))
    assert (err.status, err.code) == (400, "task_not_supported")
    assert "'generate'" in err.message and "embed, score" in err.message
