#!/usr/bin/env python3
"""Does prefill/decode disaggregation pay? A mixed fleet against a 1P1D fleet of the same size, on
simulated engines, through one router.

Starts, as subprocesses: an embedded etcd, one ``python -m infera.server --router-policy
round-robin`` and four ``python -m infera.engine.sim`` launchers with the same engine flags, as two
fleets of two workers, each fleet under its own model name (the server picks the topology per
model: a model with both a prefill and a decode worker goes PD, see ``infera/router/auto.py``):

* ``mixed`` (model ``pd-bench-mixed``): two ordinary workers; round-robin alternates between them;
* ``1P1D`` (model ``pd-bench-1p1d``): one prefill worker (``--kv-transfer-config`` NixlConnector,
  ``kv_producer``) and one decode worker (``kv_consumer``). The router sends each request to the
  prefill (one token, unstreamed), then to the decode, which pulls the prompt's KV over the
  modelled link (``--kv-transfer-bandwidth`` GB/s, ``--kv-bytes-per-token``) and streams the reply.

A load generator in its own process (``bench/_loadgen.py``) runs a closed loop of streamed chat
completions at ``--concurrency`` through the server, per workload:

* ``prompt-heavy``: ~3000-token prompts, 16 output tokens;
* ``decode-heavy``: ~200-token prompts, 256 output tokens;

with prompts that share no KV block (no prefix reuse: the comparison is about disaggregation, not
caching; the workers' cache-hit counters check it). Each window is a warm-up of 2 × concurrency
requests, then ``--requests`` measured ones. For each run, each workload is measured on both
fleets back to back with the same prompts (fresh ones every run), and which fleet goes first
alternates. Reported per (workload, fleet), as medians over ``--runs``: TTFT p50/p90, ITL p50/p90
(gaps between SSE ``data:`` events), e2e p50, req/s, output tok/s, errors; then PD/mixed ratios.

    python bench/pd.py            # full run (~2½ min on 2 cores)
    python bench/pd.py --quick    # smoke run (~15 s)

Exit status: 0 when no request failed and the 1P1D fleet really moved KV; 1 otherwise; 2 when the
fleet could not be started; 130 on Ctrl-C; 143 on SIGTERM. Everything started is stopped on the
way out, errors included.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import platform
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import aiohttp

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
# The package and the sibling benchmarks' helpers, whatever the working directory.
sys.path[:0] = [path for path in (REPO, BENCH_DIR) if path not in sys.path]

from infera.discovery.embedded_etcd import EmbeddedEtcd  # noqa: E402
from infera.engine.sim.pd import DEFAULT_KV_BYTES_PER_TOKEN, DEFAULT_KV_TRANSFER_BANDWIDTH_GBPS  # noqa: E402
from infera.engine.sim.pd import transfer_seconds  # noqa: E402
from infera.engine.sim.scheduler import decode_time_ms, prefill_time_ms  # noqa: E402

import _kv_workload as kvw  # noqa: E402
from router_overhead import Bench, FleetError, Proc, _f, _free_port, _git_commit, _median  # noqa: E402
from router_overhead import tree_cpu_seconds  # noqa: E402
from infera.engine.base.prom import sample_sum  # noqa: E402

DEFAULT_OUT = os.path.join(BENCH_DIR, "results", "pd.json")
BLOCK_SIZE = 16  # the sim's default --block-size, which the workers keep


@dataclass(frozen=True)
class WorkloadShape:
    name: str
    prompt_tokens: int  # of the user message; the chat template adds a few
    max_tokens: int  # every request produces exactly this many (ignore_eos)


WORKLOADS = (WorkloadShape("prompt-heavy", 3000, 16), WorkloadShape("decode-heavy", 200, 256))
FLEETS = ("mixed", "1P1D")
FLEET_MODEL = {"mixed": "pd-bench-mixed", "1P1D": "pd-bench-1p1d"}
FLEET_ROLES = {"mixed": ("mixed", "mixed"), "1P1D": ("prefill", "decode")}
KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}
# ITL p99 only in the JSON: where the worst prefill stalls of a mixed worker show.
MEDIAN_METRICS = ("ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "itl_p90_ms", "itl_p99_ms", "lat_p50_ms", "rps",
                  "out_tok_s")
# Worker counters read before and after each window (the sim exports vLLM's names).
SOURCE_TOKENS = "vllm:prompt_tokens_by_source_total"
WORKER_COUNTERS = {
    "requests": ("vllm:request_success_total", ""),
    "computed_tokens": (SOURCE_TOKENS, 'source="local_compute"'),
    "cache_hit_tokens": (SOURCE_TOKENS, 'source="local_cache_hit"'),
    "kv_transfer_tokens": (SOURCE_TOKENS, 'source="external_kv_transfer"'),
    "preemptions": ("vllm:num_preemptions_total", ""),
    "failed_transfers": ("vllm:nixl_num_failed_transfers_total", ""),
    "expired_kv_holds": ("vllm:nixl_num_kv_expired_reqs_total", ""),
}


# ------------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python bench/pd.py", allow_abbrev=False, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: 1 run of 24 requests per window (~15 s)")
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON results file (its folder is created)")
    p.add_argument("--runs", type=int, default=None,
                   help="windows per (workload, fleet); medians are reported [3; --quick 1]")
    p.add_argument("--requests", type=int, default=None, help="measured requests per window [200; --quick 24]")
    p.add_argument("--concurrency", type=int, default=8, help="closed-loop users")
    p.add_argument("--speedup", type=float, default=3.0, help="sim engine --speedup (simulated time ÷ this)")
    p.add_argument("--kv-transfer-bandwidth", type=float, default=DEFAULT_KV_TRANSFER_BANDWIDTH_GBPS,
                   help="sim --kv-transfer-bandwidth, GB/s between prefill and decode")
    p.add_argument("--kv-bytes-per-token", type=int, default=DEFAULT_KV_BYTES_PER_TOKEN,
                   help="sim --kv-bytes-per-token (default: an 8B Llama in bf16)")
    p.add_argument("--seed", type=int, default=0, help="prompt seed")
    p.add_argument("--max-window", type=float, default=120.0,
                   help="seconds a measured window may last before it is cut short (a safety net)")
    p.add_argument("--request-timeout", type=float, default=120.0, help="per-request client timeout (s)")
    p.add_argument("--ready-timeout", type=float, default=90.0, help="seconds the fleets get to register")
    return p


# (full, --quick) defaults of the flags that --quick shrinks.
SIZE_DEFAULTS = {"runs": (3, 1), "requests": (200, 24)}


def resolve_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    for name, (full, quick) in SIZE_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    for name in ("runs", "concurrency", "requests", "kv_bytes_per_token"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("speedup", "kv_transfer_bandwidth", "max_window", "request_timeout", "ready_timeout"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be > 0")
    # Two generations of the closed loop: past the all-at-once start, caches of the code paths warm.
    args.warmup_requests = 2 * args.concurrency
    return args


# ------------------------------------------------------------------------------------ the fleets
def machine_busy_seconds() -> float | None:
    """CPU seconds the whole machine spent busy (all cores, any process), from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


@dataclass
class SimWorker:
    fleet: str
    role: str  # "mixed" | "prefill" | "decode"
    proc: Proc
    url: str


class PdRig(Bench):
    """etcd, the server, both fleets and the load generator. ``router_overhead.Bench`` supplies the
    liveness check, the load generator's handshake and the ordered stop; the fleet is this one's."""

    def __init__(self, args: argparse.Namespace, logs_dir: str) -> None:
        super().__init__(args, logs_dir)
        self.sims: list[SimWorker] = []

    def sim_command(self, fleet: str, role: str, port: int) -> list[str]:
        a = self.args
        cmd = [sys.executable, "-m", "infera.engine.sim", "--etcd-endpoint", self.etcd.url, "--log-level", "warning",
               "--drain-timeout", "3", "--drain-settle", "0.2", "--engine-stop-timeout", "5",
               # Nobody subscribes under round-robin: publishing would only spend CPU.
               "--no-enable-kv-events",
               # One host, loopback: the PD preflight's RDMA/routable-host rules do not apply.
               "--disaggregation-allow-tcp",
               "--model", FLEET_MODEL[fleet], "--host", "127.0.0.1", "--port", str(port),
               "--speedup", repr(a.speedup), "--kv-transfer-bandwidth", repr(a.kv_transfer_bandwidth),
               "--kv-bytes-per-token", str(a.kv_bytes_per_token)]
        if role in KV_ROLE:
            cmd += ["--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": KV_ROLE[role]})]
        return cmd

    def server_command(self, port: int) -> list[str]:
        # Both fleets share this server, so they share its flags by construction.
        return [sys.executable, "-m", "infera.server", "--workers", "1", "--host", "127.0.0.1", "--port", str(port),
                "--etcd-endpoint", self.etcd.url, "--router-policy", "round-robin", "--log-level", "warning"]

    async def start(self) -> None:
        self.loadgen = Proc("loadgen", [sys.executable, os.path.join(BENCH_DIR, "_loadgen.py")],
                            os.path.join(self.logs_dir, "loadgen.log"))
        await self.loadgen.start(stdin=subprocess.PIPE, stdout=subprocess.PIPE, limit=64 * 1024 * 1024)
        self.etcd = EmbeddedEtcd(unsafe_no_fsync=True)
        await self.etcd.start()
        port = _free_port()
        self.router_url = f"http://127.0.0.1:{port}"
        self.server = Proc("server", self.server_command(port), os.path.join(self.logs_dir, "server.log"))
        await self.server.start()
        for fleet in FLEETS:
            for i, role in enumerate(FLEET_ROLES[fleet]):
                port = _free_port()
                name = f"{fleet}-{role}{i}"
                proc = Proc(name, self.sim_command(fleet, role, port), os.path.join(self.logs_dir, f"{name}.log"))
                await proc.start()
                self.workers.append(proc)  # Bench.check_alive and Bench.stop go through this list
                self.sims.append(SimWorker(fleet, role, proc, f"http://127.0.0.1:{port}"))

    async def listing(self, session: aiohttp.ClientSession) -> list[dict]:
        """The server's ``/v1/workers`` (empty while it is not answering yet)."""
        try:
            async with session.get(self.router_url + "/v1/workers", timeout=aiohttp.ClientTimeout(total=2)) as r:
                return (await r.json())["workers"]
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError, KeyError):
            return []

    @staticmethod
    def fleets_complete(listing: list[dict]) -> bool:
        """Both fleets active, each with the roles it must have (the 1P1D one: a prefill and a decode)."""
        roles = {fleet: sorted(w.get("disagg_mode") for w in listing
                               if w.get("status") == "active" and w.get("model_name") == FLEET_MODEL[fleet])
                 for fleet in FLEETS}
        return all(roles[fleet] == sorted(FLEET_ROLES[fleet]) for fleet in FLEETS)

    async def wait_ready(self, session: aiohttp.ClientSession) -> list[dict]:
        deadline = time.monotonic() + self.args.ready_timeout
        listing: list[dict] = []
        while not self.fleets_complete(listing):
            if time.monotonic() > deadline:
                raise FleetError(f"/v1/workers did not list both fleets ({FLEET_ROLES}) within "
                                 f"{self.args.ready_timeout:.0f}s (last seen: {listing})")
            self.check_alive()
            await asyncio.sleep(0.2)
            listing = await self.listing(session)
        return listing

    async def preflight(self, session: aiohttp.ClientSession) -> None:
        """One short streamed request per fleet through the server: fail fast, with a message."""
        for fleet in FLEETS:
            body = json.dumps({"model": FLEET_MODEL[fleet], "messages": [{"role": "user", "content": "ping"}],
                               "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}})
            rec = await kvw.one_chat(session, self.router_url + "/v1/chat/completions", body.encode())
            if rec["error"] is not None:
                raise FleetError(f"preflight request to the {fleet} fleet failed: {rec['error']}")

    def cpu_roles(self) -> dict[int, str]:
        """``{pid: role}``: the load generator, the server, and each fleet's workers."""
        roles = {self.loadgen.proc.pid: "loadgen", self.server.proc.pid: "server"}
        for w in self.sims:
            roles[w.proc.proc.pid] = f"{w.fleet} workers"
        return roles

    async def worker_counters(self, session: aiohttp.ClientSession, fleet: str) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for i, w in enumerate(s for s in self.sims if s.fleet == fleet):
            async with session.get(w.url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
                text = await r.text()
            out[f"{w.role}{i}"] = {k: sample_sum(text, name, label) for k, (name, label) in WORKER_COUNTERS.items()}
        return out

    async def window(self, session: aiohttp.ClientSession, fleet: str, shape: WorkloadShape,
                     prompts: list[str]) -> dict[str, Any]:
        """One closed-loop window of ``shape`` on ``fleet``: the load generator's result, with the
        CPU each role used and the fleet's worker counters over the window."""
        a = self.args
        model = FLEET_MODEL[fleet]
        bodies = [json.dumps({"model": model, "messages": [{"role": "user", "content": text}],
                              "max_tokens": shape.max_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
                              "stream_options": {"include_usage": True}}, separators=(",", ":")) for text in prompts]
        # Warm-up and window are bounded by request counts, so no body is ever sent twice.
        job = {"cmd": "run", "urls": [self.router_url + "/v1/chat/completions"], "concurrency": a.concurrency,
               "stream": True, "requests": a.requests, "duration": a.max_window, "warmup": a.max_window,
               "warmup_requests": a.warmup_requests, "request_timeout": a.request_timeout, "bodies": bodies}
        proc = self.loadgen.proc
        counters_before = await self.worker_counters(session, fleet)
        roles = self.cpu_roles()
        cpu_before, busy_before, wall_before = tree_cpu_seconds(roles), machine_busy_seconds(), time.perf_counter()
        proc.stdin.write((json.dumps(job) + "\n").encode())
        await proc.stdin.drain()
        line = await asyncio.wait_for(proc.stdout.readline(), 2 * a.max_window + a.request_timeout + 30)
        if not line:
            raise FleetError(f"the load generator exited; log {self.loadgen.log_path}:\n{self.loadgen.log_tail()}")
        result = json.loads(line)
        if "fatal" in result:
            raise FleetError(f"the load generator failed: {result['fatal']}")
        wall = time.perf_counter() - wall_before
        cpu_after, busy_after = tree_cpu_seconds(roles), machine_busy_seconds()
        counters_after = await self.worker_counters(session, fleet)
        # Cores each role kept busy over the whole window (warm-up included); "machine" counts
        # every process on the box, so machine minus the rest is whatever else was running.
        cores: dict[str, float] = {}
        if cpu_before is not None and cpu_after is not None:
            cores = {role: round((cpu_after[role] - cpu_before[role]) / wall, 3) for role in cpu_before}
        if busy_before is not None and busy_after is not None:
            cores["machine"] = round((busy_after - busy_before) / wall, 3)
        result["cpu_cores"] = cores
        result["window_wall_s"] = round(wall, 3)
        result["workers"] = {w: {k: round(counters_after[w][k] - before[k], 1) for k in before}
                             for w, before in counters_before.items()}
        totals = {k: sum(d[k] for d in result["workers"].values()) for k in WORKER_COUNTERS}
        result["worker_totals"] = totals
        served = result["completed"] + result["warmup_requests"]
        result["kv_transfer_tokens_per_req"] = round(totals["kv_transfer_tokens"] / served, 1) if served else None
        result["prompts_reused"] = max(0, result["sent"] - len(bodies))
        result["cut_short"] = result["issued"] < a.requests
        return result


# ----------------------------------------------------------------------------------------- report
def summarize(args: argparse.Namespace, runs: list[dict]) -> dict[str, dict]:
    """Per workload: the medians of each fleet, and PD/mixed ratios (of the medians, and paired
    run by run: the two fleets of one run went back to back)."""
    out: dict[str, dict] = {}
    for shape in WORKLOADS:
        cell: dict[str, Any] = {}
        by_fleet = {f: sorted((r for r in runs if r["workload"] == shape.name and r["fleet"] == f),
                              key=lambda r: r["run"]) for f in FLEETS}
        if not all(by_fleet.values()):
            continue
        for fleet, rs in by_fleet.items():
            med: dict[str, Any] = {k: _median([r.get(k) for r in rs]) for k in MEDIAN_METRICS}
            roles = sorted({role for r in rs for role in r["cpu_cores"]})
            med["cpu_cores"] = {role: _median([r["cpu_cores"].get(role) for r in rs]) for role in roles}
            med["kv_transfer_tokens_per_req"] = _median([r["kv_transfer_tokens_per_req"] for r in rs])
            med["worker_totals"] = {k: sum(r["worker_totals"][k] for r in rs) for k in WORKER_COUNTERS}
            med.update(runs=len(rs), completed=sum(r["completed"] for r in rs), errors=sum(r["errors"] for r in rs))
            cell[fleet] = med
        mixed, pd = cell["mixed"], cell["1P1D"]
        cell["ratio"] = {k: _ratio(pd[k], mixed[k]) for k in MEDIAN_METRICS}
        pairs = list(zip(by_fleet["mixed"], by_fleet["1P1D"]))
        cell["ratio_paired_median"] = {k: _median([_ratio(p.get(k), m.get(k)) for m, p in pairs])
                                       for k in MEDIAN_METRICS}
        out[shape.name] = cell
    return out


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else round(num / den, 4)


def _table(head: str, rows: list[str]) -> str:
    return "\n".join([head, "-" * len(head), *rows])


def render_table(cells: dict[str, dict]) -> str:
    def row(name: str, fleet: str, m: dict, times: str = ".1f", itl: str = ".2f", rps: str = ".2f",
            tok: str = ".0f", errors: Any = "") -> str:
        return (f"{name:<13} {fleet:<9}| {_f(m['ttft_p50_ms'], times):>8} {_f(m['ttft_p90_ms'], times):>8} | "
                f"{_f(m['itl_p50_ms'], itl):>7} {_f(m['itl_p90_ms'], itl):>7} | {_f(m['lat_p50_ms'], times):>8} | "
                f"{_f(m['rps'], rps):>7} {_f(m['out_tok_s'], tok):>9} | {errors:>6}")

    rows = []
    for name, cell in cells.items():
        rows += [row(name, fleet, cell[fleet], errors=cell[fleet]["errors"]) for fleet in FLEETS]
        rows.append(row("", "PD/mixed", cell["ratio"], ".2f", ".2f", ".2f", ".2f"))
    return _table(f"{'workload':<13} {'fleet':<9}| {'TTFT p50':>8} {'TTFT p90':>8} | {'ITL p50':>7} {'ITL p90':>7} | "
                  f"{'e2e p50':>8} | {'req/s':>7} {'out tok/s':>9} | {'errors':>6}", rows)


def render_health(cells: dict[str, dict]) -> str:
    """What the workers did and what the CPUs did, per (workload, fleet)."""
    def row(name: str, fleet: str, m: dict) -> str:
        t, c = m["worker_totals"], m["cpu_cores"]
        return (f"{name:<13} {fleet:<6}| {_f(m['kv_transfer_tokens_per_req'], '.0f'):>12} "
                f"{t['cache_hit_tokens']:>13.0f} {t['preemptions']:>7.0f} {t['failed_transfers']:>11.0f} | "
                f"{_f(c.get('loadgen')):>7} {_f(c.get('server')):>6} {_f(c.get(f'{fleet} workers')):>7} "
                f"{_f(c.get('machine')):>7}")

    return _table(f"{'workload':<13} {'fleet':<6}| {'KV moved/req':>12} {'cache-hit tok':>13} {'preempt':>7} "
                  f"{'failed xfer':>11} | {'loadgen':>7} {'server':>6} {'workers':>7} {'machine':>7}",
                  [row(name, fleet, cell[fleet]) for name, cell in cells.items() for fleet in FLEETS])


def sanity_problems(args: argparse.Namespace, runs: list[dict], cells: dict[str, dict]) -> tuple[list[str], list[str]]:
    """(problems that invalidate the comparison, warnings)."""
    problems: list[str] = []
    warnings: list[str] = []
    for r in runs:
        where = f"run {r['run'] + 1} {r['workload']} {r['fleet']}"
        totals = r["worker_totals"]
        if r["fleet"] == "1P1D" and r["completed"] and not totals["kv_transfer_tokens"]:
            problems.append(f"{where}: the decode worker received no KV by transfer (was the model routed PD?)")
        if r["prompts_reused"]:
            problems.append(f"{where}: {r['prompts_reused']} prompts were sent twice (prefix reuse)")
        prompt_tokens = totals["computed_tokens"] + totals["cache_hit_tokens"] + totals["kv_transfer_tokens"]
        if prompt_tokens and totals["cache_hit_tokens"] > 0.01 * prompt_tokens:
            warnings.append(f"{where}: {totals['cache_hit_tokens']:.0f} of {prompt_tokens:.0f} prompt tokens were "
                            f"local prefix-cache hits (expected ~0)")
        if r["cut_short"]:
            warnings.append(f"{where}: --max-window {args.max_window:g}s ended the window after {r['issued']} of "
                            f"{args.requests} requests")
        if totals["failed_transfers"]:
            warnings.append(f"{where}: {totals['failed_transfers']:.0f} KV transfers failed (the decode recomputed)")
        if totals["preemptions"]:
            warnings.append(f"{where}: {totals['preemptions']:.0f} preemptions")
    cpus = os.cpu_count() or 1
    for name, cell in cells.items():
        for fleet in FLEETS:
            c = cell[fleet]["cpu_cores"]
            if (c.get("loadgen") or 0) > 0.6:
                warnings.append(f"{name} {fleet}: the load generator kept {c['loadgen']:.2f} cores busy (one "
                                f"Python process: near its limit, it may be what bounds throughput)")
            if (c.get("machine") or 0) > 0.8 * cpus:
                warnings.append(f"{name} {fleet}: the machine was {c['machine']:.2f}/{cpus} cores busy (CPU-bound: "
                                f"lower --speedup)")
    return problems, warnings


def sim_timing(args: argparse.Namespace, shapes: dict[str, dict]) -> dict[str, dict]:
    """What the simulator's timing model charges for each workload at this --speedup, in ms."""
    out = {}
    for shape in WORKLOADS:
        n = int(shapes[shape.name]["prompt_tokens_mean"])
        full = n // BLOCK_SIZE * BLOCK_SIZE
        # vLLM (and the sim) never serve a prompt's last token from cache: with a block-aligned
        # prompt the whole last block is recomputed.
        tail = n - (n - 1) // BLOCK_SIZE * BLOCK_SIZE
        out[shape.name] = {
            "prefill_ms": round(prefill_time_ms(n) / args.speedup, 2),
            "decode_step_ms": round(decode_time_ms(0.0) / args.speedup, 2),  # near-empty cache
            "kv_transfer_ms": round(transfer_seconds(full, args.kv_bytes_per_token, args.kv_transfer_bandwidth,
                                                     args.speedup) * 1000, 2),
            # The decode recomputes the prompt's last partial block itself: a prefill step too.
            "decode_tail_prefill_ms": round(prefill_time_ms(tail) / args.speedup, 2),
        }
    return out


def prompts_for(args: argparse.Namespace, shape: WorkloadShape, run_i: int, count_tokens: Callable[[str], int],
                count: int | None = None) -> list[str]:
    """A window's prompts: warm-up and measured requests each get their own (``count`` caps them;
    prompt i is the same whatever the count)."""
    return kvw.distinct_prompts(seed=args.seed, tag=f"{shape.name}-run{run_i}",
                                count=args.warmup_requests + args.requests if count is None else count,
                                target_tokens=shape.prompt_tokens, count_tokens=count_tokens)


# ------------------------------------------------------------------------------------------- main
def plan_workloads(args: argparse.Namespace) -> tuple[dict[str, dict], Callable[[str], int]]:
    """Each workload's prompt length as the engines count it (the sims' built-in tokenizer and chat
    template, on a sample), and the token counter the prompt generator calibrates with."""
    from infera.kv.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(FLEET_MODEL["mixed"])
    count_tokens: Callable[[str], int] = lambda text: len(tokenizer.encode(text))  # noqa: E731
    shapes: dict[str, dict] = {}
    for shape in WORKLOADS:
        lengths = [len(tokenizer.encode_chat([{"role": "user", "content": text}]))
                   for text in prompts_for(args, shape, 0, count_tokens, count=8)]
        shapes[shape.name] = {"prompt_tokens_target": shape.prompt_tokens, "max_tokens": shape.max_tokens,
                              "prompt_tokens_mean": round(sum(lengths) / len(lengths), 1),
                              "prompt_tokens_range": [min(lengths), max(lengths)]}
    return shapes, count_tokens


def window_line(args: argparse.Namespace, res: dict[str, Any]) -> str:
    c = res["cpu_cores"]
    err = f"  ERRORS {res['errors']}: {res['error_samples'][:1]}" if res["errors"] else ""
    return (f"  run {res['run'] + 1}/{args.runs} {res['workload']:<12} {res['fleet']:<5} {res['rps']:>6.2f} req/s  "
            f"TTFT p50 {_f(res['ttft_p50_ms'], '.1f'):>6} p90 {_f(res['ttft_p90_ms'], '.1f'):>6}  "
            f"ITL p50 {_f(res['itl_p50_ms'], '.2f'):>5} p90 {_f(res['itl_p90_ms'], '.2f'):>6}  "
            f"e2e p50 {_f(res['lat_p50_ms'], '.0f'):>5}  {_f(res['out_tok_s'], '.0f'):>5} tok/s  "
            f"KV/req {_f(res['kv_transfer_tokens_per_req'], '.0f')}  cores: loadgen {_f(c.get('loadgen'))} "
            f"server {_f(c.get('server'))} workers {_f(c.get(res['fleet'] + ' workers'))} "
            f"machine {_f(c.get('machine'))}  n={res['completed']} ({res['window_wall_s']:.0f}s){err}")


async def measure(args: argparse.Namespace, rig: PdRig, count_tokens: Callable[[str], int]) -> list[dict]:
    """Every window: per run and workload, fresh prompts that both fleets get, back to back, the
    fleet that goes first alternating (drift on a shared box then hits both alike)."""
    runs: list[dict] = []
    async with aiohttp.ClientSession() as session:
        for run_i in range(args.runs):
            for w_i, shape in enumerate(WORKLOADS):
                prompts = prompts_for(args, shape, run_i, count_tokens)
                order = FLEETS if (run_i * len(WORKLOADS) + w_i) % 2 == 0 else FLEETS[::-1]
                for fleet in order:
                    rig.check_alive()
                    res = await rig.window(session, fleet, shape, prompts)
                    res.update(run=run_i, workload=shape.name, fleet=fleet, order=list(order),
                               wall_time=round(time.time(), 3))
                    runs.append(res)
                    print(window_line(args, res), flush=True)
    return runs


def print_report(args: argparse.Namespace, runs: list[dict], cells: dict[str, dict], problems: list[str],
                 warnings: list[str]) -> None:
    print(f"\nPD vs mixed — 2 sim workers per fleet, c={args.concurrency}, speedup {args.speedup:g}, medians of "
          f"{args.runs} run(s) × {args.requests} requests (times in ms; PD/mixed < 1 is better for times, "
          f"> 1 for req/s and tok/s)")
    print(render_table(cells))
    print(f"\nWhat the workers and CPUs did (KV moved/req: tokens the decode received by transfer; cache-hit tok: "
          f"local prefix-cache hits, summed over runs, expected 0; cores: medians, {os.cpu_count()} in all)")
    print(render_health(cells))
    notes = [f"  warning: {w}" for w in warnings] + [f"!! {p}" for p in problems]
    notes += [f"!! request error, run {r['run'] + 1} {r['workload']} {r['fleet']}: {sample}"
              for r in runs for sample in r["error_samples"]]
    if notes:
        print("\n".join(notes))


async def run(args: argparse.Namespace) -> int:
    out_path = os.path.abspath(args.out)
    logs_dir = os.path.splitext(out_path)[0] + "_logs"
    os.makedirs(logs_dir, exist_ok=True)
    # SIGTERM cancels this task, so the finally below still stops the fleet (SIGINT: asyncio.run does).
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    started, load_before = time.time(), os.getloadavg()
    shapes, count_tokens = plan_workloads(args)
    timing = sim_timing(args, shapes)
    print(f"pd: mixed (2 workers) vs 1P1D (1 prefill + 1 decode), sim speedup {args.speedup:g}, KV link "
          f"{args.kv_transfer_bandwidth:g} GB/s × {args.kv_bytes_per_token} B/token; c={args.concurrency}, "
          f"{args.warmup_requests} warm-up + {args.requests} measured requests × "
          f"{args.runs * len(WORKLOADS) * len(FLEETS)} windows; cpus={os.cpu_count()}, "
          f"loadavg={load_before[0]:.2f}; logs in {logs_dir}", flush=True)
    for shape in WORKLOADS:
        n, t = shapes[shape.name]["prompt_tokens_mean"], timing[shape.name]
        print(f"  {shape.name}: prompts ~{n:.0f} tokens (chat template included), {shape.max_tokens} output "
              f"tokens; modelled: prefill {t['prefill_ms']} ms, decode step ≥{t['decode_step_ms']} ms, KV transfer "
              f"{t['kv_transfer_ms']} ms, the decode's own tail prefill {t['decode_tail_prefill_ms']} ms", flush=True)

    rig = PdRig(args, logs_dir)
    try:
        runs = await start_and_measure(args, rig, count_tokens, started)
    finally:
        print("  stopping the fleet…", flush=True)
        await rig.stop()
    if runs is None:
        return 2
    cells = summarize(args, runs)
    problems, warnings = sanity_problems(args, runs, cells)
    print_report(args, runs, cells, problems, warnings)
    errors_total = sum(r["errors"] for r in runs)
    meta = dict(benchmark="pd", argv=sys.argv, settings={k: v for k, v in vars(args).items() if k != "out"},
                fleets={f: {"model": FLEET_MODEL[f], "roles": list(FLEET_ROLES[f])} for f in FLEETS},
                workloads=shapes, sim_timing_ms=timing, router_url=rig.router_url,
                workers=[{"fleet": w.fleet, "role": w.role, "url": w.url} for w in rig.sims],
                started_at=started, wall_s=round(time.time() - started, 2), cpu_count=os.cpu_count(),
                loadavg_before=load_before, loadavg_after=os.getloadavg(), python=platform.python_version(),
                aiohttp=aiohttp.__version__, platform=platform.platform(), git_commit=_git_commit())
    report = dict(meta=meta, runs=runs, cells=cells, problems=problems, warnings=warnings, errors_total=errors_total)
    out = pathlib.Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"\nresults: {out_path}  (wall {meta['wall_s']:.0f}s)")
    return 1 if errors_total or problems else 0


async def start_and_measure(args: argparse.Namespace, rig: PdRig, count_tokens: Callable[[str], int],
                            started: float) -> list[dict] | None:
    """Every window's result; None (after saying why) when the fleet did not start or broke."""
    try:
        await rig.start()
        async with aiohttp.ClientSession() as session:
            await rig.wait_ready(session)
            await rig.preflight(session)
        await rig.wait_loadgen_ready()
    except (FleetError, RuntimeError, OSError, asyncio.TimeoutError) as exc:
        print(f"pd: could not start the fleet: {exc}", file=sys.stderr)
        return None
    print(f"  fleet up in {time.time() - started:.1f}s: server {rig.router_url} (pid {rig.server.proc.pid}); "
          + "; ".join(f"{w.fleet} {w.role} {w.url}" for w in rig.sims), flush=True)
    try:
        return await measure(args, rig, count_tokens)
    except (FleetError, aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        print(f"pd: aborted: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> None:
    args = resolve_args(argv)
    try:
        sys.exit(asyncio.run(run(args)))
    except (KeyboardInterrupt, asyncio.CancelledError) as exc:  # Ctrl-C; SIGTERM (the task was cancelled)
        print(f"pd: stopped by {'Ctrl-C' if isinstance(exc, KeyboardInterrupt) else 'SIGTERM'}; fleet stopped",
              file=sys.stderr)
        sys.exit(130 if isinstance(exc, KeyboardInterrupt) else 143)


if __name__ == "__main__":
    main()
