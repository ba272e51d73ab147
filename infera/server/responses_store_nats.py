"""The Responses API's conversations shared between server replicas through a NATS KV bucket, when
the server is on NATS: a follow-up naming ``previous_response_id`` may reach any replica (or any
process of a ``--workers N`` server), and GET/DELETE answer the same everywhere.

``SharedResponsesStore`` writes each stored response to the bucket (``--responses-store-bucket``)
and to the replica's own ``ResponsesStore``; reads go to the bucket first (it knows about a delete
made on another replica) and fall back to the local copy when the broker is away, slow (every call
bounded by ``timeout_s``) or never got the entry (a value over the broker's max payload). The bucket
is the KV stream created with the store's bounds: ``--responses-store-ttl`` as its max age,
``--responses-store-max-bytes`` as its size, the oldest entries dropped past it (discard old, where
a plain KV bucket would refuse new ones).
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

from nats.js import api
from nats.js.errors import BucketNotFoundError, KeyDeletedError, KeyNotFoundError, NotFoundError

from infera.runtime import wait_for
from infera.server.responses_store import ResponsesStore

log = logging.getLogger(__name__)

DEFAULT_BUCKET = "infera_responses"
_KEY = re.compile(r"[-/_=.a-zA-Z0-9]{1,255}")  # what a KV key may hold; other ids are never stored there


class SharedResponsesStore:
    """``ResponsesStore``'s interface over a NATS KV bucket, with the local store as fallback."""

    def __init__(self, local: ResponsesStore, nats: Any, bucket: str = DEFAULT_BUCKET, timeout_s: float = 2.0) -> None:
        self.local = local
        self.nats = nats
        self.bucket = bucket
        self.timeout_s = timeout_s
        self._kv: Any = None
        self._binding: asyncio.Lock | None = None

    @property
    def max_bytes(self) -> int:
        return self.local.max_bytes

    async def _bucket(self) -> Any:
        """The bound bucket, created with the store's bounds by the first replica to need it."""
        if self._kv is not None:
            return self._kv
        if self._binding is None:
            self._binding = asyncio.Lock()
        async with self._binding:
            if self._kv is None:
                js = self.nats.js
                try:
                    self._kv = await js.key_value(self.bucket)
                except BucketNotFoundError:
                    await js.add_stream(
                        api.StreamConfig(
                            name=f"KV_{self.bucket}",
                            subjects=[f"$KV.{self.bucket}.>"],
                            allow_direct=True,
                            allow_rollup_hdrs=True,
                            deny_delete=True,
                            discard=api.DiscardPolicy.OLD,
                            max_age=self.local.ttl_s,
                            max_bytes=self.local.max_bytes,
                            max_msgs_per_subject=1,
                            max_msg_size=min(self.local.max_bytes, self.nats.max_payload),
                            max_consumers=-1,
                            max_msgs=-1,
                            num_replicas=1,
                            duplicate_window=min(120.0, self.local.ttl_s),
                        )
                    )
                    self._kv = await js.key_value(self.bucket)
        return self._kv

    def _shared(self, response_id: str) -> bool:
        return self.local.max_bytes > 0 and self.nats.connected and _KEY.fullmatch(response_id) is not None

    async def put(self, response_id: str, value: bytes) -> bool:
        kept = await self.local.put(response_id, value)
        if not kept or not self._shared(response_id):
            return kept
        try:
            kv = await wait_for(self._bucket(), self.timeout_s)
            await wait_for(kv.put(response_id, value), self.timeout_s)
        except Exception as exc:  # the broker away or the value too big for it: this replica still has it
            log.info(
                "response %s kept on this replica only: the NATS KV bucket refused it (%s)",
                response_id,
                type(exc).__name__,
            )
        return kept

    async def get(self, response_id: str) -> bytes | None:
        if self._shared(response_id):
            try:
                kv = await wait_for(self._bucket(), self.timeout_s)
                entry = await wait_for(kv.get(response_id), self.timeout_s)
                return bytes(entry.value)
            except (KeyDeletedError, KeyNotFoundError, NotFoundError) as exc:
                if getattr(exc, "op", None) is not None:  # a delete marker (nats-py's get raises it as not found)
                    await self.local.delete(response_id)  # deleted on another replica
                    return None
                # never reached the bucket (or aged out there): the local copy, if any
            except Exception as exc:
                log.debug("NATS KV get of a response failed (%s): the local copy", type(exc).__name__)
        return await self.local.get(response_id)

    async def delete(self, response_id: str) -> bool:
        existed = await self.local.delete(response_id)
        if self._shared(response_id):
            try:
                kv = await wait_for(self._bucket(), self.timeout_s)
                try:
                    await wait_for(kv.get(response_id), self.timeout_s)
                    existed = True
                except (KeyNotFoundError, NotFoundError):
                    pass
                await wait_for(kv.delete(response_id), self.timeout_s)
            except Exception as exc:
                log.debug("NATS KV delete of a response failed (%s)", type(exc).__name__)
        return existed
