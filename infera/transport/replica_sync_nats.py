"""Replica sync over NATS (``--replica-sync nats``): server replicas anywhere share, through the
broker, what only each of them knows. The protocol (message format, sequence gaps, full states,
heartbeats) is :mod:`infera.transport.replica_sync`'s; this file moves its messages.

Subject ``infera.replicas.<subject_token(model)>`` per model; a replica subscribes
``infera.replicas.*`` on the server's NATS connection. While NATS is down nothing is published
(deltas are dropped and counted); after a reconnect the full state goes out again, and the others'
gaps make them ask for theirs.
"""
from __future__ import annotations

import logging
from typing import Any

from infera.transport.nats_conn import NatsConnection
# The format lives in the shared base; re-exported for the callers that import it from here.
from infera.transport.replica_sync import (EMPTY_MODEL_TOKEN, SUBJECT_PREFIX, VERSION, Finished,
                                           ReplicaMsg, ReplicaSync, Started, _decode, _encode, model_of,
                                           pack_blocks, subject_for, unpack_blocks)

log = logging.getLogger(__name__)

__all__ = ["NatsReplicaSync", "EMPTY_MODEL_TOKEN", "SUBJECT_PREFIX", "VERSION", "Finished", "ReplicaMsg", "Started",
           "_decode", "_encode", "model_of", "pack_blocks", "subject_for", "unpack_blocks"]

PENDING_MSGS_LIMIT = 65536  # the subscription's queue (beyond: the broker drops; gaps are repaired)
PENDING_BYTES_LIMIT = 64 * 1024 * 1024


class NatsReplicaSync(ReplicaSync):
    """``attach`` (by the kv-aware policy), then ``start`` after the NATS connection was started;
    ``stop`` says goodbye."""

    transport = "nats"

    def __init__(self, nats: NatsConnection, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.nats = nats
        self._sub = None

    @property
    def connected(self) -> bool:
        return self.nats.connected

    def _watch(self) -> None:
        self.nats.on_reconnect(self._on_reconnect)

    async def _open(self) -> None:
        await self.nats.wait_connected()
        nc = self.nats.nc
        if self._sub is None:
            self._sub = await nc.subscribe(SUBJECT_PREFIX + "*", cb=self._on_msg,
                                           pending_msgs_limit=PENDING_MSGS_LIMIT,
                                           pending_bytes_limit=PENDING_BYTES_LIMIT)
        await nc.flush(timeout=5)  # subscribed on the broker before anything is published

    async def _send(self, subject: str, data: bytes) -> None:
        await self.nats.nc.publish(subject, data)

    async def _close(self) -> None:
        if self.nats.connected:
            try:
                await self.nats.nc.flush(timeout=2)
            except Exception as exc:  # noqa: BLE001 - best effort on the way out
                log.debug("replica sync: flush on stop: %s", exc)
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception as exc:  # noqa: BLE001
                log.debug("replica sync: unsubscribe: %s", exc)
            self._sub = None

    async def _on_msg(self, msg) -> None:
        self.receive(msg.subject, msg.data)
