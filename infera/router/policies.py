"""The router's policies by name (``--router-policy``): the registry that builds one. It imports
every policy; no policy imports it (the ``Policy`` protocol they implement is in ``policy.py``)."""
from __future__ import annotations

from typing import Any

from infera.router.kv_aware import KvAwarePolicy
from infera.router.policy import Policy, PolicyFactory
from infera.router.round_robin import RoundRobinPolicy


def policy_registry() -> dict[str, PolicyFactory]:
    return {"round-robin": RoundRobinPolicy, "kv-aware": KvAwarePolicy}


def make_policy(name: str, **kwargs: Any) -> Policy:
    registry = policy_registry()
    if name not in registry:
        raise ValueError(f"unknown router policy {name!r} (choose from {', '.join(sorted(registry))})")
    return registry[name](**kwargs)
