"""A kvd connection for an engine's cache threads: outages are handled, never raised into the engine.

A call that fails is retried once on a fresh connection (a restarted daemon costs nothing); if
that fails too, the outage is logged once as an error and calls fail fast (``KvdUnavailable``)
until a reconnect, tried at most every ``RECONNECT_EVERY_S``, works. Thread-safe: engines call
from several threads (SGLang's HiCache prefetch and backup threads, vLLM's saver and loader); the
client itself serializes requests, the lock here only guards swapping the connection.

Used by vLLM's ``InferaKvdConnector`` and SGLang's ``InferaKvdBackend``.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from infera.kvd.client import KvdError, SyncKvdClient
from infera.kvd.protocol import ProtocolError

log = logging.getLogger(__name__)

RECONNECT_EVERY_S = 5.0
#: What a dead or wedged daemon raises: a closed socket, a timeout, an error reply, an answer that
#: does not decode.
DAEMON_ERRORS = (OSError, EOFError, KvdError, ProtocolError)


class KvdUnavailable(Exception):
    """kvd did not answer (already logged by ``ResilientKvdClient``)."""


class ResilientKvdClient:
    """One ``SyncKvdClient`` with outage handling (module docstring). The first connection is made
    here and its error raised: an unreachable daemon at start is a configuration error, and the
    engine should not start. ``outage`` and ``resumed`` say, in the log lines, what the engine does
    meanwhile ("recomputing instead of loading") and what comes back ("loading and saving resume")."""

    def __init__(self, socket_path: str, client_id: str, *, arena: bool, timeout: float,
                 outage: str = "calls miss", resumed: str = "calls resume") -> None:
        self.socket_path = socket_path
        self.client_id = client_id
        self.arena = arena
        self.timeout = timeout
        self.outage = outage
        self.resumed = resumed
        self._lock = threading.Lock()
        self.client: SyncKvdClient | None = self._connect()
        self._next_try = 0.0
        self._down = False  # in an outage (logged once)

    def _connect(self) -> SyncKvdClient:
        return SyncKvdClient(self.socket_path, client_id=self.client_id, prefers_shared_arena=self.arena,
                             timeout=self.timeout)

    def current(self) -> SyncKvdClient | None:
        """The connection, reconnected if it is down and a try is due; None in an outage."""
        with self._lock:
            if self.client is not None:
                return self.client
            now = time.monotonic()
            if now < self._next_try:
                return None
            self._next_try = now + RECONNECT_EVERY_S
            try:
                self.client = self._connect()
            except DAEMON_ERRORS:
                return None
            if self._down:
                self._down = False
                log.warning("kvd at %s is reachable again (%s): %s", self.socket_path, self.client_id, self.resumed)
            return self.client

    def call(self, fn: Callable[[SyncKvdClient], Any]) -> Any:
        """``fn(client)``; raises ``KvdUnavailable`` when the daemon does not answer."""
        client = self.current()
        if client is None:
            raise KvdUnavailable
        try:
            return fn(client)
        except DAEMON_ERRORS as first:
            self._drop(client)
            client = self._reconnect_after_loss(first)
            if client is None:
                self._failed(first)
                raise KvdUnavailable from first
            try:
                return fn(client)
            except DAEMON_ERRORS as second:
                self._drop(client)
                self._failed(second)
                raise KvdUnavailable from second

    def _reconnect_after_loss(self, error: BaseException) -> SyncKvdClient | None:
        with self._lock:
            if self.client is None:
                try:
                    self.client = self._connect()
                except DAEMON_ERRORS:
                    return None
                log.warning("kvd connection of %s was lost (%s); reconnected", self.client_id,
                            error or type(error).__name__)
            return self.client

    def _drop(self, client: SyncKvdClient) -> None:
        with self._lock:
            if self.client is client:
                self.client = None
        try:
            client.close()
        except (OSError, BufferError):
            pass

    def _failed(self, error: BaseException) -> None:
        with self._lock:
            self._next_try = time.monotonic() + RECONNECT_EVERY_S
            first = not self._down
            self._down = True
        if first:  # once per outage
            log.error("kvd at %s failed (%s: %s): %s until it answers again", self.socket_path, self.client_id,
                      error or type(error).__name__, self.outage)

    def close(self) -> None:
        with self._lock:
            client, self.client = self.client, None
        if client is not None:
            try:
                client.close()
            except (OSError, BufferError):
                pass


__all__ = ["DAEMON_ERRORS", "KvdUnavailable", "RECONNECT_EVERY_S", "ResilientKvdClient"]
