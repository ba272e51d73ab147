import argparse

import pytest

from infera.config import add_flag, etcd_prefix, etcd_url, parse_bool
from infera.server.cli import parse_args


@pytest.mark.parametrize(
    "value, expected",
    [
        ("127.0.0.1:2379", "http://127.0.0.1:2379"),
        ("etcd", "http://etcd:2379"),
        ("etcd.svc:12379", "http://etcd.svc:12379"),
        ("http://h:1", "http://h:1"),
        ("https://h", "https://h:2379"),
        ("http://h:1/", "http://h:1"),
        ("[::1]:2379", "http://[::1]:2379"),
    ],
)
def test_etcd_url(value, expected):
    assert etcd_url(value) == expected


@pytest.mark.parametrize("value", ["", "ftp://h:1", "http://"])
def test_etcd_url_rejects(value):
    with pytest.raises(argparse.ArgumentTypeError):
        etcd_url(value)


def test_etcd_prefix_gets_trailing_slash():
    assert etcd_prefix("/x/y") == "/x/y/"
    assert etcd_prefix("/x/") == "/x/"


@pytest.mark.parametrize(
    "argv, env, expected",
    [
        ([], {}, 1),  # default
        ([], {"INFERA_REQUEST_MAX_RETRIES": "3"}, 3),  # env beats default
        (["--request-max-retries", "0"], {"INFERA_REQUEST_MAX_RETRIES": "3"}, 0),  # flag beats env
    ],
)
def test_flag_env_default_precedence(argv, env, expected):
    args = parse_args(["--etcd-endpoint", "h:1", *argv], environ=env)
    assert args.request_max_retries == expected


def test_env_value_is_validated_like_a_flag():
    with pytest.raises(SystemExit):
        parse_args(["--etcd-endpoint", "h"], environ={"INFERA_REQUEST_MAX_RETRIES": "-1"})


def test_server_defaults():
    args = parse_args(["--etcd-endpoint", "h"], environ={})
    assert (args.host, args.port, args.etcd_prefix) == ("0.0.0.0", 8000, "/infera/workers/")
    assert (args.router_mode, args.router_policy, args.request_transport) == ("auto", "kv-aware", "http")
    assert args.router_tokenizer_path is None and args.kv_overlap_weight == 16.0
    assert args.kv_prefill_overlap_weight is None and args.kv_decode_overlap_weight is None
    assert args.etcd_endpoint == "http://h:2379"


def test_etcd_endpoint_required_for_etcd():
    with pytest.raises(SystemExit):
        parse_args([], environ={})
    assert parse_args([], environ={"INFERA_ETCD_ENDPOINT": "e:1"}).etcd_endpoint == "http://e:1"


def test_switch_from_env():
    p = argparse.ArgumentParser()
    add_flag(p, "--x", env="X", default=False, action="store_true", environ={"X": "yes"})
    assert p.parse_args([]).x is True


@pytest.mark.parametrize("v, b", [("1", True), ("true", True), ("off", False), ("0", False)])
def test_parse_bool(v, b):
    assert parse_bool(v) is b


# -- deployment planes: production inside a Pod, dev elsewhere, explicit flags always win ------------

POD = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "INFERA_K8S_LABEL_SELECTOR": "app=w", "POD_NAMESPACE": "ns1"}


@pytest.mark.parametrize("argv, env, plane", [
    (["--etcd-endpoint", "h"], {}, ("etcd", "http", "zmq")),  # outside a Pod: the no-broker dev plane
    ([], POD, ("kubernetes", "nats", "nats")),  # inside a Pod, no plane flags: production
    (["--request-transport", "http"], POD, ("kubernetes", "http", "nats")),  # a flag wins
    ([], {**POD, "INFERA_KV_EVENT_TRANSPORT": "zmq"}, ("kubernetes", "nats", "zmq")),  # env beats the plane
    (["--discovery-backend", "etcd", "--etcd-endpoint", "h"], POD, ("etcd", "nats", "nats")),
    (["--request-transport", "nats", "--etcd-endpoint", "h"], {}, ("etcd", "nats", "zmq")),
])
def test_server_plane_defaults(argv, env, plane):
    args = parse_args(argv, environ=env)
    assert (args.discovery_backend, args.request_transport, args.kv_event_transport) == plane


def test_server_k8s_settings_from_the_pod():
    args = parse_args([], environ={**POD, "NATS_SERVER": "nats://nats.infera:4222"})
    assert (args.k8s_label_selector, args.k8s_namespace, args.nats_server) == ("app=w", "ns1", "nats://nats.infera:4222")
    assert args.nats_req_idle_timeout == 900.0 and args.nats_req_max_duration == 0 and args.nats_req_max_pending == 0


def test_kubernetes_needs_a_label_selector():
    with pytest.raises(SystemExit):
        parse_args(["--discovery-backend", "kubernetes"], environ={})


def test_namespace_from_the_service_account(tmp_path):
    from infera.config import default_k8s_namespace

    (tmp_path / "namespace").write_text("from-sa\n")
    assert default_k8s_namespace({}, sa_dir=str(tmp_path)) == "from-sa"
    assert default_k8s_namespace({"POD_NAMESPACE": "env-ns"}, sa_dir=str(tmp_path)) == "env-ns"
    assert default_k8s_namespace({}, sa_dir=str(tmp_path / "missing")) == "default"


@pytest.mark.parametrize("env, flags, expected", [
    ({}, [], ("etcd", "http", "zmq", None)),
    ({"KUBERNETES_SERVICE_HOST": "10.96.0.1", "POD_NAME": "w-0", "POD_IP": "10.1.2.3"}, [],
     ("kubernetes", "nats", "nats", "10.1.2.3")),
    ({"KUBERNETES_SERVICE_HOST": "10.96.0.1", "POD_NAME": "w-0", "POD_IP": "10.1.2.3"},
     ["--request-transport", "http", "--advertise-host", "w0.svc"], ("kubernetes", "http", "nats", "w0.svc")),
])
def test_launcher_plane_defaults(env, flags, expected):
    from infera.engine.base.launcher import build_launcher_parser
    from infera.engine.sim.launcher import SimAdapter

    args, rest = build_launcher_parser(SimAdapter(), "t", environ=env).parse_known_args([*flags, "--model", "m"])
    assert (args.discovery_backend, args.request_transport, args.kv_event_transport, args.advertise_host) == expected
    assert rest == ["--model", "m"]  # engine flags pass through untouched
