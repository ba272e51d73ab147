"""etcd v3 discovery over etcd's JSON gateway (plain HTTP; no gRPC dependency).

Three layers:

* codec helpers (pure functions, unit-tested): base64 request bodies, ``prefix_end``, parsing of
  range/keepalive responses and of the newline-delimited JSON lines of a watch stream;
* :class:`EtcdClient`: a small async client over one keep-alive aiohttp session;
* :class:`EtcdDiscovery` (server side: list → reconcile → watch → re-list on any trouble) and
  :class:`EtcdRegistration` (worker side: lease + put + keepalive, re-asserting a lost lease).

Gateway facts this relies on (etcd 3.4 / 3.5): keys and values are base64 in every body; int64 ids
and revisions are JSON strings; a PUT watch event has no ``type`` field; a watch from a compacted
revision answers ``compact_revision`` and is cancelled (the HTTP stream itself stays open).
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import logging
import math
import os
import ssl
from typing import Any, AsyncGenerator, Literal, Mapping, NamedTuple

import aiohttp
import msgspec

from infera.config import etcd_url
from infera.discovery.fleet import Fleet
from infera.discovery.record import FleetKey, RecordSignatureError, WorkerRecord, decode_record, encode_record

log = logging.getLogger(__name__)

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
# How soon a keepalive that failed is tried again (never later than the normal ttl/3 cadence).
KEEPALIVE_RETRY_S = 1.0
_JSON_HEADERS = {"Content-Type": "application/json"}
# A single watch line is one gateway message; guard memory against a runaway stream without a newline.
_MAX_WATCH_LINE = 64 * 1024 * 1024


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


# --------------------------------------------------------------------------------------------
# Credentials
# --------------------------------------------------------------------------------------------
class EtcdAuth:
    """How a client proves itself to etcd: TLS (``cacert`` verifies etcd, ``cert``/``key`` is this
    client's certificate for ``--client-cert-auth``) and/or a user whose password buys a token
    (``/v3/auth/authenticate``), sent in the ``Authorization`` header and renewed when etcd says it
    expired. The password and token never appear in a repr, a log line or an error."""

    def __init__(self, *, user: str | None = None, password: str | None = None, cacert: str | None = None,
                 cert: str | None = None, key: str | None = None) -> None:
        if bool(user) != (password is not None):
            raise ValueError("etcd authentication needs both a user (--etcd-user) and its password "
                             f"({ETCD_PASSWORD_ENV} or --etcd-password-file)")
        if bool(cert) != bool(key):
            raise ValueError("an etcd client certificate needs both --etcd-cert and --etcd-key")
        self.user = user or None
        self._password = password
        self.cacert, self.cert, self.key = cacert, cert, key
        self._ssl: ssl.SSLContext | None = None
        if self.tls:
            self._ssl = self.ssl_context()  # unreadable files fail here, at start

    @property
    def tls(self) -> bool:
        return bool(self.cacert or self.cert)

    @property
    def password(self) -> str | None:
        return self._password

    def ssl_context(self) -> ssl.SSLContext:
        """A context that verifies etcd (``cacert``, else the system CAs) and presents ``cert``."""
        if self._ssl is not None:
            return self._ssl
        try:
            ctx = ssl.create_default_context(cafile=self.cacert) if self.cacert else ssl.create_default_context()
            if self.cert:
                ctx.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"etcd TLS files (--etcd-cacert/--etcd-cert/--etcd-key) unusable: {exc}") from None
        return ctx

    @classmethod
    def from_args(cls, args: Any, environ: Mapping[str, str] | None = None) -> "EtcdAuth | None":
        """From ``--etcd-user``, ``--etcd-password-file`` (else the ``INFERA_ETCD_PASSWORD`` env
        variable), ``--etcd-cacert``, ``--etcd-cert``, ``--etcd-key``; None when none is set.
        ValueError with a readable message for an unreadable file or a half-given pair."""
        environ = os.environ if environ is None else environ
        user = getattr(args, "etcd_user", None)
        password_file = getattr(args, "etcd_password_file", None)
        cacert, cert, key = (getattr(args, name, None) for name in ("etcd_cacert", "etcd_cert", "etcd_key"))
        password = None
        if password_file:
            try:
                with open(password_file, encoding="utf-8") as f:
                    password = f.read().strip("\r\n")
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"cannot read the etcd password file {password_file}: "
                                 f"{getattr(exc, 'strerror', None) or exc}") from None
        elif user and environ.get(ETCD_PASSWORD_ENV) is not None:
            password = environ[ETCD_PASSWORD_ENV]
        if not (user or password_file or cacert or cert or key):
            return None
        auth = cls(user=user, password=password, cacert=cacert, cert=cert, key=key)
        endpoint = getattr(args, "etcd_endpoint", None) or ""
        if auth.tls and endpoint.startswith("http://"):
            raise ValueError(f"etcd TLS files are set but the endpoint {endpoint} is plain http: use https://")
        return auth

    def __repr__(self) -> str:
        return (f"EtcdAuth(user={self.user!r}, password={'***' if self._password is not None else None}, "
                f"cacert={self.cacert!r}, cert={self.cert!r})")


# --------------------------------------------------------------------------------------------
# Client
# --------------------------------------------------------------------------------------------
class EtcdClient:
    """Async etcd v3 JSON-gateway client.

    ``session``: pass one to share a connection pool; it is then NOT closed by :meth:`close`.
    Without one, the client lazily creates (inside the running loop) and owns its session.
    ``timeout`` bounds each unary call; the watch stream has a connect timeout only.
    ``auth``: TLS and/or user credentials (:class:`EtcdAuth`); the TLS part needs an owned session.
    """

    def __init__(self, base_url: str, session: aiohttp.ClientSession | None = None, timeout: float = 5.0, *,
                 auth: EtcdAuth | None = None) -> None:
        self.base_url = normalize_endpoint(base_url)
        self.timeout = timeout
        self.auth = auth
        self._session = session
        self._owns_session = session is None
        self._token: str | None = None  # from /v3/auth/authenticate; never logged
        self._auth_lock = asyncio.Lock()
        self.authentications = 0  # tokens obtained (the first one, then one per expiry)

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or (self._owns_session and self._session.closed):
            # keep-alive pool: unary calls reuse connections; the watch holds one for itself.
            tls = self.auth.ssl_context() if self.auth is not None and self.base_url.startswith("https://") else None
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=32, keepalive_timeout=30, ssl=tls if tls is not None else True))
        return self._session

    async def _headers(self) -> dict[str, str]:
        """JSON headers, plus ``Authorization: <token>`` when this client logs in as a user."""
        if self.auth is None or self.auth.user is None:
            return _JSON_HEADERS
        token = self._token
        if token is None:
            async with self._auth_lock:
                if self._token is None:
                    self._token = await self._authenticate()
                token = self._token
        return {**_JSON_HEADERS, "Authorization": token}

    async def _authenticate(self) -> str:
        assert self.auth is not None
        body = await self._post("/v3/auth/authenticate", {"name": self.auth.user, "password": self.auth.password},
                                authenticated=False)
        token = body.get("token")
        if not token:
            raise EtcdAuthError(200, None, f"etcd authenticated {self.auth.user!r} but gave no token "
                                           "(is authentication enabled on this etcd?)")
        self.authentications += 1
        log.debug("authenticated to etcd at %s as %r", self.base_url, self.auth.user)
        return str(token)

    def _drop_token(self, sent: dict[str, str]) -> None:
        if self._token is not None and sent.get("Authorization") == self._token:
            self._token = None  # the next call authenticates again

    async def close(self) -> None:
        if self._owns_session and self._session is not None and not self._session.closed:
            await self._session.close()

    async def _post(self, path: str, body: dict[str, Any], timeout: float | None = None, *,
                    authenticated: bool = True) -> dict[str, Any]:
        if not authenticated:
            return await self._post_once(path, body, timeout, _JSON_HEADERS)
        headers = await self._headers()
        try:
            return await self._post_once(path, body, timeout, headers)
        except EtcdAuthError as exc:
            if not (exc.stale_token and "Authorization" in headers):
                raise
            log.info("etcd auth token for %r expired; authenticating again", self.auth.user if self.auth else None)
            self._drop_token(headers)
            return await self._post_once(path, body, timeout, await self._headers())

    async def _post_once(self, path: str, body: dict[str, Any], timeout: float | None,
                         headers: Mapping[str, str]) -> dict[str, Any]:
        url = self.base_url + path
        data = msgspec.json.encode(body)
        client_timeout = aiohttp.ClientTimeout(total=self.timeout if timeout is None else timeout)
        for attempt in (1, 2):
            try:
                session = self._get_session()
                async with session.post(url, data=data, headers=headers, timeout=client_timeout) as resp:
                    raw = await resp.read()
                    return _parse_response(path, resp.status, raw)
            except aiohttp.ClientSSLError as exc:
                raise EtcdTlsError(url, exc) from exc
            except aiohttp.ServerDisconnectedError as exc:
                # Typically a pooled keep-alive connection that etcd closed (e.g. it restarted):
                # one retry on a fresh connection. Every call here is safe to repeat.
                if attempt == 2:
                    raise EtcdConnectionError(f"{url}: {_describe(exc)}") from exc
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                raise EtcdConnectionError(f"{url}: {_describe(exc)}") from exc
        raise AssertionError("unreachable")

    async def _get(self, path: str, timeout: float | None = None) -> dict[str, Any]:
        url = self.base_url + path
        try:
            client_timeout = aiohttp.ClientTimeout(total=self.timeout if timeout is None else timeout)
            async with self._get_session().get(url, timeout=client_timeout) as resp:  # /health, /version: no auth
                return _parse_response(path, resp.status, await resp.read())
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise EtcdConnectionError(f"{url}: {_describe(exc)}") from exc

    # -- KV --------------------------------------------------------------------------------
    async def range_prefix(self, prefix: str, *, timeout: float | None = None) -> tuple[int, list[tuple[str, bytes]]]:
        """Every (key, value) under ``prefix`` plus the store revision the read saw."""
        return parse_range_response(await self._post("/v3/kv/range", range_prefix_body(prefix), timeout))

    async def put(self, key: str, value: bytes, lease: int | None = None, *, timeout: float | None = None) -> int:
        """Write ``key``; returns the new store revision. Raises LeaseNotFound for a dead lease."""
        body = await self._post("/v3/kv/put", put_body(key, value, lease), timeout)
        return int((body.get("header") or {}).get("revision") or 0)

    async def delete(self, key: str, *, timeout: float | None = None) -> int:
        """Delete one key; returns how many keys were deleted (0 or 1)."""
        body = await self._post("/v3/kv/deleterange", {"key": b64encode(key)}, timeout)
        return int(body.get("deleted") or 0)

    # -- leases ----------------------------------------------------------------------------
    async def grant(self, ttl: int, *, timeout: float | None = None) -> int:
        body = await self._post("/v3/lease/grant", {"TTL": int(ttl)}, timeout)
        if body.get("error") or not body.get("ID"):
            raise EtcdError(f"lease grant failed: {body.get('error') or body}")
        return int(body["ID"])

    async def keepalive(self, lease_id: int, *, timeout: float | None = None) -> int:
        """Refresh a lease once; returns its TTL, 0 when the lease no longer exists."""
        try:
            body = await self._post("/v3/lease/keepalive", {"ID": str(lease_id)}, timeout)
        except LeaseNotFound:
            return 0
        return parse_keepalive_ttl(body)

    async def revoke(self, lease_id: int, *, timeout: float | None = None) -> bool:
        """Revoke a lease (deleting its keys); False when it was already gone."""
        try:
            await self._post("/v3/lease/revoke", {"ID": str(lease_id)}, timeout)
        except LeaseNotFound:
            return False
        return True

    # -- misc ------------------------------------------------------------------------------
    async def health(self, *, timeout: float | None = None) -> bool:
        try:
            body = await self._get("/health", timeout)
        except EtcdError:
            return False
        return str(body.get("health")).lower() == "true"

    async def version(self, *, timeout: float | None = None) -> dict[str, Any]:
        return await self._get("/version", timeout)

    # -- watch -----------------------------------------------------------------------------
    async def watch_prefix(self, prefix: str, start_revision: int) -> AsyncGenerator[WatchBatch, None]:
        """Stream event batches for keys under ``prefix`` from ``start_revision`` on.

        Ends when etcd closes the stream; raises WatchCompacted / WatchCanceled when etcd cancels
        the watch, EtcdConnectionError when the connection fails. Either way: re-list, then
        re-watch. There is deliberately no read timeout: an idle fleet sends nothing for hours.
        """
        timeout = aiohttp.ClientTimeout(total=None, sock_read=None, connect=self.timeout, sock_connect=self.timeout)
        url = self.base_url + "/v3/watch"
        body = msgspec.json.encode(watch_create_body(prefix, start_revision))
        headers = await self._headers()
        try:
            resp = await self._get_session().post(url, data=body, headers=headers, timeout=timeout)
        except aiohttp.ClientSSLError as exc:
            raise EtcdTlsError(url, exc) from exc
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise EtcdConnectionError(f"{url}: {_describe(exc)}") from exc
        async with resp:
            if resp.status != 200:
                try:
                    _parse_response("/v3/watch", resp.status, await resp.read())
                except EtcdAuthError as exc:
                    if exc.stale_token:
                        self._drop_token(headers)  # the caller's re-list authenticates again
                    raise
            buffer = bytearray()
            try:
                # Split lines ourselves: StreamReader.readline caps line length, and one
                # gateway message can be large (a big batch of records in one revision).
                async for chunk in resp.content.iter_any():
                    buffer += chunk
                    while (newline := buffer.find(b"\n")) >= 0:
                        line = bytes(buffer[:newline])
                        del buffer[: newline + 1]
                        try:
                            batch = parse_watch_line(line)
                        except EtcdError as exc:
                            if any(m in str(exc) for m in _STALE_TOKEN_MESSAGES):
                                self._drop_token(headers)  # the caller's re-list authenticates again
                            raise
                        if batch is not None:
                            yield batch
                    if len(buffer) > _MAX_WATCH_LINE:
                        raise EtcdError("watch line exceeds size limit")
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                raise EtcdConnectionError(f"watch stream broke: {_describe(exc)}") from exc
            if buffer.strip():
                batch = parse_watch_line(bytes(buffer))
                if batch is not None:
                    yield batch


# --------------------------------------------------------------------------------------------
# Discovery (server side)
# --------------------------------------------------------------------------------------------
def _client_for(endpoint_url: str | None, client: "EtcdClient | None", who: str,
                auth: EtcdAuth | None = None) -> "tuple[EtcdClient, bool]":
    """(the client to use, whether we created it and so must close it)."""
    if client is not None:
        return client, False
    if not endpoint_url:
        raise ValueError(f"{who} needs an endpoint_url or a client")
    return EtcdClient(endpoint_url, auth=auth), True


class EtcdDiscovery:
    """Keep a :class:`Fleet` equal to the records under ``prefix``.

    Loop: list → ``fleet.replace_all`` (reconcile: drops ghosts whose DELETE was missed while
    disconnected) → watch from ``revision + 1`` → on any error / stream end / compaction: back off
    and re-list. While etcd is unreachable the fleet keeps its last known content.
    """

    def __init__(
        self,
        endpoint_url: str | None,
        prefix: str,
        *,
        client: EtcdClient | None = None,
        backoff_initial: float = 0.2,
        backoff_max: float = 5.0,
        fleet_key: FleetKey | None = None,
        etcd_auth: EtcdAuth | None = None,
    ) -> None:
        self.client, self._owns_client = _client_for(endpoint_url, client, "EtcdDiscovery", etcd_auth)
        self.prefix = prefix
        # With a fleet key, only records it signed are applied (anyone able to write to etcd could
        # otherwise announce a worker and receive prompts).
        self.fleet_key = fleet_key
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.ready = asyncio.Event()  # set after the first successful list
        self.relists = 0  # successful lists (the first one included)
        self.last_error: str | None = None
        self._fleet: Fleet | None = None
        self._task: asyncio.Task[None] | None = None
        # key → record currently applied from it; lets a DELETE remove the record's worker_id even
        # when it differs from the key suffix (we trust the record).
        self._records_by_key: dict[str, WorkerRecord] = {}
        self._undecodable_keys: set[str] = set()  # log a bad value once, not on every re-list
        self._rejected_keys: set[str] = set()  # unsigned / wrongly signed records: logged once per key

    async def start(self, fleet: Fleet) -> None:
        """Launch the background loop and return at once (etcd may well be down right now)."""
        if self._task is not None:
            raise RuntimeError("EtcdDiscovery already started")
        self._fleet = fleet
        self._task = asyncio.create_task(self._run(fleet), name=f"etcd-discovery:{self.prefix}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task])  # wait for it to unwind; do not swallow our own cancellation
        if self._owns_client:
            await self.client.close()

    # -- loop ------------------------------------------------------------------------------
    async def _run(self, fleet: Fleet) -> None:
        backoff = self.backoff_initial
        failures = 0
        while True:
            try:
                revision = await self._relist(fleet)
                if failures:
                    log.info("etcd discovery recovered after %d failed attempt(s)", failures)
                failures = 0
                backoff = self.backoff_initial
                await self._watch(fleet, revision + 1)
                self.last_error = "watch stream ended"
                log.info("etcd watch stream on %s ended; re-listing", self.prefix)
            except asyncio.CancelledError:
                raise
            except WatchCompacted as exc:
                self.last_error = str(exc)
                log.warning("etcd watch on %s fell behind compaction (%s); re-listing", self.prefix, exc)
            except Exception as exc:  # never let discovery die: anything else means "re-list later"
                failures += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                # First failure of an outage at WARNING; repeats at DEBUG so a long outage isn't log spam.
                log.log(logging.WARNING if failures == 1 else logging.DEBUG,
                        "etcd discovery on %s failed (%s); retrying in %.1fs", self.prefix, self.last_error, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.backoff_max)

    async def _relist(self, fleet: Fleet) -> int:
        revision, items = await self.client.range_prefix(self.prefix)
        records_by_key: dict[str, WorkerRecord] = {}
        for key, value in items:
            record = self._decode(key, value)
            if record is not None:
                records_by_key[key] = record
        self._records_by_key = records_by_key
        fleet.replace_all(records_by_key.values())
        self.relists += 1
        self.ready.set()
        log.debug("etcd list of %s at revision %d: %d worker(s)", self.prefix, revision, len(records_by_key))
        return revision

    async def _watch(self, fleet: Fleet, start_revision: int) -> None:
        stream = self.client.watch_prefix(self.prefix, start_revision)
        try:
            async for batch in stream:
                for event in batch.events:
                    self._apply(fleet, event)
        finally:
            await stream.aclose()  # release the HTTP stream promptly

    def _apply(self, fleet: Fleet, event: WatchEvent) -> None:
        if event.kind == "put":
            record = self._decode(event.key, event.value)
            old = self._records_by_key.pop(event.key, None)
            if record is not None:
                self._records_by_key[event.key] = record
                fleet.upsert(record)
            if old is not None and (record is None or old.worker_id != record.worker_id):
                fleet.release(old.worker_id, self._records_by_key.values())
        else:
            old = self._records_by_key.pop(event.key, None)
            self._undecodable_keys.discard(event.key)
            self._rejected_keys.discard(event.key)
            if old is not None:
                fleet.release(old.worker_id, self._records_by_key.values())
            else:
                fleet.remove(self._key_suffix(event.key))

    def _decode(self, key: str, value: bytes) -> WorkerRecord | None:
        try:
            record = decode_record(value, self.fleet_key)
        except RecordSignatureError as exc:
            if key not in self._rejected_keys:
                self._rejected_keys.add(key)
                log.warning("ignoring worker record at %r: %s; it is not routed to (a fleet key is set: only "
                            "records signed with it count)", key, exc)
            return None
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            if key not in self._undecodable_keys:
                self._undecodable_keys.add(key)
                log.warning("skipping undecodable worker record at %s: %s", key, exc)
            return None
        self._undecodable_keys.discard(key)
        self._rejected_keys.discard(key)
        suffix = self._key_suffix(key)
        if record.worker_id != suffix:
            log.debug("record at %s names worker_id %r; trusting the record", key, record.worker_id)
        return record

    def _key_suffix(self, key: str) -> str:
        return key[len(self.prefix):] if key.startswith(self.prefix) else key


# --------------------------------------------------------------------------------------------
# Registration (worker side)
# --------------------------------------------------------------------------------------------
class EtcdRegistration:
    """Publish one worker record at ``<prefix><worker_id>`` under a lease kept alive in the background.

    If the lease is found gone (etcd wiped, lease expired while paused) the record is re-granted
    and re-put; while etcd is unreachable the keepalive retries every ``KEEPALIVE_RETRY_S`` (at
    most its normal cadence) until etcd answers.
    """

    def __init__(
        self,
        endpoint_url: str | None,
        prefix: str,
        ttl: float = 10,
        *,
        client: EtcdClient | None = None,
        first_timeout: float = 30.0,
        fleet_key: FleetKey | None = None,
        etcd_auth: EtcdAuth | None = None,
    ) -> None:
        self.client, self._owns_client = _client_for(endpoint_url, client, "EtcdRegistration", etcd_auth)
        self.prefix = prefix
        self.fleet_key = fleet_key  # signs every record put (servers with the key ignore unsigned ones)
        self.lease_ttl = max(1, math.ceil(ttl))  # etcd leases are whole seconds
        self.keepalive_interval = max(self.lease_ttl / 3, 0.5)
        self.first_timeout = first_timeout
        self.lease_id: int | None = None
        self.record: WorkerRecord | None = None
        self.reregistrations = 0  # times the lease had to be re-granted after being lost
        self._pending_put = False  # an update() that could not be written yet
        self._registered = False
        self._keepalive_task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()  # serialises lease/put changes between update() and keepalive

    @property
    def key(self) -> str:
        if self.record is None:
            raise RuntimeError("not registered")
        return self.prefix + self.record.worker_id

    async def register(self, record: WorkerRecord) -> None:
        """Grant a lease, put the record, start the keepalive.

        Raises EtcdError when etcd cannot be reached within ``first_timeout`` seconds (or refuses
        the request outright); later outages are ridden out in the background.
        """
        if self._keepalive_task is not None:
            raise RuntimeError("already registered; use update() to change the record")
        self.record = record
        try:
            await asyncio.wait_for(self._first_registration(), self.first_timeout)
        except asyncio.TimeoutError:
            raise EtcdConnectionError(
                f"could not register {record.worker_id} in etcd at {self.client.base_url} "
                f"within {self.first_timeout:.0f}s") from None
        self._registered = True
        self._keepalive_task = asyncio.create_task(self._keepalive_loop(), name=f"etcd-keepalive:{record.worker_id}")

    async def _first_registration(self) -> None:
        delay = 0.1
        while True:
            try:
                await self._grant_and_put()
                return
            except EtcdTlsError:
                raise  # a wrong certificate does not fix itself
            except EtcdRequestError as exc:
                if not exc.retryable:
                    raise
                error: EtcdError = exc
            except EtcdError as exc:
                error = exc
            log.info("etcd not ready for registration (%s); retrying in %.1fs", error, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    async def _grant_and_put(self) -> None:
        async with self._lock:
            assert self.record is not None
            # A lease that failed halfway (granted, put failed) is simply left to expire.
            self.lease_id = await self.client.grant(self.lease_ttl)
            await self.client.put(self.key, encode_record(self.record, self.fleet_key), self.lease_id)
            self._pending_put = False
            log.info("registered %s in etcd (lease %x, ttl %ds)", self.key, self.lease_id, self.lease_ttl)

    async def update(self, record: WorkerRecord) -> bool:
        """Re-put a changed record under the current lease.

        Returns True when written now; False when etcd is unreachable — the keepalive loop then
        writes the latest record as soon as etcd answers again. A lost lease is re-granted.
        """
        if not self._registered or self.record is None:
            raise RuntimeError("update() needs a live registration (call register() first)")
        if record.worker_id != self.record.worker_id:
            raise ValueError("update() cannot change worker_id; deregister and register instead")
        self.record = record
        try:
            async with self._lock:
                await self.client.put(self.key, encode_record(record, self.fleet_key), self.lease_id)
                self._pending_put = False
            return True
        except LeaseNotFound:
            try:
                await self._grant_and_put()
                self.reregistrations += 1
                return True
            except EtcdError as exc:
                log.warning("could not re-register %s: %s (will retry)", self.key, exc)
        except EtcdError as exc:
            log.warning("could not update %s: %s (will retry)", self.key, exc)
        self._pending_put = True
        return False

    async def _keepalive_loop(self) -> None:
        failing = False
        while True:
            # After a failure, try again soon rather than a whole interval later: at the default
            # ttl/3 cadence a lease only gets two more tries before it lapses.
            await asyncio.sleep(min(self.keepalive_interval, KEEPALIVE_RETRY_S) if failing else self.keepalive_interval)
            try:
                # Bound each call by the cadence so one hung request can't outlive the lease.
                timeout = max(self.keepalive_interval, 1.0)
                ttl = await self.client.keepalive(self.lease_id, timeout=timeout) if self.lease_id else 0
                if ttl <= 0:
                    log.warning("lease for %s is gone (etcd wiped or lease expired); re-registering", self.key)
                    await self._grant_and_put()
                    self.reregistrations += 1
                elif self._pending_put:
                    async with self._lock:
                        await self.client.put(self.key, encode_record(self.record, self.fleet_key), self.lease_id,
                                              timeout=timeout)
                        self._pending_put = False
                if failing:
                    log.info("etcd reachable again; %s is registered", self.key)
                    failing = False
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep trying at the same cadence; never die
                if not failing:
                    log.warning("etcd keepalive for %s failed: %s (retrying every %.1fs)", self.key, exc,
                                min(self.keepalive_interval, KEEPALIVE_RETRY_S))
                    failing = True

    async def deregister(self) -> None:
        """Stop the keepalive, delete the key, revoke the lease. Logs failures; never raises."""
        await self._stop_keepalive()  # FIRST, so it cannot re-assert the record behind our back
        self._registered = False
        lease_id, self.lease_id = self.lease_id, None
        if self.record is not None:
            try:
                await self.client.delete(self.key, timeout=10)
            except Exception as exc:
                log.warning("deregister: could not delete %s: %s", self.key, exc)
        if lease_id is not None:
            try:
                await self.client.revoke(lease_id, timeout=10)
            except Exception as exc:
                log.warning("deregister: could not revoke lease %x: %s (it expires in %ds)", lease_id, exc,
                            self.lease_ttl)
        if self.record is not None:
            log.info("deregistered %s", self.key)

    async def close(self) -> None:
        """Stop the keepalive and close an owned client. Does NOT delete the key: without
        deregister() first, the record lingers until its lease expires (like a crashed worker)."""
        await self._stop_keepalive()
        self._registered = False
        if self._owns_client:
            await self.client.close()

    async def _stop_keepalive(self) -> None:
        task, self._keepalive_task = self._keepalive_task, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task])
