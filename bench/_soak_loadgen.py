"""Closed-loop streaming load for ``bench/soak.py``, in its own process (so its memory stays out of
the server's figures).

Protocol: one JSON object per line each way.

stdin:

    {"cmd": "start", "url": ".../v1/chat/completions", "concurrency": 200, "duration": 600,
     "bodies": [{...chat request...}, ...], "hang_s": 30, "max_tokens": 24}
    {"cmd": "tick"}      # counts since the previous tick (any time after start)
    {"cmd": "quit"}

stdout: ``{"ready": true}`` at start-up; ``{"started": <monotonic>}`` once the users run; one
``{"tick": <monotonic>, ...}`` per tick; ``{"done": true, ...}`` once every user has stopped
(``duration`` is over and the requests in flight ended, each bounded by ``hang_s``).

Each user sends one streamed request at a time, the body taken round-robin from ``bodies`` with
`` #<n>`` appended to its last message, so every prompt is new (the router's KV index keeps
seeing new blocks, and dropping old ones, for the whole run). Every request carries
``X-Infera-Request-Id: soak-<n>`` (the server echoes and forwards it; grep the logs for it).

A request fails when: the status is not 200 (``http``), an SSE ``data: {"error"…}`` event arrives
(``sse_error``), the stream ends without ``data: [DONE]`` (``no_done``), it ends with ``[DONE]``
but its usage counts fewer or more than ``max_tokens`` completion tokens although the request set
``ignore_eos`` (``short``: a silently truncated reply, e.g. an engine that aborted it with
finish_reason "abort"), the client raises (``transport``), or it is still running after ``hang_s``
(``hang``: the request is abandoned, so nothing waits forever). Each failure is reported with
its start and end (``time.monotonic()``: one clock for every process on the host, so the parent
can compare it with its kill times), the worker the server's error names when it names one
(``worker <id> failed mid-stream``, ``worker <id> unreachable: …``), whether any data event had
arrived, and the request id.

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

REQUEST_ID_HEADER = "X-Infera-Request-Id"
# The server's error messages name the worker: "worker 127.0.0.1:4321 failed mid-stream",
# "worker … stalled mid-stream: …", "worker … unreachable: …", "worker … replied with …".
_WORKER_RE = re.compile(r"worker (\S+) (?:failed|stalled|unreachable|replied|returned|timed)")
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_FINISH_REASON = re.compile(rb'"finish_reason"\s*:\s*"([^"]*)"')
_MAX_FAILURES_PER_TICK = 500  # a tick carries at most this many failure records (the rest are counted)


def worker_named(text: str) -> str | None:
    m = _WORKER_RE.search(text)
    return m.group(1).rstrip(":,") if m else None


def _pct(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


class Interval:
    """What happened since the last tick."""

    def __init__(self) -> None:
        self.ok = 0
        self.latencies: list[float] = []
        self.ttfts: list[float] = []
        self.failures: list[dict[str, Any]] = []
        self.failures_dropped = 0

    def fail(self, record: dict[str, Any]) -> None:
        if len(self.failures) < _MAX_FAILURES_PER_TICK:
            self.failures.append(record)
        else:
            self.failures_dropped += 1

    def to_json(self, now: float, inflight: int) -> dict[str, Any]:
        lat = sorted(self.latencies)
        ttft = sorted(self.ttfts)
        ms = lambda v: None if v is None else round(v * 1000.0, 2)  # noqa: E731
        return {"tick": now, "ok": self.ok, "failures": self.failures, "failures_dropped": self.failures_dropped,
                "inflight": inflight, "lat_p50_ms": ms(_pct(lat, 50)), "lat_p99_ms": ms(_pct(lat, 99)),
                "lat_max_ms": ms(lat[-1] if lat else None), "ttft_p50_ms": ms(_pct(ttft, 50)),
                "ttft_p99_ms": ms(_pct(ttft, 99))}


class Soak:
    def __init__(self, job: dict[str, Any], out) -> None:
        self.url: str = job["url"]
        self.concurrency = int(job["concurrency"])
        self.duration = float(job["duration"])
        self.hang_s = float(job.get("hang_s", 30.0))
        self.max_tokens = job.get("max_tokens")
        self.bodies: list[dict[str, Any]] = job["bodies"]
        self.out = out
        self.interval = Interval()
        self.inflight = 0
        self.sent = 0
        self.totals: dict[str, int] = {"ok": 0, "failed": 0}
        self.latencies: list[float] = []  # whole run, for the summary
        self.ttfts: list[float] = []

    def emit(self, obj: dict[str, Any]) -> None:
        self.out.write(json.dumps(obj) + "\n")
        self.out.flush()

    def tick(self) -> None:
        interval, self.interval = self.interval, Interval()
        self.emit(interval.to_json(time.monotonic(), self.inflight))

    def _body(self, n: int) -> bytes:
        body = dict(self.bodies[n % len(self.bodies)])
        messages = [dict(m) for m in body["messages"]]
        messages[-1]["content"] = f"{messages[-1]['content']} #{n}"
        body["messages"] = messages
        return json.dumps(body, separators=(",", ":")).encode()

    async def run(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60)
        # The hang bound is enforced by wait_for around each request; this is only a backstop.
        timeout = aiohttp.ClientTimeout(total=self.hang_s + 10, sock_connect=10)
        start = time.monotonic()
        end = start + self.duration
        self.emit({"started": start})
        async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                         skip_auto_headers=("User-Agent",)) as session:
            async def user() -> None:
                while time.monotonic() < end:
                    n = self.sent
                    self.sent += 1
                    await self.one(session, n)

            await asyncio.gather(*(user() for _ in range(self.concurrency)))
        lat, ttft = sorted(self.latencies), sorted(self.ttfts)
        ms = lambda v: None if v is None else round(v * 1000.0, 2)  # noqa: E731
        self.emit({"done": True, "sent": self.sent, **self.totals, "elapsed_s": round(time.monotonic() - start, 3),
                   "lat_p50_ms": ms(_pct(lat, 50)), "lat_p90_ms": ms(_pct(lat, 90)), "lat_p99_ms": ms(_pct(lat, 99)),
                   "lat_max_ms": ms(lat[-1] if lat else None), "ttft_p50_ms": ms(_pct(ttft, 50)),
                   "ttft_p99_ms": ms(_pct(ttft, 99))})

    async def one(self, session: aiohttp.ClientSession, n: int) -> None:
        rid = f"soak-{n}"
        state: dict[str, Any] = {"events": 0, "first": None}
        start = time.monotonic()
        self.inflight += 1
        try:
            failure = await asyncio.wait_for(self._stream(session, self._body(n), rid, start, state), self.hang_s)
        except asyncio.TimeoutError:  # only wait_for's own: _stream turns every client error into a record
            failure = {"kind": "hang", "msg": f"still running after {self.hang_s:g}s"}
        finally:
            self.inflight -= 1
        end = time.monotonic()
        if failure is None:
            return
        failure.update(start=round(start, 4), end=round(end, 4), rid=rid, events=state["events"],
                       first_byte=state["first"] is not None)
        failure.setdefault("worker", worker_named(failure.get("msg", "")))
        self.totals["failed"] += 1
        self.interval.fail(failure)
        if failure["kind"] != "hang":
            await asyncio.sleep(0.01)  # a refused connection fails at once: don't spin on it

    async def _stream(self, session: aiohttp.ClientSession, body: bytes, rid: str, start: float,
                      state: dict[str, Any]) -> dict[str, Any] | None:
        """None when the stream completed; else a failure record (kind, msg, status)."""
        try:
            async with session.post(self.url, data=body, headers={"Content-Type": "application/json",
                                                                   REQUEST_ID_HEADER: rid}) as resp:
                if resp.status != 200:
                    text = (await resp.read())[:300].decode("utf-8", "replace")
                    return {"kind": "http", "status": resp.status, "msg": text}
                done = False
                completion_tokens = finish_reason = None
                async for line in resp.content:
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        done = True
                        continue
                    if payload.startswith(b'{"error"'):
                        return {"kind": "sse_error", "msg": payload[:300].decode("utf-8", "replace")}
                    if state["first"] is None:
                        state["first"] = time.monotonic()
                    state["events"] += 1
                    if b'"completion_tokens"' in payload:
                        m = _COMPLETION_TOKENS.search(payload)
                        if m:
                            completion_tokens = int(m.group(1))
                    if b'"finish_reason":"' in payload or b'"finish_reason": "' in payload:
                        m = _FINISH_REASON.search(payload)
                        if m:
                            finish_reason = m.group(1).decode("utf-8", "replace")
                if not done or state["first"] is None:
                    return {"kind": "no_done", "msg": f"stream ended without data: [DONE] ({state['events']} events)"}
                if self.max_tokens is not None and completion_tokens != self.max_tokens:
                    return {"kind": "short", "msg": f"[DONE] after {completion_tokens} completion tokens of "
                                                    f"{self.max_tokens} (finish_reason {finish_reason})"}
        except Exception as exc:  # refused, reset, payload errors: all count
            return {"kind": "transport", "msg": f"{type(exc).__name__}: {exc}"[:300]}
        now = time.monotonic()
        self.interval.ok += 1
        self.totals["ok"] += 1
        self.interval.latencies.append(now - start)
        self.interval.ttfts.append(state["first"] - start)
        self.latencies.append(now - start)
        self.ttfts.append(state["first"] - start)
        return None


async def serve(out) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=64 * 1024 * 1024)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    out.write(json.dumps({"ready": True, "uvloop": uvloop is not None}) + "\n")
    out.flush()
    soak: Soak | None = None
    task: asyncio.Task | None = None
    while True:
        line = await reader.readline()
        if not line:
            break
        if not line.strip():
            continue
        msg = json.loads(line)
        cmd = msg.get("cmd")
        if cmd == "quit":
            break
        if cmd == "start" and soak is None:
            soak = Soak(msg, out)
            task = asyncio.create_task(soak.run())
            task.add_done_callback(lambda t: t.cancelled() or t.exception() is None
                                   or soak.emit({"fatal": f"{type(t.exception()).__name__}: {t.exception()}"}))
        elif cmd == "tick" and soak is not None:
            soak.tick()
    if task is not None and not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def main() -> int:
    if uvloop is not None:
        uvloop.install()
    try:
        asyncio.run(serve(sys.stdout))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
