"""The simulated engine's KV-events configuration: vLLM 0.32's ``--kv-events-config`` (and SGLang
0.5.23's, which adds ``bind`` and ``format``) as :class:`KvEventsConfig`, validated, with the argparse
type ``parse_kv_events_config``, and :func:`binds`, each engine's rule for whether its PUB socket
binds or connects an endpoint. Pure data: no sockets. ``kv_events.py`` describes the wire.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from infera.config import json_config


# SGLang 0.5.23's KVEventsConfig adds these two to vLLM's fields (and has no enable_kv_cache_events).
SGLANG_ONLY_FIELDS = frozenset({"bind", "format"})
SGLANG_EVENT_FORMATS = ("default", "dynamo")


@dataclass(frozen=True)
class KvEventsConfig:
    """vLLM 0.32's ``KVEventsConfig``; SGLang 0.5.23's has the same fields minus
    ``enable_kv_cache_events``, plus ``bind`` (true/false forces bind/connect, null infers it from
    the endpoint) and ``format`` ("dynamo" namespaces hashes by LoRA/salt, which the simulator
    never has, so both formats are the same bytes here)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10000
    hwm: int = 100000
    max_queue_size: int = 100000
    topic: str = ""
    bind: bool | None = None
    format: str = "default"

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_dict(cls, obj: dict[str, Any], *, sglang: bool = False) -> "KvEventsConfig":
        """Validate a parsed JSON config. vLLM: events need ``enable_kv_cache_events`` and the
        publisher defaults to "zmq" when enabled. SGLang: a "zmq" publisher alone enables them."""
        if not isinstance(obj, dict):
            raise ValueError("must be a JSON object")
        known = {f.name for f in fields(cls)} - (set() if sglang else SGLANG_ONLY_FIELDS)
        unknown = sorted(set(obj) - known)
        if unknown:
            raise ValueError(f"unknown field(s): {', '.join(unknown)}")
        kw = dict(obj)
        if sglang:
            kw.pop("enable_kv_cache_events", None)
            kw["enable_kv_cache_events"] = (kw.get("publisher") or "null") == "zmq"
        elif kw.get("publisher") is None:
            kw["publisher"] = "zmq" if kw.get("enable_kv_cache_events") else "null"
        cfg = cls(**kw)
        if not isinstance(cfg.enable_kv_cache_events, bool):
            raise ValueError("enable_kv_cache_events must be a boolean")
        if cfg.publisher not in ("null", "zmq"):
            raise ValueError(f"publisher must be 'zmq' or 'null', got {cfg.publisher!r}")
        if not isinstance(cfg.endpoint, str) or not cfg.endpoint:
            raise ValueError("endpoint must be a non-empty string")
        if cfg.replay_endpoint is not None and not isinstance(cfg.replay_endpoint, str):
            raise ValueError("replay_endpoint must be a string or null")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            v = getattr(cfg, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1")
        if not isinstance(cfg.topic, str):
            raise ValueError("topic must be a string")
        if cfg.bind is not None and not isinstance(cfg.bind, bool):
            raise ValueError("bind must be a boolean or null")
        if cfg.format not in SGLANG_EVENT_FORMATS:
            raise ValueError(f"format must be one of {', '.join(SGLANG_EVENT_FORMATS)}, got {cfg.format!r}")
        return cfg


# argparse ``type`` for the sim's ``--kv-events-config`` (vLLM schema).
parse_kv_events_config = json_config(KvEventsConfig.from_dict)


def binds(endpoint: str, fmt: str = "vllm", bind: bool | None = None) -> bool:
    """The engine's rule for the PUB socket: wildcard, IPv6-any, ipc:// and inproc:// endpoints are
    bound, others connected; SGLang 0.5.23 also binds ``0.0.0.0`` and lets ``bind`` decide
    outright. ``tcp://*:0;<ip>:<port>`` (libzmq's source;address form) passes the rule and binds
    ``<ip>:<port>`` only: the launchers inject that to keep events off other interfaces."""
    if fmt == "atom":
        return True  # ATOM's ZmqEventPublisher always binds
    if fmt == "sglang":
        if bind is not None:
            return bind
        if "0.0.0.0" in endpoint:
            return True
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
