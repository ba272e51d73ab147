#!/usr/bin/env python3
"""Does the fair queue keep a light tenant's TTFT while a heavy tenant overloads the fleet (issue 31)?

Starts, as subprocesses: an embedded etcd, ``--engines`` sim engines (``python -m infera.engine.sim``,
``--max-num-seqs`` = ``--per-worker``: the engine's own batch bound, past which it queues FIFO) and,
one after the other, a ``python -m infera.server`` per configuration, all with the same API keys
file (two tenants, ``heavy`` and ``light``):

* ``no-queue``: ``--max-inflight-per-worker 0`` (every request goes to the engines at once);
* ``queue``: ``--max-inflight-per-worker P --queue-timeout T`` (the work-conserving fair queue);
* ``queue+reserve``: the same with ``--queue-reserve-per-worker R`` (slots kept for tenants under
  their fair share).

The fleet's capacity X (req/s) is measured first: a closed loop of 2 × P × engines streamed
requests through the ``queue`` server. Then each run has, per configuration (same order every run):

* ``unloaded`` (on the ``no-queue`` server): the light tenant alone, Poisson at 0.1 × 2X;
* ``loaded``: Poisson arrivals at 2X in all, 90 % heavy and 10 % light, for ``--duration`` s; the
  window ends when every request has an answer (the no-queue engines drain their backlog).

Every request is a streamed completion of ``--prompt-words`` fresh random words (one token each, no
prefix reuse) and ``--max-tokens`` ± ``--output-spread`` tokens (uniform; ignore_eos: replies of one
length would finish, free their slots and bring in their successors' prefills in lockstep). TTFT is the time to the first streamed
token, over requests that arrived after the first ``--warmup`` s. Each request is ``served`` (a
complete stream), ``refused`` (429/503 with Retry-After) or ``lost`` (anything else: must stay 0).
Reported as medians over ``--runs``: light TTFT p50/p99 (and the p99 of every run's samples pooled),
its p99 over the unloaded p99, heavy TTFT p50, served req/s; served/refused/lost per tenant summed
over the runs. Each window also samples the sims' ``/metrics`` every 50 ms for a sim holding more
than its batch (the router sent it more than ``--per-worker``: it queues in its own FIFO), and records
how busy the machine's CPUs and the server process were and how late the load generator's own loop
woke (its TTFTs are taken there). The report ends with what the sims' step model alone adds to a
TTFT at a busy engine (``engine_bound``).

Goal (the issue's): with ``queue+reserve`` the light tenant's p99 TTFT is within 1.5× its unloaded
p99, while ``no-queue`` degrades past it; nothing is lost anywhere.

    python bench/fairness.py            # 3 runs, ~5 min on 2 cores
    python bench/fairness.py --quick    # 1 run of 6 s windows (~1 min, smoke)

Writes ``--out`` (default ``bench/results/fairness.json``). Exit status 0 when the goal holds, 1 when
it does not, 2 when the fleet could not be started.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import random
import statistics
import string
import sys
import tempfile
import time
from dataclasses import dataclass

import aiohttp

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
sys.path[:0] = [path for path in (REPO, BENCH_DIR) if path not in sys.path]

from infera.discovery.embedded_etcd import EmbeddedEtcd  # noqa: E402
from infera.engine.sim.scheduler import decode_time_ms, prefill_time_ms  # noqa: E402
from server_workers import Proc, cpu_ns, descendants, free_port  # noqa: E402

MODEL = "fairness-bench"
KEYS = {"heavy": "sk-bench-heavy", "light": "sk-bench-light"}
CONFIGS = ("no-queue", "queue", "queue+reserve")
ROWS = ("unloaded", *CONFIGS)
GOAL_RATIO = 1.5
HEAVY_SHARE = 0.9


@dataclass(slots=True)
class Outcome:
    tenant: str
    sent_at: float  # seconds since the window began
    kind: str  # served | refused | lost
    ttft_ms: float | None = None
    detail: str = ""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1 run, 6 s windows")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--per-worker", type=int, default=8, help="--max-inflight-per-worker and the sims' --max-num-seqs")
    ap.add_argument("--reserve", type=int, default=2, help="--queue-reserve-per-worker of queue+reserve")
    ap.add_argument("--queue-timeout", type=float, default=2.0)
    ap.add_argument("--overload", type=float, default=2.0, help="offered load over the measured capacity")
    ap.add_argument("--duration", type=float, default=15.0, help="seconds of arrivals per window")
    ap.add_argument("--warmup", type=float, default=2.0, help="arrivals in the first seconds not in TTFT stats")
    ap.add_argument("--speedup", type=float, default=0.5, help="the sims' --speedup (0.5: steps twice as long)")
    ap.add_argument("--prompt-words", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=32, help="the replies' mean length in tokens")
    ap.add_argument("--output-spread", type=float, default=0.5,
                    help="reply lengths uniform in max-tokens × (1 ± this)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(BENCH_DIR, "results", "fairness.json"))
    return ap


def server_flags(args: argparse.Namespace, config: str) -> list[str]:
    if config == "no-queue":
        return ["--max-inflight-per-worker", "0"]
    flags = ["--max-inflight-per-worker", str(args.per_worker), "--queue-timeout", repr(args.queue_timeout)]
    if config == "queue+reserve":
        flags += ["--queue-reserve-per-worker", str(args.reserve)]
    return flags


class Rig:
    """etcd, the sims (up for the whole benchmark) and the server of the configuration measured."""

    def __init__(self, args: argparse.Namespace, logs_dir: str) -> None:
        self.args, self.logs_dir = args, logs_dir
        self.etcd: EmbeddedEtcd | None = None
        self.sims: list[Proc] = []
        self.sim_urls: list[str] = []
        self.server: Proc | None = None
        self.url = ""
        self.keys_file = os.path.join(logs_dir, "keys.yaml")
        with open(self.keys_file, "w") as f:
            f.write("keys:\n" + "".join(f"  - sha256: {hashlib.sha256(k.encode()).hexdigest()}\n    tenant: {t}\n"
                                        for t, k in KEYS.items()))

    async def start(self) -> None:
        self.etcd = EmbeddedEtcd(unsafe_no_fsync=True)
        await self.etcd.start()
        a = self.args
        for i in range(a.engines):
            port = free_port()
            self.sim_urls.append(f"http://127.0.0.1:{port}")
            proc = Proc(f"sim{i}", [sys.executable, "-m", "infera.engine.sim", "--etcd-endpoint", self.etcd.url,
                                    "--log-level", "warning", "--no-enable-kv-events", "--model", MODEL,
                                    "--host", "127.0.0.1", "--port", str(port), "--speedup", repr(a.speedup),
                                    "--max-num-seqs", str(a.per_worker), "--drain-timeout", "3"], self.logs_dir)
            await proc.start()
            self.sims.append(proc)

    async def serve(self, config: str, session: aiohttp.ClientSession) -> None:
        """Replace the server by one with ``config``'s flags; return once it lists every sim."""
        await self.stop_server()
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = Proc(f"server-{config.replace('+', '-')}",
                           [sys.executable, "-m", "infera.server", "--workers", "1", "--host", "127.0.0.1",
                            "--port", str(port), "--etcd-endpoint", self.etcd.url, "--log-level", "warning",
                            "--api-keys-file", self.keys_file, *server_flags(self.args, config)], self.logs_dir)
        await self.server.start()
        deadline = time.monotonic() + 60
        while True:
            for p in (self.server, *self.sims):
                if p.proc.returncode is not None:
                    raise RuntimeError(f"{p.name} exited ({p.proc.returncode}): {p.log_tail()}")
            try:
                async with session.get(self.url + "/v1/workers", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    workers = (await r.json())["workers"]
                if sum(w.get("status") == "active" for w in workers) == self.args.engines:
                    return
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not list {self.args.engines} active sims within 60 s")
            await asyncio.sleep(0.2)

    async def engine_queue(self, session: aiohttp.ClientSession, stop: asyncio.Event) -> dict:
        """Until ``stop``, every 50 ms: whether some sim held more requests (running + waiting) than
        its --max-num-seqs, i.e. queued some in its own FIFO behind a full batch (the router sent it
        more than it can batch), and the most any held."""
        samples = over = most = 0
        while not stop.is_set():
            held = 0
            for url in self.sim_urls:
                try:
                    async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=1)) as r:
                        n = sum(float(line.rsplit(" ", 1)[1]) for line in (await r.text()).splitlines()
                                if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")))
                    held = max(held, int(n))
                except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
                    pass
            samples += 1
            over += held > self.args.per_worker
            most = max(most, held)
            try:
                await asyncio.wait_for(stop.wait(), 0.05)
            except asyncio.TimeoutError:
                pass
        return {"engine_over_batch_share": round(over / max(samples, 1), 3), "engine_held_max": most}

    async def stop_server(self) -> None:
        if self.server is not None:
            await self.server.stop()
            self.server = None

    async def stop(self) -> None:
        await self.stop_server()
        await asyncio.gather(*(p.stop() for p in self.sims))
        if self.etcd is not None:
            await self.etcd.stop()


class Load:
    """Streamed completions through the server, one tenant's key each, classified as they end."""

    def __init__(self, args: argparse.Namespace, session: aiohttp.ClientSession, rng: random.Random) -> None:
        self.args, self.session, self.rng = args, session, rng

    def body(self) -> bytes:
        words = " ".join("".join(self.rng.choices(string.ascii_lowercase, k=6)) for _ in range(self.args.prompt_words))
        spread = round(self.args.max_tokens * self.args.output_spread)
        max_tokens = max(1, self.args.max_tokens + self.rng.randint(-spread, spread))
        return json.dumps({"model": MODEL, "prompt": words, "max_tokens": max_tokens, "stream": True,
                           "ignore_eos": True}).encode()

    async def one(self, url: str, tenant: str, t0: float) -> Outcome:
        body = self.body()
        start = time.perf_counter()
        out = Outcome(tenant, start - t0, "lost")
        headers = {"Authorization": f"Bearer {KEYS[tenant]}", "Content-Type": "application/json"}
        try:
            async with self.session.post(url + "/v1/completions", data=body, headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=300)) as r:
                if r.status != 200:
                    text = (await r.text())[:200]
                    refused = r.status in (429, 503) and r.headers.get("Retry-After", "").isdigit()
                    out.kind, out.detail = ("refused" if refused else "lost"), f"{r.status} {text}"
                    return out
                done = False
                async for line in r.content:
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        done = True
                        break
                    if out.ttft_ms is None and b'"text"' in payload:
                        out.ttft_ms = (time.perf_counter() - start) * 1e3
                out.kind = "served" if done and out.ttft_ms is not None else "lost"
                out.detail = "" if done else "stream ended without [DONE]"
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            out.kind, out.detail = "lost", f"{type(exc).__name__}: {exc}"[:200]
        return out

    async def open_loop(self, url: str, rates: dict[str, float], duration: float) -> tuple[list[Outcome], float]:
        """Poisson arrivals per tenant for ``duration`` s; every request's outcome, once all ended."""
        t0 = time.perf_counter()
        tasks: list[asyncio.Task] = []

        async def arrivals(tenant: str, rate: float) -> None:
            at = t0
            while True:
                at += self.rng.expovariate(rate)
                if at - t0 >= duration:
                    return
                await asyncio.sleep(max(0.0, at - time.perf_counter()))
                tasks.append(asyncio.ensure_future(self.one(url, tenant, t0)))

        await asyncio.gather(*(arrivals(t, r) for t, r in rates.items() if r > 0))
        outcomes = list(await asyncio.gather(*tasks))
        return outcomes, time.perf_counter() - t0

    async def capacity(self, url: str, concurrency: int, duration: float) -> float:
        """Completed requests per second of a closed loop of ``concurrency`` (all one tenant's)."""
        stop = time.perf_counter() + duration
        served = 0

        async def loop() -> None:
            nonlocal served
            while time.perf_counter() < stop:
                o = await self.one(url, "heavy", 0.0)
                if o.kind == "served" and time.perf_counter() <= stop:
                    served += 1
                elif o.kind != "served":
                    raise RuntimeError(f"calibration request failed: {o.detail}")

        t0 = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        return served / (min(time.perf_counter(), stop) - t0)


async def loop_lag(stop: asyncio.Event, tick: float = 0.005) -> dict:
    """Until ``stop``: how late this process's own event loop wakes (p99 and max, ms). The TTFTs are
    taken here, so a busy load generator (or a busy machine) lengthens them by about this much."""
    lags: list[float] = []
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(tick)
        lags.append((time.perf_counter() - t - tick) * 1e3)
    return {"client_loop_lag_p99_ms": round(percentile(lags, 99) or 0.0, 1),
            "client_loop_lag_max_ms": round(max(lags, default=0.0), 1)}


def machine_busy() -> tuple[int, int]:
    """(busy, total) jiffies of every CPU since boot, from /proc/stat (0, 0 where there is none)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summarize(outcomes: list[Outcome], warmup: float, elapsed: float) -> dict:
    cell: dict = {"elapsed_s": round(elapsed, 2)}
    for tenant in KEYS:
        mine = [o for o in outcomes if o.tenant == tenant]
        ttfts = [o.ttft_ms for o in mine if o.kind == "served" and o.sent_at >= warmup]
        cell[tenant] = {
            "sent": len(mine),
            **{k: sum(o.kind == k for o in mine) for k in ("served", "refused", "lost")},
            "ttft_samples": len(ttfts),
            "ttft_p50_ms": percentile(ttfts, 50), "ttft_p99_ms": percentile(ttfts, 99),
            "lost_samples": [o.detail for o in mine if o.kind == "lost"][:3],
            "ttft_ms_sorted": [round(v, 1) for v in sorted(ttfts)] if tenant == "light" else None,
        }
    cell["served_rps"] = round(sum(o.kind == "served" for o in outcomes) / elapsed, 2)
    return cell


async def one_run(args, rig: Rig, load: Load, session, capacity: float, run_i: int) -> dict:
    offered = args.overload * capacity
    rates = {"heavy": HEAVY_SHARE * offered, "light": (1 - HEAVY_SHARE) * offered}
    run: dict = {}

    async def window(row: str, window_rates: dict[str, float]) -> None:
        stop = asyncio.Event()
        sampler = asyncio.ensure_future(rig.engine_queue(session, stop))
        lag = asyncio.ensure_future(loop_lag(stop))
        busy0, total0 = machine_busy()
        server_pids = [rig.server.pid, *descendants(rig.server.pid)]  # --workers 1: a child serves
        server_ns = cpu_ns(server_pids)
        outcomes, elapsed = await load.open_loop(rig.url, window_rates, args.duration)
        server_ns = cpu_ns(server_pids) - server_ns
        busy1, total1 = machine_busy()
        stop.set()
        run[row] = c = {**summarize(outcomes, args.warmup, elapsed), **await sampler, **await lag,
                        "machine_busy_share": round((busy1 - busy0) / max(total1 - total0, 1), 2),
                        "server_cpu_share": round(server_ns / 1e9 / elapsed, 2)}
        print(f"  run {run_i}: {row:<15}light p50/p99 {fmt(c['light']['ttft_p50_ms'])}/"
              f"{fmt(c['light']['ttft_p99_ms'])} ms, heavy p50 {fmt(c['heavy']['ttft_p50_ms'])} ms, lost "
              f"{c['light']['lost'] + c['heavy']['lost']}, {elapsed:.0f} s, a sim past its batch "
              f"{c['engine_over_batch_share']:.0%} of the time (most held {c['engine_held_max']}), CPUs "
              f"{c['machine_busy_share']:.0%} busy (the server {c['server_cpu_share']:.0%} of one), client loop lag p99/max {c['client_loop_lag_p99_ms']}/"
              f"{c['client_loop_lag_max_ms']} ms", flush=True)

    for config in CONFIGS:
        await rig.serve(config, session)
        if config == "no-queue":
            await window("unloaded", {"light": rates["light"]})
        await window(config, rates)
    return run


def fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def median_cells(runs: list[dict]) -> dict:
    def med(path: tuple[str, ...]) -> float | None:
        vals = []
        for r in runs:
            v = r
            for p in path:
                v = v.get(p) if isinstance(v, dict) else None
            if v is not None:
                vals.append(v)
        return statistics.median(vals) if vals else None

    cells = {}
    for row in [r for r in ROWS if r in runs[0]]:
        cell = {"served_rps": med((row, "served_rps"))}
        for tenant in KEYS:
            cell[tenant] = {k: med((row, tenant, k)) for k in ("ttft_p50_ms", "ttft_p99_ms", "ttft_samples")}
            for k in ("sent", "served", "refused", "lost"):  # totals over the runs
                cell[tenant][k] = sum(r[row][tenant][k] for r in runs)
        cells[row] = cell
    for row in cells:
        base = cells["unloaded"]["light"]["ttft_p99_ms"]
        p99 = cells[row]["light"]["ttft_p99_ms"]
        cells[row]["light_p99_over_unloaded"] = None if not base or p99 is None else round(p99 / base, 2)
        pooled = [v for r in runs for v in r[row]["light"]["ttft_ms_sorted"]]
        cells[row]["light"]["ttft_p99_pooled_ms"] = percentile(pooled, 99)
        for k in ("engine_over_batch_share", "machine_busy_share", "server_cpu_share", "client_loop_lag_p99_ms",
                  "client_loop_lag_max_ms"):
            cells[row][k] = med((row, k))
    return cells


def render(cells: dict) -> str:
    head = (f"{'':<16}{'light p50':>10}{'light p99':>10}{'pooled':>8}{'p99/unl':>8}{'heavy p50':>10}{'req/s':>7}"
            f"{'light srv/ref/lost':>20}{'heavy srv/ref/lost':>20}{'CPUs':>6}{'server':>7}{'lag p99':>8}")
    lines = [head, "-" * len(head)]
    for row, c in cells.items():
        lt, hv = c["light"], c["heavy"]
        lines.append(f"{row:<16}{fmt(lt['ttft_p50_ms']):>10}{fmt(lt['ttft_p99_ms']):>10}"
                     f"{fmt(lt['ttft_p99_pooled_ms']):>8}{fmt(c['light_p99_over_unloaded'], '.2f'):>8}"
                     f"{fmt(hv['ttft_p50_ms']):>10}{fmt(c['served_rps']):>7}"
                     f"{'%d/%d/%d' % (lt['served'], lt['refused'], lt['lost']):>20}"
                     f"{'%d/%d/%d' % (hv['served'], hv['refused'], hv['lost']) if hv['sent'] else '-':>20}"
                     f"{fmt(c['machine_busy_share'], '.0%'):>6}{fmt(c['server_cpu_share'], '.0%'):>7}"
                     f"{fmt(c['client_loop_lag_p99_ms']):>8}")
    return "\n".join(lines)


def engine_bound(args: argparse.Namespace) -> dict:
    """What the sims' step model alone adds to a request's TTFT at a busy engine over an idle one,
    whatever the router does: it waits for the step in flight and its own prefill step carries the
    batch's decode: ``one_prompt`` when those steps prefill no other prompt, ``full_batch`` when each
    prefills a whole batch's (``--per-worker``) prompts. (The random 6-letter words are one token each
    in the built-in tokenizer; KV usage stays near 0 here.)"""
    s = args.speedup
    prompt = args.prompt_words
    idle = prefill_time_ms(prompt) / s
    decode = decode_time_ms(0.0) / s
    batch = (prefill_time_ms(prompt * args.per_worker)) / s
    return {"prefill_step_ms": round(idle, 1), "decode_step_ms": round(decode, 1),
            "busy_extra_one_prompt_ms": round(idle + 2 * decode, 1),
            "busy_extra_full_batch_ms": round(2 * (batch + decode) - idle, 1)}


def verdict(cells: dict) -> list[str]:
    """What fails the goal (empty: it holds)."""
    problems = []
    fair, open_ = cells["queue+reserve"]["light_p99_over_unloaded"], cells["no-queue"]["light_p99_over_unloaded"]
    if fair is None or fair > GOAL_RATIO:
        problems.append(f"queue+reserve: light p99 is {fmt(fair, '.2f')}× its unloaded p99 (goal ≤ {GOAL_RATIO})")
    if open_ is None or open_ <= GOAL_RATIO:
        problems.append(f"no-queue: light p99 is {fmt(open_, '.2f')}× unloaded: it should degrade past {GOAL_RATIO}")
    lost = {row: c["light"]["lost"] + c["heavy"]["lost"] for row, c in cells.items()}
    if any(lost.values()):
        problems.append(f"requests lost: {lost}")
    return problems


async def run(args: argparse.Namespace) -> int:
    logs_dir = tempfile.mkdtemp(prefix="infera-fairness-")
    rig = Rig(args, logs_dir)
    rng = random.Random(args.seed)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        try:
            try:
                await rig.start()
                await rig.serve("queue", session)
            except (RuntimeError, OSError, asyncio.TimeoutError) as exc:
                print(f"fleet did not start: {exc} (logs: {logs_dir})", file=sys.stderr)
                return 2
            load = Load(args, session, rng)
            slots = args.per_worker * args.engines
            await load.capacity(rig.url, slots, 2.0)  # warm-up
            capacity = await load.capacity(rig.url, 2 * slots, 5.0 if not args.quick else 3.0)
            print(f"capacity at {slots} slots: {capacity:.1f} req/s; offered {args.overload:g}× = "
                  f"{args.overload * capacity:.1f} req/s (light {(1 - HEAVY_SHARE) * args.overload * capacity:.1f})",
                  flush=True)
            runs = [await one_run(args, rig, load, session, capacity, i + 1) for i in range(args.runs)]
        finally:
            await rig.stop()
    cells = median_cells(runs)
    print(f"\nlight tenant's TTFT (ms, medians of {args.runs} runs; served/refused/lost: totals), "
          f"{args.engines} sims × {args.per_worker} slots, reserve {args.reserve}/worker, "
          f"{args.overload:g}× overload ({HEAVY_SHARE:.0%} heavy)")
    print(render(cells))
    bound = engine_bound(args)
    print(f"\nthe sims' step model: an idle engine's first token costs a prefill step ({bound['prefill_step_ms']} ms "
          f"here); at a busy one a request also waits for the step in flight and its own step carries the batch's "
          f"decode ({bound['decode_step_ms']} ms): +{bound['busy_extra_one_prompt_ms']} ms at most when those "
          f"steps prefill no other prompt, +{bound['busy_extra_full_batch_ms']} ms when each prefills a whole "
          f"batch's, whatever the router does")
    problems = verdict(cells)
    print("\ngoal " + ("holds" if not problems else "FAILS: " + "; ".join(problems)))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                   "capacity_rps": capacity, "engine_bound": bound, "cells": cells, "runs": runs, "problems": problems,
                   "logs": logs_dir}, f, indent=1)
    print(f"wrote {args.out}")
    return 0 if not problems else 1


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.runs, args.duration, args.warmup = 1, 6.0, 1.0
    sys.exit(asyncio.run(run(args)))


if __name__ == "__main__":
    main()
