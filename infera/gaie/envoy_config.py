"""``python -m infera.gaie --print-envoy-config``: an Envoy v3 bootstrap for this picker.

Two HTTP stages in one Envoy. The public listener removes the headers only the picker may set and
forwards to the internal listener ``infera_pick`` (no socket), retrying there when the picked worker
refused the connection. In that inner stage the ext_proc filter asks the picker (cluster
``infera_epp``, gRPC over HTTP/2; TLS without certificate validation when the picker serves TLS:
its certificate is self-signed, made at start) where the request goes, and the route sends it to
``infera_workers``, an ORIGINAL_DST cluster that connects to the address in the
``x-gateway-destination-endpoint`` header the picker set. The tests start Envoy with exactly this
output.
"""
from __future__ import annotations

from typing import Any

import yaml

from infera.router.upstream import UNREACHABLE_WORKER_HEADER

DESTINATION_HEADER = "x-gateway-destination-endpoint"
PROCESSING_MODES = ("buffered", "full-duplex-streamed")
EPP_CLUSTER = "infera_epp"
WORKERS_CLUSTER = "infera_workers"
PICK_CLUSTER = PICK_LISTENER = "infera_pick"
# The inner stage's mark on a reply whose picked worker refused the connection (or reset it before
# answering): the outer stage retries on it, the picker blames the worker and picks another.
CONNECT_FAILURE_HEADER = UNREACHABLE_WORKER_HEADER  # also set by a sidecar that could not reach a pinned worker
CONNECT_FAILURE_RETRIES = 2
# Set by the picker only: a client's own values are removed before the picker runs.
PICKER_HEADERS = (DESTINATION_HEADER, "x-worker-instance-id", "x-prefill-instance-id", "x-data-parallel-rank",
                  CONNECT_FAILURE_HEADER)
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
# The gateway's own timeouts stay out of a generation's way: no total route timeout (a long
# generation streams for minutes), and an hour of silence before a stream counts as idle (a long
# prompt's prefill sends nothing until its first token).
STREAM_IDLE_TIMEOUT = "3600s"
# How long Envoy waits for the picker's answer to one message (a pick tokenizes the prompt).
EXT_PROC_MESSAGE_TIMEOUT = "10s"


def processing_mode(mode: str) -> dict[str, str]:
    """The ext_proc processing mode per ``--processing-mode``. Both send the reply's headers (the
    picker learns its status, and a refused connection's mark).

    * buffered: Envoy buffers the request body and sends it whole; the reply body does not go
      through the picker at all (each ext_proc message is a round trip through the picker: a
      streamed reply would pay one per chunk). The charge is released when Envoy ends the ext_proc
      stream, at the end of the HTTP request. The fewest messages: the faster mode.
    * full-duplex-streamed (GAIE's): the request body streams to the picker, which answers once it
      is complete; reply bodies pass through the picker chunk by chunk (it sees the reply's end and
      its usage)."""
    if mode == "buffered":
        return {"request_header_mode": "SEND", "response_header_mode": "SEND",
                "request_body_mode": "BUFFERED", "response_body_mode": "NONE",
                "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"}
    if mode == "full-duplex-streamed":
        # Envoy requires trailers sent in FULL_DUPLEX_STREAMED (they may end a body).
        return {"request_header_mode": "SEND", "response_header_mode": "SEND",
                "request_body_mode": "FULL_DUPLEX_STREAMED", "response_body_mode": "FULL_DUPLEX_STREAMED",
                "request_trailer_mode": "SEND", "response_trailer_mode": "SEND"}
    raise ValueError(f"--processing-mode: {mode!r} is not one of {', '.join(PROCESSING_MODES)}")


def envoy_bootstrap(*, listen_port: int, grpc_port: int = 9002, epp_host: str = "127.0.0.1",
                    mode: str = "full-duplex-streamed", secure: bool = True, admin_port: int = 9901,
                    failure_mode_allow: bool = False, listen_host: str = "0.0.0.0",
                    admin_host: str = "127.0.0.1", connect_timeout_s: float = 5.0,
                    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> dict[str, Any]:
    """The bootstrap as a dict (``render_envoy_config`` prints it as YAML)."""
    epp_cluster: dict[str, Any] = {
        "name": EPP_CLUSTER,
        "type": "STRICT_DNS",
        "connect_timeout": f"{connect_timeout_s:g}s",
        "lb_policy": "ROUND_ROBIN",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            },
        },
        "load_assignment": {
            "cluster_name": EPP_CLUSTER,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
                "socket_address": {"address": epp_host, "port_value": grpc_port}}}}]}],
        },
    }
    if secure:
        # The picker's certificate is self-signed (made in memory at its start): encrypted, not
        # verified. Give the context a validation_context to verify a certificate of your own.
        epp_cluster["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                "common_tls_context": {"alpn_protocols": ["h2"]},
            },
        }
    workers_cluster = {
        "name": WORKERS_CLUSTER,
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": f"{connect_timeout_s:g}s",
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER},
    }
    # The inner stage reaches itself through Envoy's internal listener: no socket, no port.
    pick_cluster = {
        "name": PICK_CLUSTER,
        "type": "STATIC",
        "connect_timeout": f"{connect_timeout_s:g}s",
        "load_assignment": {
            "cluster_name": PICK_CLUSTER,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
                "envoy_internal_address": {"server_listener_name": PICK_LISTENER}}}}]}],
        },
    }
    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": EPP_CLUSTER}},
            # false: no picker, no request (503, from status_on_error); true lets requests through
            # unpicked, which here have no destination (503 too) — keep it false.
            "failure_mode_allow": failure_mode_allow,
            "status_on_error": {"code": "ServiceUnavailable"},
            "message_timeout": EXT_PROC_MESSAGE_TIMEOUT,
            "max_message_timeout": EXT_PROC_MESSAGE_TIMEOUT,
            "processing_mode": processing_mode(mode),
        },
    }
    router = {"name": "envoy.filters.http.router",
              "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}
    hcm_type = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
    # Outer stage (the public listener): strips what only the picker may set, and retries a request
    # whose picked worker refused the connection; each attempt goes through the inner stage anew,
    # so the picker picks again (it excludes the refused worker, by the request's x-request-id).
    public_hcm = {
        "@type": hcm_type,
        "stat_prefix": "infera_gateway",
        "codec_type": "AUTO",
        "stream_idle_timeout": STREAM_IDLE_TIMEOUT,
        "route_config": {
            "name": "infera_public_route",
            "virtual_hosts": [{
                "name": "infera",
                "domains": ["*"],
                "include_request_attempt_count": True,
                "routes": [{
                    "match": {"prefix": "/"},
                    "route": {"cluster": PICK_CLUSTER, "timeout": "0s", "idle_timeout": STREAM_IDLE_TIMEOUT,
                              "retry_policy": {
                                  "retry_on": "retriable-headers",
                                  "num_retries": CONNECT_FAILURE_RETRIES,
                                  "retriable_headers": [{"name": CONNECT_FAILURE_HEADER,
                                                         "present_match": True}],
                                  "retry_back_off": {"base_interval": "0.005s", "max_interval": "0.05s"}}},
                    # a retry resends the buffered body: bodies up to this size can be retried
                    "per_request_buffer_limit_bytes": max_body_bytes,
                    "request_headers_to_remove": list(PICKER_HEADERS),
                }],
            }],
        },
        "http_filters": [router],
    }
    # Inner stage: the picker chooses, the ORIGINAL_DST cluster connects there; a refused connection
    # becomes a local reply marked with CONNECT_FAILURE_HEADER (the outer stage retries on it, and
    # the picker, seeing it among the reply's headers, counts the failure against the worker).
    pick_hcm = {
        "@type": hcm_type,
        "stat_prefix": "infera_pick",
        "codec_type": "AUTO",
        "stream_idle_timeout": STREAM_IDLE_TIMEOUT,
        "local_reply_config": {"mappers": [{
            "filter": {"response_flag_filter": {"flags": ["UF", "UC"]}},
            "headers_to_add": [{"header": {"key": CONNECT_FAILURE_HEADER, "value": "%UPSTREAM_HOST%"}}],
        }]},
        "route_config": {
            "name": "infera_pick_route",
            "virtual_hosts": [{
                "name": "infera",
                "domains": ["*"],
                "routes": [{"match": {"prefix": "/"},
                            "route": {"cluster": WORKERS_CLUSTER, "timeout": "0s",
                                      "idle_timeout": STREAM_IDLE_TIMEOUT}}],
            }],
        },
        "http_filters": [ext_proc, router],
    }
    return {
        "admin": {"address": {"socket_address": {"address": admin_host, "port_value": admin_port}}},
        "bootstrap_extensions": [{
            "name": "envoy.bootstrap.internal_listener",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.bootstrap.internal_listener.v3.InternalListener"},
        }],
        "static_resources": {
            "listeners": [
                {"name": "infera_gateway",
                 "address": {"socket_address": {"address": listen_host, "port_value": listen_port}},
                 "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                 "typed_config": public_hcm}]}]},
                {"name": PICK_LISTENER,
                 "internal_listener": {},
                 # buffered mode: ext_proc holds the whole request body within this limit (Envoy's
                 # default, 1 MiB, would answer 413 to a long prompt the picker accepts)
                 "per_connection_buffer_limit_bytes": max_body_bytes,
                 "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                 "typed_config": pick_hcm}]}]},
            ],
            "clusters": [pick_cluster, epp_cluster, workers_cluster],
        },
    }


def render_envoy_config(**kwargs: Any) -> str:
    header = ("# Envoy v3 bootstrap for the Infera endpoint picker (python -m infera.gaie --print-envoy-config).\n"
              f"# Processing mode: {kwargs.get('mode', 'full-duplex-streamed')}; picker TLS: "
              f"{'on, certificate not verified (self-signed)' if kwargs.get('secure', True) else 'off'}.\n")
    return header + yaml.safe_dump(envoy_bootstrap(**kwargs), sort_keys=False, default_flow_style=False)
