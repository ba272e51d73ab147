"""The worker record: one schema, stored as JSON under ``<prefix><worker_id>``.

Unknown fields are ignored on decode so records can grow; ``schema`` versions the layout.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import time
from typing import Any, Literal, Optional, Sequence

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
    # What the worker serves besides the model's text generation, as its launcher read it from the
    # engine's flags and /v1/models: pooling tasks ("embed", "classify", "score", ...; a pooling
    # worker lists no "generate"), so the router sends an endpoint only to workers that serve it.
    # Empty in records from older launchers: a generative worker.
    tasks: list[str] = msgspec.field(default_factory=list)
    # The engine serves Anthropic's Messages API (/v1/messages) itself, so the router passes such
    # requests through instead of translating them. False in records from older launchers.
    anthropic_messages: bool = False
    # The LoRA adapters the engine has loaded (static --lora-modules and dynamic loads), by the
    # name requests use as their model; the launcher keeps it current. Requests for an adapter go
    # only to workers listing it. Empty in records from older launchers.
    lora_adapters: list[str] = msgspec.field(default_factory=list)
    # The engine's --max-loras (adapters it serves at once), so on-demand loads go first to workers
    # under it. 0: unknown (records from older launchers, engines without LoRA).
    lora_max: int = 0
    schema: int = SCHEMA_VERSION

    @property
    def is_active(self) -> bool:
        return self.status == "active"


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(WorkerRecord)


def encode_record(record: WorkerRecord, key: "FleetKey | None" = None) -> bytes:
    """The record's JSON; with ``key``, signed (see :class:`FleetKey`)."""
    return _encoder.encode(record) if key is None else key.sign(record)


def decode_record(data: bytes | str, key: "FleetKey | None" = None) -> WorkerRecord:
    """Decode a record; raises ``msgspec.ValidationError``/``DecodeError`` on a bad value.

    With ``key``, only a record signed with that key decodes: else :class:`RecordSignatureError`.
    Without, a signature is an unknown field, ignored (as by servers older than signing)."""
    try:
        return _decoder.decode(data) if key is None else key.verify(data)
    except RecursionError:  # JSON nested past msgspec's limit: a bad value, not a discovery crash
        raise msgspec.DecodeError("worker record nested too deeply") from None


# -- signed records ------------------------------------------------------------------------------
# Anyone who can write to the registry (etcd, a Pod's annotations) could otherwise announce a
# "worker" and receive prompts. With a shared fleet key, workers sign their records and servers drop
# the rest. The signature is one more field of the record's JSON object, so servers without the key
# (or older than signing) read signed records as before.
SIGNATURE_FIELD = "signature"
SIGNATURE_ALG = "hmac-sha256"
MIN_FLEET_KEY_BYTES = 16
_MAC_DOMAIN = b"infera-worker-record-v1\n"
_canonical_encoder = msgspec.json.Encoder(order="sorted")


class RecordSignatureError(ValueError):
    """A record that is unsigned, signed with another key, or altered after signing."""


class _Signature(msgspec.Struct, kw_only=True):
    alg: str
    kid: str
    ts: int
    mac: str


def _fingerprint(key: bytes) -> str:
    return hashlib.sha256(b"infera-fleet-key-id\n" + key).hexdigest()[:12]


class FleetKey:
    """A shared HMAC-SHA256 key (``--fleet-key-file``) that signs and verifies worker records.

    Signed bytes: every field of the record's JSON object except ``signature``, re-encoded with keys
    sorted (unknown fields included, so a newer launcher's fields are covered too), preceded by the
    key id and the signing time, which ``signature`` also carries. A verified record is decoded from
    exactly those bytes, so no parser difference can slip an unsigned value past the check.
    Not covered: replaying a record the key once signed (it names a real worker's own address).

    Key rotation: ``also_accept`` keys verify too (never sign). Servers first get ``new,old``, then the
    workers ``new``, then the servers ``new`` alone.
    """

    def __init__(self, key: bytes, also_accept: "Sequence[FleetKey]" = ()) -> None:
        if len(key) < MIN_FLEET_KEY_BYTES:
            raise ValueError(f"fleet key too short: {len(key)} bytes, at least {MIN_FLEET_KEY_BYTES} needed")
        self._key = bytes(key)
        self.kid = _fingerprint(self._key)  # names the key in logs; reveals nothing of it
        self._accepted = {self.kid: self._key, **{k.kid: k._key for k in also_accept}}  # key id → secret

    @classmethod
    def from_file(cls, path: str) -> "FleetKey":
        """The key is the file's content, surrounding blanks (a trailing newline) dropped.
        ValueError with a readable message when the file cannot be read or the key is too short."""
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise ValueError(f"cannot read the fleet key file {path}: {exc.strerror or exc}") from None
        try:
            return cls(data.strip())
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None

    @classmethod
    def from_files(cls, paths: str) -> "FleetKey":
        """``--fleet-key-file``: one file, or several comma-separated: the first signs, all verify."""
        files = [p.strip() for p in paths.split(",") if p.strip()]
        if not files:
            raise ValueError("no fleet key file given")
        return cls(cls.from_file(files[0])._key, [cls.from_file(p) for p in files[1:]])

    @property
    def accepted_kids(self) -> tuple[str, ...]:
        return tuple(self._accepted)

    def __repr__(self) -> str:  # never the key itself
        return f"FleetKey(kid={self.kid})"

    def _mac(self, kid: str, ts: int, canonical: bytes, secret: bytes | None = None) -> str:
        message = b"".join((_MAC_DOMAIN, kid.encode(), b"\n", str(ts).encode(), b"\n", canonical))
        return hmac.new(self._key if secret is None else secret, message, hashlib.sha256).hexdigest()

    def sign(self, record: WorkerRecord, ts: int | None = None) -> bytes:
        fields = msgspec.json.decode(_encoder.encode(record))
        canonical = _canonical_encoder.encode(fields)
        ts = int(time.time()) if ts is None else ts
        fields[SIGNATURE_FIELD] = {"alg": SIGNATURE_ALG, "kid": self.kid, "ts": ts,
                                   "mac": self._mac(self.kid, ts, canonical)}
        return _encoder.encode(fields)

    def verify(self, data: bytes | str) -> WorkerRecord:
        """The record ``data`` holds when this key signed it; RecordSignatureError if not (and
        msgspec's DecodeError/ValidationError for a value that is no record at all)."""
        fields = msgspec.json.decode(data)
        if not isinstance(fields, dict):
            raise msgspec.ValidationError("a worker record must be a JSON object")
        raw_signature = fields.pop(SIGNATURE_FIELD, None)
        if raw_signature is None:
            raise RecordSignatureError("unsigned record")
        try:
            signature = msgspec.convert(raw_signature, _Signature)
        except msgspec.ValidationError as exc:
            raise RecordSignatureError(f"malformed signature: {exc}") from None
        if signature.alg != SIGNATURE_ALG:
            raise RecordSignatureError(f"unsupported signature algorithm {signature.alg[:40]!r}")
        secret = self._accepted.get(signature.kid)
        if secret is None:
            raise RecordSignatureError(f"signed with another fleet key (key id {signature.kid[:40]!r}, ours "
                                       f"{', '.join(self._accepted)})")
        canonical = _canonical_encoder.encode(fields)
        if not hmac.compare_digest(self._mac(signature.kid, signature.ts, canonical, secret), signature.mac):
            raise RecordSignatureError("bad signature (the record was altered or forged)")
        return _decoder.decode(canonical)


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
