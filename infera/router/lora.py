"""LoRA adapters in the fleet: which workers hold an adapter, what base model it runs on, and the
request state that keeps an adapter's prefix cache apart in kv-aware routing.

A worker's record lists the adapters its engine has loaded (``WorkerRecord.lora_adapters``, kept
current by its launcher). A request whose model is an adapter goes only to active workers listing
it; the adapter's base model is the ``model_name`` of those workers (the tokenizer the router
renders its prompt with). vLLM folds the adapter into every block hash, so the router's chain for
such a request starts from ``chain_root(salt, adapter)`` (``infera.kv.hashing``): ``mark_adapter``
puts the adapter and its base in the request's state for the kv-aware policy to read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from infera.discovery.fleet import Fleet
from infera.discovery.record import WorkerRecord

LORA_NAME = "lora_name"  # request.state key: the adapter a request runs under (None: the base model)
LORA_BASE = "lora_base"  # request.state key: that adapter's base model (its tokenizer)


def adapter_holders(fleet: Fleet, model: str, mode: str = "mixed") -> tuple[WorkerRecord, ...]:
    """Active workers in ``mode`` whose engine holds adapter ``model`` (empty: none, or not an adapter)."""
    if not model:
        return ()
    return tuple(w for w in fleet.active(None, mode) if model in w.lora_adapters)


def knows_adapter(fleet: Fleet, model: str) -> bool:
    """True if any worker, active or draining, lists ``model`` as a loaded adapter."""
    return bool(model) and any(model in w.lora_adapters for w in fleet.all())


def adapter_models(fleet: Fleet) -> list[tuple[str, str]]:
    """(adapter, base model) for every adapter an active worker holds, sorted; an adapter name that
    is also a base model is the base model's (requests for that name go to the base)."""
    bases = set(fleet.models())
    seen: dict[str, str] = {}
    for w in fleet.active():
        for name in w.lora_adapters:
            if name not in bases and name not in seen:
                seen[name] = w.model_name
    return sorted(seen.items())


def mark_adapter(request: Any, candidates: Sequence[WorkerRecord]) -> None:
    """Record in ``request.state`` the adapter its model names and that adapter's base, when the
    candidates serve it as an adapter (not as their base model)."""
    model = request.model
    if not model or not candidates or candidates[0].model_name == model:
        return
    # (candidates for a model that is not their base hold it as an adapter, or have just loaded it)
    request.state[LORA_NAME] = model
    request.state[LORA_BASE] = candidates[0].model_name
