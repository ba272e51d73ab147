"""The etcd v3 client over the JSON gateway: :class:`EtcdAuth` (TLS files and a user's password,
which buys a token sent in ``Authorization`` and renewed when etcd says it expired; neither ever
logged) and :class:`EtcdClient`, a small async client over one keep-alive aiohttp session: KV
range/put/delete, leases, health and a prefix watch stream with its own line splitting. The
request bodies and answers' parsing are in ``etcd_codec.py``.
"""
from __future__ import annotations

import asyncio
import logging
import os
import ssl
from typing import Any, AsyncGenerator, Mapping

import aiohttp
import msgspec

from infera.discovery.etcd_codec import (_STALE_TOKEN_MESSAGES, ETCD_PASSWORD_ENV, EtcdAuthError, EtcdConnectionError,
                                         EtcdError, EtcdTlsError, LeaseNotFound, WatchBatch, _describe,
                                         _parse_response, b64encode, normalize_endpoint, parse_keepalive_ttl,
                                         parse_range_response, parse_watch_line, put_body, range_prefix_body,
                                         watch_create_body)

log = logging.getLogger("infera.discovery.etcd")  # the name etcd's logs have always had

_JSON_HEADERS = {"Content-Type": "application/json"}
# A single watch line is one gateway message; guard memory against a runaway stream without a newline.
_MAX_WATCH_LINE = 64 * 1024 * 1024


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


def _client_for(endpoint_url: str | None, client: "EtcdClient | None", who: str,
                auth: EtcdAuth | None = None) -> "tuple[EtcdClient, bool]":
    """(the client to use, whether we created it and so must close it)."""
    if client is not None:
        return client, False
    if not endpoint_url:
        raise ValueError(f"{who} needs an endpoint_url or a client")
    return EtcdClient(endpoint_url, auth=auth), True
