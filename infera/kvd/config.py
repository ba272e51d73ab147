"""``python -m infera.kvd`` flags (flag > env > default)."""
from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from infera.config import add_flag, choice_of, non_negative_int

DEFAULT_SOCKET = "/var/run/infera-kvd.sock"
SOCKET_ENV = "INFERA_KVD_SOCKET"
SELFCHECK_ENV = "INFERA_KVD_STORAGE_SELFCHECK"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGTkmgt]?)(?:i?[Bb])?")


def parse_size(value: str) -> int:
    """``8G``, ``512M``, ``64K``, ``1T`` or plain bytes (binary units; ``KB``/``KiB`` spellings too)."""
    m = _SIZE.fullmatch(str(value).strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size: {value!r}")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


def arena_size(value: str) -> int | None:
    """``auto`` (None: same as --max-bytes) or a size; 0 disables the arena."""
    return None if str(value).strip().lower() == "auto" else parse_size(value)


@dataclass(frozen=True)
class KvdConfig:
    socket: str
    max_bytes: int
    long_path: str | None
    long_bytes: int
    slot_bytes: int
    container_bytes: int
    flush_interval_ms: int
    arena_bytes: int  # 0: no arena
    arena_pin: bool
    arena_hugetlb: bool
    selfcheck: bool
    metrics_port: int
    metrics_host: str
    log_level: str


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    environ = os.environ if environ is None else environ
    p = argparse.ArgumentParser(prog="python -m infera.kvd",
                                description="Per-host tiered KV-cache daemon (L2 host RAM, L3 tablespace).")
    add_flag(p, "--socket", env=SOCKET_ENV, default=DEFAULT_SOCKET, environ=environ,
             help="Unix socket path (created 0600; a stale file is unlinked)")
    add_flag(p, "--max-bytes", default="8G", type=parse_size, environ=environ,
             help="L2 budget for values stored inline (K/M/G/T suffixes)")
    add_flag(p, "--long-path", default=None, environ=environ,
             help="directory of the L3 tablespace (long retention is written through to it)")
    add_flag(p, "--long-bytes", default="32G", type=parse_size, environ=environ, help="L3 budget")
    add_flag(p, "--use-tablespace", action="store_true", default=False, environ=environ,
             help="use the tablespace layout for --long-path (the only layout this daemon has)")
    add_flag(p, "--tablespace-slot-bytes", default="64K", type=parse_size, environ=environ,
             help="allocation unit; a value takes a run of contiguous slots in one container")
    add_flag(p, "--tablespace-container-bytes", default="1G", type=parse_size, environ=environ,
             help="size of each preallocated container file (largest value L3 can hold)")
    add_flag(p, "--tablespace-flush-interval-ms", default=0, type=non_negative_int, environ=environ,
             help="group-commit window; 0 = fsync each write inline")
    add_flag(p, "--shared-arena-bytes", default="auto", type=arena_size, environ=environ,
             help="memfd arena shared with engines; auto = --max-bytes, 0 disables")
    add_flag(p, "--shared-arena-pin", action=argparse.BooleanOptionalAction, default=True, environ=environ,
             help="mlock the arena (silently unpinned where not allowed)")
    add_flag(p, "--shared-arena-hugetlb", env="INFERA_KVD_ARENA_HUGETLB", action="store_true", default=False,
             environ=environ, help="back the arena with 2 MB pages (falls back to normal pages)")
    add_flag(p, "--metrics-port", default=0, type=non_negative_int, environ=environ,
             help="serve Prometheus metrics on this port (0 = off)")
    add_flag(p, "--metrics-host", default="127.0.0.1", environ=environ, help="bind address of --metrics-port")
    add_flag(p, "--log-level", default="INFO", type=choice_of("DEBUG", "INFO", "WARNING", "ERROR"),
             environ=environ, help="the daemon's log level")
    return p


def parse_args(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> KvdConfig:
    environ = os.environ if environ is None else environ
    parser = build_parser(environ)
    a = parser.parse_args(argv)
    if a.long_path:
        if a.tablespace_slot_bytes <= 0 or a.tablespace_container_bytes < a.tablespace_slot_bytes:
            parser.error("--tablespace-container-bytes must be >= --tablespace-slot-bytes > 0")
        if a.long_bytes < a.tablespace_container_bytes:
            parser.error("--long-bytes must hold at least one container (--tablespace-container-bytes)")
    arena = a.max_bytes if a.shared_arena_bytes is None else a.shared_arena_bytes
    return KvdConfig(
        socket=a.socket, max_bytes=a.max_bytes, long_path=a.long_path, long_bytes=a.long_bytes,
        slot_bytes=a.tablespace_slot_bytes, container_bytes=a.tablespace_container_bytes,
        flush_interval_ms=a.tablespace_flush_interval_ms, arena_bytes=arena, arena_pin=a.shared_arena_pin,
        arena_hugetlb=a.shared_arena_hugetlb, selfcheck=environ.get(SELFCHECK_ENV, "1") != "0",
        metrics_port=a.metrics_port, metrics_host=a.metrics_host, log_level=a.log_level)
