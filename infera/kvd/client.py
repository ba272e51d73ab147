"""kvd clients: ``KvdClient`` (asyncio) and ``SyncKvdClient`` (blocking, thread-safe: for an engine's
KV-connector threads). Both speak the same protocol and return the same types.

Keys are namespaced by ``(model, compat_key, key)``; ``key`` is bytes (an engine chunk key is 8
bytes). With ``prefers_shared_arena=True`` the client maps the daemon's arena: GETs of values the
daemon holds in arena slots are copied straight out of shared memory (seqlock-checked), and
``put_zero_copy`` writes a value into a leased slot and commits it, so the value never crosses the
socket.
"""
from __future__ import annotations

import asyncio
import os
import socket
import threading
from typing import Any, Iterable, NamedTuple, Sequence

import msgspec

from infera.kvd import protocol as p
from infera.kvd.arena import ArenaView, recv_fd, recv_fd_async
from infera.kvd.config import DEFAULT_SOCKET, SOCKET_ENV
from infera.runtime import wait_for


class KvdError(Exception):
    """The daemon answered with an error frame (``code`` from the protocol) or nonsense."""

    def __init__(self, code: str, message: str = ""):
        super().__init__(f"{code}: {message}" if message else code)
        self.code = code
        self.message = message


class SetResult(NamedTuple):
    accepted: bool
    reason: str = ""


def default_socket_path() -> str:
    return os.environ.get(SOCKET_ENV, DEFAULT_SOCKET)


def _expect(resp: p.Response, *types: type) -> Any:
    if isinstance(resp, p.Error):
        raise KvdError(resp.code, resp.message)
    if not isinstance(resp, types):
        raise KvdError(p.BAD_FRAME, f"expected {'/'.join(t.__name__ for t in types)}, got {type(resp).__name__}")
    return resp


def _value(resp: p.Response, view: ArenaView | None) -> tuple[bytes | None, str]:
    resp = _expect(resp, p.GetResponse, p.GetSharedResponse)
    if isinstance(resp, p.GetResponse):
        return resp.value, resp.retention
    if view is None:
        raise KvdError(p.BAD_FRAME, "shared answer on a connection without an arena")
    value = view.read(resp.slot_offset, resp.length, resp.version)
    return value, resp.retention if value is not None else ""


def _value_into(resp: p.Response, view: ArenaView | None, out: memoryview | bytearray) -> int | None:
    resp = _expect(resp, p.GetResponse, p.GetSharedResponse)
    if isinstance(resp, p.GetResponse):
        if resp.value is None:
            return None
        if len(resp.value) > len(out):
            raise ValueError(f"value of {len(resp.value)} bytes does not fit a {len(out)}-byte buffer")
        memoryview(out)[:len(resp.value)] = resp.value
        return len(resp.value)
    if view is None:
        raise KvdError(p.BAD_FRAME, "shared answer on a connection without an arena")
    if resp.length > len(out):
        raise ValueError(f"value of {resp.length} bytes does not fit a {len(out)}-byte buffer")
    return resp.length if view.read_into(resp.slot_offset, resp.length, resp.version, out) else None


def _values(resp: p.Response, view: ArenaView | None) -> list[bytes | None]:
    resp = _expect(resp, p.BatchGetResponse, p.BatchGetSharedResponse)
    if isinstance(resp, p.BatchGetResponse):
        return list(resp.values)
    if view is None:
        raise KvdError(p.BAD_FRAME, "shared answer on a connection without an arena")
    return [None if off < 0 else view.read(off, n, v)
            for off, n, v in zip(resp.offsets, resp.lengths, resp.versions)]


def _batch_set_msg(keys: Sequence[bytes], values: Sequence[bytes], retentions: Sequence[str] | None,
                   metadatas: Sequence[dict] | None, ttls_seconds: Sequence[float | None] | None,
                   model: str, compat_key: str) -> p.BatchSet:
    return p.BatchSet(keys=list(keys), values=list(values), retentions=list(retentions or []),
                      metadatas=list(metadatas or []), model=model, compat_key=compat_key,
                      ttls_seconds=None if ttls_seconds is None else list(ttls_seconds))


def _stats_dict(resp: p.Response) -> dict[str, int]:
    return msgspec.structs.asdict(_expect(resp, p.StatsResponse))


class KvdClient:
    """asyncio client. One request in flight per client (calls are serialized with a lock)."""

    def __init__(self, sock: socket.socket, hello: p.HelloAck | None, view: ArenaView | None):
        self._sock = sock
        self._lock = asyncio.Lock()
        self.hello = hello
        self.arena = view

    @classmethod
    async def connect(cls, path: str | None = None, *, client_id: str = "", prefers_shared_arena: bool = False,
                      timeout: float = 5.0, send_hello: bool = True) -> "KvdClient":
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await wait_for(loop.sock_connect(sock, path or default_socket_path()), timeout)
            hello = view = None
            if send_hello:
                await p.write_msg(loop, sock, p.Hello(client_id=client_id, prefers_shared_arena=prefers_shared_arena))
                hello = _expect(p.decode_response(await wait_for(p.read_frame(loop, sock), timeout)),
                                p.HelloAck)
                if hello.shared_arena is not None:
                    fd = await wait_for(recv_fd_async(loop, sock), timeout)
                    view = ArenaView(fd, hello.shared_arena[0])
            return cls(sock, hello, view)
        except BaseException:
            sock.close()
            raise

    async def close(self) -> None:
        self._sock.close()
        if self.arena is not None:
            self.arena.close()
            self.arena = None

    async def __aenter__(self) -> "KvdClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def request(self, msg: p.Message) -> p.Response:
        loop = asyncio.get_running_loop()
        async with self._lock:
            await p.write_msg(loop, self._sock, msg)
            return p.decode_response(await p.read_frame(loop, self._sock))

    async def send(self, msg: p.Message) -> None:
        """Send without waiting for an answer (prefetch_hint has none)."""
        async with self._lock:
            await p.write_msg(asyncio.get_running_loop(), self._sock, msg)

    async def get(self, key: bytes, *, model: str = "", compat_key: str = "") -> bytes | None:
        return (await self.get_with_retention(key, model=model, compat_key=compat_key))[0]

    async def get_with_retention(self, key: bytes, *, model: str = "", compat_key: str = "") -> tuple[bytes | None, str]:
        return _value(await self.request(p.Get(key=key, model=model, compat_key=compat_key)), self.arena)

    async def get_into(self, key: bytes, out: memoryview | bytearray, *, model: str = "",
                       compat_key: str = "") -> int | None:
        """Copy the value into ``out`` (from the arena when mapped: one copy, no bytes object);
        the number of bytes written, or None on a miss."""
        return _value_into(await self.request(p.Get(key=key, model=model, compat_key=compat_key)), self.arena, out)

    async def batch_get(self, keys: Sequence[bytes], *, model: str = "", compat_key: str = "") -> list[bytes | None]:
        return _values(await self.request(p.BatchGet(keys=list(keys), model=model, compat_key=compat_key)),
                       self.arena)

    async def set(self, key: bytes, value: bytes, *, retention: str = "short", model: str = "", compat_key: str = "",
                  metadata: dict | None = None, ttl_seconds: float | None = None) -> SetResult:
        ack = _expect(await self.request(p.Set(key=key, value=value, retention=retention, model=model,
                                               compat_key=compat_key, metadata=metadata or {},
                                               ttl_seconds=ttl_seconds)), p.SetAck)
        return SetResult(ack.accepted, ack.reason)

    async def batch_set(self, keys: Sequence[bytes], values: Sequence[bytes], *, retentions: Sequence[str] | None = None,
                        metadatas: Sequence[dict] | None = None, ttls_seconds: Sequence[float | None] | None = None,
                        model: str = "", compat_key: str = "") -> list[SetResult]:
        ack = _expect(await self.request(_batch_set_msg(keys, values, retentions, metadatas, ttls_seconds, model,
                                                        compat_key)), p.BatchSetAck)
        return [SetResult(a, r) for a, r in zip(ack.accepted, ack.reasons)]

    async def reserve(self, size: int) -> p.SetReserveResponse:
        return _expect(await self.request(p.SetReserve(size=size)), p.SetReserveResponse)

    async def commit(self, lease_token: int, key: bytes, length: int, *, retention: str = "default", model: str = "",
                     compat_key: str = "", ttl_seconds: float = 0) -> SetResult:
        r = _expect(await self.request(p.SetCommit(lease_token=lease_token, key=key, length=length, model=model,
                                                   compat_key=compat_key, retention=retention,
                                                   ttl_seconds=ttl_seconds)), p.SetCommitResponse)
        return SetResult(r.accepted, r.reason)

    async def cancel(self, lease_token: int) -> None:
        _expect(await self.request(p.SetCancel(lease_token=lease_token)), p.SetCancelResponse)

    async def put_zero_copy(self, key: bytes, value: bytes | memoryview, *, retention: str = "short", model: str = "",
                            compat_key: str = "", ttl_seconds: float = 0) -> SetResult:
        """Write into a leased arena slot and commit; a plain SET when there is no arena or no slot."""
        if self.arena is not None:
            lease = await self.reserve(len(value))
            if lease.lease_token:
                try:
                    self.arena.write_payload(lease.payload_offset, value)
                except BaseException:
                    await self.cancel(lease.lease_token)
                    raise
                return await self.commit(lease.lease_token, key, len(value), retention=retention, model=model,
                                         compat_key=compat_key, ttl_seconds=ttl_seconds)
        return await self.set(key, bytes(value), retention=retention, model=model, compat_key=compat_key,
                              ttl_seconds=ttl_seconds if ttl_seconds > 0 else None)

    async def exists(self, keys: Sequence[bytes], *, model: str = "", compat_key: str = "") -> list[bool]:
        return list(_expect(await self.request(p.Exists(keys=list(keys), model=model, compat_key=compat_key)),
                            p.ExistsResponse).present)

    async def prefetch_hint(self, keys: Iterable[bytes], *, model: str = "", compat_key: str = "",
                            deadline_ms: int = 1000) -> None:
        await self.send(p.PrefetchHint(keys=list(keys), model=model, compat_key=compat_key, deadline_ms=deadline_ms))

    async def clear(self, *, model: str = "", compat_key: str = "") -> int:
        return _expect(await self.request(p.Clear(model=model, compat_key=compat_key)), p.ClearAck).cleared_entries

    async def stats(self) -> dict[str, int]:
        return _stats_dict(await self.request(p.Stats()))


class SyncKvdClient:
    """Blocking client with the same methods as ``KvdClient``; safe to share between threads."""

    def __init__(self, path: str | None = None, *, client_id: str = "", prefers_shared_arena: bool = False,
                 timeout: float | None = 30.0, send_hello: bool = True):
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        self.hello: p.HelloAck | None = None
        self.arena: ArenaView | None = None
        try:
            self._sock.connect(path or default_socket_path())
            if send_hello:
                p.write_msg_sync(self._sock, p.Hello(client_id=client_id, prefers_shared_arena=prefers_shared_arena))
                self.hello = _expect(p.decode_response(p.read_frame_sync(self._sock)), p.HelloAck)
                if self.hello.shared_arena is not None:
                    self.arena = ArenaView(recv_fd(self._sock), self.hello.shared_arena[0])
        except BaseException:
            self._sock.close()
            raise

    def close(self) -> None:
        self._sock.close()
        if self.arena is not None:
            self.arena.close()
            self.arena = None

    def __enter__(self) -> "SyncKvdClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, msg: p.Message) -> p.Response:
        with self._lock:
            p.write_msg_sync(self._sock, msg)
            return p.decode_response(p.read_frame_sync(self._sock))

    def send(self, msg: p.Message) -> None:
        with self._lock:
            p.write_msg_sync(self._sock, msg)

    def get(self, key: bytes, *, model: str = "", compat_key: str = "") -> bytes | None:
        return self.get_with_retention(key, model=model, compat_key=compat_key)[0]

    def get_with_retention(self, key: bytes, *, model: str = "", compat_key: str = "") -> tuple[bytes | None, str]:
        return _value(self.request(p.Get(key=key, model=model, compat_key=compat_key)), self.arena)

    def get_into(self, key: bytes, out: memoryview | bytearray, *, model: str = "", compat_key: str = "") -> int | None:
        return _value_into(self.request(p.Get(key=key, model=model, compat_key=compat_key)), self.arena, out)

    def batch_get(self, keys: Sequence[bytes], *, model: str = "", compat_key: str = "") -> list[bytes | None]:
        return _values(self.request(p.BatchGet(keys=list(keys), model=model, compat_key=compat_key)), self.arena)

    def set(self, key: bytes, value: bytes, *, retention: str = "short", model: str = "", compat_key: str = "",
            metadata: dict | None = None, ttl_seconds: float | None = None) -> SetResult:
        ack = _expect(self.request(p.Set(key=key, value=value, retention=retention, model=model,
                                         compat_key=compat_key, metadata=metadata or {}, ttl_seconds=ttl_seconds)),
                      p.SetAck)
        return SetResult(ack.accepted, ack.reason)

    def batch_set(self, keys: Sequence[bytes], values: Sequence[bytes], *, retentions: Sequence[str] | None = None,
                  metadatas: Sequence[dict] | None = None, ttls_seconds: Sequence[float | None] | None = None,
                  model: str = "", compat_key: str = "") -> list[SetResult]:
        ack = _expect(self.request(_batch_set_msg(keys, values, retentions, metadatas, ttls_seconds, model,
                                                  compat_key)), p.BatchSetAck)
        return [SetResult(a, r) for a, r in zip(ack.accepted, ack.reasons)]

    def reserve(self, size: int) -> p.SetReserveResponse:
        return _expect(self.request(p.SetReserve(size=size)), p.SetReserveResponse)

    def commit(self, lease_token: int, key: bytes, length: int, *, retention: str = "default", model: str = "",
               compat_key: str = "", ttl_seconds: float = 0) -> SetResult:
        r = _expect(self.request(p.SetCommit(lease_token=lease_token, key=key, length=length, model=model,
                                             compat_key=compat_key, retention=retention, ttl_seconds=ttl_seconds)),
                    p.SetCommitResponse)
        return SetResult(r.accepted, r.reason)

    def cancel(self, lease_token: int) -> None:
        _expect(self.request(p.SetCancel(lease_token=lease_token)), p.SetCancelResponse)

    def put_zero_copy(self, key: bytes, value: bytes | memoryview, *, retention: str = "short", model: str = "",
                      compat_key: str = "", ttl_seconds: float = 0) -> SetResult:
        if self.arena is not None:
            lease = self.reserve(len(value))
            if lease.lease_token:
                try:
                    self.arena.write_payload(lease.payload_offset, value)
                except BaseException:
                    self.cancel(lease.lease_token)
                    raise
                return self.commit(lease.lease_token, key, len(value), retention=retention, model=model,
                                   compat_key=compat_key, ttl_seconds=ttl_seconds)
        return self.set(key, bytes(value), retention=retention, model=model, compat_key=compat_key,
                        ttl_seconds=ttl_seconds if ttl_seconds > 0 else None)

    def exists(self, keys: Sequence[bytes], *, model: str = "", compat_key: str = "") -> list[bool]:
        return list(_expect(self.request(p.Exists(keys=list(keys), model=model, compat_key=compat_key)),
                            p.ExistsResponse).present)

    def prefetch_hint(self, keys: Iterable[bytes], *, model: str = "", compat_key: str = "",
                      deadline_ms: int = 1000) -> None:
        self.send(p.PrefetchHint(keys=list(keys), model=model, compat_key=compat_key, deadline_ms=deadline_ms))

    def clear(self, *, model: str = "", compat_key: str = "") -> int:
        return _expect(self.request(p.Clear(model=model, compat_key=compat_key)), p.ClearAck).cleared_entries

    def stats(self) -> dict[str, int]:
        return _stats_dict(self.request(p.Stats()))
