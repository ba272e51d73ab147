"""``python -m infera.gaie --print-envoy-config``: an Envoy v3 bootstrap for this picker.

A listener with an HTTP connection manager whose ext_proc filter asks the picker (cluster
``infera_epp``, gRPC over HTTP/2; TLS without certificate validation when the picker serves TLS:
its certificate is self-signed, made at start) where each request goes; the route sends
everything to ``infera_workers``, an ORIGINAL_DST cluster that connects to the address in the
``x-gateway-destination-endpoint`` header the picker set. The tests start Envoy with exactly this
output.
"""
from __future__ import annotations

from typing import Any

import yaml

DESTINATION_HEADER = "x-gateway-destination-endpoint"
PROCESSING_MODES = ("buffered", "full-duplex-streamed")
EPP_CLUSTER = "infera_epp"
WORKERS_CLUSTER = "infera_workers"
# The gateway's own timeouts stay out of a generation's way: no total route timeout (a long
# generation streams for minutes), and an hour of silence before a stream counts as idle (a long
# prompt's prefill sends nothing until its first token).
STREAM_IDLE_TIMEOUT = "3600s"
# How long Envoy waits for the picker's answer to one message (a pick tokenizes the prompt).
EXT_PROC_MESSAGE_TIMEOUT = "10s"


def processing_mode(mode: str) -> dict[str, str]:
    """The ext_proc processing mode per ``--processing-mode``. Both send headers both ways (the
    picker learns the reply's status) and pass reply bodies through chunk by chunk (a stream is
    never held back); they differ in how the request body reaches the picker."""
    if mode == "buffered":
        return {"request_header_mode": "SEND", "response_header_mode": "SEND",
                "request_body_mode": "BUFFERED", "response_body_mode": "STREAMED",
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
                    admin_host: str = "127.0.0.1", connect_timeout_s: float = 5.0) -> dict[str, Any]:
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
    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": EPP_CLUSTER}},
            # false: no picker, no request (503); true would send requests on unpicked (and here,
            # with no destination header, unroutable) — see the README's gateway section.
            "failure_mode_allow": failure_mode_allow,
            "message_timeout": EXT_PROC_MESSAGE_TIMEOUT,
            "processing_mode": processing_mode(mode),
        },
    }
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                 "HttpConnectionManager",
        "stat_prefix": "infera_gateway",
        "codec_type": "AUTO",
        "stream_idle_timeout": STREAM_IDLE_TIMEOUT,
        "route_config": {
            "name": "infera_route",
            "virtual_hosts": [{
                "name": "infera",
                "domains": ["*"],
                "routes": [{"match": {"prefix": "/"},
                            "route": {"cluster": WORKERS_CLUSTER, "timeout": "0s", "idle_timeout": STREAM_IDLE_TIMEOUT}}],
            }],
        },
        "http_filters": [
            ext_proc,
            {"name": "envoy.filters.http.router",
             "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}},
        ],
    }
    return {
        "admin": {"address": {"socket_address": {"address": admin_host, "port_value": admin_port}}},
        "static_resources": {
            "listeners": [{
                "name": "infera_gateway",
                "address": {"socket_address": {"address": listen_host, "port_value": listen_port}},
                "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                "typed_config": hcm}]}],
            }],
            "clusters": [epp_cluster, workers_cluster],
        },
    }


def render_envoy_config(**kwargs: Any) -> str:
    header = ("# Envoy v3 bootstrap for the Infera endpoint picker (python -m infera.gaie --print-envoy-config).\n"
              f"# Processing mode: {kwargs.get('mode', 'full-duplex-streamed')}; picker TLS: "
              f"{'on, certificate not verified (self-signed)' if kwargs.get('secure', True) else 'off'}.\n")
    return header + yaml.safe_dump(envoy_bootstrap(**kwargs), sort_keys=False, default_flow_style=False)
