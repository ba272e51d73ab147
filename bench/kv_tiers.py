#!/usr/bin/env python3
"""Does routing on the lower KV tiers pay? Tier-aware vs tier-blind kv-aware routing, fleet scale.

The fleet of ``bench/kv_routing.py`` (embedded etcd, ``--workers`` simulated engines through their
launchers, the shared-prefix multi-turn chat workload of ``bench/_kv_workload.py``), with two
changes: each worker's GPU cache holds only ``--cache-fraction`` of the distinct prefix blocks over
the whole fleet, and each has a host tier (``--kv-offload-blocks``, default: room for every
prefix) that keeps what its GPU evicts, published as KV events with medium ``CPU``; a prefix found
there is loaded (``--kv-offload-load-ms-per-block``, default 5 % of prefilling it) instead of
computed. Three routers over the same fleet, each window on fresh caches (every worker's
``POST /reset_prefix_cache``, which empties its host tier too) and a freshly started router:

* ``tier-aware``: ``python -m infera.server`` kv-aware, ``--kv-lower-tier-weight 0.25`` (a block on
  the host costs a quarter of a miss);
* ``tier-blind``: the same with ``--kv-lower-tier-weight 1`` (a block on the host is a miss: what
  every peer router does);
* ``round-robin``.

Open loop by default (``--rate`` requests/s; the same Poisson arrivals for every router), windows
interleaved (the order rotates per run), medians over ``--runs``. Reported per router: TTFT p50/p90,
hit % from the replies (``cached_tokens``: GPU + host-loaded, as vLLM reports connector-loaded
tokens) split into GPU (``vllm:prefix_cache_hits``) and lower tier
(``vllm:external_prefix_cache_hits``), req/s, errors. The acceptance line: tier-aware beats
tier-blind on TTFT p50.

    python bench/kv_tiers.py                 # ~8 min on 2 cores
    python bench/kv_tiers.py --quick         # smoke run
    python bench/kv_tiers.py --router-cpus 0 # routers on CPU 0, the fleet and the load on the rest

Exit status: 0 when the check passes and no request failed; 1 otherwise; 2 when the fleet could
not be started.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import signal
import sys
import time
from typing import Any

import aiohttp

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
for p in (REPO, BENCH_DIR):
    if p not in sys.path:
        sys.path.insert(0, p)

import kv_routing as kr  # noqa: E402  (the fleet, the routers and the workload plumbing)
from _main import run_bench  # noqa: E402
from router_overhead import FleetError, _f, _git_commit, _median  # noqa: E402

DEFAULT_OUT = os.path.join(BENCH_DIR, "results", "kv_tiers.json")
# Host memory for KV is typically several times the GPU's: the fleet's host tiers then hold the
# working set only if each group's prefix stays with the workers that have it.
HOST_TO_GPU = 4
# Our labels for kv_routing's router names: both kv-aware ones are single servers without sync
# (kv-aware-nosync with one replica is exactly kv-aware); only --kv-lower-tier-weight differs.
LABELS = {"kv-aware": "tier-aware", "kv-aware-nosync": "tier-blind", "round-robin": "round-robin"}
METRICS = ("hit_rate", "gpu_hit_rate", "lower_hit_rate", "ttft_p50_ms", "ttft_p90_ms", "ttft_mean_ms", "ttft_p50_warm_ms",
           "ttft_p50_cold_ms", "rps")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python bench/kv_tiers.py", allow_abbrev=False,
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workers", type=int, default=4)
    # 96: each GPU cache (40 % of the prefixes over 4 workers) still runs ~9 prompts at once, as a
    # real engine's does. With 32 the same 40 % is ~3 prompts, admission then waits for free blocks
    # and TTFT measures that queue, not prefill (measured: warm and cold TTFT within 2 ms of each other)
    p.add_argument("--groups", type=int, default=96, help="prefix groups (system prompts)")
    p.add_argument("--prefix-tokens", type=int, default=2048, help="tokens per system prompt")
    p.add_argument("--user-tokens", type=int, default=96)
    # 1: every request revisits a shared prefix (system prompts, RAG documents), the case lower
    # tiers are for; follow-up turns of a chat hit the GPU under any kv-aware routing
    p.add_argument("--turns", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--requests", type=int, default=720, help="requests per window (~7.5 visits per group)")
    p.add_argument("--rate", type=float, default=16.0, help="open loop: requests/s offered (0: closed loop)")
    p.add_argument("--concurrency", type=int, default=16, help="closed loop (--rate 0): users")
    p.add_argument("--popularity", choices=("uniform", "zipf"), default="uniform")
    p.add_argument("--runs", type=int, default=3, help="windows per router (medians reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--cache-fraction", type=float, default=0.4,
                   help="the whole fleet's GPU caches hold this share of the distinct prefix blocks")
    p.add_argument("--kv-offload-blocks", type=int, default=None,
                   help="host-tier blocks per worker [%d × its GPU blocks]" % HOST_TO_GPU)
    p.add_argument("--kv-offload-load-ms-per-block", type=float, default=None,
                   help="sim load time per block from the host tier [the sim's default: 5%% of a prefill]")
    p.add_argument("--lower-tier-weight", type=float, default=0.25, help="tier-aware's --kv-lower-tier-weight")
    p.add_argument("--speedup", type=float, default=1.0,
                   help="sim --speedup (1: a cold 2k-token prefill costs ~50 ms, as the sim models a GPU)")
    p.add_argument("--router-cpus", default=None, help="pin the routers to these CPUs, the rest elsewhere")
    p.add_argument("--routers", nargs="+", choices=tuple(LABELS.values()), default=list(LABELS.values()))
    p.add_argument("--kv-server-args", default="", help="extra flags for both kv-aware servers")
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--quick", action="store_true", help="small counts for a smoke run")
    return p


def resolve_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Our flags, turned into the namespace ``kv_routing`` works with (plus ours)."""
    a = build_parser().parse_args(argv)
    if a.quick:
        a.groups, a.prefix_tokens, a.requests, a.runs = min(a.groups, 16), min(a.prefix_tokens, 1024), 120, 1
    by_label = {v: k for k, v in LABELS.items()}
    argv_kr = ["--workers", str(a.workers), "--groups", str(a.groups), "--prefix-tokens", str(a.prefix_tokens),
               "--user-tokens", str(a.user_tokens), "--turns", str(a.turns), "--max-tokens", str(a.max_tokens),
               "--requests", str(a.requests), "--concurrency", str(a.concurrency), "--popularity", a.popularity,
               "--runs", str(a.runs), "--seed", str(a.seed), "--block-size", str(a.block_size),
               "--cache-fraction", str(a.cache_fraction), "--speedup", repr(a.speedup), "--out", a.out,
               "--routers", *[by_label[r] for r in a.routers]]
    if a.rate:
        argv_kr += ["--rate", repr(a.rate)]
    if a.router_cpus:
        argv_kr += ["--router-cpus", a.router_cpus]
    args = kr.resolve_args(argv_kr)
    args.kv_offload_blocks = a.kv_offload_blocks
    args.kv_offload_load_ms_per_block = a.kv_offload_load_ms_per_block
    args.lower_tier_weight = a.lower_tier_weight
    args.base_kv_server_args = a.kv_server_args
    args.quick = a.quick
    return args


class TierFleet(kr.Fleet):
    """kv_routing's fleet, each sim worker with a host tier; remembers every scrape."""

    def __init__(self, args: argparse.Namespace, logs_dir: str) -> None:
        super().__init__(args, logs_dir)
        self.host_blocks = 0
        self.scrapes: list[list[dict[str, float]]] = []

    def engine_cmd(self, i: int, port: int, blocks: int, max_model_len: int):
        cmd, env = super().engine_cmd(i, port, blocks, max_model_len)
        cmd += ["--kv-offload-blocks", str(self.host_blocks)]
        if self.args.kv_offload_load_ms_per_block is not None:
            cmd += ["--kv-offload-load-ms-per-block", repr(self.args.kv_offload_load_ms_per_block)]
        return cmd, env

    async def scrape(self, session: aiohttp.ClientSession) -> list[dict[str, float]]:
        out = await super().scrape(session)
        self.scrapes.append(out)
        return out


class TierBench(kr.Bench):
    """kv_routing's windows; the two kv-aware routers differ only in --kv-lower-tier-weight."""

    async def _start_one(self, name: str, session: aiohttp.ClientSession, tag: str) -> kr.Router:
        a = self.args
        weight = a.lower_tier_weight if name == "kv-aware" else 1.0
        a.kv_server_args = f"{a.base_kv_server_args} --kv-lower-tier-weight {weight!r}".strip()
        return await super()._start_one(name, session, tag)

    async def window(self, session: aiohttp.ClientSession, name: str, run_i: int, workload) -> dict[str, Any] | None:
        self.fleet.scrapes.clear()
        res = await super().window(session, name, run_i, workload)
        if res is None:
            return None
        before, after = self.fleet.scrapes[-2], self.fleet.scrapes[-1]

        def delta(key: str) -> float:
            return sum(aft.get(key, 0.0) - bef.get(key, 0.0) for bef, aft in zip(before, after))

        queries = delta("vllm:prefix_cache_queries_total")
        res["gpu_hit_rate"] = round(delta("vllm:prefix_cache_hits_total") / queries, 4) if queries else None
        res["lower_hit_rate"] = round(delta("vllm:external_prefix_cache_hits_total") / queries, 4) if queries else None
        res["label"] = LABELS[name]
        res.pop("requests", None)  # no per-request rows: a small results file
        return res


def summarize(runs: list[dict], labels: list[str]) -> dict[str, dict]:
    med: dict[str, dict] = {}
    for label in labels:
        rs = [r for r in runs if r["label"] == label]
        if rs:
            med[label] = {k: _median([r.get(k) for r in rs]) for k in METRICS}
            med[label].update(runs=len(rs), errors=sum(r["errors"] for r in rs),
                              completed=sum(r["completed"] for r in rs),
                              ttft_p50_windows=sorted(r["ttft_p50_ms"] for r in rs if r.get("ttft_p50_ms") is not None))
    return med


def render(med: dict[str, dict]) -> str:
    pct = lambda v: "-" if v is None else f"{v * 100:.1f}"  # noqa: E731
    head = (f"{'router':<12} | {'TTFT p50':>8} {'TTFT p90':>8} {'mean':>6} {'warm p50':>8} {'cold p50':>8} | "
            f"{'hit %':>6} {'GPU %':>6} {'lower %':>7} | {'req/s':>6} | {'errors':>6}")
    lines = [head, "-" * len(head)]
    for label, m in med.items():
        lines.append(f"{label:<12} | {_f(m['ttft_p50_ms'], '.1f'):>8} {_f(m['ttft_p90_ms'], '.1f'):>8} "
                     f"{_f(m['ttft_mean_ms'], '.1f'):>6} "
                     f"{_f(m['ttft_p50_warm_ms'], '.1f'):>8} {_f(m['ttft_p50_cold_ms'], '.1f'):>8} | "
                     f"{pct(m['hit_rate']):>6} {pct(m['gpu_hit_rate']):>6} {pct(m['lower_hit_rate']):>7} | "
                     f"{_f(m['rps'], '.2f'):>6} | {m['errors']:>6}")
    return "\n".join(lines)


def check(med: dict[str, dict]) -> dict[str, str]:
    title = "tier-aware beats tier-blind on TTFT p50"
    a, b = med.get("tier-aware"), med.get("tier-blind")
    if not a or not b or a["ttft_p50_ms"] is None or b["ttft_p50_ms"] is None:
        return {"check": title, "status": "SKIP", "detail": "both routers must be measured"}
    ok = a["ttft_p50_ms"] < b["ttft_p50_ms"] and not a["errors"] and not b["errors"]
    detail = (f"{a['ttft_p50_ms']:.1f} ms vs {b['ttft_p50_ms']:.1f} ms "
              f"({(1 - a['ttft_p50_ms'] / b['ttft_p50_ms']) * 100:.0f} % lower); windows "
              f"{a['ttft_p50_windows']} vs {b['ttft_p50_windows']}")
    return {"check": title, "status": "PASS" if ok else "FAIL", "detail": detail}


async def run(args: argparse.Namespace) -> int:
    out_path = os.path.abspath(args.out)
    logs_dir = os.path.splitext(out_path)[0] + "_logs"
    os.makedirs(logs_dir, exist_ok=True)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    started = time.time()
    if args.router_cpus:
        os.sched_setaffinity(0, kr.parse_cpu_list(kr.fleet_cpus(args.router_cpus)))
    fleet = TierFleet(args, logs_dir)
    workload, sizing = kr.plan(args, None)
    fleet.host_blocks = (args.kv_offload_blocks if args.kv_offload_blocks is not None
                         else HOST_TO_GPU * sizing["num_gpu_blocks"])
    sizing["kv_offload_blocks"] = fleet.host_blocks
    from infera.engine.sim.scheduler import default_load_ms_per_block, prefill_time_ms

    load_ms = (args.kv_offload_load_ms_per_block if args.kv_offload_load_ms_per_block is not None
               else default_load_ms_per_block(args.block_size))
    prefix_blocks = sizing["prefix_tokens_mean"] / args.block_size
    print(f"kv_tiers: sim × {args.workers} workers, routers {[LABELS[r] for r in args.routers]}, "
          f"{args.requests} requests × {args.runs} run(s), "
          + (f"open loop at {args.rate:g} req/s" if args.rate else f"closed loop c={args.concurrency}")
          + f", speedup {args.speedup:g}; logs in {logs_dir}", flush=True)
    kr.print_sizing(args, sizing)
    print(f"  host tier: {fleet.host_blocks} blocks per worker "
          f"({fleet.host_blocks / max(1, sizing['distinct_prefix_blocks']):.0%} of the prefixes); loading a ~{prefix_blocks:.0f}-block prefix costs "
          f"{prefix_blocks * load_ms / args.speedup:.2f} ms, prefilling it "
          f"{prefill_time_ms(round(sizing['prefix_tokens_mean'])) / args.speedup:.1f} ms", flush=True)
    bench = TierBench(args, fleet, logs_dir)
    runs: list[dict] = []
    try:
        try:
            await fleet.start(sizing["num_gpu_blocks"], sizing["max_model_len"])
            async with aiohttp.ClientSession() as session:
                await fleet.wait_ready(session)
        except (FleetError, RuntimeError, OSError, asyncio.TimeoutError) as exc:
            print(f"kv_tiers: could not start the fleet: {exc}", file=sys.stderr)
            return 2
        async with aiohttp.ClientSession() as session:
            for run_i in range(args.runs):
                order = args.routers[run_i % len(args.routers):] + args.routers[:run_i % len(args.routers)]
                for name in order:
                    t = time.time()
                    res = await bench.window(session, name, run_i, workload)
                    if res is None:
                        continue
                    runs.append(res)
                    print(f"  run {run_i + 1}/{args.runs} {res['label']:<11} TTFT p50 {_f(res['ttft_p50_ms'], '.1f'):>7} "
                          f"p90 {_f(res['ttft_p90_ms'], '.1f'):>7} ms  hit {_f((res['hit_rate'] or 0) * 100, '.1f')} % "
                          f"(GPU {_f((res['gpu_hit_rate'] or 0) * 100, '.1f')}, lower "
                          f"{_f((res['lower_hit_rate'] or 0) * 100, '.1f')})  {res['rps']:.2f} req/s  "
                          f"errors {res['errors']}  ({time.time() - t:.0f}s)", flush=True)
    except FleetError as exc:
        print(f"kv_tiers: aborted: {exc}", file=sys.stderr)
        return 2
    finally:
        await fleet.stop()
    med = summarize(runs, [LABELS[r] for r in args.routers])
    verdict = check(med)
    print(f"\nKV tiers — sim, {args.popularity}, {args.workers} workers, "
          + (f"{args.rate:g} req/s open loop" if args.rate else f"c={args.concurrency}")
          + f", medians of {args.runs} run(s) (times in ms; hit % of prompt tokens: GPU + lower tier)")
    print(render(med))
    print(f"\n[{verdict['status']}] {verdict['check']}: {verdict['detail']}")
    report = {"meta": {"benchmark": "kv_tiers", "argv": sys.argv, "sizing": sizing,
                       "settings": {k: v for k, v in vars(args).items() if k != "out"},
                       "load_ms_per_block": load_ms, "started_at": started, "wall_s": round(time.time() - started, 1),
                       "cpu_count": os.cpu_count(), "python": sys.version.split()[0],
                       "platform": platform.platform(), "git_commit": _git_commit()},
              "runs": runs, "medians": med, "checks": [verdict]}
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"results: {out_path}")
    errors = sum(r["errors"] for r in runs)
    return 0 if verdict["status"] == "PASS" and not errors else 1


def main(argv: list[str] | None = None) -> None:
    sys.exit(run_bench("kv_tiers", run(resolve_args(argv))))


if __name__ == "__main__":
    main()
