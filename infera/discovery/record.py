"""The worker record: one schema, stored as JSON under ``<prefix><worker_id>``.

Unknown fields are ignored on decode so records can grow; ``schema`` versions the layout.
"""
from __future__ import annotations

import hashlib
import os
from typing import Any, Literal, Optional

import msgspec

Engine = Literal["vllm", "sglang", "atom", "sim"]
Status = Literal["active", "draining"]
DisaggMode = Literal["mixed", "prefill", "decode"]

SCHEMA_VERSION = 1

# ``tokenizer`` of a worker whose engine tokenizes with the simulator's built-in tokenizer (a sim, or
# a sim stand-in, serving a model *name*). The colon keeps it apart from any path or hub id.
BUILTIN_TOKENIZER = "infera:builtin"


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
    # The tokenizer the engine was started with (its --tokenizer, else its model: an absolute folder
    # on the worker's host, a hub id, or BUILTIN_TOKENIZER), and the sha256 of that tokenizer.json
    # where the launcher could read it. A kv-aware server with no --router-tokenizer-path loads it.
    # Both None in records from older launchers.
    tokenizer: Optional[str] = None
    tokenizer_sha256: Optional[str] = None
    # The kvd socket (path on the worker's host) its engine's KV connector saves to and loads from:
    # the router then tells that engine each request's retention (router/engine_hints.py).
    kvd_socket: Optional[str] = None
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


def tokenizer_json_path(source: str | None) -> str | None:
    """The ``tokenizer.json`` a record's ``tokenizer`` names on this host: in a folder, the file
    itself, or a hub id's copy in the local Hugging Face cache (never downloaded); None if absent."""
    if not source or source == BUILTIN_TOKENIZER:
        return None
    if os.path.isdir(source):
        path = os.path.join(source, "tokenizer.json")
        return path if os.path.isfile(path) else None
    if os.path.isfile(source):
        return source
    try:
        from huggingface_hub import try_to_load_from_cache  # optional: only for hub ids
        cached = try_to_load_from_cache(source, "tokenizer.json")
    except Exception:  # not installed, not a valid repo id, unreadable cache
        return None
    return cached if isinstance(cached, str) and os.path.isfile(cached) else None


def tokenizer_fingerprint(source: str | None) -> str | None:
    """sha256 (hex) of the ``tokenizer.json`` ``source`` names here; None when there is none.

    Reads a file of a few MB: call it off the event loop.
    """
    path = tokenizer_json_path(source)
    if path is None:
        return None
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    except OSError:
        return None
    return digest.hexdigest()
