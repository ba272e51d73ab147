"""Closed-loop HTTP load generator for ``bench/router_overhead.py`` (runs in its own process).

Protocol: one JSON object per line on stdin, one JSON result per line on stdout.

    {"cmd": "run", "urls": [...], "concurrency": 16, "stream": false, "requests": 3000,
     "duration": 4.0, "warmup": 1.0, "bodies": ["{...json...}", ...]}
    {"cmd": "quit"}

Optional job keys: ``warmup_requests`` (the warm-up also ends once that many requests were issued,
so a job that must never send a body twice can size ``bodies`` as warm-up + ``requests``) and
``request_timeout`` (seconds, default 60).

For each ``run``: ``concurrency`` coroutines each send one request at a time (closed loop), the
target URL taken round-robin from ``urls`` (several worker URLs when hitting workers directly;
the one router URL otherwise). The first ``warmup`` seconds are discarded; the measured window
then issues requests until ``requests`` have been issued or ``duration`` seconds have passed,
whichever comes first, and waits for them. Reported per run: completed requests, errors (with a
few samples), req/s, latency percentiles and, for streams, TTFT (first ``data:`` event) and ITL
(gaps between consecutive ``data:`` events, ``[DONE]`` excluded), and completion tokens from the
replies' ``usage`` where present (streams need ``stream_options.include_usage``). Times in the
result are ms.

Standalone: stdlib + aiohttp (+ uvloop when available); it never imports ``infera``.
"""
from __future__ import annotations

import asyncio
import json
import math
import re
import sys
import time
from typing import Any

import aiohttp

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None

_HEADERS = {"Content-Type": "application/json"}
_MAX_ERROR_SAMPLES = 5
# Matched only in payloads that contain the key, so the hot path stays a substring test.
_COMPLETION_TOKENS_KEY = b'"completion_tokens"'
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default) of an already sorted list; None when empty."""
    n = len(sorted_values)
    if n == 0:
        return None
    if n == 1:
        return sorted_values[0]
    pos = (n - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


class _Stats:
    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.ttfts: list[float] = []
        self.itls: list[float] = []
        self.data_events = 0
        self.completion_tokens = 0
        self.replies_with_usage = 0
        self.errors = 0
        self.error_samples: list[str] = []
        self.last_done = 0.0

    def error(self, what: str) -> None:
        self.errors += 1
        if len(self.error_samples) < _MAX_ERROR_SAMPLES:
            self.error_samples.append(what[:300])

    def count_usage(self, completion_tokens: int | None) -> None:
        if completion_tokens is not None:
            self.completion_tokens += completion_tokens
            self.replies_with_usage += 1


def _completion_tokens(payload: bytes) -> int | None:
    """``usage.completion_tokens`` of a reply or SSE chunk; None when it carries no usage."""
    if _COMPLETION_TOKENS_KEY not in payload:
        return None
    m = _COMPLETION_TOKENS.search(payload)
    return int(m.group(1)) if m else None


async def _one_request(session: aiohttp.ClientSession, url: str, body: bytes, stream: bool, stats: _Stats,
                       headers: dict[str, str] = _HEADERS) -> None:
    clock = time.perf_counter
    start = clock()
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            if resp.status != 200:
                text = (await resp.read())[:200].decode("utf-8", "replace")
                stats.error(f"HTTP {resp.status} from {url}: {text}")
                return
            if not stream:
                payload = await resp.read()
                if b'"choices"' not in payload:
                    stats.error(f"no choices in the reply from {url}: {payload[:200]!r}")
                    return
                end = clock()
                stats.latencies.append(end - start)
                stats.count_usage(_completion_tokens(payload))
                stats.last_done = end
                return
            first: float | None = None
            prev = 0.0
            done = False
            itls: list[float] = []
            events = 0
            completion_tokens: int | None = None  # the last usage seen (continuous usage repeats it)
            async for line in resp.content:  # one SSE line at a time
                if not line.startswith(b"data:"):
                    continue
                now = clock()
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    continue
                if payload.startswith(b'{"error"'):
                    stats.error(f"SSE error event from {url}: {payload[:200].decode('utf-8', 'replace')}")
                    return
                events += 1
                found = _completion_tokens(payload)
                if found is not None:
                    completion_tokens = found
                if first is None:
                    first = now
                else:
                    itls.append(now - prev)
                prev = now
            end = clock()
            if not done or first is None:
                stats.error(f"stream from {url} ended without data: [DONE] ({events} data events)")
                return
            stats.latencies.append(end - start)
            stats.ttfts.append(first - start)
            stats.itls.extend(itls)
            stats.data_events += events
            stats.count_usage(completion_tokens)
            stats.last_done = end
    except Exception as exc:  # transport errors, timeouts, malformed streams: all count as errors
        stats.error(f"{type(exc).__name__} from {url}: {exc}")
        await asyncio.sleep(0.001)  # don't spin if the target is gone


async def run_job(job: dict[str, Any]) -> dict[str, Any]:
    urls: list[str] = job["urls"]
    concurrency = int(job["concurrency"])
    stream = bool(job["stream"])
    max_requests = int(job["requests"])
    duration = float(job["duration"])
    warmup = float(job["warmup"])
    warmup_requests = job.get("warmup_requests")
    warmup_requests = math.inf if warmup_requests is None else int(warmup_requests)
    bodies = [b.encode() for b in job["bodies"]]
    headers = {**_HEADERS, **job.get("headers", {})}  # e.g. an API key
    clock = time.perf_counter

    warm = _Stats()
    measured = _Stats()
    state = {"phase": "warmup", "issued": 0, "rr": 0, "measure_start": 0.0, "measure_deadline": 0.0}

    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60, force_close=False)
    timeout = aiohttp.ClientTimeout(total=float(job.get("request_timeout", 60.0)))
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, skip_auto_headers=("User-Agent",)) as session:
        warm_deadline = clock() + warmup

        async def user() -> None:
            while True:
                now = clock()
                if state["phase"] == "warmup" and (now >= warm_deadline or state["rr"] >= warmup_requests):
                    # The first user to notice opens the measured window for everyone.
                    state["phase"] = "measure"
                    state["measure_start"] = now
                    state["measure_deadline"] = now + duration
                if state["phase"] == "measure":
                    if state["issued"] >= max_requests or now >= state["measure_deadline"]:
                        return
                    state["issued"] += 1
                    stats = measured
                else:
                    stats = warm
                i = state["rr"]
                state["rr"] = i + 1
                await _one_request(session, urls[i % len(urls)], bodies[i % len(bodies)], stream, stats, headers)

        await asyncio.gather(*(user() for _ in range(concurrency)))

    lat = sorted(measured.latencies)
    ttft = sorted(measured.ttfts)
    itl = sorted(measured.itls)
    completed = len(lat)
    start = state["measure_start"]
    elapsed = (measured.last_done - start) if completed else (clock() - start if start else 0.0)
    ms = lambda v: None if v is None else round(v * 1000.0, 4)  # noqa: E731
    return {
        "concurrency": concurrency,
        "stream": stream,
        "issued": state["issued"],
        "sent": state["rr"],  # warm-up included: bodies[i % len(bodies)] went out for i < sent
        "completed": completed,
        "errors": measured.errors + warm.errors,
        "errors_measured": measured.errors,
        "errors_warmup": warm.errors,
        "error_samples": (measured.error_samples + warm.error_samples)[:_MAX_ERROR_SAMPLES],
        "warmup_requests": len(warm.latencies),
        "elapsed_s": round(elapsed, 4),
        "rps": round(completed / elapsed, 2) if completed and elapsed > 0 else 0.0,
        "lat_mean_ms": ms(sum(lat) / completed) if completed else None,
        "lat_p50_ms": ms(percentile(lat, 50)),
        "lat_p90_ms": ms(percentile(lat, 90)),
        "lat_p99_ms": ms(percentile(lat, 99)),
        "lat_max_ms": ms(lat[-1] if lat else None),
        "ttft_p50_ms": ms(percentile(ttft, 50)),
        "ttft_p90_ms": ms(percentile(ttft, 90)),
        "ttft_p99_ms": ms(percentile(ttft, 99)),
        "itl_p50_ms": ms(percentile(itl, 50)),
        "itl_p90_ms": ms(percentile(itl, 90)),
        "itl_p99_ms": ms(percentile(itl, 99)),
        "completion_tokens": measured.completion_tokens,
        "replies_with_usage": measured.replies_with_usage,
        "out_tok_s": (round(measured.completion_tokens / elapsed, 2)
                      if measured.replies_with_usage and elapsed > 0 else None),
        "data_events_per_stream": round(measured.data_events / completed, 2) if stream and completed else None,
    }


def main() -> int:
    loop = uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    out = sys.stdout
    out.write(json.dumps({"ready": True, "uvloop": uvloop is not None}) + "\n")
    out.flush()
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            job = json.loads(line)
            if job.get("cmd") == "quit":
                break
            try:
                result = loop.run_until_complete(run_job(job))
            except Exception as exc:  # report, keep serving
                result = {"fatal": f"{type(exc).__name__}: {exc}"}
            out.write(json.dumps(result) + "\n")
            out.flush()
    except KeyboardInterrupt:
        pass
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
