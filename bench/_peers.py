"""Peer routers for the benchmarks: one bench-only venv, ``bench/.venv-peers``, one pinned version per peer.

Pinned so that a published comparison names what it was measured against. ``ensure_peer(name)``
creates the venv on first use and (re)installs the peer when it is missing or at another version;
it returns the executable, or ``None`` and the reason, which the benchmarks print when they skip
that peer's columns. ``launch_cmd`` builds the command line of one peer router in front of a fixed
list of worker URLs.

Blocking (pip can take minutes): call it from a thread (``asyncio.to_thread``) in async code.
Standalone: stdlib only; it never imports ``infera``.
"""
from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
PEERS_VENV = os.path.join(BENCH_DIR, ".venv-peers")


@dataclass(frozen=True)
class Peer:
    package: str  # PyPI name
    version: str  # the pinned version
    exe: str  # console script in the venv's bin/
    launch_args: tuple[str, ...]  # what comes before the flags
    quiet_log_level: str  # their --log-level spellings differ
    # Known defects that skew what the benchmarks measure, shown next to the peer's numbers.
    defect: str | None = None


# Both are Rust routers shipped as wheels; their Python packages (sglang_router, vllm_router) do
# not clash, so one venv holds both.
PEERS: dict[str, Peer] = {
    "sglang-router": Peer(
        "sglang-router", "0.3.2", "sglang-router", ("launch",), "warn",
        defect="sglang-router 0.3.2 never sets TCP_NODELAY on its client sockets: its first small SSE write "
               "waits in Nagle's buffer for the client's delayed ACK (~40 ms on Linux; see bench/README.md, "
               "kv_routing.py), so its streamed TTFT and streamed p50 carry up to ~40 ms that is that defect, "
               "not routing cost (in full at c=1); judge its routing cost on the non-streaming rows"),
    "vllm-router": Peer("vllm-router", "0.1.17", "vllm-router", (), "warning"),
}


def installed_version(package: str, venv: str = PEERS_VENV) -> str | None:
    """``package``'s version as installed in ``venv``, None when absent (or the venv is broken)."""
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        return None
    try:
        r = subprocess.run([python, "-c", f"import importlib.metadata as m; print(m.version({package!r}))"],
                           capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def ensure_peer(name: str, venv: str = PEERS_VENV, log: Callable[[str], None] = print) -> tuple[str | None, str]:
    """The executable of peer ``name`` at its pinned version in ``venv``: created, installed or
    re-installed (on a version mismatch) as needed. ``(None, why)`` when that fails."""
    peer = PEERS.get(name)
    if peer is None:
        return None, f"unknown peer {name!r} (known: {', '.join(PEERS)})"
    exe = os.path.join(venv, "bin", peer.exe)
    if os.path.exists(exe) and installed_version(peer.package, venv) == peer.version:
        return exe, ""
    # Two benchmarks started at once must not pip into one venv together. The lock lives in the
    # venv's folder (git-ignored with it); python -m venv fills a folder that exists.
    os.makedirs(venv, exist_ok=True)
    with open(os.path.join(venv, ".install.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(exe) and installed_version(peer.package, venv) == peer.version:
            return exe, ""  # someone else installed it while we waited
        have = installed_version(peer.package, venv)
        log(f"  preparing {venv}: pip install {peer.package}=={peer.version}"
            + (f" (found {have})" if have else "") + "…")
        try:
            if not os.path.exists(os.path.join(venv, "bin", "pip")):
                subprocess.run([sys.executable, "-m", "venv", venv], check=True, capture_output=True, timeout=120)
            r = subprocess.run([os.path.join(venv, "bin", "pip"), "install", "-q", "--disable-pip-version-check",
                                f"{peer.package}=={peer.version}"], capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.SubprocessError) as exc:
            return None, f"could not prepare {venv} for {peer.package}: {exc}"
        if r.returncode != 0 or not os.path.exists(exe):
            # pip's WARNING lines (unreachable extra indexes…) bury the ERROR that says why
            lines = [ln for ln in (r.stderr or r.stdout).splitlines() if ln.strip() and not ln.startswith("WARNING")]
            tail = " / ".join(lines)[-500:]
            return None, f"pip install {peer.package}=={peer.version} failed (rc {r.returncode}): {tail}"
        got = installed_version(peer.package, venv)
        if got != peer.version:
            return None, f"{peer.package} {got} installed in {venv}, not the pinned {peer.version}"
    return exe, ""


def launch_cmd(name: str, exe: str, *, policy: str, host: str, port: int, worker_urls: list[str],
               prometheus_port: int, request_timeout_s: int) -> list[str]:
    """The command line of peer ``name`` routing over ``worker_urls`` with ``policy``. Both peers
    take the same flags (vllm-router is a fork of sglang-router); the Prometheus port is given so
    that two peers, or two benchmarks, never fight over the default one."""
    peer = PEERS[name]
    return [exe, *peer.launch_args, "--host", host, "--port", str(port), "--worker-urls", *worker_urls,
            "--policy", policy, "--prometheus-host", host, "--prometheus-port", str(prometheus_port),
            "--log-level", peer.quiet_log_level, "--request-timeout-secs", str(request_timeout_s)]
