"""Pure codec of the etcd JSON gateway: request bodies, prefix_end, response and watch-line parsing."""
from __future__ import annotations

import base64

import pytest

from infera.discovery import DISCOVERY_BACKENDS, make_discovery, make_registration
from infera.discovery.etcd import (
    EtcdError,
    EtcdDiscovery,
    EtcdRegistration,
    LeaseNotFound,
    WatchBatch,
    WatchCanceled,
    WatchCompacted,
    WatchEvent,
    _parse_response,
    b64decode,
    b64encode,
    normalize_endpoint,
    parse_keepalive_ttl,
    parse_range_response,
    parse_watch_line,
    prefix_end,
    put_body,
    range_prefix_body,
    watch_create_body,
)


def b64(s: str | bytes) -> str:
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


@pytest.mark.parametrize(
    ("prefix", "expected"),
    [
        ("/infera/workers/", b"/infera/workers0"),  # '/' + 1 == '0'
        ("a", b"b"),
        (b"ab\xff", b"ac"),  # trailing 0xff can't be incremented: dropped, previous byte bumped
        (b"a\xff\xff", b"b"),
        (b"\xff", b"\x00"),  # no upper bound → "\0" (to the end of the keyspace)
        (b"\xff\xff", b"\x00"),
        ("", b"\x00"),
        ("é", "é".encode()[:-1] + bytes([0xA9 + 1])),  # works on UTF-8 bytes, not characters
    ],
)
def test_prefix_end(prefix: str | bytes, expected: bytes) -> None:
    assert prefix_end(prefix) == expected


def test_prefix_end_bounds_every_key_with_the_prefix() -> None:
    prefix = b"/p/"
    end = prefix_end(prefix)
    for key in (b"/p/", b"/p/a", b"/p/\xff\xff"):
        assert prefix <= key < end
    assert not (b"/p0" < end)


@pytest.mark.parametrize(
    ("data", "text"),
    [(b"", ""), (b"a", "YQ=="), ("/infera/", "L2luZmVyYS8="), (b"\x00\xff", "AP8=")],
)
def test_b64_roundtrip(data: str | bytes, text: str) -> None:
    assert b64encode(data) == text
    assert b64decode(text) == (data.encode() if isinstance(data, str) else data)


def test_b64decode_missing_field_is_empty() -> None:
    assert b64decode(None) == b""


def test_range_body() -> None:
    assert range_prefix_body("/w/") == {"key": b64("/w/"), "range_end": b64("/w0")}
    # etcd rejects an empty key: the whole keyspace is "\0".."\0"
    assert range_prefix_body("") == {"key": b64(b"\x00"), "range_end": b64(b"\x00")}


@pytest.mark.parametrize(
    ("lease", "expected"),
    [
        (None, {"key": b64("/w/a"), "value": b64(b"{}")}),
        (0, {"key": b64("/w/a"), "value": b64(b"{}")}),
        (7587862316453917747, {"key": b64("/w/a"), "value": b64(b"{}"), "lease": "7587862316453917747"}),
    ],
)
def test_put_body(lease: int | None, expected: dict) -> None:
    assert put_body("/w/a", b"{}", lease) == expected


def test_watch_create_body_revision_is_a_string() -> None:
    assert watch_create_body("/w/", 42) == {
        "create_request": {"key": b64("/w/"), "range_end": b64("/w0"), "start_revision": "42"}
    }
    assert "start_revision" not in watch_create_body("/w/", 0)["create_request"]


def test_parse_range_response() -> None:
    body = {
        "header": {"cluster_id": "1", "revision": "17"},
        "kvs": [
            {"key": b64("/w/a"), "create_revision": "2", "mod_revision": "5", "version": "2",
             "value": b64(b'{"x":1}'), "lease": "99"},
            {"key": b64("/w/b"), "mod_revision": "6"},  # empty value: the gateway omits it
        ],
        "count": "2",
    }
    assert parse_range_response(body) == (17, [("/w/a", b'{"x":1}'), ("/w/b", b"")])
    assert parse_range_response({"header": {"revision": "3"}}) == (3, [])  # kvs absent when empty


@pytest.mark.parametrize(
    ("body", "ttl"),
    [
        ({"result": {"header": {}, "ID": "5", "TTL": "10"}}, 10),
        ({"result": {"header": {}, "ID": "5"}}, 0),  # lease gone: TTL omitted
        ({"result": {"header": {}, "ID": "5", "TTL": "0"}}, 0),
    ],
)
def test_parse_keepalive_ttl(body: dict, ttl: int) -> None:
    assert parse_keepalive_ttl(body) == ttl


# Golden watch lines, as etcd 3.5's gateway writes them.
_CREATED = b'{"result":{"header":{"cluster_id":"1","member_id":"2","revision":"4","raft_term":"2"},"created":true}}'
_PUT = (b'{"result":{"header":{"cluster_id":"1","member_id":"2","revision":"5","raft_term":"2"},'
        b'"events":[{"kv":{"key":"L3cvYQ==","create_revision":"5","mod_revision":"5","version":"1","value":"Yg=="}}]}}')
_DELETE = (b'{"result":{"header":{"cluster_id":"1","member_id":"2","revision":"6","raft_term":"2"},'
           b'"events":[{"type":"DELETE","kv":{"key":"L3cvYQ==","mod_revision":"6"}}]}}')
_MIXED = (b'{"result":{"header":{"revision":"9"},"events":['
          b'{"kv":{"key":"L3cvYQ==","value":"MQ=="}},{"type":"DELETE","kv":{"key":"L3cvYg=="}},'
          b'{"type":"PUT","kv":{"key":"L3cvYw==","value":"Mw=="}}]}}')
_PROGRESS = b'{"result":{"header":{"revision":"12"}}}'
_COMPACTED = (b'{"result":{"header":{"cluster_id":"1","member_id":"2","raft_term":"2"},'
              b'"canceled":true,"compact_revision":"3"}}')
_CANCELED = b'{"result":{"header":{"revision":"7"},"canceled":true,"cancel_reason":"permission denied"}}'
_STREAM_ERROR = b'{"error":{"grpc_code":14,"http_code":503,"message":"etcdserver: no leader","http_status":"Service Unavailable"}}'


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (_CREATED, None),
        (b"", None),
        (b"  \r", None),
        (_PUT, WatchBatch(5, [WatchEvent("put", "/w/a", b"b")])),
        (_DELETE, WatchBatch(6, [WatchEvent("delete", "/w/a", b"")])),
        (_MIXED, WatchBatch(9, [WatchEvent("put", "/w/a", b"1"), WatchEvent("delete", "/w/b", b""),
                                WatchEvent("put", "/w/c", b"3")])),
        (_PROGRESS, WatchBatch(12, [])),
        (_PUT.decode() + "\n", WatchBatch(5, [WatchEvent("put", "/w/a", b"b")])),  # str + newline ok
    ],
)
def test_parse_watch_line(line: bytes | str, expected: WatchBatch | None) -> None:
    assert parse_watch_line(line) == expected


@pytest.mark.parametrize(
    ("line", "error", "match"),
    [
        (_COMPACTED, WatchCompacted, "compact_revision=3"),
        (_CANCELED, WatchCanceled, "permission denied"),
        (_STREAM_ERROR, EtcdError, "no leader"),
        (b"{not json", EtcdError, "unparsable"),
        (b"[1,2]", EtcdError, "unexpected"),
    ],
)
def test_parse_watch_line_errors(line: bytes, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match) as info:
        parse_watch_line(line)
    if error is WatchCompacted:
        assert info.value.compact_revision == 3


def test_error_responses() -> None:
    lease_gone = b'{"error":"etcdserver: requested lease not found","code":5,"message":"etcdserver: requested lease not found"}'
    with pytest.raises(LeaseNotFound):
        _parse_response("/v3/lease/revoke", 404, lease_gone)
    with pytest.raises(EtcdError, match="illegal base64") as info:
        _parse_response("/v3/kv/range", 400, b'{"error":"illegal base64 data","code":3,"message":"illegal base64 data"}')
    assert not info.value.retryable  # type: ignore[attr-defined]
    with pytest.raises(EtcdError) as info:
        _parse_response("/v3/kv/put", 503, b"upstream down")
    assert info.value.retryable  # type: ignore[attr-defined]
    assert _parse_response("/v3/kv/put", 200, b'{"header":{"revision":"2"}}') == {"header": {"revision": "2"}}


@pytest.mark.parametrize(
    ("endpoint", "url"),
    [("127.0.0.1:2379", "http://127.0.0.1:2379"), ("etcd", "http://etcd:2379"), ("https://e:1/", "https://e:1")],
)
def test_normalize_endpoint(endpoint: str, url: str) -> None:
    assert normalize_endpoint(endpoint) == url


def test_normalize_endpoint_rejects_garbage() -> None:
    with pytest.raises(ValueError):
        normalize_endpoint("ftp://x")


def test_registry() -> None:
    assert DISCOVERY_BACKENDS == ("etcd", "kubernetes")
    discovery = make_discovery("etcd", etcd_endpoint="127.0.0.1:2379", etcd_prefix="/infera/workers/")
    assert isinstance(discovery, EtcdDiscovery) and discovery.client.base_url == "http://127.0.0.1:2379"
    registration = make_registration("etcd", etcd_endpoint="h:1", etcd_prefix="/w/", lease_ttl=2.5)
    assert isinstance(registration, EtcdRegistration)
    assert registration.lease_ttl == 3 and registration.keepalive_interval == 1.0
    with pytest.raises(ValueError, match="unknown discovery backend 'zk'"):
        make_discovery("zk", etcd_endpoint="h:1", etcd_prefix="/w/")
    with pytest.raises(ValueError, match="needs an etcd endpoint"):
        make_registration("etcd", etcd_endpoint=None, etcd_prefix="/w/", lease_ttl=10)


# -- etcd authentication answers (--etcd-user) ----------------------------------------------------

def test_auth_errors_are_classified() -> None:
    from infera.discovery.etcd import EtcdAuthError

    def error(status: int, code: int, message: str) -> EtcdAuthError:
        raw = ('{"error":"%s","code":%d,"message":"%s"}' % (message, code, message)).encode()
        with pytest.raises(EtcdAuthError) as info:
            _parse_response("/v3/kv/put", status, raw)
        return info.value

    expired = error(401, 16, "etcdserver: invalid auth token")
    assert expired.stale_token and not expired.retryable
    assert error(400, 3, "etcdserver: revision of auth store is old").stale_token
    anonymous = error(400, 3, "etcdserver: user name is empty")
    assert not anonymous.stale_token and "no credentials" in str(anonymous) and "--etcd-user" in str(anonymous)
    assert not error(403, 7, "etcdserver: permission denied").stale_token
    assert not error(400, 3, "etcdserver: authentication failed, invalid user ID or password").stale_token
    with pytest.raises(EtcdAuthError, match="without a CN"):  # etcd answers this one in plain text
        _parse_response("/v3/kv/put", 400, b"CommonName of client sending a request against gateway will be ignored "
                                           b"and not used as expected\n")
    with pytest.raises(LeaseNotFound):  # unchanged
        _parse_response("/v3/lease/keepalive", 404, b'{"code":5,"message":"etcdserver: requested lease not found"}')


def test_etcd_auth_keeps_its_secret() -> None:
    from infera.discovery.etcd import EtcdAuth

    auth = EtcdAuth(user="u", password="s3cret-pw")
    assert "s3cret-pw" not in repr(auth) and auth.password == "s3cret-pw" and not auth.tls
    with pytest.raises(ValueError, match="both a user"):
        EtcdAuth(user="u")
    with pytest.raises(ValueError, match="both a user"):
        EtcdAuth(password="p")
    with pytest.raises(ValueError, match="both --etcd-cert and --etcd-key"):
        EtcdAuth(cert="/c.pem")
