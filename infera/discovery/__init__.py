"""Discovery backends: how servers find workers and how workers announce themselves.

Backends are imported lazily so picking one never imports another's dependencies.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from infera.discovery.base import Discovery, Registration

DISCOVERY_BACKENDS: tuple[str, ...] = ("etcd", "kubernetes")


def _check_backend(backend: str) -> None:
    if backend not in DISCOVERY_BACKENDS:
        raise ValueError(f"unknown discovery backend {backend!r} (choose from {', '.join(DISCOVERY_BACKENDS)})")


def _require(value: str | None, what: str) -> str:
    if not value:
        raise ValueError(what)
    return value


def make_discovery(backend: str, *, etcd_endpoint: str | None = None, etcd_prefix: str = "/infera/workers/",
                   k8s_namespace: str | None = None, k8s_label_selector: str | None = None, **kw: Any) -> "Discovery":
    """Server side. Extra keywords go to the backend (etcd: ``client``, ``backoff_initial``,
    ``backoff_max``; kubernetes: ``config``)."""
    _check_backend(backend)
    if backend == "kubernetes":
        from infera.discovery.kubernetes import KubernetesDiscovery

        return KubernetesDiscovery(
            _require(k8s_label_selector, "the kubernetes discovery backend needs a label selector"),
            k8s_namespace or "default", **kw)
    from infera.discovery.etcd import EtcdDiscovery

    return EtcdDiscovery(_require(etcd_endpoint, "the etcd discovery backend needs an etcd endpoint "
                                  "(host:port or http://host:port)"), etcd_prefix, **kw)


def make_registration(backend: str, *, etcd_endpoint: str | None = None, etcd_prefix: str = "/infera/workers/",
                      lease_ttl: float = 10.0, k8s_namespace: str | None = None, k8s_pod_name: str | None = None,
                      **kw: Any) -> "Registration":
    """Worker side. Extra keywords go to the backend (etcd: ``client``, ``first_timeout``;
    kubernetes: ``config``, ``refresh_s``)."""
    _check_backend(backend)
    if backend == "kubernetes":
        from infera.discovery.kubernetes import KubernetesRegistration

        return KubernetesRegistration(
            k8s_namespace or "default",
            _require(k8s_pod_name, "the kubernetes discovery backend needs the worker's Pod name (POD_NAME)"), **kw)
    from infera.discovery.etcd import EtcdRegistration

    return EtcdRegistration(_require(etcd_endpoint, "the etcd discovery backend needs an etcd endpoint "
                                     "(host:port or http://host:port)"), etcd_prefix, lease_ttl, **kw)


def discovery_options(args: Any, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The security keywords for make_discovery / make_registration from parsed plane flags:
    ``fleet_key`` (``--fleet-key-file``, read now) and, on the etcd backend, ``etcd_auth`` (``--etcd-user``
    + password, ``--etcd-cacert/-cert/-key``). ValueError with a readable message when a file cannot be
    read, a key is too short or a pair is half given (entry points turn it into a usage error)."""
    options: dict[str, Any] = {}
    path = getattr(args, "fleet_key_file", None)
    if path:
        from infera.discovery.record import FleetKey

        options["fleet_key"] = FleetKey.from_files(path)
    if getattr(args, "discovery_backend", "etcd") == "etcd":
        from infera.discovery.etcd import EtcdAuth

        auth = EtcdAuth.from_args(args, environ)
        if auth is not None:
            options["etcd_auth"] = auth
    return options


__all__ = ["DISCOVERY_BACKENDS", "discovery_options", "make_discovery", "make_registration"]
