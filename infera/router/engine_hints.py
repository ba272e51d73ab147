"""A request's cache retention, written into the body its engine receives (reference §3.9, §8.6).

The retention is the request's cache hint (``infera.api.cache_hints``), or the server's default
(``--router-default-retention``, long) when the client gave none; an explicit "none" stays none.
What each engine gets, on a mixed request and on both legs of a PD pair:

* SGLang: ``priority`` 0 / 50 / 100 for none / short / long (SGLang runs higher values first,
  and without ``--enable-priority-scheduling`` accepts and ignores the field), and
  ``infera_retention`` (the name).
* vLLM, and the sim (it speaks vLLM's API): ``kv_transfer_params.infera_retention`` when the
  worker has kvd (its record names a ``kvd_socket``), merged into the PD connector's own
  ``kv_transfer_params``. Nothing otherwise: vLLM refuses a non-zero ``priority`` unless started
  with ``--scheduling-policy priority``, and logs a warning for every request that carries
  ``kv_transfer_params`` to an engine without a KV connector.
* ATOM: nothing.

The client's own fields win: its ``infera_retention``, top-level or inside its
``kv_transfer_params``, is never overwritten. A body is only rebuilt when something is added.

Except ``priority``, which orders an engine's queue: a client's own is dropped, for every engine
(SGLang gets the router's in its place), unless the operator allows it (``--allow-client-priority``);
then a JSON integer is clamped into the router's range, 0-100 (the scale of the router's own
0/50/100), and anything else is dropped. Unchecked, any client could send ``2147483647`` and jump
every queue. Finding it costs one substring scan of the body (``"priority"``); only a body that names
it is decoded (parse_request refuses a guarded key spelled with escapes, so the scan cannot miss one).
"""
from __future__ import annotations

from typing import Any

import msgspec

from infera.api.cache_hints import LONG, NONE, RETENTION_NAMES, SHORT, CacheHints, parse_cache_hints
from infera.discovery.record import WorkerRecord
from infera.router.policy import RoutedRequest

ENGINE_PRIORITY = {NONE: 0, SHORT: 50, LONG: 100}
PRIORITY_KEY = "priority"
_PRIORITY_BYTES = b'"priority"'
# A client's priority, when allowed, is clamped into the router's own range.
MIN_PRIORITY, MAX_PRIORITY = min(ENGINE_PRIORITY.values()), max(ENGINE_PRIORITY.values())
KV_TRANSFER_PARAMS = "kv_transfer_params"
RETENTION_KEY = "infera_retention"
# Engines by the request fields they take: "sglang" (priority + retention), "vllm" (retention for kvd).
_DIALECTS = {"sglang": "sglang", "vllm": "vllm", "sim": "vllm"}

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


def worker_has_kvd(worker: WorkerRecord) -> bool:
    """Whether the worker's engine saves and loads KV through kvd. The record names its socket
    (``kvd_socket``: the vLLM launcher publishes it when its engine runs the kvd connector)."""
    return bool(getattr(worker, "kvd_socket", None))


def _additions(dialect: str | None, retention: int, kvd: bool) -> dict[str, Any] | None:
    name = RETENTION_NAMES[retention]
    if dialect == "sglang":
        return {"priority": ENGINE_PRIORITY[retention], RETENTION_KEY: name}
    if dialect == "vllm" and kvd:
        return {KV_TRANSFER_PARAMS: {RETENTION_KEY: name}}
    return None


class EngineHints:
    """Adds the engine fields of §3.9 to the body sent to one worker."""

    def __init__(self, default_retention: int = LONG, *, allow_client_priority: bool = False) -> None:
        if default_retention not in RETENTION_NAMES:
            raise ValueError(f"unknown retention {default_retention!r}")
        self.default_retention = default_retention
        # --allow-client-priority: a client's integer priority reaches the engine, clamped; off: dropped.
        self.allow_client_priority = allow_client_priority
        # (dialect, retention, kvd) → the fields, and their JSON members ready to splice into a body
        self._fields: dict[tuple[str | None, int, bool], tuple[dict[str, Any], tuple[bytes, ...], bytes] | None] = {}
        for dialect in (None, *set(_DIALECTS.values())):
            for retention in RETENTION_NAMES:
                for kvd in (False, True):
                    fields = _additions(dialect, retention, kvd)
                    self._fields[(dialect, retention, kvd)] = None if fields is None else (
                        fields, tuple(_encode(k) for k in fields), _encode(fields)[1:-1])

    def retention(self, req: RoutedRequest) -> int:
        """The request's retention: its hint, or the default when it gave none (parsed once per
        request; the kv-aware policy may already have)."""
        hints: CacheHints | None = req.state.get("hints")
        if hints is None:
            hints = req.state["hints"] = parse_cache_hints(req.parsed)
        if hints.retention == NONE and not hints.explicit:
            return self.default_retention
        return hints.retention

    def _for(self, worker: WorkerRecord, req: RoutedRequest):
        dialect = _DIALECTS.get(worker.engine)
        if dialect is None:
            return None
        return self._fields[(dialect, self.retention(req), dialect == "vllm" and worker_has_kvd(worker))]

    def apply_dict(self, body: dict[str, Any], worker: WorkerRecord, req: RoutedRequest) -> dict[str, Any]:
        """``body`` with the fields added: a new dict (shallow copy; a merged ``kv_transfer_params``
        is a new dict too), or ``body`` itself when nothing is added. Never mutates ``body``."""
        found = self._for(worker, req)
        checked = self._client_priority(body)
        return checked if found is None else _merged(checked, found[0])

    def _client_priority(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` with a client's ``priority`` dropped, or clamped when allowed (a new dict), or
        ``body`` itself when it has none or an allowed one in range."""
        if PRIORITY_KEY not in body:
            return body
        value = body[PRIORITY_KEY]
        if self.allow_client_priority and type(value) is int:  # (not a bool, a float or a string)
            clamped = min(max(value, MIN_PRIORITY), MAX_PRIORITY)
            return body if clamped == value else {**body, PRIORITY_KEY: clamped}
        out = dict(body)
        del out[PRIORITY_KEY]
        return out

    def apply_bytes(self, body: bytes, worker: WorkerRecord, req: RoutedRequest) -> bytes:
        """``body`` (a JSON object) with the fields added, or ``body`` itself when nothing is.

        When the body names none of the keys (the usual case), the fields are spliced in after
        the opening brace: no decode, one copy. Otherwise it is decoded, merged and encoded once.
        (A key spelled with JSON escapes slips past the check; the client's member then comes
        after ours, and JSON parsers keep the last of duplicate keys, so the client still wins.)"""
        found = self._for(worker, req)
        named = _PRIORITY_BYTES in body  # a client's priority, or the word in some text: decode to tell
        if found is None and not named:
            return body
        if found is not None and not named and not any(k in body for k in found[1]):
            brace = _skip_blanks(body, 0)
            if body[brace:brace + 1] == b"{":
                after = brace + 1
                empty = body[_skip_blanks(body, after):][:1] == b"}"
                return b"".join((b"{", found[2], b"" if empty else b",", memoryview(body)[after:]))
        try:
            decoded = _decode(body)
        except msgspec.DecodeError:
            return body  # not ours to judge: the engine answers it
        if not isinstance(decoded, dict):
            return body
        checked = self._client_priority(decoded)
        merged = checked if found is None else _merged(checked, found[0])
        return body if merged is decoded else _encode(merged)


def _skip_blanks(data: bytes, at: int) -> int:
    """The index of the first byte at or after ``at`` that is not JSON whitespace."""
    while data[at:at + 1] in (b" ", b"\t", b"\r", b"\n"):
        at += 1
    return at


def _merged(body: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] | None = None
    for key, value in fields.items():
        current = body.get(key)
        if key == KV_TRANSFER_PARAMS:
            # The PD connector's params (or the client's, when allowed): ours join them, theirs stay.
            if isinstance(current, dict):
                if RETENTION_KEY in current:
                    continue
                value = {**current, **value}
            elif current is not None:
                continue  # not an object: the engine will say what it thinks of it
            else:
                value = dict(value)  # the body's own, never the shared template
        elif key in body:
            continue  # the client's own choice
        if out is None:
            out = dict(body)
        out[key] = value
    return body if out is None else out
