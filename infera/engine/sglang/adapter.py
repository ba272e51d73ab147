"""SGLang: argv translation, readiness and the worker record for ``python -m infera.engine.sglang``.

Every flag the user gives goes to ``python -m sglang.launch_server`` verbatim and in order; Infera
only appends what is missing:

* ``--enable-metrics`` (the drain reads ``/metrics``; SGLang serves none without it),
* with KV events on (the default) and no user ``--kv-events-config``:
  ``--kv-events-config '{"publisher":"zmq","endpoint":"tcp://*:<free port>","topic":"kv-events"}'``.
  With ``--dp-size N`` (N > 1) a block of N consecutive free ports is reserved, because SGLang's
  publisher of attention-DP rank r binds the configured port + r,
* on a GPU host ``--kv-cache-dtype fp8_e4m3`` (``kv_dtype.py``: not over the user's own dtype,
  not with ``INFERA_DEFAULT_KV_FP8=0``), and
* for a decode worker on the mooncake transfer backend with KV events on:
  ``--disaggregation-decode-enable-radix-cache``. SGLang's decode otherwise runs a chunk cache: it
  keeps no prefixes, so it would publish no KV events and a KV-aware router would have nothing to
  route decodes by. Not with a speculative algorithm (SGLang refuses the pair), nor over the
  user's ``--disable-radix-cache`` or ``--enable-hisparse`` (also refused with it).

With ``--infera-kvd-socket PATH`` (env ``INFERA_KVD_SOCKET``; prefill and mixed workers only) the
daemon is probed (fatal when it does not answer) and SGLang's HiCache gets kvd as its storage
backend: ``--enable-hierarchical-cache --hicache-storage-backend dynamic
--hicache-storage-backend-extra-config {...InferaKvdBackend...}`` (see ``kvd_hicache_flags``).

A launcher with ``--node-rank`` > 0 (or ``LWS_WORKER_INDEX`` > 0) is a multinode follower: it
runs the same engine command and never registers (``infera/engine/base/follower.py``).

The record: ``model_name`` = ``--served-model-name`` or ``--model-path``; ``kv_block_size`` =
``--page-size`` (SGLang's default 1); ``dp_size`` when > 1; the PD role from
``--disaggregation-mode`` with the ``sglang-bootstrap`` protocol; the KV-events endpoint.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Any, Sequence

import aiohttp

from infera.config import add_flag, parse_bool
from infera.engine.base.argv import flag_value, has_flag
from infera.engine.base.engine_config import http_ready, parse_json_flag
from infera.engine.base.kv_dtype import has_gpu, with_kv_fp8_default
from infera.engine.base.kv_events import bind_kv_events
from infera.engine.base.launcher import WILDCARD_HOSTS, EngineProcessSpec, default_advertise_host, engine_command
from infera.engine.base.ports import free_port_blocks
from infera.engine.base.preflight import SGLANG_RDMA_BACKENDS, PdSetup, sglang_transfer_refusals
from infera.engine.base.prom import sum_samples
from infera.engine.base.rocm_env import apply_rocm_env
from infera.kvd.config import DEFAULT_SOCKET as DEFAULT_KVD_SOCKET, SOCKET_ENV as KVD_SOCKET_ENV

log = logging.getLogger("infera.launcher.sglang")

PROG = "infera.engine.sglang"
SGLANG_MODULE = "sglang.launch_server"

# SGLang's own defaults (sglang.srt.server_args.ServerArgs) for the flags the record is built from.
SGLANG_DEFAULT_HOST = "127.0.0.1"
SGLANG_DEFAULT_PORT = 30000
SGLANG_DEFAULT_PAGE_SIZE = 1
SGLANG_DEFAULT_BOOTSTRAP_PORT = 8998
# SGLang's KVEventsConfig defaults: no publisher unless one is named; this endpoint when none is.
SGLANG_DEFAULT_KV_EVENTS_ENDPOINT = "tcp://*:5557"

MODEL_FLAGS = ("--model-path", "--model")
TP_FLAGS = ("--tp-size", "--tensor-parallel-size", "--tp")
DP_FLAGS = ("--dp-size", "--data-parallel-size", "--dp")
DISAGG_MODES = {"null": "mixed", "prefill": "prefill", "decode": "decode"}
PROTOCOL = "sglang-bootstrap"
SGLANG_DEFAULT_TRANSFER_BACKEND = "mooncake"
DECODE_RADIX_CACHE_FLAG = "--disaggregation-decode-enable-radix-cache"
# SGLang's parser allows abbreviations; "--speculative-al…" is the shortest unambiguous prefix.
SPECULATIVE_ALGORITHM_FLAG = "--speculative-algorithm"
SPECULATIVE_ALGORITHM_MIN_PREFIX = "--speculative-al"
# Flags SGLang refuses (or that say "no radix cache") together with the decode radix cache.
DECODE_RADIX_CACHE_CONFLICTS = ("--disable-radix-cache", "--enable-hisparse")

SGLANG_INFLIGHT = ("sglang:num_running_reqs", "sglang:num_queue_reqs")
# PD queues: requests a disaggregated worker holds outside running/queued (bootstrap handshakes,
# KV transfers in flight) — a drain that ignored them would cut transfers short.
SGLANG_PD_QUEUES = (
    "sglang:num_prefill_bootstrap_queue_reqs",
    "sglang:num_prefill_inflight_queue_reqs",
    "sglang:num_decode_prealloc_queue_reqs",
    "sglang:num_decode_transfer_queue_reqs",
)

_WILDCARDS = WILDCARD_HOSTS


def add_kv_events_flag(parser: argparse.ArgumentParser, default: bool, helptext: str) -> None:
    try:
        add_flag(parser, "--enable-kv-events", env="INFERA_ENABLE_KV_EVENTS", default=default,
                 action=argparse.BooleanOptionalAction, help=helptext)
    except argparse.ArgumentTypeError as exc:  # a bad env value, converted while the flag is built
        parser.error(f"INFERA_ENABLE_KV_EVENTS: {exc}")


def kv_events_enabled(args: argparse.Namespace, prog: str) -> bool:
    """``--enable-kv-events`` as a bool (an env default may arrive as a string)."""
    try:
        return parse_bool(args.enable_kv_events)
    except argparse.ArgumentTypeError:
        raise SystemExit(f"{prog}: INFERA_ENABLE_KV_EVENTS is not a boolean: {args.enable_kv_events!r}") from None


def int_flag(argv: Sequence[str], names: Sequence[str], default: int, prog: str) -> int:
    raw = flag_value(argv, *names)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise SystemExit(f"{prog}: {names[0]} must be an integer, got {raw!r}") from None


def speculative_algorithm(argv: Sequence[str]) -> str | None:
    """The ``--speculative-algorithm`` value the engine will see, abbreviations included (SGLang's
    argparse takes any unambiguous prefix, e.g. ``--speculative-algo NEXTN``)."""
    found: str | None = None
    for i, tok in enumerate(argv):
        name, eq, value = tok.partition("=")
        if name.startswith(SPECULATIVE_ALGORITHM_MIN_PREFIX) and SPECULATIVE_ALGORITHM_FLAG.startswith(name):
            found = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
    return found


def decode_radix_cache_decision(argv: Sequence[str], kv_events_on: bool) -> str | None:
    """None: append ``--disaggregation-decode-enable-radix-cache``; "": not a decode worker (nothing
    to decide); otherwise the reason the default is skipped (logged by the caller)."""
    if flag_value(argv, "--disaggregation-mode", default="null") != "decode":
        return ""
    backend = flag_value(argv, "--disaggregation-transfer-backend", default=SGLANG_DEFAULT_TRANSFER_BACKEND)
    if backend != "mooncake":
        return f"transfer backend {backend!r} (only mooncake's decode radix cache is used)"
    if not kv_events_on:
        return "KV events are off"
    if has_flag(argv, DECODE_RADIX_CACHE_FLAG):
        return "the user passed it"
    spec = speculative_algorithm(argv)
    if spec is not None:
        return f"speculative algorithm {spec!r} (SGLang refuses the decode radix cache with it)"
    for flag in DECODE_RADIX_CACHE_CONFLICTS:
        if has_flag(argv, flag):
            return f"the user's {flag}"
    return None


def parse_kv_events_endpoint(raw: str) -> tuple[str | None, int] | None:
    """(bind host or None for a wildcard, port) of a user's ``--kv-events-config``; None if it
    publishes nothing a router could subscribe to (no zmq publisher, or not a TCP endpoint)."""
    cfg = parse_json_flag(raw, "--kv-events-config", PROG) or {}
    if cfg.get("publisher", "null") != "zmq":
        log.warning("--kv-events-config has no zmq publisher: no KV-events endpoint is advertised")
        return None
    endpoint = cfg.get("endpoint") or SGLANG_DEFAULT_KV_EVENTS_ENDPOINT
    if not endpoint.startswith("tcp://") or ":" not in endpoint[len("tcp://"):]:
        log.warning("KV-events endpoint %r is not tcp://host:port: not advertised", endpoint)
        return None
    host, port = endpoint[len("tcp://"):].rsplit(":", 1)
    try:
        port_n = int(port)
    except ValueError:
        raise SystemExit(f"{PROG}: bad port in --kv-events-config endpoint {endpoint!r}") from None
    return (None if host in _WILDCARDS else host.strip("[]")), port_n


# --- kvd (spec §8.6): --infera-kvd-socket makes kvd SGLang's HiCache storage backend ---------------

KVD_SOCKET_FLAG = "--infera-kvd-socket"
HIERARCHICAL_CACHE_FLAGS = ("--enable-hierarchical-cache", "--enable-hicache")  # SGLang's alias
HICACHE_BACKEND_FLAG = "--hicache-storage-backend"
HICACHE_EXTRA_CONFIG_FLAG = "--hicache-storage-backend-extra-config"
KVD_BACKEND_MODULE = "infera.engine.sglang.kvd_adapter"
# SGLang's "dynamic" backend imports module_path.class_name; prefetch_threshold (tokens) is popped
# by SGLang itself: a storage hit shorter than that is not worth a prefetch.
KVD_BACKEND_CONFIG = {"backend_name": "infera-kvd", "module_path": KVD_BACKEND_MODULE,
                      "class_name": "InferaKvdBackend", "prefetch_threshold": 64}


def kvd_hicache_flags(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(flags to append for kvd, what of the user's was kept instead). The user's own hierarchical
    cache switch or storage backend wins: a backend (or extra config) they chose is not replaced."""
    added: list[str] = []
    kept: list[str] = []
    if has_flag(argv, *HIERARCHICAL_CACHE_FLAGS):
        kept.append(next(f for f in HIERARCHICAL_CACHE_FLAGS if has_flag(argv, f)))
    else:
        added.append(HIERARCHICAL_CACHE_FLAGS[0])
    user_backend = flag_value(argv, HICACHE_BACKEND_FLAG)
    if user_backend is not None or has_flag(argv, HICACHE_EXTRA_CONFIG_FLAG):
        kept.append(f"{HICACHE_BACKEND_FLAG} {user_backend}" if user_backend is not None else HICACHE_EXTRA_CONFIG_FLAG)
    else:
        added += [HICACHE_BACKEND_FLAG, "dynamic", HICACHE_EXTRA_CONFIG_FLAG,
                  json.dumps(KVD_BACKEND_CONFIG, separators=(",", ":"))]
    return added, kept


def uses_kvd_backend(argv: Sequence[str]) -> bool:
    """Whether the engine's HiCache storage is kvd (ours, or a user's config naming our module)."""
    if flag_value(argv, HICACHE_BACKEND_FLAG) != "dynamic":
        return False
    raw = flag_value(argv, HICACHE_EXTRA_CONFIG_FLAG) or ""
    try:
        cfg = json.loads(raw) if raw and not raw.startswith("@") else {}
    except ValueError:
        return False
    return isinstance(cfg, dict) and cfg.get("module_path") == KVD_BACKEND_MODULE


def probe_kvd(path: str) -> None:
    """Fail fast (before the engine spends its start-up) when the daemon does not answer:
    connect and stats, 5 s each."""
    from infera.kvd.client import KvdError, SyncKvdClient  # needed only with --infera-kvd-socket
    from infera.kvd.protocol import ProtocolError

    try:
        with SyncKvdClient(path, client_id="infera-launcher-probe", timeout=5.0) as client:
            client.stats()
    except (OSError, EOFError, KvdError, ProtocolError) as e:  # ProtocolError: not a kvd socket
        raise SystemExit(f"{PROG}: kvd at {path} does not answer ({e or type(e).__name__}); start it with "
                         f"`python -m infera.kvd --socket {path}` or drop {KVD_SOCKET_FLAG}") from None


def with_kvd_storage(argv: list[str], socket_path: str, env: dict[str, str]) -> list[str]:
    """argv with kvd as the HiCache storage backend (probed first); ``env`` gets INFERA_KVD_SOCKET.
    A decode worker is left alone: it loads its KV from the prefill, not from storage."""
    if flag_value(argv, "--disaggregation-mode", default="null") == "decode":
        log.info("decode worker: %s %s ignored (kvd serves prefill and mixed workers)", KVD_SOCKET_FLAG, socket_path)
        return argv
    if has_flag(argv, "--disable-radix-cache"):
        raise SystemExit(f"{PROG}: {KVD_SOCKET_FLAG} needs SGLang's hierarchical cache, which refuses "
                         f"--disable-radix-cache; drop one of them")
    probe_kvd(socket_path)
    added, kept = kvd_hicache_flags(argv)
    for flag in kept:
        log.info("kvd: keeping the user's %s (not replaced by kvd's)", flag)
    env[KVD_SOCKET_ENV] = socket_path
    if added:
        log.info("kvd at %s: appending %s", socket_path, " ".join(added))
    return [*argv, *added]


class SglangAdapter:
    engine = "sglang"
    node_rank_flags = ("--node-rank",)  # the follower gate (also LWS_WORKER_INDEX)

    def __init__(self) -> None:
        self.kv_events: tuple[str | None, int] | None = None  # (bind host, port) of the publisher

    def add_flags(self, parser: argparse.ArgumentParser) -> None:
        add_kv_events_flag(parser, True, "publish KV events: inject a zmq --kv-events-config on a free port "
                                         "unless one is given")
        add_flag(parser, KVD_SOCKET_FLAG, env=KVD_SOCKET_ENV, default=None,
                 help="kvd daemon socket: make kvd SGLang's HiCache storage backend (prefill/mixed workers; "
                      "the daemon must answer) and pass the socket to the engine")

    def pd_setup(self, engine_argv: list[str]) -> PdSetup:
        mode = flag_value(engine_argv, "--disaggregation-mode", default="null")
        if mode not in DISAGG_MODES:
            raise SystemExit(f"{PROG}: --disaggregation-mode must be one of null, prefill, decode; got {mode!r}")
        backend = flag_value(engine_argv, "--disaggregation-transfer-backend", default=SGLANG_DEFAULT_TRANSFER_BACKEND)
        return PdSetup(DISAGG_MODES[mode], PROTOCOL, f"the {backend!r} transfer backend",
                       rdma_capable=backend in SGLANG_RDMA_BACKENDS,
                       refusals=sglang_transfer_refusals(DISAGG_MODES[mode], backend),
                       bind_host=flag_value(engine_argv, "--host", default=SGLANG_DEFAULT_HOST))

    def prepare(self, engine_argv: list[str], args: argparse.Namespace) -> EngineProcessSpec:
        argv = list(engine_argv)
        if not flag_value(argv, *MODEL_FLAGS):
            raise SystemExit(f"{PROG}: --model-path (or --model) is required (a model folder or a hub id)")
        mode = flag_value(argv, "--disaggregation-mode", default="null")
        if mode not in DISAGG_MODES:
            raise SystemExit(f"{PROG}: --disaggregation-mode must be one of null, prefill, decode; got {mode!r}")
        port = int_flag(argv, ["--port"], SGLANG_DEFAULT_PORT, PROG)
        dp_size = int_flag(argv, DP_FLAGS, 1, PROG)
        for names, default in ((TP_FLAGS, 1), (["--page-size"], SGLANG_DEFAULT_PAGE_SIZE),
                               (["--disaggregation-bootstrap-port"], SGLANG_DEFAULT_BOOTSTRAP_PORT)):
            int_flag(argv, names, default, PROG)  # fail fast here, not after the engine is up
        if not has_flag(argv, "--enable-metrics"):
            argv.append("--enable-metrics")
        self.kv_events = None
        if kv_events_enabled(args, PROG):
            user_cfg = flag_value(argv, "--kv-events-config")
            if user_cfg is None:
                try:
                    # apart from the engine's own port, also unbound until the engine starts
                    (kv_port,) = free_port_blocks([max(dp_size, 1)], avoid=[range(port, port + 1)])
                except OSError as exc:
                    raise SystemExit(f"{PROG}: {exc} for KV events") from None
                argv += ["--kv-events-config", json.dumps(
                    {"publisher": "zmq", "endpoint": f"tcp://*:{kv_port}", "topic": "kv-events"},
                    separators=(",", ":"))]
                self.kv_events = (None, kv_port)
            else:
                self.kv_events = parse_kv_events_endpoint(user_cfg)
        argv = with_kv_fp8_default(argv, has_gpu(), os.environ, "SGLang", PROG, log)
        why_not = decode_radix_cache_decision(argv, kv_events_enabled(args, PROG))
        if why_not is None:
            argv.append(DECODE_RADIX_CACHE_FLAG)
            log.info("decode worker: %s (its prefixes become KV events the router can use)", DECODE_RADIX_CACHE_FLAG)
        elif why_not:
            log.info("decode worker: not adding %s: %s", DECODE_RADIX_CACHE_FLAG, why_not)
        env: dict[str, str] = {}
        kvd_socket = getattr(args, "infera_kvd_socket", None)
        if kvd_socket:
            argv = with_kvd_storage(argv, kvd_socket, env)
        bind = flag_value(argv, "--host", default=SGLANG_DEFAULT_HOST)
        reach = default_advertise_host(bind)
        if self.kv_events is not None and flag_value(engine_argv, "--kv-events-config") is None:
            argv = bind_kv_events(argv, args.advertise_host or reach)  # ours: bound where the router connects
        apply_rocm_env("sglang", argv, env)  # spec §6.5: an AMD host's RDMA defaults
        return EngineProcessSpec(cmd=engine_command(args, SGLANG_MODULE, argv), port=port, host=reach, env=env,
                                 argv=argv)

    async def ready(self, session: aiohttp.ClientSession, base_url: str) -> bool:
        return await http_ready(session, base_url)

    async def describe(self, session: aiohttp.ClientSession | None, base_url: str, engine_argv: list[str],
                       args: argparse.Namespace) -> dict[str, Any]:
        argv = engine_argv  # as finally passed (spec.argv): what the engine really runs with
        bind = flag_value(argv, "--host", default=SGLANG_DEFAULT_HOST)
        advertise = args.advertise_host or default_advertise_host(bind)  # as the base launcher decides
        fields: dict[str, Any] = {
            "model_name": flag_value(argv, "--served-model-name") or flag_value(argv, *MODEL_FLAGS),
            "kv_block_size": int_flag(argv, ["--page-size"], SGLANG_DEFAULT_PAGE_SIZE, PROG),
        }
        if not args.advertise_host:
            # Only without --advertise-host: the base launcher pops bind_host only when it needs it.
            fields["bind_host"] = bind
        dp_size = int_flag(argv, DP_FLAGS, 1, PROG)
        if dp_size > 1:
            # One HTTP endpoint fronts all N ranks either way. With --enable-dp-attention the ranks
            # are attention-DP groups inside one model instance; without it SGLang's data-parallel
            # controller runs N full replicas and spreads requests over them. Both honour a
            # requested rank, so the record is rank-multiplexed: dp_size=N, dp_rank=None.
            fields["dp_size"] = dp_size
            fields["dp_rank"] = None
        mode = DISAGG_MODES[flag_value(argv, "--disaggregation-mode", default="null")]
        fields["disagg_mode"] = mode
        if mode == "mixed":
            fields["disagg_meta"] = {}
        else:
            params: dict[str, Any] = {}
            if mode == "prefill":
                boot = int_flag(argv, ["--disaggregation-bootstrap-port"], SGLANG_DEFAULT_BOOTSTRAP_PORT, PROG)
                host = f"[{advertise}]" if ":" in advertise and not advertise.startswith("[") else advertise
                params["bootstrap_addr"] = f"{host}:{boot}"  # IPv6 bracketed: the router splits on the last ':'
            if has_flag(argv, *TP_FLAGS):
                params["tp_size"] = int_flag(argv, TP_FLAGS, 1, PROG)
            fields["disagg_meta"] = {"protocol": PROTOCOL, "params": params}
        if self.kv_events is not None:
            host, port = self.kv_events
            fields["kv_events_endpoint"] = f"tcp://{host or advertise}:{port}"
        if uses_kvd_backend(argv):  # --infera-kvd-socket, or the user's own config naming the backend
            fields["kvd_socket"] = (getattr(args, "infera_kvd_socket", None) or os.environ.get(KVD_SOCKET_ENV)
                                    or DEFAULT_KVD_SOCKET)
        return fields

    def inflight(self, metrics_text: str) -> int | None:
        core = sum_samples(metrics_text, SGLANG_INFLIGHT)
        if core is None:
            return None
        return core + (sum_samples(metrics_text, SGLANG_PD_QUEUES) or 0)
