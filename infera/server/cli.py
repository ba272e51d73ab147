"""``python -m infera.server`` flags (flag > env > default)."""
from __future__ import annotations

import argparse
import math
import os
from typing import Mapping, Sequence

from infera.config import (add_flag, add_plane_flags, choice_of, non_negative_float, non_negative_int, port_number,
                           positive_float, positive_int)
from infera.discovery import discovery_options
from infera.heap_trim import DEFAULT_HEAP_TRIM_INTERVAL_S
from infera.kv.bound import default_max_bytes, parse_size
from infera.kv.prompt import DEFAULT_CACHE_BYTES, DEFAULT_PREFIX_CHARS
from infera.router.kv_aware import DEFAULT_LOWER_TIER_WEIGHT
from infera.server.limits import (DEFAULT_BODY_TIMEOUT, DEFAULT_HEADER_TIMEOUT, DEFAULT_KEEPALIVE_TIMEOUT,
                                 DEFAULT_MAX_INFLIGHT_BYTES)

DEFAULT_MAX_REQUEST_BYTES = 32 * 1024 * 1024
DEFAULT_KV_OVERLAP_WEIGHT = 16.0
# Upstream (HTTP) bounds per leg: a worker that accepts and never answers, or stops mid-stream
# (SIGSTOP, a wedged engine), must not hold a request forever.
DEFAULT_REQUEST_FIRST_BYTE_TIMEOUT = 300.0
DEFAULT_REQUEST_IDLE_TIMEOUT = 120.0
DEFAULT_MAX_UPSTREAM_REPLY_BYTES = 64 * 1024 * 1024
DEFAULT_RESPONSES_STORE_BYTES = 64 * 1024 * 1024
DEFAULT_RESPONSES_STORE_TTL_S = 3600.0
MAX_SERVER_WORKERS = 1024  # a typo (10000) must not fork a process per unit


def default_server_workers(cgroup_root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> int:
    """One server process per core this process may run on: its CPU affinity (as taskset or a
    cpuset leaves it; not the machine's count), capped by a cgroup CPU quota (a container limited
    to 2 CPUs on a 64-core node sees 64 cores in its affinity, and would fork 64 processes)."""
    try:
        cores = max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no sched_getaffinity (macOS)
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root, proc_cgroup)
    return max(1, min(cores, math.ceil(quota))) if quota else cores


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> float | None:
    """CPUs this process's cgroup quota allows (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` /
    ``cpu.cfs_period_us``); None without a quota or where it cannot be read."""
    v2_path, v1_path = "/", "/"
    try:
        with open(proc_cgroup) as f:
            for line in f:
                hid, controllers, path = line.rstrip("\n").split(":", 2)
                if hid == "0" and not controllers:
                    v2_path = path
                elif "cpu" in controllers.split(","):
                    v1_path = path
    except (OSError, ValueError):
        pass
    # v2: the process's own cgroup, else the root of the (container's) hierarchy
    for folder in (os.path.join(root, v2_path.lstrip("/")), root):
        try:
            with open(os.path.join(folder, "cpu.max")) as f:
                quota, period = f.read().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        except (OSError, ValueError):
            continue
    for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        for folder in (os.path.join(root, mount, v1_path.lstrip("/")), os.path.join(root, mount)):
            try:
                with open(os.path.join(folder, "cpu.cfs_quota_us")) as f:
                    quota_us = int(f.read())
                with open(os.path.join(folder, "cpu.cfs_period_us")) as f:
                    period_us = int(f.read())
            except (OSError, ValueError):
                continue
            return quota_us / period_us if quota_us > 0 and period_us > 0 else None
    return None


def server_workers(value: str) -> int:
    n = int(value)
    if not 1 <= n <= MAX_SERVER_WORKERS:
        raise argparse.ArgumentTypeError(f"must be between 1 and {MAX_SERVER_WORKERS}: {value!r}")
    return n


def inflight_weight(value: str) -> float | None:
    """``auto`` (None: learned) or a number of missed blocks >= 0."""
    if value.strip().lower() == "auto":
        return None
    try:
        weight = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a number >= 0, got {value!r}") from None
    if not weight >= 0 or weight == float("inf"):
        raise argparse.ArgumentTypeError(f"expected auto or a number >= 0, got {value!r}")
    return weight


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infera.server",
                                description="Infera front door: OpenAI endpoints routed over a worker fleet.")
    f = lambda *a, **k: add_flag(p, *a, environ=environ, **k)  # noqa: E731
    f("--host", env="INFERA_HOST", default="0.0.0.0", help="bind address")
    f("--port", env="INFERA_PORT", default=8000, type=port_number, help="bind port (0: any free port)")
    f("--workers", env="INFERA_SERVER_WORKERS", default=None, type=server_workers,
      help="server processes sharing the port (SO_REUSEPORT), each a full replica fed by the engines' events; "
           "1: a single process (default: one per core this process may use: its CPU affinity, capped by a "
           "cgroup CPU quota)")
    add_plane_flags(p, environ)
    f("--k8s-label-selector", env="INFERA_K8S_LABEL_SELECTOR", default=None,
      help="kubernetes discovery: label selector of the worker Pods (required there)")
    f("--replica-sync", env="INFERA_REPLICA_SYNC", default=None, type=choice_of("nats", "local", "off"),
      help="kv-aware: share in-flight requests and just-served prefixes with the other server replicas, so "
           "replicas route as one; nats: over NATS, with every replica; local: among this server's --workers "
           "processes only, no broker (default: nats when this server uses NATS, else local with --workers > 1, "
           "else off)")
    f("--router-mode", env="INFERA_ROUTER_MODE", default="auto", type=choice_of("auto", "direct"),
      help="auto: the router picks; direct: honour the x-worker-instance-id header")
    f("--router-policy", env="INFERA_ROUTER_POLICY", default="kv-aware", type=choice_of("kv-aware", "round-robin"),
      help="kv-aware: the worker already holding the longest prefix of the prompt, balanced against load")
    f("--router-tokenizer-path", env="INFERA_ROUTER_TOKENIZER_PATH", default=None,
      help="kv-aware: the model's tokenizer (a folder with tokenizer.json + chat template, or the file), for "
           "every model; default: per model, the tokenizer its workers' records name (kv-aware routing of a "
           "model is marked degraded in /health when that cannot be loaded here)")
    f("--router-prefix-chars", env="INFERA_ROUTER_PREFIX_CHARS", default=DEFAULT_PREFIX_CHARS, type=positive_int,
      help="kv-aware: only this many characters of the rendered prompt (of a token-id prompt: ids) are tokenized "
           "and hashed for routing; picks for shorter prompts are unchanged, a huge prompt costs no more "
           "(default 512 KiB, ~128k tokens)")
    f("--router-tokenizer-cache-bytes", env="INFERA_ROUTER_TOKENIZER_CACHE_BYTES", default=DEFAULT_CACHE_BYTES,
      type=non_negative_int, help="kv-aware: memory budget of the router's token-id caches (repeated prompts and "
                                  "chat segments), in bytes (0: no cache)")
    f("--kv-index-max-bytes", env="INFERA_KV_INDEX_MAX_BYTES", default=default_max_bytes(), type=parse_size,
      help="kv-aware: memory bound of the router's KV index (every worker's cached blocks), in bytes or with a "
           "binary unit (512Mi, 4G); past it the coldest blocks (longest since stored or matched) are evicted "
           "(0: unbounded; default: 1/8 of this host's memory, /proc/meminfo MemTotal read at start)")
    f("--kv-index-scope", env="INFERA_KV_INDEX_SCOPE", default="host", type=choice_of("host", "process"),
      help="kv-aware with --workers N: host: one process applies every engine's KV events into an index in "
           "shared memory, which the others read without locks (memory and event CPU once per host); process: "
           "every process keeps its own index and applies every event itself")
    f("--heap-trim-interval", env="INFERA_HEAP_TRIM_INTERVAL", default=DEFAULT_HEAP_TRIM_INTERVAL_S,
      type=non_negative_float,
      help="seconds between trims of this process's freed heap (glibc malloc_trim, in a thread): what a burst "
           "(the index's first fill, an event backlog) left free goes back to the OS (0: never)")
    # 16, not upstream's 1.0: with in-flight blocks as the load term, a weight of 1 lets one or two
    # running requests outweigh a whole cached prefix, so conversations scatter and caches hold
    # duplicates (bench/kv_routing.py: hit rate 64.8 % at 1, 77.8 % at 16 uniform; 74.9 → 86.2 %
    # on Zipf), with TTFT p50 no worse.
    f("--kv-overlap-weight", env="INFERA_KV_OVERLAP_WEIGHT", default=DEFAULT_KV_OVERLAP_WEIGHT, type=non_negative_float,
      help="kv-aware: cost of one missed block relative to one in-flight block")
    f("--kv-inflight-weight", env="INFERA_KV_INFLIGHT_WEIGHT", default=None, type=inflight_weight,
      help="kv-aware: what one request in flight on a worker weighs, in missed blocks (its load beyond the "
           "distinct blocks it holds there): auto learns it from the streams' times to first byte "
           "(infera/router/ttft_balance.py); a number fixes it; 0 turns it off")
    f("--kv-prefill-overlap-weight", env="INFERA_KV_PREFILL_OVERLAP_WEIGHT", default=None, type=non_negative_float,
      help="kv-aware: the weight for prefill picks of PD pairs (default: --kv-overlap-weight)")
    f("--kv-decode-overlap-weight", env="INFERA_KV_DECODE_OVERLAP_WEIGHT", default=None, type=non_negative_float,
      help="kv-aware: the weight for decode picks of PD pairs (default: --kv-overlap-weight)")
    f("--request-max-retries", env="INFERA_REQUEST_MAX_RETRIES", default=1, type=non_negative_int,
      help="other workers tried when one fails before the first byte")
    f("--request-first-byte-timeout", env="INFERA_REQUEST_FIRST_BYTE_TIMEOUT",
      default=DEFAULT_REQUEST_FIRST_BYTE_TIMEOUT, type=non_negative_float,
      help="HTTP workers, per leg (mixed, PD prefill, PD decode): seconds from sending the request to the "
           "first body byte; then the connection is closed (the engine aborts), the request fails over and "
           "the breaker counts it (504 when no worker is left). Generous by default: a loaded engine may queue "
           "and prefill a long prompt for minutes, and a unary reply only arrives once fully generated, so "
           "this also bounds a unary generation (raise it for long unary outputs). 0 = off")
    f("--request-idle-timeout", env="INFERA_REQUEST_IDLE_TIMEOUT", default=DEFAULT_REQUEST_IDLE_TIMEOUT,
      type=non_negative_float,
      help="HTTP workers, per leg: longest gap between body chunks after the first (like "
           "--nats-req-idle-timeout); then the connection is closed and a stream ends with an SSE error event "
           "(a unary reply, not yet relayed, fails over; 504 when no worker is left). Decoding sends a chunk "
           "per token, so minutes of silence mean a stalled engine, not a slow one. 0 = off")
    f("--max-upstream-reply-bytes", env="INFERA_MAX_UPSTREAM_REPLY_BYTES", default=DEFAULT_MAX_UPSTREAM_REPLY_BYTES,
      type=positive_int, help="largest worker reply read whole into memory (unary replies, errors); "
                              "a larger one fails the request with 502 instead of exhausting memory")
    f("--migration-limit", env="INFERA_MIGRATION_LIMIT", default=0, type=non_negative_int,
      help="times a streamed generation whose worker dies or stalls mid-stream moves to another mixed worker "
           "and continues there (exactly from token ids on vLLM, else from the text so far); 0: off, the "
           "stream ends with an SSE error event. On, every streamed event is parsed (~10 µs each)")
    f("--lora-dynamic-loading", env="INFERA_LORA_DYNAMIC_LOADING", default=False, action="store_true",
      help="a request for a LoRA adapter no worker holds loads it first on the worker of its base model with the "
           "fewest adapters (POST /v1/load_lora_adapter: vLLM needs VLLM_ALLOW_RUNTIME_LORA_UPDATING), from "
           "--lora-adapter-dir/<name>; concurrent first requests share one load")
    f("--lora-adapter-dir", env="INFERA_LORA_ADAPTER_DIR", default=None,
      help="dynamic LoRA loading: the folder, on the workers' hosts, holding each adapter as a subfolder by name")
    f("--lora-base-model", env="INFERA_LORA_BASE_MODEL", default=None,
      help="dynamic LoRA loading: the base model adapters are loaded onto (default: the fleet's only one)")
    f("--lora-load-timeout", env="INFERA_LORA_LOAD_TIMEOUT", default=30.0, type=positive_float,
      help="dynamic LoRA loading: seconds one load may take")
    f("--pd-prefill-timeout", env="INFERA_PD_PREFILL_TIMEOUT", default=120.0, type=positive_float,
      help="PD: seconds a prefill leg may take before it is aborted and the pair retried")
    f("--breaker-failure-threshold", env="INFERA_BREAKER_FAILURE_THRESHOLD", default=3, type=non_negative_int,
      help="consecutive failures before the first byte (5xx, unreachable) that stop routing to a worker "
           "for a cooldown; 0 disables the circuit breaker")
    f("--breaker-cooldown-s", env="INFERA_BREAKER_COOLDOWN_S", default=5.0, type=positive_float,
      help="seconds an opened worker gets no requests before one probe is let through")
    f("--breaker-max-cooldown-s", env="INFERA_BREAKER_MAX_COOLDOWN_S", default=60.0, type=positive_float,
      help="cap of the cooldown, which doubles each time a probe fails")
    f("--max-request-bytes", env="INFERA_MAX_REQUEST_BYTES", default=DEFAULT_MAX_REQUEST_BYTES,
      type=positive_int, help="largest accepted request body (413 above)")
    # -- the Responses API's conversations, kept by the router (infera/server/responses_store.py) --
    f("--responses-store-max-bytes", env="INFERA_RESPONSES_STORE_MAX_BYTES", default=DEFAULT_RESPONSES_STORE_BYTES,
      type=parse_size, help="/v1/responses: memory bound of the stored responses (each one's input and output, "
                            "for previous_response_id follow-ups and GET/DELETE), in bytes or with a unit "
                            "(64MiB); the least recently used go first past it; 0: none is stored")
    f("--responses-store-ttl", env="INFERA_RESPONSES_STORE_TTL", default=DEFAULT_RESPONSES_STORE_TTL_S,
      type=positive_float, help="/v1/responses: seconds a stored response is kept")
    f("--responses-store-bucket", env="INFERA_RESPONSES_STORE_BUCKET", default="infera_responses",
      help="/v1/responses, on NATS: the JetStream KV bucket the server replicas share stored responses in "
           "(created with the store's size and TTL by the first replica; each replica keeps its own copy too)")
    # -- the front door's own limits against slow or hostile clients (infera/server/limits.py) --
    f("--header-timeout", env="INFERA_HEADER_TIMEOUT", default=DEFAULT_HEADER_TIMEOUT, type=non_negative_float,
      help="seconds a client has to send a request's head (request line and headers) once its connection "
           "opens or its next request begins; the connection is closed after (0: off)")
    f("--body-timeout", env="INFERA_BODY_TIMEOUT", default=DEFAULT_BODY_TIMEOUT, type=non_negative_float,
      help="seconds a client has to send a request's whole body after its head; the connection is closed "
           "after (0: off)")
    f("--keepalive-timeout", env="INFERA_KEEPALIVE_TIMEOUT", default=DEFAULT_KEEPALIVE_TIMEOUT, type=positive_float,
      help="seconds an idle client connection is kept open between requests")
    f("--max-connections", env="INFERA_MAX_CONNECTIONS", default=0, type=non_negative_int,
      help="open client connections per server process; a new one past it closes the oldest idle one, or is "
           "refused when every one has a request in progress (0: derived from the open-files limit, "
           "(RLIMIT_NOFILE - 64) / 2, which keeps descriptors free for upstream connections and /health)")
    f("--max-inflight-bytes", env="INFERA_MAX_INFLIGHT_BYTES", default=DEFAULT_MAX_INFLIGHT_BYTES,
      type=positive_int,
      help="request body bytes all requests in progress may hold together, per server process (a chunked body "
           "counts as --max-request-bytes); past it a request gets 503 with Retry-After before its body is read")
    f("--http-fast-path", env="INFERA_HTTP_FAST_PATH", default="on", type=choice_of("on", "off"),
      help="on: plain HTTP/1.1 requests to /v1/chat/completions and /v1/completions are served by the front "
           "door's own protocol, without aiohttp's request and response objects (less CPU per request); any "
           "other request (and one without a valid key under --api-keys-file) hands its connection to aiohttp")
    f("--admin-token", env="INFERA_ADMIN_TOKEN", default=None, type=optional_secret,
      help="enables the /v1/admin/ endpoints, which then need 'Authorization: Bearer <token>'; off (403) "
           "without it. Prefer the env variable: a flag shows in the process list")
    f("--metrics-token", env="INFERA_METRICS_TOKEN", default=None, type=optional_secret,
      help="a read-only token for scrapers: 'Authorization: Bearer <token>' (or the admin token) opens /metrics, "
           "/v1/workers and the detailed /health once either token is set; without one /health shows status "
           "and counts only")
    f("--api-keys-file", env="INFERA_API_KEYS_FILE", default=None,
      help="YAML (or JSON) list of API keys by their sha256, each with a tenant and the models it may use "
           "(README: API keys); the inference API then needs 'Authorization: Bearer <key>' or 'x-api-key: <key>' "
           "(401 without a valid one, 403 for a model the key may not use). Reloaded when the file changes "
           "(a mounted Kubernetes Secret); off: the API is open. An entry's cache_isolation: true gives its tenant "
           "a cache_salt of its own (docs: multi-tenancy); the optional top-level cache_salt_secret keeps the salts "
           "equal across replicas and key rotations")
    f("--max-inflight-per-worker", env="INFERA_MAX_INFLIGHT_PER_WORKER", default=0, type=non_negative_int,
      help="fair queueing under overload: a model admits this many requests per worker (mixed and decode) at "
           "once; the rest wait in a bounded queue, served fairly among tenants and by their priority, and are "
           "picked for when a slot frees (0: off, every request goes to the engines at once)")
    f("--queue-timeout", env="INFERA_QUEUE_TIMEOUT", default=30.0, type=positive_float,
      help="seconds a request may wait for a free slot (--max-inflight-per-worker); then 429 with Retry-After")
    f("--queue-max-waiting", env="INFERA_QUEUE_MAX_WAITING", default=1024, type=positive_int,
      help="requests that may wait per model (--max-inflight-per-worker); past it 503 with Retry-After")
    f("--queue-reserve-per-worker", env="INFERA_QUEUE_RESERVE_PER_WORKER", default=0, type=non_negative_int,
      help="of each worker's --max-inflight-per-worker slots, keep this many for tenants holding less than their "
           "fair share, so a light tenant's request finds a slot at once while a heavy one overloads the model "
           "(it would otherwise wait for a slot to free). They stay idle while one tenant alone fills the rest, "
           "and always without --api-keys-file (every request is one tenant's). Must be below "
           "--max-inflight-per-worker (0: off, every slot open to all)")
    f("--otlp-traces-endpoint", env="INFERA_OTLP_TRACES_ENDPOINT", default=None,
      help="export a span per request over OTLP to this collector (e.g. http://otel-collector:4317; the protocol "
           "is OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, grpc by default as in vLLM) and send each engine the span's "
           "traceparent, so the engine's own spans join the trace; off: no spans (a client's own traceparent "
           "still reaches the engine)")
    f("--dashboard-session-s", env="INFERA_DASHBOARD_SESSION_S", default=12 * 3600.0, type=positive_float,
      help="seconds a /dashboard sign-in (its cookie) stays valid; the server refuses it afterwards")
    f("--allow-client-kv-transfer-params", env="INFERA_ALLOW_CLIENT_KV_TRANSFER_PARAMS", default=False,
      action="store_true",
      help="pass a client's own kv_transfer_params to the engines (they tell a vLLM KV connector which host to "
           "pull KV from); off: such a request gets a 400")
    f("--allow-client-priority", env="INFERA_ALLOW_CLIENT_PRIORITY", default=False, action="store_true",
      help="pass a client's own integer 'priority' to the engines, clamped to the router's range 0-100; off: it "
           "is dropped (SGLang gets the router's own 0/50/100 from the cache retention)")
    # -- cache hints to engines, profiling fan-out (infera/router/engine_hints.py, infera/server/profiling.py)
    f("--router-default-retention", env="INFERA_ROUTER_DEFAULT_RETENTION", default="long",
      type=choice_of("none", "short", "long"),
      help="the cache retention engines are told for a request that gives no cache hint (prompt_cache_retention, "
           "prompt_cache_key, cache_control): SGLang's priority 0/50/100, and kvd's retention on vLLM workers "
           "with kvd")
    f("--enable-profiling", env="INFERA_ENABLE_PROFILING", default=False, action="store_true",
      help="POST /v1/admin/profile/start and /stop: start or stop the engine profiler of the selected workers "
           "(admin endpoints: also needs --admin-token); off: 404")
    f("--enable-scaling-api", env="INFERA_ENABLE_SCALING_API", default=False, action="store_true",
      help="GET /v1/admin/scale (each service's wanted, current and ready replicas, and why it is short) and "
           "POST /v1/admin/scale {\"services\": {\"decode\": 3}} (absolute counts, >= 1: one merge patch of "
           "this server's InferaDeployment, found from its own Pod's label infera.amd.com/deployment). For "
           "servers the Infera operator deployed; needs --admin-token, POD_NAME and RBAC to get Pods and "
           "get/patch inferadeployments; off: 404")
    f("--k8s-pod-name", env="POD_NAME", default=None,
      help="this server's own Pod (set POD_NAME from the Downward API): --enable-scaling-api reads its labels")
    f("--log-level", env="INFERA_LOG_LEVEL", default="info", type=choice_of("debug", "info", "warning", "error"),
      help="the server's log level (the GAIE picker shares this flag)")
    f("--access-log", env="INFERA_ACCESS_LOG", default=False, action="store_true",
      help="log every request (off by default: it costs on the hot path)")
    # -- lower KV tiers: tier-aware kv-aware routing, prewarm and kv-stats (infera/server/kv_tiers.py) --
    f("--kv-lower-tier-weight", env="INFERA_KV_LOWER_TIER_WEIGHT", default=DEFAULT_LOWER_TIER_WEIGHT, type=unit_float,
      help="kv-aware: what a prompt block the worker's engine holds on a lower tier (host memory, disk, kvd: "
           "published as KV events with that medium) costs, as a fraction of a missed block: loading it back "
           "is cheap but not free. 1: tier-blind (such a block is a miss), 0: as good as a GPU hit")
    f("--kvd-socket-path", env="INFERA_KVD_SOCKET_PATH", default=None, type=optional_path,
      help="the local kvd's Unix socket: enables POST /v1/cache/prewarm (a PrefetchHint to it) and adds its "
           "stats to GET /v1/kv-stats")
    # -- the KV self-check over a window (infera/server/engine_scrape.py) --
    f("--engine-scrape-interval", env="INFERA_ENGINE_SCRAPE_INTERVAL", default=10.0, type=non_negative_float,
      help="kv-aware: seconds between scrapes of every worker's /metrics, whose prefix-cache counters are "
           "compared with the router's predicted hits over --engine-scrape-window (0: off)")
    f("--engine-scrape-window", env="INFERA_ENGINE_SCRAPE_WINDOW", default=300.0, type=positive_float,
      help="kv-aware: seconds over which the predicted and the engine-measured hit rates are compared (at "
           "least two scrape intervals)")
    return p


def unit_float(value: str) -> float:
    """A float in [0, 1]."""
    v = non_negative_float(value)
    if not v <= 1.0:  # (nan too)
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {value!r}")
    return v


def optional_path(value: str) -> str | None:
    """A path flag: surrounding blanks dropped, empty = unset (an empty env variable turns it off)."""
    return value.strip() or None


def optional_secret(value: str) -> str | None:
    """A token flag: surrounding blanks dropped, empty = unset (an empty env variable turns it off)."""
    return value.strip() or None


def parse_args(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    parser = build_parser(environ)
    args = parser.parse_args(argv)
    check_args(parser, args, environ)
    return args


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace,
               environ: Mapping[str, str] | None = None) -> None:
    """The checks across flags and the derived defaults (also the GAIE endpoint picker's, whose
    parser is this one plus its own flags); a bad combination is ``parser.error``."""
    if args.discovery_backend == "etcd" and not args.etcd_endpoint:
        parser.error("--etcd-endpoint (or INFERA_ETCD_ENDPOINT) is required with --discovery-backend etcd")
    if args.discovery_backend == "kubernetes" and not args.k8s_label_selector:
        parser.error("--k8s-label-selector (or INFERA_K8S_LABEL_SELECTOR) is required with --discovery-backend "
                     "kubernetes: it names the worker Pods to route to")
    try:
        discovery_options(args, environ)  # fleet key, etcd credentials: read at start, a bad file stops here
    except ValueError as exc:
        parser.error(str(exc))
    if getattr(args, "lora_dynamic_loading", False) and not args.lora_adapter_dir:
        parser.error("--lora-dynamic-loading needs --lora-adapter-dir (where the workers find the adapters)")
    if args.workers is None:
        args.workers = default_server_workers()
    if args.replica_sync is None:
        if "nats" in (args.request_transport, args.kv_event_transport):
            args.replica_sync = "nats"
        else:
            args.replica_sync = "local" if args.workers > 1 else "off"
    elif args.replica_sync == "local" and args.workers == 1:
        parser.error("--replica-sync local shares among the processes of one server: it needs --workers > 1 "
                     "(or INFERA_SERVER_WORKERS); use nats to share with other server replicas")
    if "nats" in (args.request_transport, args.kv_event_transport) or args.replica_sync == "nats":
        from infera.transport.nats_auth import NatsAuth

        try:  # NATS credentials and TLS files are read at start: a bad one stops the server here
            NatsAuth.from_args(args, environ)
        except ValueError as exc:
            parser.error(str(exc))
    if getattr(args, "otlp_traces_endpoint", None):
        from infera.server.tracing import PROTOCOL_ENV, PROTOCOLS

        env = os.environ if environ is None else environ
        if env.get(PROTOCOL_ENV, "grpc") not in PROTOCOLS:
            parser.error(f"--otlp-traces-endpoint: {PROTOCOL_ENV}={env[PROTOCOL_ENV]!r} is not one of "
                         f"{', '.join(PROTOCOLS)}")
        try:
            import opentelemetry.sdk.trace  # noqa: F401
        except ImportError:
            parser.error("--otlp-traces-endpoint needs the OpenTelemetry SDK and OTLP exporters "
                         "(pip install opentelemetry-sdk opentelemetry-exporter-otlp)")
    if getattr(args, "api_keys_file", None):
        from infera.server.api_keys import ApiKeys, ApiKeysError

        try:  # read at start: a bad file stops the server here, naming the entry and field
            ApiKeys(args.api_keys_file).load()
        except ApiKeysError as exc:
            parser.error(f"--api-keys-file {args.api_keys_file}: {exc}")
    if args.enable_scaling_api and not args.admin_token:
        parser.error("--enable-scaling-api (or INFERA_ENABLE_SCALING_API) needs --admin-token (or "
                     "INFERA_ADMIN_TOKEN): POST /v1/admin/scale resizes the deployment, and the admin endpoints "
                     "are off without a token")
    if args.breaker_max_cooldown_s < args.breaker_cooldown_s:
        parser.error(f"--breaker-max-cooldown-s ({args.breaker_max_cooldown_s:g}) must be >= --breaker-cooldown-s "
                     f"({args.breaker_cooldown_s:g})")
    if args.queue_reserve_per_worker and args.queue_reserve_per_worker >= max(args.max_inflight_per_worker, 1):
        parser.error(f"--queue-reserve-per-worker ({args.queue_reserve_per_worker}) must be below "
                     f"--max-inflight-per-worker ({args.max_inflight_per_worker}): some slots must be open to "
                     "every tenant, and the reserve needs the per-worker bound")
