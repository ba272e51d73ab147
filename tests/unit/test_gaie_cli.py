"""``python -m infera.gaie`` flags (the server's names and env variables, flag > env > default),
``--print-envoy-config`` and the self-signed certificate."""
from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from infera.gaie.cli import parse_args
from infera.gaie.envoy_config import envoy_bootstrap
from infera.gaie.tls import self_signed_cert

BASE = ["--etcd-endpoint", "e:2379"]


def test_defaults_and_env():
    args = parse_args(BASE, environ={})
    assert (args.grpc_port, args.grpc_health_port, args.destination_port, args.secure_serving) == (9002, 9003, 8000,
                                                                                                   True)
    assert args.router_policy == "kv-aware" and args.router_mode == "auto" and args.workers == 1
    env = {"INFERA_EPP_GRPC_PORT": "9100", "INFERA_EPP_DEST_PORT": "0", "INFERA_EPP_SECURE": "false",
           "INFERA_KV_OVERLAP_WEIGHT": "3", "INFERA_ROUTER_POLICY": "round-robin"}
    args = parse_args(BASE, environ=env)
    assert (args.grpc_port, args.destination_port, args.secure_serving) == (9100, 0, False)
    assert args.kv_overlap_weight == 3.0 and args.router_policy == "round-robin"
    args = parse_args(BASE + ["--grpc-port", "9200", "--secure-serving"], environ=env)
    assert args.grpc_port == 9200 and args.secure_serving and args.router_mode == "auto"  # the picker always picks


def test_server_checks_apply(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--discovery-backend", "etcd"], environ={})  # no endpoint
    assert "--etcd-endpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--replica-sync", "local"], environ={})
    args = parse_args(BASE + ["--kv-event-transport", "nats", "--nats-server", "nats://n:4222"], environ={})
    assert args.replica_sync == "nats"  # EPP replicas share in-flight state like server replicas


@pytest.mark.parametrize("mode, body_mode", [("buffered", "BUFFERED"), ("full-duplex-streamed", "FULL_DUPLEX_STREAMED")])
def test_printed_config_is_yaml_with_the_filter_and_the_clusters(mode, body_mode):
    out = subprocess.run([sys.executable, "-m", "infera.gaie", "--print-envoy-config", "--listen-port", "10000",
                          "--grpc-port", "9555", "--processing-mode", mode, "--epp-host", "epp.ns.svc",
                          "--admin-port", "9911"], capture_output=True, text=True, timeout=60, check=True,
                         env={"PATH": "/usr/bin:/bin"})
    config = yaml.safe_load(out.stdout)
    public, inner = config["static_resources"]["listeners"]
    assert public["address"]["socket_address"]["port_value"] == 10000
    outer_route = public["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]["virtual_hosts"][0][
        "routes"][0]
    assert outer_route["route"]["cluster"] == "infera_pick"
    assert outer_route["route"]["retry_policy"]["retriable_headers"][0]["name"] == "x-infera-upstream-connect-failure"
    assert "x-gateway-destination-endpoint" in outer_route["request_headers_to_remove"]  # clients cannot steer
    assert inner["name"] == "infera_pick" and "internal_listener" in inner
    hcm = inner["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = hcm["http_filters"][0]["typed_config"]
    assert ext_proc["status_on_error"] == {"code": "ServiceUnavailable"}
    assert ext_proc["@type"].endswith("ext_proc.v3.ExternalProcessor")
    assert ext_proc["grpc_service"]["envoy_grpc"]["cluster_name"] == "infera_epp"
    assert ext_proc["processing_mode"]["request_body_mode"] == body_mode
    assert ext_proc["failure_mode_allow"] is False
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    epp = clusters["infera_epp"]
    assert epp["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"] == {
        "address": "epp.ns.svc", "port_value": 9555}
    assert "transport_socket" in epp  # TLS by default (self-signed: not validated)
    workers = clusters["infera_workers"]
    assert workers["type"] == "ORIGINAL_DST"
    assert workers["original_dst_lb_config"] == {"use_http_header": True,
                                                 "http_header_name": "x-gateway-destination-endpoint"}
    assert config["admin"]["address"]["socket_address"]["port_value"] == 9911


def test_plaintext_and_failure_mode_allow():
    config = envoy_bootstrap(listen_port=1, secure=False, failure_mode_allow=True)
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    assert "transport_socket" not in clusters["infera_epp"]
    hcm = config["static_resources"]["listeners"][1]["filter_chains"][0]["filters"][0]["typed_config"]
    assert hcm["http_filters"][0]["typed_config"]["failure_mode_allow"] is True


def test_print_needs_a_listen_port(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--print-envoy-config"], environ={})
    assert "--listen-port" in capsys.readouterr().err


def test_self_signed_cert_is_rsa_2048_pem():
    key, cert = self_signed_cert()
    assert key.startswith(b"-----BEGIN PRIVATE KEY-----") and cert.startswith(b"-----BEGIN CERTIFICATE-----")
    text = subprocess.run(["openssl", "x509", "-noout", "-text"], input=cert, capture_output=True, check=True).stdout
    assert b"2048 bit" in text and b"DNS:localhost" in text


@pytest.mark.parametrize("flag", sorted(__import__("infera.gaie.cli", fromlist=["SERVER_ONLY_FLAGS"]).SERVER_ONLY_FLAGS))
def test_server_only_flags_are_refused_not_ignored(flag, capsys):
    # A flag the picker accepted and never read would be a stub: each is an argparse error.
    from infera.gaie.cli import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args([flag, "1"], environ={})
    assert exc.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err
