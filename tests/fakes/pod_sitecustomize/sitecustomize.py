"""Cluster DNS for Python processes run as Pods by the local test cluster (tests/fakes/kubelet.py).

Imported by every Python process whose ``PYTHONPATH`` starts with this directory (the LocalKubelet
puts it there). When ``INFERA_TEST_CLUSTER_HOSTS`` names a JSON file (rewritten atomically by the
kubelet: ``{"records": {"<fqdn>": ["ip", ...]}}``), ``socket.getaddrinfo``, ``gethostbyname`` and
``gethostbyname_ex`` answer cluster names from it, expanding a name with the Pod's DNS search path
as a Pod's ``resolv.conf`` does (``<ns>.svc.cluster.local svc.cluster.local cluster.local``, the
namespace from ``INFERA_TEST_CLUSTER_NAMESPACE``); every other name goes to the real resolver.
The file is re-read only when it changed (inode and mtime), so a lookup costs one ``stat``.

Standalone on purpose: a Pod's interpreter must not import anything from the test tree.
"""
from __future__ import annotations

import json
import os
import socket

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


if os.environ.get(HOSTS_ENV):
    install(os.environ[HOSTS_ENV], os.environ.get(NAMESPACE_ENV, "default"))
