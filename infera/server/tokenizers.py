"""The kv-aware router's tokenizer, per model, and whether kv-aware routing can work with it.

With ``--router-tokenizer-path`` that tokenizer serves every model. Without it, each model gets the
tokenizer its workers name in their records (``tokenizer``: a folder, a hub id, or the simulator's
built-in one; ``tokenizer_sha256``), loaded in a thread when the model appears. Prompts must be
tokenized exactly as the engine does, or no block hash ever matches and kv-aware routing silently
becomes load-only routing. So it is never silent: a model is **degraded** when

* its workers name no tokenizer (launchers older than the field) and are not all simulators,
* the tokenizer they name cannot be loaded on this host (path missing here, hub unreachable),
* they name different tokenizers,
* the ``tokenizer.json`` loaded here differs from the one a worker's engine loaded (sha256), or
* the self-check finds a worker's reported cached tokens disagreeing with the predictions.

A degraded model is logged as an error once (with the fix), shown in ``GET /health`` and on its
workers in ``GET /v1/workers``, and exported as ``infera_router_tokenizer_degraded{model}``; it is
still served (a front door that refuses traffic over a routing-quality problem would turn it into
an outage), its prompts tokenized with the built-in tokenizer.
"""
from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from prometheus_client.core import GaugeMetricFamily, Metric

from infera.discovery.fleet import Fleet
from infera.discovery.record import BUILTIN_TOKENIZER, WorkerRecord, tokenizer_fingerprint
from infera.kv.prompt import PromptTokenizer, resolve_tokenizer_path
from infera.kv.tokenizer import SimTokenizer, load_tokenizer
from infera.router.kv_targets import expand_targets
from infera.server.kv import DIVERGENCE_WINDOW

log = logging.getLogger(__name__)

OK, LOADING, DEGRADED = "ok", "loading", "degraded"

# name → (tokenizer, sha256 of the tokenizer.json loaded); raises with a reason. Blocking.
Loader = Callable[[str], "tuple[SimTokenizer, str | None]"]


def load_named_tokenizer(name: str) -> tuple[SimTokenizer, str | None]:
    """A worker-named tokenizer on this host: a folder or file, else a hub id (downloaded when the
    hub is reachable). Blocking: file reads, maybe a download."""
    path = resolve_tokenizer_path(name)
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise ValueError(f"{path!r} has no tokenizer.json")
    return load_tokenizer(path), tokenizer_fingerprint(path)


@dataclass
class _Loaded:
    prompts: PromptTokenizer
    source: str  # the name it was loaded from
    sha256: str | None  # of the tokenizer.json loaded here (None: builtin, or unreadable)


@dataclass
class _Model:
    want: tuple[tuple[str, ...], str | None] | None = None  # (names to try in order, expected sha256)
    chosen: frozenset[str] = frozenset()  # workers whose tokenizer the router follows
    conflict: str | None = None
    loaded: _Loaded | None = None
    error: str | None = None  # why nothing loaded
    task: asyncio.Task | None = None
    reason: str | None = None  # the model's problem (None: fine or loading)
    worker_problems: dict[str, str] = field(default_factory=dict)


def _short(sha: str | None) -> str:
    return (sha or "?")[:12]


class RouterTokenizers:
    """What ``KvAwarePolicy`` tokenizes prompts with (``token_ids``), per request model: the
    ``PromptTokenizer`` interface, dispatching on the request's model. ``prompt_kwargs`` go to every
    ``PromptTokenizer`` made (prefix cap, cache budget…)."""

    def __init__(self, fleet: Fleet, explicit_path: str | None = None, *, self_check: Any = None,
                 loader: Loader = load_named_tokenizer, **prompt_kwargs: Any) -> None:
        self.fleet = fleet
        self.self_check = self_check  # KvEventsBridge: its per-target prediction verdicts
        self._loader = loader
        self._prompt_kwargs = prompt_kwargs
        self._builtin = _Loaded(PromptTokenizer.from_path(None, **prompt_kwargs), BUILTIN_TOKENIZER, None)
        self.explicit: _Loaded | None = None
        if explicit_path:  # as before: a bad path stops the server at startup
            path = resolve_tokenizer_path(explicit_path)
            self.explicit = _Loaded(PromptTokenizer(load_tokenizer(path), **prompt_kwargs), explicit_path,
                                    tokenizer_fingerprint(path))
        self._models: dict[str, _Model] = {}
        self._cache: dict[str, _Loaded] = {BUILTIN_TOKENIZER: self._builtin}
        self._worker_model: dict[str, str] = {}
        self._logged: set[tuple[str, str]] = set()
        fleet.subscribe(self._on_fleet_change)

    # -- the policy's side --------------------------------------------------------------------------
    def prompts_for(self, model: str | None) -> PromptTokenizer | None:
        """None while the model's tokenizer is loading (routed by load for that moment)."""
        if self.explicit is not None:
            return self.explicit.prompts
        state = self._models.get(model or "")
        if state is None or state.want is None:
            return self._builtin.prompts
        if state.loaded is not None:
            return state.loaded.prompts
        return self._builtin.prompts if state.error is not None else None

    async def token_ids(self, route: str, parsed: Any) -> Sequence[int]:
        prompts = self.prompts_for(getattr(parsed, "model", None))
        return await prompts.token_ids(route, parsed) if prompts is not None else ()

    async def tokens(self, route: str, parsed: Any) -> list[int]:
        return list(await self.token_ids(route, parsed))

    def configure(self, **prompt_kwargs: Any) -> None:
        """``PromptTokenizer.configure`` for every tokenizer, those loaded later included."""
        self._prompt_kwargs.update(prompt_kwargs)
        for loaded in [*self._cache.values(), self.explicit]:
            if loaded is not None:
                loaded.prompts.configure(**prompt_kwargs)

    def close(self) -> None:
        """Stop loads under way and every tokenizer's threads (idempotent)."""
        for state in self._models.values():
            if state.task is not None:
                state.task.cancel()
                state.task = None
        for loaded in [*self._cache.values(), self.explicit]:
            if loaded is not None:
                loaded.prompts.close()  # idempotent

    # -- fleet → per-model tokenizer ------------------------------------------------------------------
    def _on_fleet_change(self, worker_id: str, record: WorkerRecord | None) -> None:
        models = {self._worker_model.pop(worker_id, None)}
        if record is not None:
            self._worker_model[worker_id] = record.model_name
            models.add(record.model_name)
        for model in sorted(m for m in models if m is not None):
            self._refresh(model)

    def _refresh(self, model: str) -> None:
        workers = self.fleet.active(model)
        if not workers:
            state = self._models.pop(model, None)
            if state is not None and state.task is not None:
                state.task.cancel()
            self._prune_cache()
            return
        state = self._models.setdefault(model, _Model())
        if self.explicit is None:
            want, state.chosen, state.conflict = self._wanted(workers)
            if want != state.want:
                if state.task is not None:
                    state.task.cancel()
                state.want, state.loaded, state.error, state.task = want, None, None, None
                if want is not None:
                    self._start_load(model, state)
        self._judge(model, state)

    @staticmethod
    def _wanted(workers: tuple[WorkerRecord, ...]) -> tuple[tuple[tuple[str, ...], str | None] | None,
                                                            frozenset[str], str | None]:
        """(names to load + expected sha256, the workers agreeing on it, a conflict description)."""
        named = [w for w in workers if w.tokenizer]
        if not named:
            return None, frozenset(), None
        sha_of_name = {w.tokenizer: w.tokenizer_sha256 for w in named if w.tokenizer_sha256}
        groups: dict[str, list[WorkerRecord]] = {}
        for w in named:  # same tokenizer.json = same tokenizer, whatever path each host has it at
            sha = w.tokenizer_sha256 or sha_of_name.get(w.tokenizer)
            groups.setdefault(sha or "name:" + w.tokenizer, []).append(w)
        key, best = min(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))
        counts: dict[str, int] = {}
        for w in best:
            counts[w.tokenizer] = counts.get(w.tokenizer, 0) + 1
        names = tuple(sorted(counts, key=lambda n: (-counts[n], n)))  # most named first: tried in order
        sha = None if key.startswith("name:") else key
        conflict = None
        if len(groups) > 1:
            conflict = "its workers name different tokenizers: " + "; ".join(
                f"{ws[0].tokenizer} (sha256 {_short(ws[0].tokenizer_sha256)}, {len(ws)} worker(s))"
                for _, ws in sorted(groups.items()))
        return (names, sha), frozenset(w.worker_id for w in best), conflict

    def _start_load(self, model: str, state: _Model) -> None:
        assert state.want is not None
        names, sha = state.want
        for name in names:
            cached = self._cache.get(name)
            if cached is not None and (sha is None or cached.sha256 in (None, sha)):
                state.loaded = cached
                return  # else the file changed since (a new worker names a new fingerprint): reload
        want = state.want
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # fed outside a loop (tests, tools): load inline
            self._finish(model, want, *self._load_all(names))
            return
        state.task = loop.create_task(self._load_in_thread(model, want))

    async def _load_in_thread(self, model: str, want: tuple[tuple[str, ...], str | None]) -> None:
        loaded, errors = await asyncio.to_thread(self._load_all, want[0])
        self._finish(model, want, loaded, errors)

    def _load_all(self, names: tuple[str, ...]) -> tuple[_Loaded | None, list[str]]:
        errors: list[str] = []
        for name in names:
            if name == BUILTIN_TOKENIZER:
                return self._builtin, errors
            try:
                tokenizer, sha = self._loader(name)
                return _Loaded(PromptTokenizer(tokenizer, **self._prompt_kwargs), name, sha), errors
            except Exception as exc:  # any failure is a reason shown to the operator, not a crash
                errors.append(f"{name}: {exc}")
        return None, errors

    def _finish(self, model: str, want: tuple[tuple[str, ...], str | None], loaded: _Loaded | None,
                errors: list[str]) -> None:
        state = self._models.get(model)
        if state is None or state.want != want:
            return  # superseded while loading
        state.task = None
        if loaded is not None:
            self._cache[loaded.source] = loaded
            state.loaded = loaded
            log.info("router tokenizer for model %s: %s (the one its workers name)", model, loaded.source)
        else:
            state.error = "; ".join(errors) or "nothing to load"
        self._prune_cache()
        self._judge(model, state)

    def _prune_cache(self) -> None:
        """Forget tokenizers no model uses. Not closed: a request may still be tokenizing with one
        (its idle threads end when it is collected)."""
        used = {id(s.loaded) for s in self._models.values() if s.loaded is not None}
        for name in [n for n, x in self._cache.items() if n != BUILTIN_TOKENIZER and id(x) not in used]:
            del self._cache[name]

    # -- verdicts -------------------------------------------------------------------------------------
    def _judge(self, model: str, state: _Model) -> None:
        workers = self.fleet.active(model)
        loaded = self.explicit or state.loaded
        reason = None
        if self.explicit is None:
            if state.want is None:
                if not all(w.engine == "sim" for w in workers):
                    reason = ("no worker of this model names its tokenizer (launchers older than this server): "
                              "prompts cannot be hashed as its engines do; pass --router-tokenizer-path")
            elif state.error is not None:
                reason = (f"cannot load the tokenizer its workers name ({state.error}): using the built-in "
                          "tokenizer, whose hashes match no real engine's; make it readable on this host or "
                          "pass --router-tokenizer-path")
        if state.conflict is not None and self.explicit is None:
            self._log_once(model, state.conflict, "kv-aware routing for model %s is degraded: %s; the router "
                           "follows the one most workers name", model, state.conflict)
        problems: dict[str, str] = {}
        for w in workers:
            problem = self._worker_problem(w, state, loaded)
            if problem is not None:
                problems[w.worker_id] = problem
        state.reason, state.worker_problems = reason, problems
        if reason is not None:
            self._log_once(model, reason, "kv-aware routing for model %s is degraded: %s", model, reason)
        for wid, problem in problems.items():
            self._log_once(wid, problem, "kv-aware routing to worker %s (model %s) is degraded: %s", wid, model,
                           problem)

    def _worker_problem(self, w: WorkerRecord, state: _Model, loaded: _Loaded | None) -> str | None:
        if loaded is None or not w.tokenizer:
            return None  # loading, or nothing to compare (the model's reason covers it)
        if self.explicit is None and w.worker_id not in state.chosen:
            return f"it names tokenizer {w.tokenizer}, the router follows {loaded.source}"
        if (w.tokenizer == BUILTIN_TOKENIZER) != (loaded.source == BUILTIN_TOKENIZER):
            return f"its engine tokenizes with {w.tokenizer}, the router with {loaded.source}"
        if w.tokenizer_sha256 and loaded.sha256 and w.tokenizer_sha256 != loaded.sha256:
            return (f"its engine's tokenizer.json (sha256 {_short(w.tokenizer_sha256)}…) differs from the router's "
                    f"({loaded.source}, sha256 {_short(loaded.sha256)}…)")
        return None

    def _log_once(self, key: str, what: str, msg: str, *args: Any) -> None:
        if (key, what) not in self._logged:
            self._logged.add((key, what))
            log.error(msg, *args)

    def _diverged(self, record: WorkerRecord) -> bool:
        """The self-check's current verdict: most recent informative replies were mispredicted."""
        targets = getattr(self.self_check, "targets", None)
        if not targets:
            return False
        # the worker's own targets (the bridges key them so), not a walk over the fleet's: the
        # model's status asks this of every worker, and /metrics, /health and /v1/workers ask that
        for _rank, key in expand_targets(record):
            t = targets.get(key)
            if (t is not None and t.verdicts is not None and len(t.verdicts) == DIVERGENCE_WINDOW
                    and 2 * t.wrong > DIVERGENCE_WINDOW):
                return True
        return False

    # -- visibility -------------------------------------------------------------------------------------
    def worker_status(self, record: WorkerRecord) -> tuple[str, str | None]:
        """(ok | loading | degraded, why) for one worker, as /v1/workers shows it."""
        state = self._models.get(record.model_name)
        if state is None or not record.is_active:
            return OK, None
        problem = state.worker_problems.get(record.worker_id) or state.reason
        if problem is None and self._diverged(record):
            problem = ("the self-check finds the engine's reported cached tokens disagreeing with the router's "
                       "predictions (tokenizer, chat template or block size mismatch)")
        if problem is not None:
            return DEGRADED, problem
        return (LOADING, None) if self.prompts_for(record.model_name) is None else (OK, None)

    def model_status(self, model: str) -> dict[str, Any]:
        state = self._models.get(model)
        loaded = self.explicit or (state.loaded if state is not None else None)
        if state is not None and state.want is None and self.explicit is None:
            loaded = self._builtin
        verdicts = [self.worker_status(w) for w in self.fleet.active(model)]
        conflict = state.conflict if state is not None and self.explicit is None else None
        reasons = ([conflict] if conflict else []) + sorted({why for _, why in verdicts if why})
        status = DEGRADED if reasons else LOADING if any(s == LOADING for s, _ in verdicts) else OK
        out: dict[str, Any] = {"status": status, "tokenizer": loaded.source if loaded is not None else None}
        if reasons:
            out["reasons"] = reasons
        return out

    def health(self) -> dict[str, Any]:
        models = {m: self.model_status(m) for m in sorted(self._models)}
        statuses = {s["status"] for s in models.values()}
        status = DEGRADED if DEGRADED in statuses else LOADING if LOADING in statuses else OK
        return {"status": status, "tokenizer": "--router-tokenizer-path" if self.explicit else "workers",
                "models": models}

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily("infera_router_tokenizer_degraded", "1 when kv-aware routing of a model is "
                                  "degraded (tokenizer not loadable here, workers disagree, fingerprint or "
                                  "self-check mismatch)", labels=["model"])
        for model in sorted(self._models):
            gauge.add_metric([model], 1 if self.model_status(model)["status"] == DEGRADED else 0)
        yield gauge
