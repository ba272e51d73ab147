"""Dynamic LoRA loading (``--lora-dynamic-loading``): a request for an adapter that no active worker
holds loads it on the best worker first, then goes there.

The adapter's path is ``<--lora-adapter-dir>/<name>`` on the worker's host (vLLM's runtime
``POST /v1/load_lora_adapter``, which needs ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` on the engine). The
best worker is an active generative worker of the adapter's base model (``--lora-base-model``, else
the fleet's only one) under its engine's ``--max-loras`` (the record's ``lora_max``) holding the
fewest adapters, so loads spread and stay under each engine's bound; workers at their bound come
last (vLLM then swaps adapters through its CPU cache). A refused load (an engine at its bound, one
without runtime loading) tries the next worker, at most ``MAX_LOAD_ATTEMPTS``. Concurrent first
requests share one load (single flight). Until the worker's record lists the adapter (its
launcher's poll), the router remembers where it loaded it; a failed name is remembered briefly,
so a typo is not a load per request. Every wait is bounded (``--lora-load-timeout``), both
memories are bounded in entries.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp

from infera.api.errors import ApiError
from infera.api.pooling import GENERATE, serves
from infera.discovery.fleet import Fleet
from infera.discovery.record import WorkerRecord
from infera.runtime import wait_for

log = logging.getLogger("infera.router.lora")

MAX_LOAD_ATTEMPTS = 2
PLACED_TTL_S = 120.0  # how long a load is trusted before the worker's record lists it
FAILED_TTL_S = 10.0
MEMORY_CAP = 1024
# An adapter name becomes a path under --lora-adapter-dir: no separators, no "..", no leading dot.
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$")


def valid_adapter_name(name: str) -> bool:
    return bool(_NAME.match(name)) and ".." not in name


class AdapterLoader:
    """Loads adapters on demand; ``holders(model)`` is the router's answer for an adapter no record lists."""

    def __init__(
        self,
        fleet: Fleet,
        adapter_dir: str,
        *,
        base_model: str | None = None,
        timeout: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not adapter_dir:
            raise ValueError("dynamic LoRA loading needs --lora-adapter-dir (where the workers find adapters)")
        self.fleet = fleet
        self.adapter_dir = adapter_dir.rstrip("/") or "/"
        self.base_model = base_model
        self.timeout = timeout
        self._clock = clock
        self._loads: dict[str, asyncio.Task[WorkerRecord]] = {}  # adapter -> its one load in flight
        self._placed: OrderedDict[str, tuple[str, float]] = OrderedDict()  # adapter -> (worker_id, until)
        self._failed: OrderedDict[str, tuple[ApiError, float]] = OrderedDict()
        self.loads = 0  # loads sent to engines (for tests and metrics)

    def path_of(self, name: str) -> str:
        return f"{self.adapter_dir}/{name}"

    async def holders(self, model: str) -> Sequence[WorkerRecord]:
        """Workers to send a request for adapter ``model`` to, loading it first when none has it;
        an ApiError (404 for an unknown name or a failed load, 503 for no worker) otherwise."""
        if not valid_adapter_name(model) or model in self.fleet.models():
            raise _not_found(self.fleet, model)
        placed = self._recall(model)
        if placed is not None:
            return [placed]
        failed = self._failed.get(model)
        if failed is not None and failed[1] > self._clock():
            raise failed[0]
        task = self._loads.get(model)
        if task is None:
            task = self._loads[model] = asyncio.ensure_future(self._load(model))
            task.add_done_callback(functools.partial(self._load_done, model))
        try:
            return [await wait_for(asyncio.shield(task), self.timeout * MAX_LOAD_ATTEMPTS + 1)]
        except asyncio.TimeoutError:
            raise ApiError(
                503,
                f"loading LoRA adapter {model!r} is taking too long; retry shortly",
                "adapter_loading",
                headers={"Retry-After": "1"},
            ) from None

    def _load_done(self, model: str, _task: asyncio.Task[WorkerRecord]) -> None:
        self._loads.pop(model, None)

    def _recall(self, model: str) -> WorkerRecord | None:
        entry = self._placed.get(model)
        if entry is None:
            return None
        worker = self.fleet.get(entry[0])
        if entry[1] < self._clock() or worker is None or not worker.is_active:
            self._placed.pop(model, None)
            return None
        return worker

    def _eligible(self) -> list[WorkerRecord]:
        workers = [w for w in self.fleet.active(None, "mixed") if serves(w.tasks, GENERATE)]
        bases = sorted({w.model_name for w in workers})
        base = self.base_model
        if base is None:
            if len(bases) > 1:
                raise ApiError(
                    400,
                    f"the fleet serves several base models ({', '.join(bases)}): the server needs "
                    "--lora-base-model to load adapters on demand",
                    "adapter_base_ambiguous",
                    param="model",
                )
            base = bases[0] if bases else None
        pending: dict[str, int] = {}
        for wid, _ in self._placed.values():
            pending[wid] = pending.get(wid, 0) + 1
        chosen = [w for w in workers if w.model_name == base]

        def held(w: WorkerRecord) -> int:
            return len(w.lora_adapters) + pending.get(w.worker_id, 0)

        return sorted(chosen, key=lambda w: (0 < w.lora_max <= held(w), held(w), w.worker_id))

    async def _load(self, model: str) -> WorkerRecord:
        workers = self._eligible()
        if not workers:
            raise ApiError(
                503,
                "no active worker to load the adapter on; retry shortly",
                "no_active_worker",
                headers={"Retry-After": "1"},
            )
        last: ApiError | None = None
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout)) as session:
            for worker in workers[:MAX_LOAD_ATTEMPTS]:
                try:
                    self.loads += 1
                    async with session.post(
                        worker.url + "/v1/load_lora_adapter",
                        json={"lora_name": model, "lora_path": self.path_of(model)},
                    ) as resp:
                        text = await resp.text()
                        status = resp.status
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    last = ApiError(
                        503,
                        f"loading LoRA adapter {model!r} on {worker.worker_id} failed: {type(exc).__name__}",
                        "adapter_load_failed",
                        headers={"Retry-After": "1"},
                    )
                    continue
                if status == 200 or (status == 400 and "already been loaded" in text):
                    log.info("loaded LoRA adapter %s on %s", model, worker.worker_id)
                    self._remember(self._placed, model, (worker.worker_id, self._clock() + PLACED_TTL_S))
                    return worker
                log.warning("loading LoRA adapter %s on %s: engine answered %d", model, worker.worker_id, status)
                # 404: no such adapter at that path; else (at --max-loras, no runtime loading...) it may pass
                last = (
                    ApiError(
                        404,
                        f"LoRA adapter {model!r} could not be loaded: {text[:300]}",
                        "model_not_found",
                        param="model",
                    )
                    if status == 404
                    else ApiError(
                        503,
                        f"LoRA adapter {model!r} could not be loaded (engine answered {status}: {text[:300]})",
                        "adapter_load_failed",
                        headers={"Retry-After": "1"},
                    )
                )
        assert last is not None
        self._remember(self._failed, model, (last, self._clock() + FAILED_TTL_S))
        raise last

    @staticmethod
    def _remember(memory: OrderedDict[str, Any], key: str, value: tuple[Any, float]) -> None:
        memory[key] = value
        memory.move_to_end(key)
        while len(memory) > MEMORY_CAP:
            memory.popitem(last=False)


def adapter_loader_from_args(fleet: Fleet, args: Any) -> AdapterLoader | None:
    """The server's loader (``--lora-dynamic-loading`` and its flags), or None when it is off."""
    if not getattr(args, "lora_dynamic_loading", False):
        return None
    return AdapterLoader(
        fleet,
        args.lora_adapter_dir,
        base_model=getattr(args, "lora_base_model", None),
        timeout=getattr(args, "lora_load_timeout", 30.0),
    )


def _not_found(fleet: Fleet, model: str) -> ApiError:
    return ApiError(
        404,
        f"The model `{model}` does not exist. Available: {', '.join(fleet.models())}",
        "model_not_found",
        param="model",
    )
