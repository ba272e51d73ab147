#!/usr/bin/env python3
"""A real fleet's KV-event load against ``python -m infera.server`` (kv-aware), 100 to 1,000 engines.

Starts, as subprocesses: an embedded etcd; ``--publishers`` processes (``bench/_fleet_publisher.py``)
that each host a share of the engines, every engine a real vLLM-wire ZMQ PUB socket plus its
replay ROUTER on loopback, replaying ``bench/_fleet_workload.py``'s chat workload on an LRU pool of
``--pool`` blocks of 16 tokens (``--sharing``: the share of conversations every engine draws from
one fleet catalog, so their blocks are shared; 0: every block distinct); one fake OpenAI worker
(``bench/_fake_worker.py``, registered under another prefix, so the server never sees it as a
worker) that every engine's record names as its URL, for the pick measurement; and, per fleet size
and ``--workers`` N, a fresh ``python -m infera.server --workers N --router-policy kv-aware``
(``--engine-scrape-interval 0``: the engines serve no /metrics). The bench itself registers one
real worker record per engine (engine ``vllm``, the model, its KV-event and replay endpoints, block
size 16, the built-in tokenizer) under one lease.

Per fleet size, once every process of the server lists the whole fleet:

* **memory**: the engines send their first period (filling the pools, at ``--warm-rate``, 100k
  block events/s: below what the server applies, so what is read is its index, not the buffers a
  backlog leaves in its memory -- at 400k/s those tripled it); when every server process
  holds ``engines × pool`` (block, worker) entries, the server's memory is read (PSS, and RSS,
  summed over its processes, ``/proc/<pid>/smaps_rollup``). Bytes per entry: the slope of memory
  over the fleet sizes (least squares; per run, median reported), so what does not grow with the
  index (the interpreter, the code) drops out.
* **events**: windows of ``--window`` s at an offered rate (block events/s, all engines together,
  round-robin, each batch stamped when sent), then a drain: /metrics is read until every process
  applied all that was sent. Per window: applied events, the server's CPU (all threads of its
  processes, ``/proc/*/task/*/schedstat``; the CPU of the /metrics reads themselves, measured
  first, subtracted) → block events applied per core, end to end from the socket; lag = the
  server's ``infera_kv_event_delay_seconds`` (apply time − the batch's timestamp) over the
  window, p50/p99. First ``--rate``, then halving or doubling to the edge, then one step between:
  **max held** is the highest rate where every process applied ≥ 99.5% of it, drained within 1 s
  and 99% of the batches lagged < 1 s. Events/s per core is that of the highest held window.
* **pick**: ``--picks`` ``/v1/completions`` requests with an 8k-token prompt (token ids: a prefix
  the fleet holds, then fresh tokens; ``max_tokens`` 1), one at a time, through the server and,
  interleaved, straight to the fake worker: through-the-server p50/p99, **added** = through −
  direct p50, and the server's CPU per request. The added latency includes the JSON of 8k ids,
  hashing 512 blocks, the match over every engine and the proxying; the **policy pick** p50/p99 is
  the pick alone, from the server's ``infera_router_pick_seconds`` over the same requests, and is
  what the pick goal checks.

    python bench/fleet_scale.py                         # 100, 300, 1000 engines; --workers 1 and 2; 3 runs (~25 min)
    python bench/fleet_scale.py --quick                 # ~1-3 min smoke: 20, 60 engines, 1 run
    python bench/fleet_scale.py --engines 1000 --workers 1 --sharing 0
    python bench/fleet_scale.py --soak-seconds 600 --kv-index-max-bytes 64Mi --engines 300 --workers 1 --sharing 0

**soak** (``--soak-seconds S``, ``bench/_fleet_soak.py``): instead of the measurements above, one
fleet runs S seconds at ``--soak-rate`` with the server's KV index at ``--kv-index-max-bytes``, and
the server's RSS growth after ``--soak-warmup`` is reported (goal < 5 %; exit status 1 above it).

Prints one line per measurement, then the table of medians; writes ``--out`` (JSON). Exit status
0 when every goal holds (≤ 48 B per entry at the largest fleet; --workers 2 memory and event CPU
≤ 1.1 × --workers 1; ≥ 1M block events/s per core, held with lag < 1 s; pick p99 ≤ 1 ms), 1 when one
fails, 2 when the fleet could not start.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import tempfile
import time
from array import array
from typing import Any

import aiohttp

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
for _p in (REPO, BENCH_DIR):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from infera.discovery.embedded_etcd import EmbeddedEtcd  # noqa: E402
from infera.discovery.etcd import EtcdClient  # noqa: E402
from infera.discovery.record import BUILTIN_TOKENIZER, WorkerRecord, encode_record  # noqa: E402
from infera.transport.embedded_nats import EmbeddedNats  # noqa: E402
from _fleet_report import (hist_quantile, bucket_delta, goals, medians, memory_slopes, total_pss_ratios,  # noqa: E402
                           percentile, scrape_table, table, window_held)
from _fleet_workload import VOCAB, Catalog, Source  # noqa: E402
from _main import run_bench  # noqa: E402
from server_workers import Proc, free_port, pin  # noqa: E402
from _fleet_procs import PREFIX, Publishers, Relays, Server, memory  # noqa: E402
from _fleet_soak import soak, soak_table  # noqa: E402
from infera.kv.bound import parse_size  # noqa: E402

DEFAULT_OUT = os.path.join(BENCH_DIR, "results", "fleet_scale.json")
DEFAULT_SOAK_OUT = os.path.join(BENCH_DIR, "results", "fleet_scale_soak.json")
SOAK_GOAL_PCT = 5.0
MODEL = "fleet-bench"
PICK_PREFIX = "/infera/bench-fleet-scale-pick/"  # the fake worker's own record: not in the fleet
PROMPT_TOKENS = 8192
DRAIN_TIMEOUT_S = 60.0
FULL_TIMEOUT_S = 300.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python bench/fleet_scale.py", allow_abbrev=False,
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--engines", type=int, nargs="+", default=None, help="fleet sizes [100 300 1000; --quick: 20 60]")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="the server's --workers, each measured")
    p.add_argument("--sharing", type=float, nargs="+", default=[0.0, 1.0],
                   help="share of conversations drawn from the fleet catalog (shared blocks), each measured")
    p.add_argument("--mode", choices=("zmq", "nats"), default="zmq",
                   help="zmq: the server reads every engine's PUB socket; nats: each engine's launcher relay "
                        "(bench/_fleet_relay.py) republishes its events into JetStream, where the server reads them")
    p.add_argument("--runs", type=int, default=None, help="runs for medians [3; --quick: 1]")
    p.add_argument("--pool", type=int, default=2048, help="blocks in each engine's LRU pool")
    p.add_argument("--publishers", type=int, default=4, help="publisher processes")
    p.add_argument("--rate", type=float, default=1_000_000, help="offered block events/s (the lag is reported here)")
    p.add_argument("--warm-rate", type=float, default=100_000,
                   help="block events/s while the pools fill (faster than the server applies them, its backlog's "
                        "buffers stay in its memory: see bench/README.md)")
    p.add_argument("--window", type=float, default=None, help="seconds per rate window [3; --quick: 1.5]")
    p.add_argument("--picks", type=int, default=None, help="8k-token picks per measurement [200; --quick: 40]")
    p.add_argument("--pin", choices=("auto", "off"), default="auto",
                   help="auto: the server's processes on the first core, the publishers, etcd, the fake worker and "
                        "this process on the others (where there are 2+ cores); off: nothing pinned")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--ready-timeout", type=float, default=120.0)
    p.add_argument("--quick", action="store_true", help="small fleets and counts: a smoke run")
    p.add_argument("--out", default=None, help=f"JSON results file [{DEFAULT_OUT}; soak: {DEFAULT_SOAK_OUT}]")
    p.add_argument("--soak-seconds", type=float, default=0.0,
                   help="soak: run this long at the index's byte bound and report the server's RSS growth (0: off)")
    p.add_argument("--kv-index-max-bytes", type=parse_size, default=None,
                   help="soak: the server's --kv-index-max-bytes (512Mi, 4G; default: the server's own)")
    p.add_argument("--soak-rate", type=float, default=100_000, help="soak: offered block events/s")
    p.add_argument("--soak-sample", type=float, default=10.0, help="soak: seconds between memory samples")
    p.add_argument("--soak-warmup", type=float, default=None,
                   help="soak: seconds before the growth baseline [a third of --soak-seconds]")
    return p


def resolve_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    q = args.quick
    args.engines = sorted(set(args.engines or ([20, 60] if q else [100, 300, 1000])))
    args.runs = args.runs if args.runs is not None else (1 if q else 3)
    args.window = args.window if args.window is not None else (1.5 if q else 3.0)
    args.picks = args.picks if args.picks is not None else (40 if q else 200)
    if q and args.rate == 1_000_000:
        args.rate = 200_000
    if min(args.engines) < 1 or args.runs < 1 or args.publishers < 1 or min(args.workers) < 1:
        raise SystemExit("--engines, --runs, --publishers and --workers must be >= 1")
    if any(not 0.0 <= s <= 1.0 for s in args.sharing):
        raise SystemExit("--sharing must be within [0, 1]")
    if args.soak_seconds < 0 or args.soak_sample <= 0 or args.soak_rate <= 0:
        raise SystemExit("--soak-seconds must be >= 0, --soak-sample and --soak-rate > 0")
    args.out = args.out or (DEFAULT_SOAK_OUT if args.soak_seconds else DEFAULT_OUT)
    return args


# ------------------------------------------------------------------------------------- measurement
def records(pubs: Publishers, engines: list[int], fake_url: str, mode: str) -> dict[int, WorkerRecord]:
    """What a vLLM worker's launcher registers, per engine (its URL: the fake worker's)."""
    return {e: WorkerRecord(worker_id=f"fleet-{e:05d}", url=fake_url, model_name=MODEL, engine="vllm",
                            kv_events_endpoint=pubs.endpoints[e][0], kv_events_replay_endpoint=pubs.endpoints[e][1],
                            kv_block_size=16, tokenizer=BUILTIN_TOKENIZER, kv_event_transport=mode)
            for e in engines}


async def register(client: EtcdClient, recs: dict[int, WorkerRecord]) -> int:
    lease = await client.grant(60)
    items = list(recs.values())
    for start in range(0, len(items), 50):
        await asyncio.gather(*(client.put(f"{PREFIX}{r.worker_id}", encode_record(r), lease)
                               for r in items[start:start + 50]))
    return lease


async def keep_alive(client: EtcdClient, lease: int) -> None:
    while True:
        await asyncio.sleep(10)
        await client.keepalive(lease)


FULL_POLL_S = 5.0  # a /metrics read of 1,000 workers churns ~10 MB of objects in the process that answers


async def wait_full(server: Server, session: aiohttp.ClientSession, entries: int, timeout: float) -> dict:
    """Until every server process's views hold ``entries``, read every FULL_POLL_S: at 2 reads a
    second the reads' own garbage (in whichever process answered: the gatherer of a --workers N
    server renders its siblings' pages too) was in the memory measured."""
    deadline = time.monotonic() + timeout
    while True:
        kv = await server.kv(session)
        if len(kv) >= server.workers and all(p.view_blocks >= entries for p in kv.values()):
            return kv
        if time.monotonic() > deadline:
            raise RuntimeError(f"index not full after {timeout:.0f}s: " +
                               ", ".join(f"process {k}: {p.view_blocks:.0f}/{entries}" for k, p in kv.items()))
        await asyncio.sleep(FULL_POLL_S)


async def settle_trimmed(full: dict) -> None:
    """After the fill: the server's freed heap given back (``--heap-trim-interval``, infera/heap_trim.py).
    A /metrics read leaves megabytes of freed heap at 1,000 engines (the page's strings), the reads
    that saw the fill complete included: the memory is read once a whole trim interval has passed
    since the last one, so a trim ran after it (at once where the trimmer is off)."""
    interval = max((p.heap_trim_interval for p in full.values()), default=0.0)
    if interval > 0:
        await asyncio.sleep(interval + 1.0)


async def caught_up(server: Server, session: aiohttp.ClientSession, last_seq: dict[int, int]) -> bool:
    """Whether the server has applied the last batch sent to a sample of the engines (cheap: a
    /metrics read of 1,000 workers costs the server ~0.3 s of its loop, which would stall the drain)."""
    keys = sorted(last_seq)
    sample = keys[::max(1, len(keys) // 8)] + keys[-1:]
    for e in sample:
        async with session.get(f"{server.url}/v1/admin/cache-view/fleet-{e:05d}", headers=server.auth) as r:
            r.raise_for_status()
            view = await r.json()
        seq = view.get("last_event_seq")
        if seq is None or seq < last_seq[e]:
            return False
    return True


async def window(server: Server, pubs: Publishers, session: aiohttp.ClientSession, engines: list[int],
                 rate: float, duration: float) -> dict:
    before = await server.kv(session)
    scrapes0, c0 = server.scrapes, server.cpu_s()
    sent_parts = await pubs.command("run", engines, rate, duration=duration)
    stopped = time.monotonic()
    sent = sum(s["block_events"] for s in sent_parts)
    send_wall = max(s["wall_s"] for s in sent_parts)
    last_seq = {int(e): q for s in sent_parts for e, q in s["last_seq"].items()}
    # Fresh connections: with --workers N each check lands on any of the processes.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                     timeout=aiohttp.ClientTimeout(total=30)) as probe:
        while True:
            if time.monotonic() - stopped > DRAIN_TIMEOUT_S:
                drain = time.monotonic() - stopped
                after = await server.kv(session)
                break
            if await caught_up(server, probe, last_seq):
                drain = time.monotonic() - stopped  # (the confirmation below costs the server ~0.3 s)
                after = await server.kv(session)  # every process, every worker
                if all(after[k].block_events - before[k].block_events >= sent for k in appliers(after, before)):
                    break
                await asyncio.sleep(0.5)
            await asyncio.sleep(0.05)
    applied = {k: after[k].block_events - before[k].block_events for k in appliers(after, before)}
    cpu = server.cpu_s() - c0 - (server.scrapes - scrapes0) * server.scrape_cpu_s
    buckets: dict[float, float] = {}
    for k, p in after.items():
        for le, n in bucket_delta(p.delay_buckets, before[k].delay_buckets if k in before else {}):
            buckets[le] = buckets.get(le, 0.0) + n
    cum = sorted(buckets.items())
    p50, p99 = hist_quantile(cum, 0.5), hist_quantile(cum, 0.99)
    applied_min = min(applied.values()) if applied else 0.0
    sent_rate = sent / send_wall if send_wall else 0.0
    return {"offered_rate": rate, "sent": sent, "sent_rate": sent_rate,
            "applied_min": applied_min, "drain_s": round(drain, 3), "server_cpu_s": round(cpu, 3),
            "server_cores_busy": round(cpu / (send_wall + drain), 3) if send_wall else None,
            # per core, of the fleet's events: the server's CPU, all its processes (with --workers N
            # each applies every event, or one does for the host: --kv-index-scope)
            "events_per_core": applied_min / cpu if cpu > 0 else None,
            "applied_all_processes": sum(applied.values()),
            "lag_p50_ms": None if p50 is None else 1000 * p50, "lag_p99_ms": None if p99 is None else 1000 * p99,
            "gaps": sum(p.gaps - before.get(k, p).gaps for k, p in after.items()),
            "held": window_held(sent, applied_min, drain, p99)}


async def events_transport(server: Server) -> str | None:
    """The plane the server's events come in on, as a process that reads them says (a reader of the
    host's shared index says "shared": fresh connections until another process answers)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                     timeout=aiohttp.ClientTimeout(total=30)) as probe:
        for _ in range(50):
            async with probe.get(f"{server.url}/v1/admin/cache-view/fleet-00000", headers=server.auth) as resp:
                transport = (await resp.json()).get("transport")
            if transport != "shared":
                return transport
    return "shared"


def appliers(after: dict, before: dict) -> list[str]:
    """The server processes that apply events: all, but the readers of a host's shared index."""
    return [k for k, p in after.items() if k in before and p.role != "reader"]


async def rate_windows(server: Server, pubs: Publishers, session: aiohttp.ClientSession, engines: list[int],
                       args: argparse.Namespace) -> list[dict]:
    """``--rate`` first, then halving (while not held) or doubling (while held), then one step between."""
    ws = [await window(server, pubs, session, engines, args.rate, args.window)]
    rate, held = args.rate, ws[0]["held"]
    for _ in range(4):
        rate = rate * 2 if held else rate / 2
        w = await window(server, pubs, session, engines, rate, args.window)
        ws.append(w)
        if w["held"] != held:
            break
        if w["sent_rate"] < 0.9 * rate:  # the publishers' limit here: no higher rate can be offered
            break
    held_rates = [w["offered_rate"] for w in ws if w["held"]]
    failed_rates = [w["offered_rate"] for w in ws if not w["held"]]
    if held_rates and failed_rates and min(failed_rates) > max(held_rates):
        ws.append(await window(server, pubs, session, engines, (max(held_rates) + min(failed_rates)) / 2, args.window))
    return ws


def pick_prompt(args: argparse.Namespace, sharing: float) -> list[int]:
    """An 8k-token prompt: a prefix the fleet holds (the fleet catalog's first conversation, or with
    no sharing engine 0's hottest system prompt), then fresh tokens."""
    if sharing > 0:
        head = Catalog(args.seed, 16, args.pool).conversations[0].tokens
    else:
        head = Source(f"engine-{args.seed}-0", 16).system[0][0]
    rng = random.Random(args.seed + 7)
    tail = array("I", (x % VOCAB for x in array("I", rng.randbytes(4 * PROMPT_TOKENS))))
    return (head.tolist() + tail.tolist())[:PROMPT_TOKENS]


def pick_buckets(per_process: dict) -> dict[float, float]:
    """infera_router_pick_seconds (role mixed), summed over the server's processes."""
    out: dict[float, float] = {}
    for kv in per_process.values():
        for le, count in kv.pick_buckets.items():
            out[le] = out.get(le, 0.0) + count
    return out


async def picks(server: Server, fake_url: str, session: aiohttp.ClientSession, prompt: list[int], n: int) -> dict:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}).encode()
    headers = {"Content-Type": "application/json"}

    async def one(url: str) -> float:
        t0 = time.perf_counter()
        async with session.post(url, data=body, headers=headers) as r:
            await r.read()
            if r.status != 200:
                raise RuntimeError(f"{url}: HTTP {r.status}")
        return time.perf_counter() - t0

    via_url, direct_url = f"{server.url}/v1/completions", f"{fake_url}/v1/completions"
    for _ in range(10):  # warm-up: connections, the tokenizer, caches
        await one(via_url)
        await one(direct_url)
    before = pick_buckets(await server.kv(session))
    via, direct, cpu = [], [], 0.0
    for _ in range(n):
        direct.append(await one(direct_url))
        c0 = server.cpu_s()
        via.append(await one(via_url))
        cpu += server.cpu_s() - c0
    d50 = percentile(direct, 50)
    # the policy's pick alone, from the server's infera_router_pick_seconds over these requests
    picked = bucket_delta(pick_buckets(await server.kv(session)), before)
    p50, p99 = hist_quantile(picked, 0.5), hist_quantile(picked, 0.99)
    return {"policy_pick_p50_ms": None if p50 is None else 1000 * p50,
            "policy_pick_p99_ms": None if p99 is None else 1000 * p99,
            "pick_p50_ms": 1000 * percentile(via, 50), "pick_p99_ms": 1000 * percentile(via, 99),
            "direct_p50_ms": 1000 * d50, "direct_p99_ms": 1000 * percentile(direct, 99),
            "added_p50_ms": 1000 * (percentile(via, 50) - d50), "added_p99_ms": 1000 * (percentile(via, 99) - d50),
            "cpu_ms_per_request": 1000 * cpu / n}


async def measure(args: argparse.Namespace, etcd: EmbeddedEtcd, client: EtcdClient, pubs: Publishers, fake_url: str,
                  sharing: float, workers: int, n: int, run: int, log_dir: str, relays: Relays | None,
                  nats_url: str | None) -> dict:
    engines = list(range(n))
    await pubs.command("restart", engines)  # fresh engines for a fresh server
    recs = records(pubs, engines, fake_url, args.mode)
    if relays is not None:
        await relays.relay(recs)  # the launcher starts its relay before it registers the worker
    lease = await register(client, recs)
    alive = asyncio.ensure_future(keep_alive(client, lease))
    server = Server(args, etcd.url, workers, log_dir, f"s{sharing:g}-w{workers}-n{n}-r{run}", nats_url)
    r: dict[str, Any] = {"sharing": sharing, "workers": workers, "engines": n, "run": run, "mode": args.mode}
    try:
        t0 = time.monotonic()
        await server.start(n, args.ready_timeout, args.server_cores)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            r["pss_empty_bytes"], r["rss_empty_bytes"] = memory(server.pids)
            await pubs.command("warm", engines, args.warm_rate)
            kv = await wait_full(server, session, n * args.pool, FULL_TIMEOUT_S)
            r["fill_s"] = round(time.monotonic() - t0, 1)
            r["entries"] = n * args.pool
            r["pss_untrimmed_bytes"], r["rss_untrimmed_bytes"] = memory(server.pids)
            await settle_trimmed(kv)  # what the fill left free goes back, as it does in service
            r["pss_bytes"], r["rss_bytes"] = memory(server.pids)
            r["pss_by_process"] = {str(pid): memory([pid])[0] for pid in server.pids}  # the supervisor, then the workers
            r["pss_mb"] = r["pss_bytes"] / 2 ** 20
            r["fill_gaps"] = sum(p.gaps for p in kv.values())
            r["fill_resets"] = sum(p.resets for p in kv.values())
            r["transport"] = await events_transport(server)  # the plane the server reads them on
            if r["transport"] != args.mode:
                raise RuntimeError(f"the server reads the events over {r['transport']}, not {args.mode}")
            await server.measure_scrape_cpu(session)
            r["scrape_cpu_ms"] = round(1000 * server.scrape_cpu_s, 1)
            r.update(await server.scrape_stall(session))  # what a scrape holds the loop for
            ws = await rate_windows(server, pubs, session, engines, args)
            r["windows"] = ws
            at_rate = ws[0]
            r["lag_p50_ms"], r["lag_p99_ms"] = at_rate["lag_p50_ms"], at_rate["lag_p99_ms"]
            r["sent_at_rate"] = at_rate["sent_rate"]
            r["server_busy_at_rate"] = at_rate["server_cores_busy"]  # < 1: the server was not what held it back
            held = [w for w in ws if w["held"]]
            best = max(held, key=lambda w: w["sent_rate"]) if held else None
            r["max_held_rate"] = best["sent_rate"] if best else 0.0  # what the publishers achieved
            r["events_per_core"] = (best or max(ws, key=lambda w: w["sent_rate"]))["events_per_core"]
            r.update(await picks(server, fake_url, session, pick_prompt(args, sharing), args.picks))
    finally:
        alive.cancel()
        await server.proc.stop()
        if relays is not None:
            await relays.stop_relaying()
        try:
            await client.revoke(lease)
        except Exception:  # noqa: BLE001 - the etcd is torn down next anyway
            pass
    return r


async def soak_fleet(args: argparse.Namespace, etcd: EmbeddedEtcd, client: EtcdClient, pubs: Publishers,
                     fake_url: str, sharing: float, log_dir: str) -> dict:
    """The soak (bench/_fleet_soak.py) on the first fleet size and --workers, its engines registered."""
    n, workers = args.engines[0], args.workers[0]
    engines = list(range(n))
    await pubs.command("restart", engines)
    lease = await register(client, records(pubs, engines, fake_url, "zmq"))
    alive = asyncio.ensure_future(keep_alive(client, lease))
    try:
        r = await soak(args, etcd.url, pubs, engines, workers, log_dir, f"soak-s{sharing:g}-w{workers}-n{n}")
    finally:
        alive.cancel()
        try:
            await client.revoke(lease)
        except Exception:  # noqa: BLE001 - the etcd is torn down next anyway
            pass
    r["sharing"] = sharing
    return r


def soak_report(args: argparse.Namespace, r: dict, pub_info: dict) -> int:
    print(f"\nfleet_scale soak: sharing {r['sharing']:g}, pool {args.pool} blocks/engine, {os.cpu_count()} cores")
    print(soak_table(r))
    growth = r.get("rss_growth_pct")
    ok = growth is not None and growth < SOAK_GOAL_PCT
    print(f"check rss_growth_after_warmup: {'PASS' if ok else 'FAIL'} "
          f"({'-' if growth is None else f'{growth:+.2f} %'} vs goal < {SOAK_GOAL_PCT:g} %)")
    out = {"meta": {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count(),
                    "loadavg_1m_at_end": os.getloadavg()[0], "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "args": vars(args), "publishers": pub_info},
           "soak": r, "checks": {"rss_growth_after_warmup": {"ok": ok, "value": growth, "goal": SOAK_GOAL_PCT}}}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"JSON: {args.out}")
    return 0 if ok else 1


def line(r: dict) -> str:
    return (f"  sharing {r['sharing']:g} --workers {r['workers']} {r['engines']:>5} engines run {r['run']}: "
            f"{r['entries']:,} entries, PSS {r['pss_mb']:,.0f} MB (filled in {r['fill_s']} s), "
            f"{(r['events_per_core'] or 0) / 1e3:,.0f}k ev/s/core, lag p50/p99 at {r['windows'][0]['offered_rate'] / 1e3:,.0f}k/s "
            f"{r['lag_p50_ms'] or 0:.0f}/{r['lag_p99_ms'] or 0:.0f} ms (sent {(r['sent_at_rate'] or 0) / 1e3:,.0f}k/s), "
            f"max held {r['max_held_rate'] / 1e3:,.0f}k/s; pick p50/p99 {r['pick_p50_ms']:.2f}/{r['pick_p99_ms']:.2f} ms "
            f"(+{r['added_p50_ms']:.2f}/+{r['added_p99_ms']:.2f}), {r['cpu_ms_per_request']:.2f} ms CPU/req")


def arrange(args: argparse.Namespace) -> None:
    """``args.server_cores`` and ``args.bench_cores`` (None: not pinned)."""
    cores = sorted(os.sched_getaffinity(0))
    if args.pin == "auto" and len(cores) >= 2:
        args.server_cores, args.bench_cores = cores[:1], cores[1:]
    else:
        args.server_cores = args.bench_cores = None


async def run(args: argparse.Namespace) -> int:
    log_dir = tempfile.mkdtemp(prefix="bench-fleet-scale-")
    arrange(args)
    if args.bench_cores:
        pin([os.getpid()], args.bench_cores)
    etcd = EmbeddedEtcd(unsafe_no_fsync=True)
    client: EtcdClient | None = None
    fake: Proc | None = None
    nats: EmbeddedNats | None = EmbeddedNats(auth=False) if args.mode == "nats" else None
    results: list[dict] = []
    pub_info: dict[str, Any] = {}
    try:
        try:
            await etcd.start()
            client = EtcdClient(etcd.url)
            fake_port = free_port()
            fake = Proc("fake-worker", [sys.executable, os.path.join(BENCH_DIR, "_fake_worker.py"), "--etcd-endpoint",
                                        etcd.url, "--etcd-prefix", PICK_PREFIX, "--model", MODEL, "--port",
                                        str(fake_port)], log_dir)
            await fake.start()
            if nats is not None:
                await nats.start()
            if args.bench_cores:
                pin([p for p in (etcd.pid, fake.pid, nats and nats.proc and nats.proc.pid) if p], args.bench_cores)
        except Exception as exc:  # noqa: BLE001
            print(f"fleet failed to start: {exc}", file=sys.stderr)
            return 2
        fake_url = f"http://127.0.0.1:{fake_port}"
        for sharing in args.sharing:
            pubs = Publishers(args, sharing, log_dir)
            relays = Relays(pubs.count, nats.url, log_dir) if nats is not None else None
            try:
                t0 = time.monotonic()
                await pubs.start(600)
                if relays is not None:
                    await relays.start(60)
                if args.bench_cores:
                    pin(pubs.pids + (relays.pids if relays else []), args.bench_cores)
                pub_info[f"{sharing:g}"] = {"setup_s": round(time.monotonic() - t0, 1), "processes": pubs.info}
                print(f"sharing {sharing:g}: {max(args.engines)} engines in {pubs.count} publishers, ready in "
                      f"{time.monotonic() - t0:.1f} s (logs: {log_dir})", flush=True)
                if args.soak_seconds:
                    soaked = await soak_fleet(args, etcd, client, pubs, fake_url, sharing, log_dir)
                    return soak_report(args, soaked, pub_info)
                for run_i in range(args.runs):
                    order = args.workers if run_i % 2 == 0 else args.workers[::-1]  # interleaved: drift hits both
                    for workers in order:
                        for n in args.engines:
                            r = await measure(args, etcd, client, pubs, fake_url, sharing, workers, n, run_i, log_dir,
                                              relays, nats.url if nats is not None else None)
                            results.append(r)
                            print(line(r), flush=True)
            finally:
                if relays is not None:
                    await relays.stop()
                await pubs.stop()
    finally:
        if fake is not None:
            await fake.stop(5)
        if client is not None:
            await client.close()
        if nats is not None:
            await nats.stop()
        await etcd.stop()
    return report(args, results, pub_info)


def report(args: argparse.Namespace, results: list[dict], pub_info: dict) -> int:
    rows = medians(results)
    slopes = memory_slopes(results)
    where = (f"server on core(s) {args.server_cores}, publishers and the rest on {args.bench_cores}"
             if args.server_cores else "nothing pinned")
    print(f"\nfleet_scale ({args.mode}): medians of {args.runs} run(s); pool {args.pool} blocks/engine, block size 16; offered "
          f"{args.rate / 1e3:,.0f}k block events/s; {os.cpu_count()} cores, {where}")
    print(table(rows, slopes))
    print("\n/metrics at fleet size (medians):")
    print(scrape_table(rows))
    for (s, w), v in slopes.items():
        if v.get("untrimmed_bytes_per_entry") is not None:
            print(f"sharing {s:g}, --workers {w}: {v['untrimmed_bytes_per_entry']:.1f} B/entry read before the "
                  f"server's first heap trim after the fill (B/entry above: after it)")
    checks = goals(rows, slopes)
    totals = total_pss_ratios(rows)
    for sharing, ratio in totals.items():
        print(f"sharing {sharing}: --workers 2's whole PSS is {ratio:.2f}x --workers 1's at the largest fleet "
              f"(the index and each process's fixed cost)")
    for name, c in checks.items():
        verdict = "n/a" if c["ok"] is None else "PASS" if c["ok"] else "FAIL"
        value = "-" if c["value"] is None else f"{c['value']:,.2f}"
        print(f"check {name}: {verdict} ({value} vs goal {c['goal']:,})")
    out = {"meta": {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count(),
                    "loadavg_1m_at_end": os.getloadavg()[0], "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "args": vars(args), "publishers": pub_info},
           "results": results, "medians": rows,
           "bytes_per_entry": [{"sharing": s, "workers": w, **v} for (s, w), v in slopes.items()],
           "workers2_total_pss_ratio": totals, "checks": checks}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"JSON: {args.out}")
    return 0 if checks and all(c["ok"] for c in checks.values()) else 1


def main(argv: list[str] | None = None) -> int:
    return run_bench("fleet_scale", run(resolve_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
