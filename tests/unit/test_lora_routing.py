"""LoRA-aware routing: an adapter's requests go only to workers holding it, /v1/models lists each
adapter with its base, an adapter nobody holds is a 404, and the router's block hashes for an
adapter live in a space of their own (as vLLM folds the adapter into every block hash)."""
from __future__ import annotations

import pytest

from infera.api.errors import ApiError
from infera.discovery.fleet import Fleet
from infera.discovery.record import WorkerRecord
from infera.kv.events import Stored
from infera.kv.hashing import ROUTER_SEED, block_hashes, chain_root, salt_root
from infera.router.dispatch import MixedRouter
from infera.router.lora import LORA_BASE, LORA_NAME, adapter_holders, adapter_models, knows_adapter, mark_adapter
from infera.router.policy import RoutedRequest
from infera.router.round_robin import RoundRobinPolicy


def _rec(worker_id: str, model: str, adapters=(), status="active", tasks=()) -> WorkerRecord:
    return WorkerRecord(worker_id=worker_id, url=f"http://{worker_id}", model_name=model, status=status,
                        disagg_mode="mixed", lora_adapters=list(adapters), tasks=list(tasks))


def _req(model: str) -> RoutedRequest:
    return RoutedRequest(route="/v1/completions", body=b"{}", parsed=None, model=model, stream=False,
                         request_id="r")


class _NoTransport:
    def forget(self, record) -> None:  # pragma: no cover - never reached by candidates()
        pass


def _router(*records) -> MixedRouter:
    fleet = Fleet()
    for r in records:
        fleet.upsert(r)
    return MixedRouter(fleet, RoundRobinPolicy(), _NoTransport(), metrics=None)  # type: ignore[arg-type]


A = _rec("a", "base", ["sql", "chat"])
B = _rec("b", "base", ["sql"])
C = _rec("c", "base")
D = _rec("d", "other", ["poet"])
DRAIN = _rec("x", "base", ["legal"], status="draining")
EMB = _rec("e", "base", ["sql"], tasks=["embed"])  # a pooling worker: never a chat/completions candidate
SHADOW = _rec("s", "base", ["other"])  # an adapter named like a base model: the base model wins


@pytest.mark.parametrize("model,records,expected", [
    ("sql", (A, B, C, D), {"a", "b"}),
    ("chat", (A, B, C, D), {"a"}),
    ("poet", (A, B, C, D), {"d"}),
    ("base", (A, B, C, D), {"a", "b", "c"}),        # the base model: every worker of it
    ("other", (A, D, SHADOW), {"d"}),                # a base model's name is never read as an adapter
    ("nope", (A, B, C), (404, "model_not_found")),
    ("legal", (A, DRAIN), (503, "no_active_worker")),  # its only holder drains: it may come back
    ("legal", (), (503, "no_active_worker")),
])
def test_candidates_for_adapters(model, records, expected):
    router = _router(*records)
    if isinstance(expected, set):
        assert {w.worker_id for w in router.candidates(model)} == expected
        return
    with pytest.raises(ApiError) as err:
        router.candidates(model)
    assert (err.value.status, err.value.code) == expected
    if expected[0] == 404:
        assert "sql" in err.value.message and "chat" in err.value.message  # adapters are listed as available


def test_candidates_follow_loads_and_unloads():
    router = _router(A, C)
    assert {w.worker_id for w in router.candidates("sql")} == {"a"}
    router.fleet.upsert(_rec("c", "base", ["sql"]))  # its launcher saw a dynamic load
    assert {w.worker_id for w in router.candidates("sql")} == {"a", "c"}
    router.fleet.upsert(_rec("a", "base", ["chat"]))  # and an unload
    assert {w.worker_id for w in router.candidates("sql")} == {"c"}


def test_directory_helpers():
    fleet = Fleet()
    for r in (A, B, C, D, DRAIN, SHADOW):
        fleet.upsert(r)
    assert adapter_models(fleet) == [("chat", "base"), ("poet", "other"), ("sql", "base")]
    assert {w.worker_id for w in adapter_holders(fleet, "sql")} == {"a", "b"}
    assert adapter_holders(fleet, "") == ()
    assert knows_adapter(fleet, "legal") and not knows_adapter(fleet, "base") and not knows_adapter(fleet, "")


@pytest.mark.parametrize("model,candidates,expected", [
    ("sql", (A, B), ("sql", "base")),
    ("base", (A, C), None),      # the base model itself
    ("sql", (), None),
])
def test_mark_adapter(model, candidates, expected):
    req = _req(model)
    mark_adapter(req, candidates)
    got = (req.state[LORA_NAME], req.state[LORA_BASE]) if LORA_NAME in req.state else None
    assert got == expected


def test_chain_roots_keep_adapters_and_salts_apart():
    roots = [chain_root(None), chain_root("s"), chain_root(None, "sql"), chain_root("s", "sql"),
             chain_root(None, "chat"), chain_root("s", "chat"), chain_root("", "sql"),
             chain_root("l", "sq"), chain_root(None, "sql" + "l")]
    assert roots[0] == ROUTER_SEED and roots[1] == salt_root("s")
    assert roots[6] == roots[2]  # an empty salt is no salt, as in vLLM
    distinct = roots[:6] + roots[7:]
    assert len(set(distinct)) == len(distinct)
    tokens = list(range(64))
    base, adapter = block_hashes(tokens, 16), block_hashes(tokens, 16, chain_root(None, "sql"))
    assert not set(base) & set(adapter)  # not one block of the adapter's chain is the base model's


@pytest.mark.parametrize("extra_keys,lora_name,expected", [
    # vLLM 0.32 (to_event_extra_keys): the LoRA name first on every block, the salt on the first
    ([("sql",), ("sql",)], "sql", chain_root(None, "sql")),
    ([("sql", "tenant"), ("sql",)], "sql", chain_root("tenant", "sql")),
    ([("sql", "sql")], "sql", chain_root("sql", "sql")),  # a salt equal to the name still counts
    ([("tenant",)], None, salt_root("tenant")),
    ([None, None], None, ROUTER_SEED),
    (None, None, ROUTER_SEED),
])
def test_stored_event_root(extra_keys, lora_name, expected):
    ev = Stored([1, 2], None, list(range(32)), 16, extra_keys=extra_keys, lora_name=lora_name)
    assert ev.root() == expected


# -- dynamic loading and the launcher's watch: the pure parts ---------------------------------------

@pytest.mark.parametrize("name,ok", [
    ("sql", True), ("sql-v2.1_x", True), ("_a", True), ("", False), ("../etc", False), ("a/b", False),
    (".hidden", False), ("a..b", False), ("a" * 128, True), ("a" * 129, False), ("a b", False),
])
def test_adapter_names_that_may_become_paths(name, ok):
    from infera.router.lora_loading import valid_adapter_name

    assert valid_adapter_name(name) is ok


def test_loader_prefers_the_worker_with_fewest_adapters_of_the_base():
    from infera.router.lora_loading import AdapterLoader

    fleet = Fleet()
    for r in (_rec("a", "base", ["x", "y"]), _rec("b", "base", ["x"]), _rec("c", "base"), EMB):
        fleet.upsert(r)
    loader = AdapterLoader(fleet, "/adapters/")
    assert [w.worker_id for w in loader._eligible()] == ["c", "b", "a"]  # the embedder never
    assert loader.path_of("sql") == "/adapters/sql"
    fleet.upsert(D)  # a second base model: which one is ambiguous without --lora-base-model
    with pytest.raises(ApiError) as err:
        loader._eligible()
    assert err.value.status == 400
    assert [w.worker_id for w in AdapterLoader(fleet, "/a", base_model="other")._eligible()] == ["d"]
    with pytest.raises(ValueError):
        AdapterLoader(fleet, "")


async def test_loader_refuses_bad_names_and_base_models_without_loading():
    from infera.router.lora_loading import AdapterLoader

    fleet = Fleet()
    fleet.upsert(C)
    loader = AdapterLoader(fleet, "/adapters")
    for model in ("../x", "base"):
        with pytest.raises(ApiError) as err:
            await loader.holders(model)
        assert err.value.status == 404
    assert loader.loads == 0


@pytest.mark.parametrize("body,bases,expected", [
    ({"data": [{"id": "m", "parent": None}, {"id": "sql", "parent": "m"}, {"id": "a", "parent": "m"}]}, ["m"],
     ["a", "sql"]),
    ({"data": [{"id": "m", "parent": None}]}, ["m"], []),
    ({"data": [{"id": "m", "parent": "m"}]}, ["m"], []),  # a base is never its own adapter
    ({"data": [{"parent": "m"}, "junk", {"id": 3, "parent": "m"}]}, ["m"], []),
    ({"object": "error"}, ["m"], None),
    ([], ["m"], None),
])
def test_adapters_from_models(body, bases, expected):
    from infera.engine.base.lora_watch import adapters_from_models

    assert adapters_from_models(body, bases) == expected


@pytest.mark.parametrize("argv,enabled", [
    (["--model", "m", "--enable-lora"], True), (["--enable-lora=true"], True), (["--enable-lora=false"], False),
    (["--model", "m"], False), (["--enable-lora-bias"], False),
])
def test_lora_enabled(argv, enabled):
    from infera.engine.base.lora_watch import lora_enabled

    assert lora_enabled(argv) is enabled


def test_poll_interval_flag_env_default():
    import argparse

    from infera.engine.base.lora_watch import DEFAULT_POLL_INTERVAL_S, POLL_INTERVAL_ENV, lora_poll_interval

    env = {POLL_INTERVAL_ENV: "0.5"}
    assert lora_poll_interval(argparse.Namespace(lora_poll_interval=3.0), env) == 3.0
    assert lora_poll_interval(argparse.Namespace(), env) == 0.5
    assert lora_poll_interval(argparse.Namespace(), {}) == DEFAULT_POLL_INTERVAL_S
    with pytest.raises(argparse.ArgumentTypeError):
        lora_poll_interval(argparse.Namespace(), {POLL_INTERVAL_ENV: "0"})


def test_server_flags_for_dynamic_loading():
    from infera.router.lora_loading import adapter_loader_from_args
    from infera.server.cli import parse_args

    common = ["--etcd-endpoint", "http://127.0.0.1:1"]
    with pytest.raises(SystemExit):
        parse_args([*common, "--lora-dynamic-loading"], environ={})  # no --lora-adapter-dir
    args = parse_args(common, environ={"INFERA_LORA_DYNAMIC_LOADING": "true", "INFERA_LORA_ADAPTER_DIR": "/env"})
    assert args.lora_dynamic_loading and args.lora_adapter_dir == "/env"
    args = parse_args([*common, "--lora-adapter-dir", "/flag", "--lora-load-timeout", "5"],
                      environ={"INFERA_LORA_DYNAMIC_LOADING": "1", "INFERA_LORA_ADAPTER_DIR": "/env"})
    loader = adapter_loader_from_args(Fleet(), args)
    assert loader is not None and loader.adapter_dir == "/flag" and loader.timeout == 5
    assert adapter_loader_from_args(Fleet(), parse_args(common, environ={})) is None


def test_loader_puts_workers_at_their_max_loras_last():
    """Records carry the engine's --max-loras (lora_max): a worker at its bound is tried only after
    every worker under it, however few adapters those hold; 0 (unknown) is never full."""
    from infera.router.lora_loading import AdapterLoader

    fleet = Fleet()
    recs = (_rec("a", "base", ["x"]), _rec("b", "base", ["x", "y", "z"]), _rec("c", "base", ["x", "y"]),
            _rec("d", "base", ["w", "x", "y", "z"]))
    for r, bound in zip(recs, (1, 4, 2, 0)):
        fleet.upsert(WorkerRecord(**{**{f: getattr(r, f) for f in r.__struct_fields__}, "lora_max": bound}))
    # b: 3 of 4 (room); d: unknown bound, 4 held; a and c: full
    assert [w.worker_id for w in AdapterLoader(fleet, "/a")._eligible()] == ["b", "d", "a", "c"]


@pytest.mark.parametrize("argv,bound", [
    (["--enable-lora", "--max-loras", "4"], 4), (["--enable-lora", "--max-loras=3"], 3),
    (["--enable-lora"], 1),                       # vLLM's default
    (["--enable-lora", "--max-loras", "x"], 1),   # the engine refuses it itself
    (["--enable-lora", "--max-loras", "0"], 1),
    (["--max-loras", "4"], 0),                    # LoRA off: no bound to state
    (["--enable-lora", "--max-loras"], 1),
])
def test_max_loras_from_the_engine_flags(argv, bound):
    from infera.engine.base.lora_watch import max_loras

    assert max_loras(argv) == bound
