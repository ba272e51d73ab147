"""The routing stack one server replica routes with, built from the server's flags: fleet,
discovery, circuit breaker, NATS connection, request transports, KV events and index, router
tokenizers, the policy (kv weights, replica sync) and the mixed / PD / auto routers.

``infera.server`` (``InferaServer``) and the GAIE endpoint picker (``infera.gaie``) both build one
of these, so a gateway's picks come from exactly the objects and flags a server replica uses.
"""
from __future__ import annotations

import argparse
import functools
import logging

from infera.api.cache_hints import RETENTION_BY_NAME
from infera.discovery import discovery_options, make_discovery
from infera.discovery.base import Discovery
from infera.discovery.fleet import Fleet
from infera.discovery.record import WorkerRecord
from infera.heap_trim import HeapTrimmer
from infera.kv.index import KvIndex, NativeKvIndex, PyKvIndex
from infera.kv.index_shared import SharedKvIndex
from infera.kv.native import native
from infera.router.auto import AutoRouter
from infera.router.breaker import CircuitBreaker
from infera.router.disagg import DisaggRouter
from infera.router.dispatch import MixedRouter
from infera.router.engine_hints import EngineHints
from infera.router.lora_loading import adapter_loader_from_args
from infera.router.pd import protocol_registry
from infera.router.policies import make_policy
from infera.router.policy import Policy
from infera.server.engine_scrape import EngineHitWindow
from infera.server.kv import KvEventsBridge
from infera.server.kv_share import WRITER_INDEX, SharedViewBridge, arena_bytes, writer_rows
from infera.server.metrics import NatsMetrics, ReplicaSyncMetrics, ServerMetrics, drop_worker_keys
from infera.server.supervisor import ChildContext
from infera.server.tokenizers import RouterTokenizers
from infera.transport.http import HttpTransport
from infera.transport.kv_index_share import KvIndexShareServer, share_socket
from infera.transport.nats_conn import NatsConnection
from infera.transport.nats_request import NatsRequestClient
from infera.transport.request import RequestTransports

log = logging.getLogger(__name__)


def index_role(args: argparse.Namespace, process: ChildContext | None) -> str:
    """This process's part in the KV index (kv-aware): "writer" or "reader" of the host's shared
    index (``--kv-index-scope host`` with ``--workers N``: infera/server/kv_share.py), or "own": an
    index of its own, fed every event (one process, ``--kv-index-scope process``, or no C
    accelerator to share the index with)."""
    if process is None or process.count < 2 or args.kv_index_scope != "host":
        return "own"
    if native is None:
        log.warning("--kv-index-scope host needs the C accelerator (not built here): every server process keeps "
                    "its own KV index")
        return "own"
    return "writer" if process.index == WRITER_INDEX else "reader"


class RoutingStack:
    """Everything that decides where a request goes, and its lifecycle (``start``/``stop``).
    ``nats_name``: the NATS client name this process shows the broker."""

    def __init__(self, args: argparse.Namespace, discovery: Discovery | None = None,
                 process: ChildContext | None = None, *, nats_name: str = "infera-server") -> None:
        self.args = args
        # A worker this process cannot reach (NATS-only, no NATS here) stays listed but never routed.
        self.fleet = Fleet(unroutable=lambda record: self.transport.unreachable_reason(record))
        self.discovery = discovery or make_discovery(args.discovery_backend, etcd_endpoint=args.etcd_endpoint,
                                                     etcd_prefix=args.etcd_prefix, k8s_namespace=args.k8s_namespace,
                                                     k8s_label_selector=args.k8s_label_selector,
                                                     **discovery_options(args))
        # One breaker for mixed and PD dispatch: a worker's verdict holds whichever router sent to it.
        self.breaker = CircuitBreaker(failure_threshold=args.breaker_failure_threshold,
                                      cooldown_s=args.breaker_cooldown_s, max_cooldown_s=args.breaker_max_cooldown_s,
                                      is_member=lambda worker_id: self.fleet.get(worker_id) is not None)
        self.metrics = ServerMetrics(self.fleet, breaker=self.breaker)
        # One NATS connection for every NATS use, opened only when a flag asks for the broker plane.
        self.nats: NatsConnection | None = None
        if "nats" in (args.request_transport, args.kv_event_transport) or args.replica_sync == "nats":
            self.nats = NatsConnection.from_args(args, name=nats_name)
        nats_requests = None
        if args.request_transport == "nats":
            assert self.nats is not None
            nats_requests = NatsRequestClient(self.nats, idle_timeout=args.nats_req_idle_timeout,
                                              max_duration=args.nats_req_max_duration,
                                              max_pending=args.nats_req_max_pending)
        self.transport = RequestTransports(HttpTransport(first_byte_timeout=args.request_first_byte_timeout,
                                                         idle_timeout=args.request_idle_timeout,
                                                         max_reply_bytes=args.max_upstream_reply_bytes),
                                           nats_requests)
        self.kv: KvEventsBridge | None = None
        self.tokenizers: RouterTokenizers | None = None  # kv-aware only
        usage_observer = None
        # A ReplicaSync: kv-aware replicas share what only each one knows, and every replica its
        # tenants' usage under --api-keys-file limits (a side channel, infera/server/tenant_limits.py).
        self.replica_sync = None
        self.policy: Policy
        if args.router_policy == "kv-aware" or getattr(args, "api_keys_file", None):
            replica_id = (process.replica_id or None) if process is not None else None
            if args.replica_sync == "nats":
                from infera.transport.replica_sync_nats import NatsReplicaSync

                assert self.nats is not None
                self.replica_sync = NatsReplicaSync(self.nats, replica_id=replica_id)
            elif args.replica_sync == "local":
                from infera.transport.replica_sync_local import LocalReplicaSync

                assert process is not None
                self.replica_sync = LocalReplicaSync(process.runtime_dir, process.index, process.count,
                                                     replica_id=replica_id)
        self.kv_share: KvIndexShareServer | None = None  # the host's shared index, when this process writes it
        if args.router_policy == "kv-aware":
            kv_nats = self.nats if args.kv_event_transport == "nats" else None
            role = index_role(args, process)
            index: PyKvIndex | SharedKvIndex
            if role == "writer":  # applies every event for the host, into a shared arena
                assert process is not None
                shared = NativeKvIndex(max_bytes=args.kv_index_max_bytes,
                                       shared_bytes=arena_bytes(args.kv_index_max_bytes))
                self.kv = KvEventsBridge(self.fleet, shared, nats=kv_nats)
                share_fd = shared.shared_fd()
                assert share_fd is not None
                self.kv_share = KvIndexShareServer(share_socket(process.runtime_dir), share_fd, process.generation,
                                                   functools.partial(writer_rows, self.kv))
                index = shared
            elif role == "reader":  # matches against the writer's arena: applies nothing
                assert process is not None
                index = SharedKvIndex()
                self.kv = SharedViewBridge(self.fleet, index, share_socket(process.runtime_dir))
            else:
                index = KvIndex(max_bytes=args.kv_index_max_bytes)
                self.kv = KvEventsBridge(self.fleet, index, nats=kv_nats)
            self.kv.index_role = role
            self.metrics.registry.register(self.kv)
            # The tokenizer per model: --router-tokenizer-path, else the one the model's workers name.
            self.tokenizers = RouterTokenizers(self.fleet, args.router_tokenizer_path, self_check=self.kv)
            self.metrics.registry.register(self.tokenizers)
            # Routing prefix cap and token-cache budget (infera/kv/prompt.py) of every router tokenizer.
            self.tokenizers.configure(prefix_chars=args.router_prefix_chars,
                                      cache_bytes=args.router_tokenizer_cache_bytes)
            self.policy = make_policy("kv-aware", index=index, prompts=self.tokenizers,
                                      overlap_weight=args.kv_overlap_weight,
                                      prefill_overlap_weight=args.kv_prefill_overlap_weight,
                                      decode_overlap_weight=args.kv_decode_overlap_weight, observer=self.kv,
                                      replica_sync=self.replica_sync, inflight_weight=args.kv_inflight_weight,
                                      lower_tier_weight=args.kv_lower_tier_weight)
            usage_observer = self.kv.observe_usage
            self.kv.active_blocks = getattr(self.policy, "active_blocks", None)  # infera_policy_active_blocks
            self.kv.balance = getattr(self.policy, "balance", None)  # infera_policy_inflight_weight
        else:
            self.policy = make_policy(args.router_policy)
        self.usage_observer = usage_observer  # (worker, request, engine-reported cached tokens)
        direct = args.router_mode == "direct"
        # What each engine is told about a request's cache retention (--router-default-retention).
        engine_hints = EngineHints(RETENTION_BY_NAME[args.router_default_retention],
                                   allow_client_priority=args.allow_client_priority)
        mixed = MixedRouter(self.fleet, self.policy, self.transport, self.metrics,
                            max_retries=args.request_max_retries, direct=direct, usage_observer=usage_observer,
                            breaker=self.breaker, migration_limit=args.migration_limit,
                            engine_hints=engine_hints, lora_loader=adapter_loader_from_args(self.fleet, args))
        disagg = DisaggRouter(self.fleet, self.policy, self.transport, self.metrics, protocol_registry(),
                              max_retries=args.request_max_retries, prefill_timeout=args.pd_prefill_timeout,
                              breaker=self.breaker, engine_hints=engine_hints)
        self.router = AutoRouter(self.fleet, mixed, disagg, direct=direct)
        if self.nats is not None:
            self.metrics.registry.register(NatsMetrics(self.nats, nats_requests))
        if self.replica_sync is not None:
            self.metrics.registry.register(ReplicaSyncMetrics(self.replica_sync))
        # The KV self-check over a window: engines' prefix-cache counters against the predictions.
        self.engine_window: EngineHitWindow | None = None
        if self.kv is not None and args.engine_scrape_interval > 0:
            self.engine_window = EngineHitWindow(self.fleet, self.kv.hit_totals,
                                                 interval_s=args.engine_scrape_interval,
                                                 window_s=args.engine_scrape_window)
        # What a burst leaves free in the heap goes back to the OS (infera/heap_trim.py).
        self.heap_trimmer = HeapTrimmer.for_this_process(args.heap_trim_interval)
        self.metrics.registry.register(self.heap_trimmer)
        self._workers: dict[str, WorkerRecord] = {}
        self.fleet.subscribe(self._on_fleet_change)

    def _on_fleet_change(self, worker_id: str, record) -> None:
        if record is None or not record.is_active:
            self.policy.forget(worker_id)
            self.breaker.forget(worker_id)
            self.metrics.forget_worker(worker_id)
        if record is None:
            if self.kv is not None:  # its kv-aware pick counters (the metrics drop their own series)
                drop_worker_keys(self.kv.picks, worker_id, 1)
            old = self._workers.pop(worker_id, None)
            if old is not None:
                self.transport.forget(old)
        else:
            self._workers[worker_id] = record

    async def start_planes(self) -> None:
        """Everything but discovery: NATS (in the background), transports, KV events, replica sync."""
        if self.nats is not None:
            await self.nats.start()  # in the background: a broker that comes up later is fine
        await self.transport.start()
        if self.kv is not None:
            await self.kv.start()
        if self.kv_share is not None:
            await self.kv_share.start()
        if self.engine_window is not None:
            await self.engine_window.start()
        if self.replica_sync is not None:
            await self.replica_sync.start()
        self.heap_trimmer.start()

    async def start_discovery(self) -> None:
        await self.discovery.start(self.fleet)  # returns at once; converges in the background

    async def start(self) -> None:
        await self.start_planes()
        await self.start_discovery()

    async def stop(self) -> None:
        await self.router.close()
        await self.heap_trimmer.stop()
        await self.discovery.stop()
        if self.replica_sync is not None:
            await self.replica_sync.stop()
        if self.engine_window is not None:
            await self.engine_window.stop()
        if self.kv_share is not None:
            await self.kv_share.stop()
        if self.kv is not None:
            await self.kv.stop()
        if self.tokenizers is not None:
            self.tokenizers.close()
        await self.transport.close()
        if self.nats is not None:
            await self.nats.close()
