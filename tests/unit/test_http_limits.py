"""The connection cap's choice (infera/server/limits.py): past the cap a new connection closes the
oldest one with no request in progress, or is refused when every one is busy; the default cap is
derived from the open-files limit; the in-flight bytes cap always lets one request through."""
from __future__ import annotations

import collections

from infera.server.limits import MIN_CONNECTIONS, ServerLimits, default_max_connections


class FakeConn:
    def __init__(self, busy: bool = False, queued: bool = False) -> None:
        self._request_in_progress = busy
        self._messages = collections.deque([1] if queued else [])
        self.evicted = False

    def evict(self) -> None:
        self.evicted = True


def test_past_the_cap_the_oldest_idle_connection_makes_room():
    limits = ServerLimits(max_connections=3)
    busy, idle_old, idle_new = FakeConn(busy=True), FakeConn(), FakeConn()
    for c in (busy, idle_old, idle_new):
        assert limits.admit(c)
    newcomer = FakeConn()
    assert limits.admit(newcomer)
    assert idle_old.evicted and not busy.evicted and not idle_new.evicted
    assert list(limits.connections) == [busy, idle_new, newcomer]
    assert (limits.evicted, limits.refused) == (1, 0)


def test_past_the_cap_with_every_connection_busy_the_newcomer_is_refused():
    limits = ServerLimits(max_connections=2)
    conns = [FakeConn(busy=True), FakeConn(queued=True)]  # a parsed request waiting counts as busy
    for c in conns:
        assert limits.admit(c)
    assert not limits.admit(FakeConn())
    assert not any(c.evicted for c in conns) and len(limits.connections) == 2
    assert limits.refused == 1


def test_the_default_cap_leaves_descriptors_for_upstream_connections():
    assert default_max_connections(256) == 96
    assert default_max_connections(1024) == 480
    assert default_max_connections(65536) == 32736
    assert default_max_connections(32) == MIN_CONNECTIONS
    assert default_max_connections() >= MIN_CONNECTIONS


def test_inflight_bytes_cap():
    limits = ServerLimits(max_inflight_bytes=100)
    assert limits.reserve(150)  # alone: always (it is under --max-request-bytes)
    assert not limits.reserve(1)
    limits.inflight_bytes -= 150
    assert limits.reserve(60) and limits.reserve(40) and not limits.reserve(1)


def test_flags_env_and_defaults():
    from infera.server.cli import parse_args

    base = ["--etcd-endpoint", "x:1"]
    args = parse_args(base, environ={})
    limits = ServerLimits.from_args(args)
    assert (limits.header_timeout, limits.body_timeout, limits.keepalive_timeout) == (15.0, 60.0, 75.0)
    assert limits.max_inflight_bytes == 512 * 1024 * 1024 and limits.max_connections == default_max_connections()
    env = {"INFERA_HEADER_TIMEOUT": "3", "INFERA_BODY_TIMEOUT": "0", "INFERA_KEEPALIVE_TIMEOUT": "5",
           "INFERA_MAX_CONNECTIONS": "100", "INFERA_MAX_INFLIGHT_BYTES": "1000"}
    limits = ServerLimits.from_args(parse_args(base, environ=env))
    assert (limits.header_timeout, limits.body_timeout, limits.keepalive_timeout) == (3.0, 0.0, 5.0)
    assert (limits.max_connections, limits.max_inflight_bytes) == (100, 1000)
    limits = ServerLimits.from_args(parse_args([*base, "--header-timeout", "9", "--max-connections", "7"], environ=env))
    assert (limits.header_timeout, limits.max_connections) == (9.0, 7)
