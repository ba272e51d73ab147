"""Discovery backends: how servers find workers and how workers announce themselves.

Backends are imported lazily so picking one never imports another's dependencies.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from infera.discovery.base import Discovery, Registration

DISCOVERY_BACKENDS: tuple[str, ...] = ("etcd",)


def _check_backend(backend: str) -> None:
    if backend not in DISCOVERY_BACKENDS:
        raise ValueError(f"unknown discovery backend {backend!r} (choose from {', '.join(DISCOVERY_BACKENDS)})")


def _require_etcd_endpoint(etcd_endpoint: str | None) -> str:
    if not etcd_endpoint:
        raise ValueError("the etcd discovery backend needs an etcd endpoint (host:port or http://host:port)")
    return etcd_endpoint


def make_discovery(backend: str, *, etcd_endpoint: str | None, etcd_prefix: str, **kw: Any) -> "Discovery":
    """Server side. Extra keywords go to the backend (etcd: ``client``, ``backoff_initial``, ``backoff_max``)."""
    _check_backend(backend)
    from infera.discovery.etcd import EtcdDiscovery

    return EtcdDiscovery(_require_etcd_endpoint(etcd_endpoint), etcd_prefix, **kw)


def make_registration(
    backend: str, *, etcd_endpoint: str | None, etcd_prefix: str, lease_ttl: float, **kw: Any
) -> "Registration":
    """Worker side. Extra keywords go to the backend (etcd: ``client``, ``first_timeout``)."""
    _check_backend(backend)
    from infera.discovery.etcd import EtcdRegistration

    return EtcdRegistration(_require_etcd_endpoint(etcd_endpoint), etcd_prefix, lease_ttl, **kw)


__all__ = ["DISCOVERY_BACKENDS", "make_discovery", "make_registration"]
