"""Cluster DNS for Python processes run as Pods by the local test cluster (tests/fakes/kubelet.py).

Imported by every Python process whose ``PYTHONPATH`` starts with this directory (the LocalKubelet
puts it there). When ``INFERA_TEST_CLUSTER_HOSTS`` names a JSON file (rewritten atomically by the
kubelet: ``{"records": {"<fqdn>": ["ip", ...]}}``), ``socket.getaddrinfo``, ``gethostbyname`` and
``gethostbyname_ex`` answer cluster names from it, expanding a name with the Pod's DNS search path
as a Pod's ``resolv.conf`` does (``<ns>.svc.cluster.local svc.cluster.local cluster.local``, the
namespace from ``INFERA_TEST_CLUSTER_NAMESPACE``); every other name goes to the real resolver.
The file is re-read only when it changed (inode and mtime), so a lookup costs one ``stat``.
uvloop, which resolves in C, is patched when first imported (its loop's ``getaddrinfo`` and
``create_connection``). Other C-level resolvers (gRPC's c-ares, libcurl) are not covered.

Standalone on purpose: a Pod's interpreter must not import anything from the test tree.
"""
from __future__ import annotations

import importlib.util
import json
import os
import socket
import sys

HOSTS_ENV = "INFERA_TEST_CLUSTER_HOSTS"
NAMESPACE_ENV = "INFERA_TEST_CLUSTER_NAMESPACE"
CLUSTER_DOMAIN = "cluster.local"


def search_path(namespace: str, domain: str = CLUSTER_DOMAIN) -> list[str]:
    """A Pod's DNS search suffixes, most specific first (as kubelet writes resolv.conf)."""
    return [f"{namespace}.svc.{domain}", f"svc.{domain}", domain]


def candidates(name: str, namespace: str, domain: str = CLUSTER_DOMAIN) -> list[str]:
    """The fully qualified names tried for ``name``, in order: with ``ndots:5`` a name with fewer
    than 5 dots goes through the search path before being tried as it is; a trailing dot means
    absolute."""
    name = name.lower()
    if name.endswith("."):
        return [name.rstrip(".")]
    expanded = [f"{name}.{suffix}" for suffix in search_path(namespace, domain)]
    return expanded + [name] if name.count(".") < 5 else [name] + expanded


def lookup(records: dict[str, list[str]], name: str, namespace: str, domain: str = CLUSTER_DOMAIN) -> list[str] | None:
    """The IPs of ``name`` in ``records`` (fully qualified names), None when it is not a cluster name."""
    for fqdn in candidates(name, namespace, domain):
        ips = records.get(fqdn)
        if ips is not None:
            return list(ips)
    return None


class HostsFile:
    """The kubelet's records file, re-read when its inode or mtime changes."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._key: tuple[int, int] | None = None
        self._records: dict[str, list[str]] = {}

    def records(self) -> dict[str, list[str]]:
        try:
            st = os.stat(self.path)
        except OSError:
            return {}
        key = (st.st_ino, st.st_mtime_ns)
        if key != self._key:
            try:
                with open(self.path, encoding="utf-8") as f:
                    self._records = dict(json.load(f).get("records", {}))
                self._key = key
            except (OSError, ValueError):
                return self._records  # mid-write or unreadable: keep the last good records
        return self._records


def install(path: str, namespace: str) -> None:
    """Wrap the resolver functions of :mod:`socket` so cluster names resolve from ``path``."""
    hosts = HostsFile(path)
    real_getaddrinfo = socket.getaddrinfo
    real_gethostbyname = socket.gethostbyname
    real_gethostbyname_ex = socket.gethostbyname_ex

    def resolve(host) -> list[str] | None:
        if not isinstance(host, (str, bytes)) or not host:
            return None
        text = host.decode() if isinstance(host, bytes) else host
        if text.replace(".", "").isdigit() or ":" in text:
            return None  # an address already
        return lookup(hosts.records(), text, namespace)

    def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
        ips = resolve(host)
        if not ips:
            return real_getaddrinfo(host, port, family, type, proto, flags)
        out = []
        for ip in ips:
            try:
                out.extend(real_getaddrinfo(ip, port, family, type, proto, flags | socket.AI_NUMERICHOST))
            except socket.gaierror:
                continue  # an IPv4 record asked for AF_INET6
        if not out:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return out

    def gethostbyname(host):
        ips = resolve(host)
        return ips[0] if ips else real_gethostbyname(host)

    def gethostbyname_ex(host):
        ips = resolve(host)
        return (host, [], ips) if ips else real_gethostbyname_ex(host)

    socket.getaddrinfo = getaddrinfo
    socket.gethostbyname = gethostbyname
    socket.gethostbyname_ex = gethostbyname_ex
    sys.meta_path.insert(0, _PatchOnImport("uvloop", lambda module: _patch_uvloop(module, resolve)))


def _patch_uvloop(uvloop, resolve) -> None:
    """uvloop resolves names in C (libuv), past ``socket.getaddrinfo``: its loop's
    ``getaddrinfo`` and ``create_connection`` answer cluster names first."""
    loop_class = uvloop.Loop  # a Python subclass of the Cython loop: its methods can be replaced
    real_getaddrinfo = loop_class.getaddrinfo
    real_create_connection = loop_class.create_connection

    async def getaddrinfo(self, host, port, *, family=0, type=0, proto=0, flags=0):
        if resolve(host):
            return socket.getaddrinfo(host, port, family, type, proto, flags)  # numeric: no blocking
        return await real_getaddrinfo(self, host, port, family=family, type=type, proto=proto, flags=flags)

    async def create_connection(self, protocol_factory, host=None, port=None, *args, **kwargs):
        ips = resolve(host)
        if not ips:
            return await real_create_connection(self, protocol_factory, host, port, *args, **kwargs)
        if kwargs.get("ssl") and kwargs.get("server_hostname") is None:
            kwargs["server_hostname"] = host
        error: OSError | None = None
        for ip in ips:
            try:
                return await real_create_connection(self, protocol_factory, ip, port, *args, **kwargs)
            except OSError as exc:
                error = exc
        raise error  # type: ignore[misc]

    loop_class.getaddrinfo = getaddrinfo
    loop_class.create_connection = create_connection


class _PatchOnImport:
    """A meta path finder that runs ``patch(module)`` right after ``name`` is first imported
    (so a Pod that never uses uvloop does not pay for importing it)."""

    def __init__(self, name: str, patch) -> None:
        self.name = name
        self.patch = patch

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        real_exec = spec.loader.exec_module
        patch = self.patch

        def exec_module(module):
            real_exec(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get(HOSTS_ENV):
    install(os.environ[HOSTS_ENV], os.environ.get(NAMESPACE_ENV, "default"))
