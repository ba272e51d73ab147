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
