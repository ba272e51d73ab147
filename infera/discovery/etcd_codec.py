"""etcd v3's JSON gateway, spelled out as pure functions: the errors a call can end in (and
:func:`_parse_response`, which maps the gateway's status and gRPC code to them: a dead lease, a
stale token, refused credentials), the base64 request bodies, ``prefix_end``, and the parsing of
range and keepalive answers and of a watch stream's newline-delimited JSON lines. No I/O; unit
tested on its own. ``etcd.py`` lists the gateway facts this relies on.
"""
from __future__ import annotations

import argparse
import base64
from typing import Any, Literal, NamedTuple

import msgspec

from infera.config import etcd_url

# gRPC status code etcd uses for "requested lease not found" (and other not-found errors).
_GRPC_NOT_FOUND = 5
_GRPC_PERMISSION_DENIED = 7
_GRPC_UNAUTHENTICATED = 16
# etcd's answers that mean "authenticate again": an expired/unknown token, or one issued before the
# auth store changed. The token is dropped and the call repeated once with a fresh one.
_STALE_TOKEN_MESSAGES = ("invalid auth token", "revision of auth store is old")
# etcd's answers that no retry can fix: no or wrong credentials, not allowed, auth not enabled.
_AUTH_MESSAGES = ("user name is empty", "authentication failed", "permission denied", "authentication is not enabled",
                  "user name not found", "invalid auth management", "CommonName of client")
ETCD_PASSWORD_ENV = "INFERA_ETCD_PASSWORD"


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------
class EtcdError(Exception):
    """Base class for every etcd failure raised by this module."""


class EtcdConnectionError(EtcdError):
    """etcd unreachable, timed out, or the connection broke mid-request."""


class EtcdTlsError(EtcdConnectionError):
    """The TLS handshake with etcd failed (its certificate not trusted, ours missing or refused):
    a configuration problem, not an outage."""

    def __init__(self, url: str, exc: BaseException) -> None:
        super().__init__(f"TLS with etcd at {url} failed ({_describe(exc)}); check --etcd-cacert (the CA that "
                         "verifies etcd) and --etcd-cert/--etcd-key (this client's certificate, which an etcd with "
                         "--client-cert-auth requires)")


class EtcdRequestError(EtcdError):
    """etcd answered with an error status/body."""

    def __init__(self, status: int, code: int | None, message: str) -> None:
        super().__init__(f"etcd error (HTTP {status}, code {code}): {message}")
        self.status = status
        self.code = code
        self.message = message

    @property
    def retryable(self) -> bool:
        """Server-side trouble (no leader yet, overloaded) is worth retrying; a bad request is not."""
        return self.status >= 500 or self.status == 429


class EtcdAuthError(EtcdRequestError):
    """etcd refused the credentials (none, wrong, not allowed): retrying will not help."""

    def __init__(self, status: int, code: int | None, message: str, *, stale_token: bool = False) -> None:
        super().__init__(status, code, message)
        self.stale_token = stale_token  # the token expired: authenticate again and repeat

    @property
    def retryable(self) -> bool:
        return False

    def __str__(self) -> str:
        if "user name is empty" in self.message:
            return (f"{self.message}: etcd has authentication enabled and this client has no credentials "
                    f"(--etcd-user, with {ETCD_PASSWORD_ENV} or --etcd-password-file)")
        if "CommonName of client" in self.message:
            return (f"{self.message}: with authentication on, etcd's HTTP gateway refuses a client certificate that "
                    "has a CommonName (--etcd-cert): issue one without a CN (a subjectAltName only)")
        return super().__str__()


class LeaseNotFound(EtcdRequestError):
    """The lease does not exist (expired, revoked, or etcd's data was wiped)."""


class WatchCanceled(EtcdError):
    """etcd cancelled the watch (for a reason other than compaction)."""


class WatchCompacted(WatchCanceled):
    """The watch's start revision was compacted away; the caller must re-list."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"watch start revision compacted (compact_revision={compact_revision})")
        self.compact_revision = compact_revision


# --------------------------------------------------------------------------------------------
# Codec (pure functions)
# --------------------------------------------------------------------------------------------
class WatchEvent(NamedTuple):
    kind: Literal["put", "delete"]
    key: str
    value: bytes  # b"" for deletes


class WatchBatch(NamedTuple):
    revision: int
    events: list[WatchEvent]


def normalize_endpoint(endpoint: str) -> str:
    """``host:port`` / ``host`` / ``http(s)://host[:port]`` → base URL (ValueError when malformed)."""
    try:
        return etcd_url(endpoint)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(str(exc)) from None


def _as_bytes(data: str | bytes) -> bytes:
    return data.encode("utf-8") if isinstance(data, str) else bytes(data)


def b64encode(data: str | bytes) -> str:
    return base64.b64encode(_as_bytes(data)).decode("ascii")


def b64decode(text: str | None) -> bytes:
    """The gateway omits empty fields, so a missing value decodes to ``b""``."""
    return base64.b64decode(text) if text else b""


def prefix_end(prefix: str | bytes) -> bytes:
    """The smallest key greater than every key starting with ``prefix`` (etcd's range_end).

    Increment the last byte; trailing 0xff bytes cannot be incremented so they are dropped first.
    An empty or all-0xff prefix has no upper bound: etcd spells that ``"\\0"`` ("to the end").
    """
    raw = bytearray(_as_bytes(prefix))
    while raw:
        if raw[-1] < 0xFF:
            raw[-1] += 1
            return bytes(raw)
        raw.pop()
    return b"\x00"


def _range_key(prefix: str | bytes) -> bytes:
    # etcd rejects an empty key; "\0" with range_end "\0" means "every key".
    return _as_bytes(prefix) or b"\x00"


def range_prefix_body(prefix: str | bytes) -> dict[str, Any]:
    return {"key": b64encode(_range_key(prefix)), "range_end": b64encode(prefix_end(prefix))}


def put_body(key: str | bytes, value: bytes, lease: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"key": b64encode(key), "value": b64encode(value)}
    if lease:
        body["lease"] = str(lease)  # int64 → JSON string, as the gateway expects
    return body


def watch_create_body(prefix: str | bytes, start_revision: int) -> dict[str, Any]:
    request = range_prefix_body(prefix)
    if start_revision > 0:
        request["start_revision"] = str(start_revision)
    return {"create_request": request}


def parse_range_response(body: dict[str, Any]) -> tuple[int, list[tuple[str, bytes]]]:
    """→ (store revision at read time, [(key, value)]); ``kvs`` is absent when nothing matched."""
    revision = int((body.get("header") or {}).get("revision") or 0)
    items = [
        (b64decode(kv.get("key")).decode("utf-8", "replace"), b64decode(kv.get("value")))
        for kv in body.get("kvs") or ()
    ]
    return revision, items


def parse_keepalive_ttl(body: dict[str, Any]) -> int:
    """Remaining TTL in seconds; 0 means the lease is gone (etcd just omits TTL then)."""
    result = body.get("result", body)
    return int(result.get("TTL") or 0)


def parse_watch_line(line: str | bytes) -> WatchBatch | None:
    """Parse one line of a watch stream.

    Returns None for lines that carry no events to apply (blank, ``created``), a
    :class:`WatchBatch` otherwise (possibly with no events, e.g. a progress notification).
    Raises :class:`WatchCompacted` / :class:`WatchCanceled` when etcd ends the watch, and
    :class:`EtcdError` for a stream-level error or an unparsable line.
    """
    line = line.strip()
    if not line:
        return None
    try:
        message = msgspec.json.decode(line)
    except msgspec.DecodeError as exc:
        raise EtcdError(f"unparsable watch line: {line[:200]!r}") from exc
    if not isinstance(message, dict):
        raise EtcdError(f"unexpected watch line: {line[:200]!r}")
    if "error" in message and "result" not in message:
        error = message["error"]
        text = error.get("message") if isinstance(error, dict) else message.get("message") or error
        raise EtcdError(f"watch stream error: {text}")
    result = message.get("result") or {}
    compact_revision = int(result.get("compact_revision") or 0)
    if compact_revision:
        raise WatchCompacted(compact_revision)
    if result.get("canceled"):
        raise WatchCanceled(f"watch canceled by etcd: {result.get('cancel_reason') or 'no reason given'}")
    if result.get("created"):
        return None
    revision = int((result.get("header") or {}).get("revision") or 0)
    events: list[WatchEvent] = []
    for event in result.get("events") or ():
        kv = event.get("kv") or {}
        key = b64decode(kv.get("key")).decode("utf-8", "replace")
        if event.get("type") == "DELETE":
            events.append(WatchEvent("delete", key, b""))
        else:  # PUT is the proto3 default enum value, so the gateway omits "type"
            events.append(WatchEvent("put", key, b64decode(kv.get("value"))))
    return WatchBatch(revision, events)


def _describe(exc: BaseException) -> str:
    """Short, readable error text (aiohttp reprs are very long; a TimeoutError's str() is empty)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _parse_response(path: str, status: int, raw: bytes) -> dict[str, Any]:
    try:
        body = msgspec.json.decode(raw) if raw else {}
    except msgspec.DecodeError:
        body = None
    if status != 200:
        if isinstance(body, dict):
            code, message = body.get("code"), str(body.get("message") or body.get("error"))
        else:  # e.g. a proxy's HTML error page
            code, message = None, raw[:200].decode("utf-8", "replace")
        if code == _GRPC_NOT_FOUND and "lease not found" in message:
            raise LeaseNotFound(status, code, message)
        if code == _GRPC_UNAUTHENTICATED or any(m in message for m in _STALE_TOKEN_MESSAGES):
            raise EtcdAuthError(status, code, f"{path}: {message}", stale_token=True)
        if code == _GRPC_PERMISSION_DENIED or any(m in message for m in _AUTH_MESSAGES):
            raise EtcdAuthError(status, code, f"{path}: {message}")
        raise EtcdRequestError(status, code, f"{path}: {message}")
    if not isinstance(body, dict):
        raise EtcdError(f"{path}: unexpected response body {raw[:200]!r}")
    return body
