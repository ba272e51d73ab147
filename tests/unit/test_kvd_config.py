"""``python -m infera.kvd`` flags: sizes, defaults, env, validation."""
from __future__ import annotations

import argparse

import pytest

from infera.kvd.config import DEFAULT_SOCKET, parse_args, parse_size


@pytest.mark.parametrize("text, n", [("8G", 8 << 30), ("64K", 64 << 10), ("1.5M", 3 << 19), ("2T", 2 << 40),
                                     ("100", 100), ("2GiB", 2 << 30), ("3kb", 3 << 10), (" 0 ", 0)])
def test_sizes(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["", "G", "-1G", "1X", "abc"])
def test_bad_sizes(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(text)


def test_defaults():
    c = parse_args([], environ={})
    assert c.socket == DEFAULT_SOCKET and c.max_bytes == 8 << 30 and c.long_path is None
    assert c.long_bytes == 32 << 30 and c.slot_bytes == 64 << 10 and c.container_bytes == 1 << 30
    assert c.flush_interval_ms == 0 and c.arena_bytes == c.max_bytes  # arena "auto" = --max-bytes
    assert c.arena_pin and not c.arena_hugetlb and c.selfcheck and c.metrics_port == 0 and c.log_level == "INFO"


def test_flags_and_env():
    env = {"INFERA_KVD_SOCKET": "/tmp/env.sock", "INFERA_KVD_ARENA_HUGETLB": "1", "INFERA_KVD_STORAGE_SELFCHECK": "0"}
    c = parse_args(["--max-bytes", "1G", "--shared-arena-bytes", "0", "--no-shared-arena-pin",
                    "--tablespace-flush-interval-ms", "20", "--log-level", "DEBUG"], environ=env)
    assert c.socket == "/tmp/env.sock" and c.arena_hugetlb and not c.selfcheck
    assert c.max_bytes == 1 << 30 and c.arena_bytes == 0 and not c.arena_pin and c.flush_interval_ms == 20
    assert parse_args(["--socket", "/tmp/flag.sock"], environ=env).socket == "/tmp/flag.sock"  # flag > env


@pytest.mark.parametrize("argv", [
    ["--long-path", "/x", "--long-bytes", "1M", "--tablespace-container-bytes", "2M"],
    ["--long-path", "/x", "--tablespace-slot-bytes", "2G"],
    ["--tablespace-flush-interval-ms", "-1"],
    ["--log-level", "CHATTY"],
    ["--long-backend", "mooncake"],  # L4 is not implemented, so the flag does not exist
])
def test_rejected(argv):
    with pytest.raises(SystemExit):
        parse_args(argv, environ={})
