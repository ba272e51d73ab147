"""Prefill/decode disaggregation for the simulated engine, speaking two real engines' wire contracts.

No tensors move: "KV" is the token ids of the prompt's full blocks, from which the decode rebuilds
(and caches, with KV events) the very blocks a local prefill would have made. The transfer of N
tokens takes ``N x --kv-bytes-per-token / (--kv-transfer-bandwidth x 1e9)`` seconds, divided by
``--speedup`` like all simulated time. Timeouts (``--kv-hold-timeout``, ``--kv-transfer-timeout``)
are wall-clock protections, not modelled work, so ``--speedup`` leaves them alone.

**vLLM NixlConnector** (``--kv-transfer-config``, :class:`NixlDisaggregation`):

* prefill (``kv_producer``/``kv_both``): a non-streaming request whose ``kv_transfer_params`` has
  ``do_remote_decode: true`` runs normally; its prompt's full blocks are then pinned under a new
  ``remote_request_id`` until a decode pulls them or ``--kv-hold-timeout`` passes, and the reply
  carries vLLM's ``kv_transfer_params`` naming this server's own HTTP address as the side channel.
* decode (``kv_consumer``/``kv_both``): ``do_remote_prefill: true`` first pulls from
  ``remote_host:remote_port`` (``POST /sim/kv/pull``), waits the transfer time for the blocks it
  does not already cache, inserts them, then runs the request, whose prefill finds them cached.
  A failed pull recomputes locally (``kv_load_failure_policy`` "recompute", vLLM's default) or
  fails the request ("fail").

**SGLang bootstrap** (the stand-in's ``--disaggregation-mode``, :class:`SglangDisaggregation`):
requests must carry ``bootstrap_host``/``bootstrap_port``/``bootstrap_room``. The prefill computes
the prompt (1 output token), offers the room's KV on its bootstrap server
(``--disaggregation-bootstrap-port``; held until fetched or the hold timeout) and answers. The
decode long-polls ``POST /sim/kv/fetch`` on that server until the room is offered (at most
``--kv-transfer-timeout``, else 500 "KV transfer failed"), waits the transfer time, inserts the
blocks and decodes. The legs may arrive in either order.

This module owns building an engine's role from its flags (:func:`build_disaggregation`); the parts
live beside it: the configuration and the modelled link in ``pd_config.py``, the holds, the leg and
the base class in ``pd_base.py``, vLLM's NIXL in ``pd_nixl.py`` and SGLang's bootstrap in
``pd_sglang.py``. Their names are importable from here too.
"""
from __future__ import annotations

import argparse
from typing import Any, Callable

from .cache import KVCache
# The parts' names stay importable from here, where the server, the stand-ins, atom_pd and the
# tests find them.
from .pd_base import (Disaggregation, HeldKv, KvHoldTable, LegError, LegPlan, PdFields, _bootstrap_health,
                      _held_kv_body, _HeldKvReply, _http_base, _json_error)
from .pd_config import (DEFAULT_KV_BYTES_PER_TOKEN, DEFAULT_KV_TRANSFER_BANDWIDTH_GBPS, KV_FETCH_PATH, KV_PULL_PATH,
                        KV_ROLES, KV_TRANSFER_CONFIG_FIELDS, LOAD_FAILURE_POLICIES, NIXL_CONNECTORS,
                        SGLANG_DISAGGREGATION_MODES, SGLANG_KV_HOLD_TIMEOUT_S, SGLANG_KV_TRANSFER_TIMEOUT_S,
                        SGLANG_TRANSFER_BACKENDS, VLLM_KV_HOLD_TIMEOUT_S, VLLM_KV_TRANSFER_TIMEOUT_S, KvLink,
                        KvTransferConfig, SglangDisaggregationConfig, parse_kv_transfer_config, transfer_seconds)
from .pd_nixl import NixlDisaggregation
from .pd_sglang import SglangDisaggregation

__all__ = ["DEFAULT_KV_BYTES_PER_TOKEN", "DEFAULT_KV_TRANSFER_BANDWIDTH_GBPS", "KV_FETCH_PATH", "KV_PULL_PATH",
           "KV_ROLES", "KV_TRANSFER_CONFIG_FIELDS", "LOAD_FAILURE_POLICIES", "NIXL_CONNECTORS",
           "SGLANG_DISAGGREGATION_MODES", "SGLANG_KV_HOLD_TIMEOUT_S", "SGLANG_KV_TRANSFER_TIMEOUT_S",
           "SGLANG_TRANSFER_BACKENDS", "VLLM_KV_HOLD_TIMEOUT_S", "VLLM_KV_TRANSFER_TIMEOUT_S", "Disaggregation",
           "HeldKv", "KvHoldTable", "KvLink", "KvTransferConfig", "LegError", "LegPlan", "NixlDisaggregation",
           "PdFields", "SglangDisaggregation", "SglangDisaggregationConfig", "_HeldKvReply", "_bootstrap_health",
           "_held_kv_body", "_http_base", "_json_error", "build_disaggregation", "parse_kv_transfer_config",
           "transfer_seconds"]


# ============================================================================= factory


def build_disaggregation(args: argparse.Namespace, cache: KVCache,
                         flush_kv_events: Callable[[], Any] | None = None) -> Disaggregation | None:
    """The engine's PD role from its flags: ``--kv-transfer-config`` (vLLM flavour) or the SGLang
    stand-in's ``sglang_disaggregation``; None for a mixed engine."""
    link = KvLink(bandwidth_gbps=args.kv_transfer_bandwidth, bytes_per_token=args.kv_bytes_per_token,
                  speedup=args.speedup, hold_timeout_s=args.kv_hold_timeout,
                  transfer_timeout_s=args.kv_transfer_timeout)
    sglang_cfg: SglangDisaggregationConfig | None = getattr(args, "sglang_disaggregation", None)
    if sglang_cfg is not None and sglang_cfg.mode != "null":
        return SglangDisaggregation(sglang_cfg, cache, link, args.host, flush_kv_events)
    kv_cfg: KvTransferConfig | None = getattr(args, "kv_transfer_config", None)
    if kv_cfg is not None:
        return NixlDisaggregation(kv_cfg, cache, link, flush_kv_events)
    return None
