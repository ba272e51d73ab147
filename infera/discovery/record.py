"""The worker record: one schema, stored as JSON under ``<prefix><worker_id>``.

Unknown fields are ignored on decode so records can grow; ``schema`` versions the layout.
"""
from __future__ import annotations

from typing import Any, Literal, Optional

import msgspec

Engine = Literal["vllm", "sglang", "atom", "sim"]
Status = Literal["active", "draining"]
DisaggMode = Literal["mixed", "prefill", "decode"]

SCHEMA_VERSION = 1


class WorkerRecord(msgspec.Struct, kw_only=True, omit_defaults=False):
    worker_id: str
    url: str
    model_name: str
    engine: Engine = "sim"
    status: Status = "active"
    disagg_mode: DisaggMode = "mixed"
    disagg_meta: dict[str, Any] = msgspec.field(default_factory=dict)
    kv_events_endpoint: Optional[str] = None
    kv_events_replay_endpoint: Optional[str] = None  # vLLM's replay socket (DEALER), when enabled
    kv_block_size: Optional[int] = None
    dp_rank: Optional[int] = None
    dp_size: Optional[int] = None
    request_transport: Literal["http", "nats"] = "http"
    # Where this worker's KV events can be read: the engine's ZMQ publisher (always, at
    # kv_events_endpoint), and also JetStream when its launcher relays them there ("nats").
    kv_event_transport: Literal["zmq", "nats"] = "zmq"
    schema: int = SCHEMA_VERSION

    @property
    def is_active(self) -> bool:
        return self.status == "active"


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(WorkerRecord)


def encode_record(record: WorkerRecord) -> bytes:
    return _encoder.encode(record)


def decode_record(data: bytes | str) -> WorkerRecord:
    """Decode a record; raises ``msgspec.ValidationError``/``DecodeError`` on a bad value."""
    return _decoder.decode(data)


def record_to_dict(record: WorkerRecord) -> dict[str, Any]:
    return msgspec.to_builtins(record)
