#!/usr/bin/env python3
"""What does the kv-aware hot path cost per request and per KV event? In-process, no I/O.

Sections (``--sections``, all by default):

* ``short``: router_overhead.py's eight short chat prompts, two workers (block size 16): the
  per-request CPU of each step of the kv-aware path — tokenize + cache hints (``prepare``), the
  pick (hashing, index walk), the pick's metrics (``record_pick``), ``on_started`` +
  ``on_finished``, the self-check (``observe_usage``) — and round-robin's pick for comparison.
  Each step runs over the same requests in its own loop; the figure is the best of ``--runs``
  loops (the least disturbed by other processes).
* ``fleet``: the pick's CPU µs per request against fleets of 2-128 workers, its loop over the
  targets in C and in Python (``INFERA_NATIVE=0``'s), short prompts and behind a system prompt,
  16 requests in flight; the two must pick alike.
* ``shared``: kv_routing.py's workload replayed in-process: 32 system prompts of 2048 tokens,
  3-turn conversations of 96-token user turns and 12-word replies, four simulated engines (the
  sim's real ``KVCache`` and KV-event publisher, cache sized for 60 % of the prefixes). Each
  request goes through the policy as in the server (prepare, pick, on_started, the engine
  computes it and publishes its batch, on_finished, observe_usage) and the batch through the
  server's ``KvEventsBridge`` (decode, re-hash, apply). Reported: CPU µs per request of each
  step, per event batch, round-robin's pick over the same requests, the engines' prefix-cache hit
  rate (so a speed-up that changed the picks would show) and every cache's hit accounting.
  Median of ``--runs`` runs, each from a fresh state.
* ``rag``: the same replay for single-turn prompts: one of 8 system prompts (1024 tokens) and a
  ~3000-token document no other request has (retrieval-augmented generation).
* ``zmq``: the ZMQ subscriber's CPU per KV-event batch (``ZmqKvEventSubscriber``, uvloop), a
  publisher process sending batches at ``--zmq-rates`` per second.
* ``tokenize``: the built-in tokenizer's ns per token on the workload's system prompts.

    python bench/kv_path.py                 # ~1 min on 2 cores
    python bench/kv_path.py --quick         # smoke run
    PYTHONPATH=/tmp/old python bench/kv_path.py --out /tmp/old.json   # the same against other code

Prints one table per section and writes ``--out`` (JSON). The package never imports bench/.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from typing import Any

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)
if not any(os.path.isdir(os.path.join(p, "infera")) for p in sys.path if p):
    sys.path.insert(0, REPO)  # run from anywhere; an explicit PYTHONPATH (other code) wins

import msgspec  # noqa: E402

import _kv_workload as wl  # noqa: E402
from infera.api.requests import parse_request  # noqa: E402
from infera.discovery.fleet import Fleet  # noqa: E402
from infera.discovery.record import WorkerRecord  # noqa: E402
from infera.engine.sim.cache import KVCache  # noqa: E402
from infera.engine.sim.kv_events import KvEventPublisher, KvEventsConfig  # noqa: E402
from infera.kv.index import KvIndex  # noqa: E402
from infera.kv.prompt import PromptTokenizer  # noqa: E402
from infera.kv.tokenizer import load_tokenizer  # noqa: E402
from infera.router.kv_aware import KvAwarePolicy  # noqa: E402
from infera.router.policy import RoutedRequest  # noqa: E402
from infera.router.round_robin import RoundRobinPolicy  # noqa: E402
from infera.server.kv import KvEventsBridge  # noqa: E402

CHAT = "/v1/chat/completions"
SHORT_PROMPTS = ["Hello!", "Say something short.", "What is a router?", "Count to three.", "Name a colour.",
                 "Tell me a fact.", "Why is the sky blue?", "Summarise: benchmarks are useful."]
BS = 16
cpu = time.process_time


def workers(n: int, bs: int = BS) -> tuple[WorkerRecord, ...]:
    return tuple(msgspec.convert({"worker_id": f"w{i}", "model_name": "m", "url": f"http://127.0.0.1:{9000 + i}",
                                  "engine": "sim", "kv_block_size": bs,
                                  "kv_events_endpoint": f"tcp://127.0.0.1:{9100 + i}"}, WorkerRecord)
                 for i in range(n))


def kv_fleet(n: int, **policy_kw: Any) -> tuple[tuple[WorkerRecord, ...], KvIndex, KvEventsBridge, KvAwarePolicy,
                                                PromptTokenizer]:
    """The server's kv-aware objects, wired as ``infera.server.main`` wires them."""
    ws = workers(n)
    index = KvIndex()
    bridge = KvEventsBridge(Fleet(), index)
    for w in ws:
        bridge._on_fleet_change(w.worker_id, w)
    prompts = PromptTokenizer.from_path(None)
    policy = KvAwarePolicy(index, prompts, overlap_weight=16.0, observer=bridge, **policy_kw)
    return ws, index, bridge, policy, prompts


def chat_request(i: int, body: bytes, parsed: Any) -> RoutedRequest:
    return RoutedRequest(route=CHAT, body=body, parsed=parsed, model="m", stream=True, request_id=str(i))


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 2) if xs else None


# ------------------------------------------------------------------------------------------ short
async def short_section(runs: int, n: int) -> dict[str, Any]:
    ws, index, bridge, policy, _ = kv_fleet(2)
    rr = RoundRobinPolicy()
    bodies = [json.dumps({"model": "m", "messages": [{"role": "user", "content": p}], "max_tokens": 16}).encode()
              for p in SHORT_PROMPTS]
    parsed = [parse_request(CHAT, b) for b in bodies]
    best: dict[str, float] = {}

    def keep(step: str, t0: float) -> None:
        best[step] = min(best.get(step, 1e9), (cpu() - t0) / n * 1e6)

    for _ in range(runs):
        reqs = [chat_request(i, bodies[i % 8], parsed[i % 8]) for i in range(n)]
        t0 = cpu()
        for r in reqs:
            if not policy.prepare_cached(r):  # as the server calls them (dispatch.py)
                await policy.prepare(r)
        keep("prepare", t0)
        observer, policy.observer = policy.observer, None
        t0 = cpu()
        picked = [policy.pick(ws, r) for r in reqs]
        keep("pick", t0)
        policy.observer = observer
        t0 = cpu()
        for r in reqs:
            bridge.record_pick("mixed", r.state["route_key"], r.state["predicted_hit_blocks"], 0)
        keep("record_pick", t0)
        t0 = cpu()
        for w, r in zip(picked, reqs):
            policy.on_started(w, r)
            r.state["served"] = True
            policy.on_finished(w, r)
        keep("started+finished", t0)
        t0 = cpu()
        for w, r in zip(picked, reqs):
            bridge.observe_usage(w, r, 0)
        keep("observe_usage", t0)
        t0 = cpu()
        for r in reqs:
            w = rr.pick(ws, r)
            rr.on_started(w, r)
            rr.on_finished(w, r)
        keep("round-robin", t0)
    kv_total = sum(v for k, v in best.items() if k != "round-robin")
    return {"us_per_request": {k: round(v, 2) for k, v in best.items()}, "kv_aware_total_us": round(kv_total, 2),
            "round_robin_us": round(best["round-robin"], 2), "requests": n, "runs": runs}


# ------------------------------------------------------------------------------------------ fleet
FLEET_SIZES = (2, 8, 32, 128)
FLEET_IN_FLIGHT = 16  # requests kept in flight, as a closed loop at c=16 keeps them


async def fleet_section(runs: int, n: int, sizes: tuple[int, ...] = FLEET_SIZES) -> dict[str, Any]:
    """The pick's CPU µs per request against fleets of ``sizes`` workers, with its loop over the
    targets in C (``native.score_targets``) and in Python (``policy._score = None``, as with
    ``INFERA_NATIVE=0``), for the short prompts (no full block: every target ties on cost, the
    tie-break decides) and behind an 80-word system prompt (6-7 blocks: the blocks in flight and
    served decide). ``FLEET_IN_FLIGHT`` requests are in flight at each pick. Both loops must make
    the same picks: the run fails if they do not."""
    out: dict[str, Any] = {}
    system = [{"role": "system", "content": " ".join(f"word{i}" for i in range(80))}]
    for workload, head in (("short", []), ("system", system)):
        bodies = [json.dumps({"model": "m", "messages": head + [{"role": "user", "content": p}],
                              "max_tokens": 16}).encode() for p in SHORT_PROMPTS]
        parsed = [parse_request(CHAT, b) for b in bodies]
        for size in sizes:
            row: dict[str, Any] = {}
            picks: dict[str, list[str]] = {}
            for loop in ("native", "python"):
                best = 1e9
                for _ in range(runs):
                    ws, index, bridge, policy, _ = kv_fleet(size)
                    policy.observer = None
                    if loop == "python":
                        policy._score = None
                    elif policy._score is None:
                        return {"skipped": "the C accelerator is not built"}
                    reqs = [chat_request(i, bodies[i % 8], parsed[i % 8]) for i in range(n)]
                    for r in reqs:
                        if not policy.prepare_cached(r):
                            await policy.prepare(r)
                    spent = 0.0
                    chosen: list[WorkerRecord] = []
                    for i, r in enumerate(reqs):
                        t0 = cpu()
                        w = policy.pick(ws, r)
                        spent += cpu() - t0
                        chosen.append(w)
                        policy.on_started(w, r)
                        r.state["served"] = True
                        if i >= FLEET_IN_FLIGHT:
                            policy.on_finished(chosen[i - FLEET_IN_FLIGHT], reqs[i - FLEET_IN_FLIGHT])
                    best = min(best, spent / n * 1e6)
                    picks[loop] = [w.worker_id for w in chosen]
                row[f"{loop}_us"] = round(best, 2)
            if picks["native"] != picks["python"]:
                raise SystemExit(f"fleet {workload}/{size}: the C and Python loops picked differently")
            row["python_over_native"] = round(row["python_us"] / row["native_us"], 2)
            out[f"{workload}/{size}"] = row
    return out


# ----------------------------------------------------------------------------------------- shared
def build_shared(quick: bool) -> tuple[list[bytes], dict[int, list[int]], Any]:
    """Request bodies in the order a closed loop plays them (each conversation's turns in turn,
    conversations interleaved), and the reply token ids each turn's engine generates."""
    tok = load_tokenizer("")
    conversations = 120 if quick else 400
    workload = wl.build_workload(seed=0, groups=32, prefix_tokens=2048, turns=3, user_tokens=96,
                                 popularity="uniform", zipf_s=1.1, conversations=conversations,
                                 count_tokens=lambda s: len(tok.encode(s)))
    vocab = wl.pseudo_vocabulary(0)[:400]
    replies = {c.cid: [" " + " ".join(random.Random(f"{c.cid}-{t}").choice(vocab) for _ in range(12))
                       for t in range(3)] for c in workload.conversations}
    bodies: list[bytes] = []
    reply_ids: dict[int, list[int]] = {}
    users = 16  # concurrency: this many conversations interleave
    active = list(workload.conversations[:users])
    queue = list(workload.conversations[users:])
    turn = {c.cid: 0 for c in workload.conversations}
    while active:
        for c in list(active):
            t = turn[c.cid]
            msgs = workload.messages(c, t, replies[c.cid])
            reply_ids[len(bodies)] = tok.encode(replies[c.cid][t])[:16]
            bodies.append(json.dumps({"model": "m", "messages": msgs, "max_tokens": 16}).encode())
            turn[c.cid] += 1
            if turn[c.cid] == 3:
                active.remove(c)
                if queue:
                    active.append(queue.pop(0))
    return bodies, reply_ids, tok


def build_rag(quick: bool) -> tuple[list[bytes], dict[int, list[int]], Any]:
    """Single-turn requests: one of 8 system prompts (1024 tokens) and a document of ~3000 tokens
    no other request has, then a question (retrieval-augmented generation)."""
    tok = load_tokenizer("")
    count = lambda s: len(tok.encode(s))  # noqa: E731
    workload = wl.build_workload(seed=1, groups=8, prefix_tokens=1024, turns=1, user_tokens=16,
                                 popularity="uniform", zipf_s=1.1, conversations=1, count_tokens=count)
    n = 150 if quick else 600
    docs = wl.distinct_prompts(seed=1, tag="rag", count=n, target_tokens=3000, count_tokens=count)
    bodies = []
    for i, doc in enumerate(docs):
        msgs = [{"role": "system", "content": workload.prefixes[i % 8]},
                {"role": "user", "content": f"Document:\n{doc}\n\nQuestion {i}: what does it say?"}]
        bodies.append(json.dumps({"model": "m", "messages": msgs, "max_tokens": 16}).encode())
    return bodies, {}, tok


class CacheFlusher:
    """``--cold-kb``: streams that many bytes through the CPU caches before each timed step, as the
    server's other work (HTTP, JSON, other requests) does between one request's steps there. A
    step then pays the cache misses it pays in the server (its per-block walks: ~3 us in a warm
    loop, ~20-70 us in the server, by the server threads' CPU clock), which a warm loop hides."""

    def __init__(self, kb: int) -> None:
        self.src = bytes(kb * 1024)
        self.dst = bytearray(kb * 1024)

    def __call__(self) -> None:
        if self.src:
            self.dst[:] = self.src


async def shared_run(bodies: list[bytes], reply_ids: dict[int, list[int]], tok: Any, cold_kb: int = 0,
                     **policy_kw: Any) -> dict[str, Any]:
    flush = CacheFlusher(cold_kb)
    ws, index, bridge, policy, prompts = kv_fleet(4, **policy_kw)
    rr = RoundRobinPolicy()
    engine_tok = PromptTokenizer.from_path(None)  # the engines' own tokenization (whole prompts)
    num_blocks = int(32 * 2048 / BS * 0.6 / len(ws)) + 600
    engines = {}
    for i, w in enumerate(ws):
        cache = KVCache(BS, num_blocks)
        publisher = KvEventPublisher(KvEventsConfig.from_dict({"enable_kv_cache_events": True, "publisher": "zmq"}),
                                     block_size=BS, seed=i)
        publisher.attach(cache)
        engines[w.worker_id] = (cache, publisher)
    steps = dict.fromkeys(("prepare", "pick", "started+finished", "observe_usage", "events", "round-robin"), 0.0)
    batches = 0
    for i, body in enumerate(bodies):
        parsed = parse_request(CHAT, body)
        req = chat_request(i, body, parsed)
        flush()
        t0 = cpu()
        if not getattr(policy, "prepare_cached", lambda r: False)(req):  # as dispatch.py calls them
            await policy.prepare(req)
        t1 = cpu()
        steps["prepare"] += t1 - t0
        flush()
        t1 = cpu()
        worker = policy.pick(ws, req)
        t2 = cpu()
        steps["pick"] += t2 - t1
        flush()
        t2 = cpu()
        policy.on_started(worker, req)
        t3 = cpu()
        steps["started+finished"] += t3 - t2
        cache, publisher = engines[worker.worker_id]
        prompt = list(await engine_tok.token_ids(CHAT, parsed))
        cached = cache.allocate(i, prompt)
        assert cached is not None, "engine out of blocks"
        generated = (reply_ids.get(i) or [])[:16]
        for token in generated + [1000] * (16 - len(generated)):  # max_tokens 16
            cache.append_token(i, token)
        cache.free(i)
        seq = publisher.flush()
        req.state["served"] = True
        flush()
        t0 = cpu()
        policy.on_finished(worker, req)
        t1 = cpu()
        bridge.observe_usage(worker, req, cached)
        t2 = cpu()
        steps["started+finished"] += t1 - t0
        steps["observe_usage"] += t2 - t1
        flush()
        t2 = cpu()
        if seq is not None:
            bridge._on_batch(worker.worker_id, seq, publisher.buffered()[-1][1])
            batches += 1
        t3 = cpu()
        steps["events"] += t3 - t2
        flush()
        t3 = cpu()
        rr_req = chat_request(i, body, parsed)
        rr_worker = rr.pick(ws, rr_req)
        rr.on_started(rr_worker, rr_req)
        rr.on_finished(rr_worker, rr_req)
        t4 = cpu()
        steps["round-robin"] += t4 - t3
    n = len(bodies)
    queries = sum(c.prefix_cache_queries for c, _ in engines.values())
    hits = sum(c.prefix_cache_hits for c, _ in engines.values())
    stats = [index.stats(w.worker_id) for w in ws]
    out: dict[str, Any] = {
        "us_per_request": {k: round(v / n * 1e6, 2) for k, v in steps.items()},
        "us_per_batch": round(steps["events"] / max(batches, 1) * 1e6, 2), "batches": batches, "requests": n,
        "engine_hit_rate": round(hits / queries, 4) if queries else None,
        "blocks_stored": sum(s.stored_blocks for s in stats), "blocks_removed": sum(s.removed_blocks for s in stats),
        "prompt_cache": {"hits": prompts.hits, "misses": prompts.misses, "segment_hits": prompts.segment_hits,
                         "horizon_cuts": getattr(prompts, "horizon_cuts", None),
                         "horizon_chars_skipped": getattr(prompts, "horizon_chars_skipped", None),
                         "bytes": prompts.cache.bytes},
    }
    hash_cache = getattr(policy, "hash_cache", None)
    if hash_cache is not None:
        out["hash_cache"] = {"hits": hash_cache.hits, "misses": hash_cache.misses,
                             "blocks_reused": hash_cache.blocks_reused, "blocks_hashed": hash_cache.blocks_hashed,
                             "bytes": hash_cache.lru.bytes}
    kv = sum(v for k, v in out["us_per_request"].items() if k != "round-robin")
    out["kv_aware_total_us"] = round(kv, 2)
    return out


async def shared_section(runs: int, quick: bool, build: Any = None, cold_kb: int = 0,
                         **policy_kw: Any) -> dict[str, Any]:
    bodies, reply_ids, tok = (build or build_shared)(quick)
    results = [await shared_run(bodies, reply_ids, tok, cold_kb, **policy_kw) for _ in range(runs)]
    med = {k: _median([r["us_per_request"][k] for r in results]) for k in results[0]["us_per_request"]}
    return {"us_per_request": med, "kv_aware_total_us": _median([r["kv_aware_total_us"] for r in results]),
            "round_robin_us": med["round-robin"], "us_per_batch": _median([r["us_per_batch"] for r in results]),
            "runs": results}


# -------------------------------------------------------------------------------------------- zmq
_PUBLISHER = r'''
import sys, time, zmq
ctx = zmq.Context(); s = ctx.socket(zmq.PUB); s.bind(sys.argv[1]); time.sleep(1.0)
n, rate = int(sys.argv[2]), float(sys.argv[3]); payload = b"x" * 400
t0 = time.perf_counter()
for i in range(n):
    s.send_multipart([b"kv-events", i.to_bytes(8, "big"), payload])
    while time.perf_counter() < t0 + (i + 1) / rate:
        pass
time.sleep(0.5); s.close(0); ctx.term()
'''


def zmq_once(n: int, rate: float) -> float | None:
    """CPU µs per batch of a subscriber process (uvloop) receiving ``n`` batches at ``rate``/s."""
    code = r'''
import asyncio, resource, sys, socket
sys.path[:0] = sys.argv[4:]
from infera.transport.kv_events_zmq import ZmqKvEventSubscriber
try:
    import uvloop
except ImportError:
    uvloop = None
async def main():
    n, rate, ep = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    got = [0]; done = asyncio.Event()
    def on_batch(key, seq, payload):
        got[0] += 1
        if got[0] == n:
            done.set()
    sub = ZmqKvEventSubscriber(on_batch, lambda key: None)
    sub.add("w0", ep)
    await sub.start()
    await asyncio.sleep(0.9)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    try:
        await asyncio.wait_for(done.wait(), n / rate + 10)
    except asyncio.TimeoutError:
        pass
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    used = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
    print(used / max(got[0], 1) * 1e6 if got[0] >= n * 0.99 else -1)
    await sub.stop()
(uvloop.run if uvloop else asyncio.run)(main())
'''
    with socket_port() as port:
        ep = f"tcp://127.0.0.1:{port}"
    pub = subprocess.Popen([sys.executable, "-c", _PUBLISHER, ep, str(n), str(rate)])
    try:
        out = subprocess.run([sys.executable, "-c", code, str(n), str(rate), ep, *sys.path], capture_output=True,
                             text=True, timeout=n / rate + 30)
    finally:
        pub.wait(timeout=n / rate + 30)
    try:
        value = float(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None
    return value if value >= 0 else None


class socket_port:
    def __enter__(self) -> int:
        import socket
        self.s = socket.socket()
        self.s.bind(("127.0.0.1", 0))
        return self.s.getsockname()[1]

    def __exit__(self, *exc: Any) -> None:
        self.s.close()


def zmq_section(runs: int, rates: list[float], n: int) -> dict[str, Any]:
    return {str(int(rate)): _median([zmq_once(n, rate) for _ in range(runs)]) for rate in rates}


# --------------------------------------------------------------------------------------- tokenize
def tokenize_section(runs: int) -> dict[str, Any]:
    tok = load_tokenizer("")
    workload = wl.build_workload(seed=0, groups=32, prefix_tokens=2048, turns=3, user_tokens=96,
                                 popularity="uniform", zipf_s=1.1, conversations=1,
                                 count_tokens=lambda s: len(tok.encode(s)))
    tokens = sum(len(tok.encode(t)) for t in workload.prefixes)
    best = 1e9
    for _ in range(runs):
        t0 = cpu()
        for text in workload.prefixes:
            tok.encode(text)
        best = min(best, (cpu() - t0) / tokens * 1e9)
    return {"ns_per_token": round(best, 1), "tokens": tokens}


# ------------------------------------------------------------------------------------------ report
def render(report: dict[str, Any]) -> str:
    lines = []
    for name in ("short", "shared", "rag"):
        sec = report.get(name)
        if not sec:
            continue
        steps = sec["us_per_request"]
        lines.append(f"\n[{name}] CPU µs per request" + (" (best of runs)" if name == "short" else " (median of runs)"))
        lines.append("  " + "  ".join(f"{k} {v:.2f}" for k, v in steps.items()))
        ratio = sec["kv_aware_total_us"] / sec["round_robin_us"] if sec["round_robin_us"] else float("nan")
        lines.append(f"  kv-aware total {sec['kv_aware_total_us']:.2f} µs vs round-robin {sec['round_robin_us']:.2f} µs"
                     f" (+{sec['kv_aware_total_us'] - sec['round_robin_us']:.2f} µs, x{ratio:.1f})")
        if name in ("shared", "rag"):
            last = sec["runs"][-1]
            lines.append(f"  per event batch {sec['us_per_batch']:.2f} µs ({last['batches']} batches, "
                         f"{last['blocks_stored']} blocks stored, {last['blocks_removed']} removed); "
                         f"engines' prefix-cache hit rate {last['engine_hit_rate']}")
            pc = last["prompt_cache"]
            lines.append(f"  prompt cache: {pc['hits']} whole-prompt hits / {pc['misses']} misses, "
                         f"{pc['segment_hits']} segment hits, horizon cuts {pc['horizon_cuts']} "
                         f"({pc['horizon_chars_skipped']} chars never tokenized), {pc['bytes']} B")
            if "hash_cache" in last:
                hc = last["hash_cache"]
                lines.append(f"  hash cache: {hc['hits']} hits / {hc['misses']} misses, {hc['blocks_reused']} blocks "
                             f"reused, {hc['blocks_hashed']} hashed, {hc['bytes']} B")
    fleet = report.get("fleet")
    if fleet and "skipped" in fleet:
        lines.append(f"\n[fleet] skipped: {fleet['skipped']}")
    elif fleet:
        lines.append(f"\n[fleet] pick CPU µs per request by fleet size ({FLEET_IN_FLIGHT} in flight; best of runs): "
                     "loop over the targets in C | in Python")
        for name, row in fleet.items():
            lines.append(f"  {name:<12} {row['native_us']:8.2f} | {row['python_us']:8.2f}  (x{row['python_over_native']:.2f})")
    if report.get("zmq"):
        lines.append("\n[zmq] subscriber CPU µs per batch, by batches/s: "
                     + ", ".join(f"{r}/s {v}" for r, v in report["zmq"].items()))
    if report.get("tokenize"):
        t = report["tokenize"]
        lines.append(f"\n[tokenize] built-in tokenizer: {t['ns_per_token']} ns per token ({t['tokens']} tokens)")
    return "\n".join(lines)


async def run(a: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"meta": {"argv": sys.argv, "cold_kb": a.cold_kb, "python": sys.version.split()[0],
                                       "platform": platform.platform(), "cpu_count": os.cpu_count(),
                                       "loadavg_before": os.getloadavg(), "started_at": time.time(),
                                       "infera": os.path.dirname(os.path.dirname(
                                           sys.modules["infera.router.kv_aware"].__file__))}}
    runs = a.runs or (2 if a.quick else 5)
    if "tokenize" in a.sections:
        report["tokenize"] = tokenize_section(runs)
    if "short" in a.sections:
        report["short"] = await short_section(runs * 4, 500 if a.quick else 2000)
    policy_kw = {"horizon": False} if a.no_horizon else {}
    if "fleet" in a.sections:
        report["fleet"] = await fleet_section(runs, 500 if a.quick else 2000)
    if "shared" in a.sections:
        report["shared"] = await shared_section(runs, a.quick, cold_kb=a.cold_kb, **policy_kw)
    if "rag" in a.sections:
        report["rag"] = await shared_section(runs, a.quick, build_rag, cold_kb=a.cold_kb, **policy_kw)
    if "zmq" in a.sections:
        report["zmq"] = zmq_section(max(1, runs // 2), a.zmq_rates, 2000 if a.quick else 10000)
    report["meta"]["loadavg_after"] = os.getloadavg()
    return report


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python bench/kv_path.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", nargs="+", default=["tokenize", "short", "fleet", "shared", "rag", "zmq"],
                   choices=["tokenize", "short", "fleet", "shared", "rag", "zmq"])
    p.add_argument("--runs", type=int, default=None, help="runs per figure [5; --quick 2]")
    p.add_argument("--zmq-rates", type=float, nargs="+", default=[2000.0, 20000.0])
    p.add_argument("--out", default=os.path.join(BENCH_DIR, "results", "kv_path.json"))
    p.add_argument("--quick", action="store_true", help="fewer requests and runs (smoke)")
    p.add_argument("--no-horizon", action="store_true", help="shared: tokenize whole prompts (KvAwarePolicy(horizon=False))")
    p.add_argument("--cold-kb", type=int, default=0,
                   help="shared, rag: stream this many KiB through the CPU caches before each timed step "
                        "(as the server's other work does; 2048 covers this machine's 1 MiB L2) [0: warm]")
    a = p.parse_args(argv)
    report = asyncio.run(run(a))
    print(render(report))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nresults: {a.out}")


if __name__ == "__main__":
    main()
