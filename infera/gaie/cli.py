"""``python -m infera.gaie`` flags: the server's own routing flags (same names and env variables,
flag > env > default: discovery, transports, NATS, policy, tokenizer, kv weights, replica sync,
breaker, body size) plus the picker's."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Mapping, Sequence

from infera.config import add_flag, choice_of, non_negative_float, non_negative_int, port_number
from infera.gaie.envoy_config import PROCESSING_MODES, render_envoy_config
from infera.server.cli import build_parser as build_server_parser
from infera.server.cli import check_args

DEFAULT_GRPC_PORT = 9002
DEFAULT_HEALTH_PORT = 9003
DEFAULT_DESTINATION_PORT = 8000
DEFAULT_DRAIN_TIMEOUT = 30.0

# Server flags the picker has no use for: it serves no HTTP API (no port, processes, connection
# limits, admin features, API keys or dashboard: the gateway authenticates), never dispatches
# (retries, timeouts, migration, PD legs, engine hints: the request goes through Envoy to the worker
# or its sidecar, which owns those) and always picks (no direct mode: pinning headers are the
# sidecar's). Accepting them and ignoring them would be a lie; argparse refuses them instead. Their
# server defaults stay in the namespace for the shared routing stack, which builds the same objects
# as the server.
SERVER_ONLY_FLAGS = frozenset({
    "--port", "--workers", "--router-mode", "--request-max-retries", "--request-first-byte-timeout",
    "--request-idle-timeout", "--max-upstream-reply-bytes", "--migration-limit", "--pd-prefill-timeout",
    "--header-timeout", "--body-timeout", "--keepalive-timeout", "--max-connections", "--max-inflight-bytes",
    "--dashboard-session-s", "--allow-client-priority", "--router-default-retention", "--enable-profiling",
    "--enable-scaling-api", "--k8s-pod-name", "--access-log", "--kvd-socket-path", "--nats-req-idle-timeout",
    "--nats-req-max-duration", "--nats-req-max-pending", "--api-keys-file",
    "--otlp-traces-endpoint", "--max-inflight-per-worker", "--queue-timeout", "--queue-max-waiting",
    "--queue-reserve-per-worker", "--kv-index-scope",
})


def _drop_server_only_flags(parser: argparse.ArgumentParser) -> None:
    defaults = {}
    for action in list(parser._actions):
        if not SERVER_ONLY_FLAGS.intersection(action.option_strings):
            continue
        defaults[action.dest] = action.default
        parser._remove_action(action)
        for group in parser._action_groups:
            if action in group._group_actions:
                group._group_actions.remove(action)
        for option in action.option_strings:
            parser._option_string_actions.pop(option, None)
    parser.set_defaults(**defaults)


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    p = build_server_parser(environ)
    _drop_server_only_flags(p)
    p.prog = "python -m infera.gaie"
    p.description = ("Infera's Gateway API endpoint picker: an Envoy ext_proc gRPC server that picks the worker "
                     "(kv-aware, PD-preferred) with the same routing stack as infera.server.")
    g = p.add_argument_group("endpoint picker")
    fg = lambda *a, **k: add_flag(g, *a, environ=environ, **k)  # noqa: E731
    fg("--grpc-port", env="INFERA_EPP_GRPC_PORT", default=DEFAULT_GRPC_PORT, type=port_number,
       help="ext_proc gRPC port (also serves gRPC health; 0: any free port)")
    fg("--grpc-health-port", env="INFERA_EPP_GRPC_HEALTH_PORT", default=DEFAULT_HEALTH_PORT, type=port_number,
       help="plaintext gRPC health port for probes (service inference-extension)")
    fg("--destination-port", env="INFERA_EPP_DEST_PORT", default=DEFAULT_DESTINATION_PORT, type=non_negative_int,
       help="port of x-gateway-destination-endpoint on the picked worker's host: its infera.server "
            "--router-mode direct sidecar; 0: the worker record's own port (straight to the engine, no sidecar: "
            "mixed workers only, a PD pair needs the sidecar)")
    fg("--secure-serving", env="INFERA_EPP_SECURE", default=True, action=argparse.BooleanOptionalAction,
       help="serve ext_proc over TLS with a self-signed RSA-2048 certificate made in memory at start")
    fg("--metrics-port", env="INFERA_EPP_METRICS_PORT", default=0, type=port_number,
       help="HTTP port serving the picker's Prometheus /metrics (the server's routing series: workers, in-flight "
            "requests per worker, kv-aware picks); 0: off")
    fg("--drain-timeout", env="INFERA_EPP_DRAIN_TIMEOUT", default=DEFAULT_DRAIN_TIMEOUT, type=non_negative_float,
       help="on SIGTERM: seconds the open ext_proc streams (requests in progress; in full-duplex-streamed mode "
            "their replies stream through the picker) may finish while no new one is accepted and health says "
            "NOT_SERVING")
    # --print-envoy-config: print a bootstrap and exit
    fg("--print-envoy-config", default=False, action="store_true",
       help="print an Envoy v3 bootstrap (YAML) for this picker and exit")
    fg("--listen-port", default=None, type=port_number, help="--print-envoy-config: the gateway's listener port")
    fg("--processing-mode", default="full-duplex-streamed", type=choice_of(*PROCESSING_MODES),
       help="--print-envoy-config: how Envoy hands the request body over")
    fg("--epp-host", default="127.0.0.1", help="--print-envoy-config: where Envoy reaches this picker")
    fg("--admin-port", default=9901, type=port_number, help="--print-envoy-config: Envoy's admin port (loopback)")
    fg("--failure-mode-allow", default=False, action="store_true",
       help="--print-envoy-config: let requests through when the picker is down (they then have no "
            "destination; off: Envoy answers 503)")
    return p


def parse_args(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    parser = build_parser(environ)
    args = parser.parse_args(argv)
    if args.print_envoy_config:
        if args.listen_port is None:
            parser.error("--print-envoy-config needs --listen-port")
        return args
    args.workers = 1  # one process; replicas share in-flight state over --replica-sync nats
    if args.replica_sync == "local":
        parser.error("--replica-sync local is for a server's --workers processes; EPP replicas share over nats")
    args.router_mode = "auto"  # the picker always picks: pinning headers are the sidecar's
    check_args(parser, args, environ)
    return args


async def serve(args: argparse.Namespace) -> None:
    from infera.gaie.server import EppServer
    from infera.runtime import wait_for_shutdown_signal

    server = EppServer(args)
    await server.start()
    try:
        await wait_for_shutdown_signal()
    finally:
        logging.getLogger("infera.gaie").info("shutting down")
        await server.stop()


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.print_envoy_config:
        sys.stdout.write(render_envoy_config(listen_port=args.listen_port, grpc_port=args.grpc_port,
                                             epp_host=args.epp_host, mode=args.processing_mode,
                                             secure=args.secure_serving, admin_port=args.admin_port,
                                             failure_mode_allow=args.failure_mode_allow,
                                             max_body_bytes=args.max_request_bytes))
        return
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from infera.heap_trim import limit_malloc_arenas
    from infera.runtime import install_event_loop

    limit_malloc_arenas(os.environ)  # before any thread has one of its own (infera/heap_trim.py)
    install_event_loop()
    asyncio.run(serve(args))
