"""The kv-aware router's per-model tokenizer: the one the workers name, loaded off the loop; never a
silent fallback (degraded in status, logged once) when it cannot be loaded, workers disagree, the
fingerprint differs or the self-check diverges."""
from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import deque
from types import SimpleNamespace

import pytest

from infera.api.requests import parse_request
from infera.discovery.fleet import Fleet
from infera.discovery.record import BUILTIN_TOKENIZER, WorkerRecord, tokenizer_fingerprint
from infera.kv.prompt import PromptTokenizer
from infera.kv.tokenizer import BuiltinTokenizer
from infera.server.kv import DIVERGENCE_WINDOW
from infera.server.tokenizers import DEGRADED, LOADING, OK, RouterTokenizers
from tests.e2e.tiny_model import build_tiny_model
from tests.conftest import wait_for


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tok") / "m"))


def worker(wid: str, *, model: str = "m", engine: str = "vllm", tokenizer: str | None = None,
           sha: str | None = None) -> WorkerRecord:
    return WorkerRecord(worker_id=wid, url=f"http://{wid}", model_name=model, engine=engine, tokenizer=tokenizer,
                        tokenizer_sha256=sha)


def chat(model: str = "m"):
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hello there, general"}]}).encode()
    return parse_request("/v1/chat/completions", body)


BUILTIN_IDS = asyncio.run(PromptTokenizer.from_path(None).tokens("/v1/chat/completions", chat()))


async def settled(tk: RouterTokenizers, model: str = "m") -> dict:
    await wait_for(lambda: tk.prompts_for(model) is not None, 10, message="tokenizer loaded (or given up)")
    return tk.model_status(model)


async def test_sim_workers_use_the_builtin_tokenizer_named_or_not():
    fleet = Fleet()
    tk = RouterTokenizers(fleet)
    fleet.upsert(worker("a", engine="sim", tokenizer=BUILTIN_TOKENIZER))
    fleet.upsert(worker("b", engine="sim"))  # an older sim launcher: names nothing
    assert await settled(tk) == {"status": OK, "tokenizer": BUILTIN_TOKENIZER}
    assert await tk.tokens("/v1/chat/completions", chat()) == BUILTIN_IDS
    assert tk.health()["status"] == OK


async def test_workers_named_folder_is_loaded_and_matches_the_engines_tokenization(tiny_dir):
    fleet = Fleet()
    tk = RouterTokenizers(fleet)
    sha = tokenizer_fingerprint(tiny_dir)
    fleet.upsert(worker("a", tokenizer=tiny_dir, sha=sha))
    fleet.upsert(worker("b", tokenizer="/other/host/path", sha=sha))  # same file elsewhere: agrees
    assert await settled(tk) == {"status": OK, "tokenizer": tiny_dir}
    expected = await PromptTokenizer.from_path(tiny_dir).tokens("/v1/chat/completions", chat())
    assert await tk.tokens("/v1/chat/completions", chat()) == expected != BUILTIN_IDS
    assert [tk.worker_status(w) for w in fleet.active("m")] == [(OK, None), (OK, None)]


async def test_unloadable_tokenizer_is_degraded_loudly_and_falls_back_to_builtin(caplog):
    fleet = Fleet()
    tk = RouterTokenizers(fleet)
    with caplog.at_level(logging.ERROR):
        fleet.upsert(worker("a", tokenizer="/nowhere/llama", sha="ab" * 32))
        status = await settled(tk)
        fleet.upsert(worker("b", tokenizer="/nowhere/llama", sha="ab" * 32))  # same verdict: no new log
    assert status["status"] == DEGRADED and "/nowhere/llama" in status["reasons"][0]
    assert "--router-tokenizer-path" in status["reasons"][0]
    assert tk.worker_status(fleet.get("a"))[0] == DEGRADED
    assert await tk.tokens("/v1/chat/completions", chat()) == BUILTIN_IDS
    assert sum("degraded" in r.getMessage() for r in caplog.records) == 1
    assert tk.health()["status"] == DEGRADED
    (gauge,) = tk.collect()
    assert [(s.labels, s.value) for s in gauge.samples] == [({"model": "m"}, 1)]


async def test_real_engines_naming_no_tokenizer_are_degraded():
    fleet = Fleet()
    tk = RouterTokenizers(fleet)
    fleet.upsert(worker("a", engine="vllm"))  # a launcher from before the field
    status = await settled(tk)
    assert status["status"] == DEGRADED and "names its tokenizer" in status["reasons"][0]


async def test_fingerprint_mismatch_degrades_that_worker(tiny_dir):
    fleet = Fleet()
    tk = RouterTokenizers(fleet)
    fleet.upsert(worker("a", tokenizer=tiny_dir))  # no fingerprint: followed, unverified
    await settled(tk)
    fleet.upsert(worker("b", tokenizer=tiny_dir, sha="0" * 64))  # its host's file differs from ours
    await settled(tk)  # re-read: the file here may have changed since
    status, why = tk.worker_status(fleet.get("b"))
    assert status == DEGRADED and "differs" in why
    assert tk.worker_status(fleet.get("a")) == (OK, None)
    assert tk.model_status("m")["status"] == DEGRADED


async def test_workers_naming_different_tokenizers_follow_the_majority(tiny_dir):
    fleet = Fleet()
    tk = RouterTokenizers(fleet)
    sha = tokenizer_fingerprint(tiny_dir)
    for wid in ("a", "b"):
        fleet.upsert(worker(wid, tokenizer=tiny_dir, sha=sha))
    fleet.upsert(worker("c", tokenizer="org/other", sha="1" * 64))
    status = await settled(tk)
    assert status["status"] == DEGRADED and status["tokenizer"] == tiny_dir
    assert "different tokenizers" in status["reasons"][0]
    assert tk.worker_status(fleet.get("a")) == (OK, None)
    assert tk.worker_status(fleet.get("c"))[0] == DEGRADED
    fleet.remove("c")  # the odd one leaves: the model is fine again
    assert tk.model_status("m")["status"] == OK


async def test_explicit_path_serves_every_model_and_is_checked_against_the_workers(tiny_dir):
    fleet = Fleet()
    tk = RouterTokenizers(fleet, tiny_dir, loader=lambda name: pytest.fail("nothing is loaded per model"))
    fleet.upsert(worker("a", tokenizer="/their/copy", sha=tokenizer_fingerprint(tiny_dir)))
    fleet.upsert(worker("s", model="sim", engine="sim", tokenizer=BUILTIN_TOKENIZER))
    assert tk.model_status("m") == {"status": OK, "tokenizer": tiny_dir}
    status = tk.model_status("sim")
    assert status["status"] == DEGRADED and BUILTIN_TOKENIZER in status["reasons"][0]
    assert tk.health()["tokenizer"] == "--router-tokenizer-path"
    assert await tk.tokens("/v1/chat/completions", chat("sim")) != BUILTIN_IDS


async def test_requests_route_by_load_while_loading_and_a_superseded_load_is_dropped():
    release = threading.Event()
    loads: list[str] = []

    def slow_loader(name):
        loads.append(name)
        release.wait(10)
        return BuiltinTokenizer(), "c" * 64

    fleet = Fleet()
    tk = RouterTokenizers(fleet, loader=slow_loader)
    fleet.upsert(worker("a", tokenizer="org/first"))
    await wait_for(lambda: loads == ["org/first"], 5, message="the first load started")
    assert tk.model_status("m")["status"] == LOADING
    assert list(await tk.token_ids("/v1/chat/completions", chat())) == []  # not blocked, not a wrong tokenizer
    fleet.upsert(worker("a", tokenizer="org/second"))  # the worker restarted with another tokenizer
    release.set()
    status = await settled(tk)
    assert status == {"status": OK, "tokenizer": "org/second"}
    tk.close()


async def test_self_check_divergence_marks_the_worker_degraded():
    fleet = Fleet()
    target = SimpleNamespace(worker_id="a", verdicts=deque([True] * DIVERGENCE_WINDOW), wrong=DIVERGENCE_WINDOW)
    tk = RouterTokenizers(fleet, self_check=SimpleNamespace(targets={"a": target}))
    fleet.upsert(worker("a", engine="sim", tokenizer=BUILTIN_TOKENIZER))
    status, why = tk.worker_status(fleet.get("a"))
    assert status == DEGRADED and "self-check" in why
    target.verdicts, target.wrong = deque([False] * DIVERGENCE_WINDOW), 0  # predictions agree again
    assert tk.worker_status(fleet.get("a")) == (OK, None)


@pytest.mark.parametrize("diverged_key, dp_size, degraded", [
    ("a#dp1", 2, {"a"}),  # one rank of a DP-attention worker (one target per rank) diverged
    ("a#dp1", 1, set()),  # not a's target: a is one target, keyed "a"
    ("ab", 1, {"ab"}),  # a worker whose id starts with another's is its own
])
async def test_a_divergence_is_blamed_on_the_worker_whose_target_it_is(diverged_key, dp_size, degraded):
    fleet = Fleet()
    wrong = SimpleNamespace(verdicts=deque([True] * DIVERGENCE_WINDOW), wrong=DIVERGENCE_WINDOW)
    fine = SimpleNamespace(verdicts=deque([False] * DIVERGENCE_WINDOW), wrong=0)
    targets = {"a": fine, "a#dp0": fine, "ab": fine, diverged_key: wrong}
    tk = RouterTokenizers(fleet, self_check=SimpleNamespace(targets=targets))
    fleet.upsert(WorkerRecord(worker_id="a", url="http://a", model_name="m", engine="sim",
                              tokenizer=BUILTIN_TOKENIZER, dp_size=dp_size))
    fleet.upsert(worker("ab", engine="sim", tokenizer=BUILTIN_TOKENIZER))
    assert {w.worker_id for w in fleet.all() if tk.worker_status(w)[0] == DEGRADED} == degraded
    assert tk.model_status("m")["status"] == (DEGRADED if degraded else OK)


async def test_a_model_without_workers_is_forgotten(tiny_dir):
    fleet = Fleet()
    tk = RouterTokenizers(fleet)
    fleet.upsert(worker("a", tokenizer=tiny_dir))
    await settled(tk)
    fleet.remove("a")
    assert tk.health() == {"status": OK, "tokenizer": "workers", "models": {}}
    assert list(tk._cache) == [BUILTIN_TOKENIZER]


async def test_configure_reaches_tokenizers_loaded_later(tiny_dir):
    fleet = Fleet()
    tk = RouterTokenizers(fleet)
    tk.configure(prefix_chars=1000, cache_bytes=4096)  # what the server's flags set at startup
    assert tk.prompts_for("m").prefix_chars == 1000
    fleet.upsert(worker("a", tokenizer=tiny_dir))
    await settled(tk)
    prompts = tk.prompts_for("m")
    assert prompts.tokenizer.kind == "hf" and prompts.prefix_chars == 1000 and prompts.cache.max_bytes == 4096
