"""One publisher process of ``bench/fleet_scale.py``: many synthetic vLLM engines' KV events on
real ZMQ sockets, as vLLM 0.32 serves them.

Per engine: a PUB socket (``[topic, seq (8-byte BE), payload]``, seq from 0, +1 per batch) and a
replay ROUTER (a DEALER's ``[b"", start_seq]`` gets every buffered batch with seq >= start_seq, then
the end marker ``[b"", b"", -1, b""]``), both bound on loopback at ephemeral ports; the events are
``bench/_fleet_workload.py``'s, encoded at start-up. One thread, no asyncio: a poll loop serves the
replay sockets and the commands while it sends batches paced to the rate asked, round-robin over
the engines, each re-stamped with the time of its send (the server's delay = apply − that).

Commands, one JSON line each on stdin, one JSON line answered on stdout:

* ``{"cmd": "restart", "engines": [...]}``: those engines start over as freshly started vLLM
  engines (empty pool, seq 0, empty replay buffer): a new server sees each from its first batch;
* ``{"cmd": "warm", "engines": [...], "rate": R}``: their first period (filling the pool), at most R
  block events/s; answers when all is sent;
* ``{"cmd": "run", "engines": [...], "rate": R, "duration": D}``: their steady state (the periodic
  batches, in a loop) at R block events/s for D seconds; answers what was sent;
* ``{"cmd": "quit"}``.

Started by ``fleet_scale.py``: ``--count``, ``--procs``, ``--index`` (this process hosts engines
``index, index + procs, ...`` below ``count``), the workload's ``--seed``,
``--pool``, ``--block-size``, ``--sharing``. The first line out is ``{"ready": ..., "engines":
{id: [publisher endpoint, replay endpoint]}}``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import deque

import zmq

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
for p in (REPO, BENCH_DIR):
    if p not in sys.path:
        sys.path.insert(0, p)

from _fleet_workload import Catalog, engine_events, stamp  # noqa: E402

TOPIC = b"kv-events"  # what infera's launchers configure (and the server subscribes to)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
REPLAY_BUFFER = 1000  # batches kept for replay per engine (vLLM's buffer_steps is 10000)
SNDHWM = 100_000  # vLLM's default hwm
SEND_CHUNK = 256  # batches sent between two polls of the replay sockets and the commands


class Engine:
    __slots__ = ("id", "pub", "rep", "warm", "loop", "seq", "pos", "buffer")

    def __init__(self, eid: int, ctx: zmq.Context, host: str, events) -> None:
        self.id = eid
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, SNDHWM)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"tcp://{host}:*")
        self.rep = ctx.socket(zmq.ROUTER)
        self.rep.setsockopt(zmq.LINGER, 0)
        self.rep.setsockopt(zmq.SNDHWM, SNDHWM)
        self.rep.bind(f"tcp://{host}:*")
        self.warm, self.loop = events.warm, events.loop
        self.restart()

    def restart(self) -> None:
        self.seq = 0
        self.pos = 0  # next batch: warm[pos] while pos < len(warm), then loop[(pos - len(warm)) % len(loop)]
        self.buffer: deque = deque(maxlen=REPLAY_BUFFER)  # (seq, template, ts)

    @property
    def warm_left(self) -> bool:
        return self.pos < len(self.warm)

    def send_next(self) -> int:
        """Publish the next batch; returns its block events."""
        nw = len(self.warm)
        template, n = self.warm[self.pos] if self.pos < nw else self.loop[(self.pos - nw) % len(self.loop)]
        self.pos += 1
        ts = time.time()
        seq = self.seq
        self.seq += 1
        self.pub.send_multipart((TOPIC, seq.to_bytes(8, "big"), stamp(template, ts)), copy=False)
        self.buffer.append((seq, template, ts))
        return n

    def serve_replay(self) -> None:
        while True:
            try:
                frames = self.rep.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) < 2 or len(frames[-1]) != 8:
                continue
            envelope = frames[:-1]
            start = int.from_bytes(frames[-1], "big")
            try:
                for seq, template, ts in list(self.buffer):
                    if seq >= start:
                        self.rep.send_multipart([*envelope, TOPIC, seq.to_bytes(8, "big"), stamp(template, ts)])
                self.rep.send_multipart([*envelope, b"", END_SEQ, b""])
            except zmq.ZMQError:
                pass  # the requester went away


class Publisher:
    def __init__(self, engines: dict[int, Engine]) -> None:
        self.engines = engines
        self.poller = zmq.Poller()
        self.poller.register(sys.stdin.fileno(), zmq.POLLIN)
        self.by_socket = {}
        for e in engines.values():
            self.poller.register(e.rep, zmq.POLLIN)
            self.by_socket[e.rep] = e
        self.stdin = os.fdopen(sys.stdin.fileno(), "rb", buffering=0)
        self._line = b""
        self.commands: deque = deque()

    def poll(self, timeout_ms: float) -> None:
        for sock, _ in self.poller.poll(max(0, int(timeout_ms))):
            if isinstance(sock, int):
                chunk = os.read(sock, 65536)
                if not chunk:
                    self.commands.append({"cmd": "quit"})
                    continue
                self._line += chunk
                while b"\n" in self._line:
                    line, self._line = self._line.split(b"\n", 1)
                    if line.strip():
                        self.commands.append(json.loads(line))
            else:
                self.by_socket[sock].serve_replay()

    def pace(self, engines: list[Engine], rate: float, until: float | None) -> dict:
        """Send round-robin over ``engines`` at ``rate`` block events/s: their warm-up when ``until`` is
        None (until all is sent), else their steady state until the monotonic time ``until``."""
        t0 = time.perf_counter()
        sent = batches = 0
        active = [e for e in engines if until is not None or e.warm_left]
        i = 0
        max_behind = 0.0
        while active:
            now = time.perf_counter()
            if until is not None and now >= until:
                break
            allowed = rate * (now - t0)
            if sent >= allowed:
                self.poll(max(1.0, 1000 * (sent - allowed) / rate))  # never a busy wait: the server shares the cores
                continue
            max_behind = max(max_behind, (allowed - sent) / rate)
            for _ in range(SEND_CHUNK):
                if sent >= allowed or not active:
                    break
                i %= len(active)
                e = active[i]
                sent += e.send_next()
                batches += 1
                if until is None and not e.warm_left:
                    active.pop(i)
                else:
                    i += 1
            self.poll(0)
        wall = time.perf_counter() - t0
        return {"block_events": sent, "batches": batches, "wall_s": wall, "max_behind_s": max_behind,
                "last_seq": {e.id: e.seq - 1 for e in engines}}

    def serve(self) -> None:
        while True:
            if not self.commands:
                self.poll(200)
                continue
            cmd = self.commands.popleft()
            what = cmd.get("cmd")
            if what == "quit":
                return
            engines = [self.engines[i] for i in cmd.get("engines", ()) if i in self.engines]
            if what == "restart":
                for e in engines:
                    e.restart()
                out: dict = {"ok": True}
            elif what == "warm":
                out = self.pace(engines, float(cmd["rate"]), None)
            elif what == "run":
                out = self.pace(engines, float(cmd["rate"]), time.perf_counter() + float(cmd["duration"]))
            else:
                out = {"error": f"unknown command {what!r}"}
            sys.stdout.write(json.dumps(out) + "\n")
            sys.stdout.flush()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, required=True, help="engines in the whole fleet")
    ap.add_argument("--procs", type=int, default=1, help="publisher processes")
    ap.add_argument("--index", type=int, default=0, help="this process: it hosts the engines e with e %% procs == index")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--pool", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--sharing", type=float, default=0.0)
    ap.add_argument("--host", default="127.0.0.1")
    args = ap.parse_args()
    ids = range(args.index, args.count, args.procs)
    t0 = time.perf_counter()
    ctx = zmq.Context()
    ctx.setsockopt(zmq.MAX_SOCKETS, 2 * len(ids) + 64)
    catalog = Catalog(args.seed, args.block_size, args.pool)
    engines = {}
    for eid in ids:
        events = engine_events(eid, args.seed, args.block_size, args.pool, args.sharing, catalog)
        engines[eid] = Engine(eid, ctx, args.host, events)
    info = {eid: [e.pub.getsockopt_string(zmq.LAST_ENDPOINT), e.rep.getsockopt_string(zmq.LAST_ENDPOINT)]
            for eid, e in engines.items()}
    warm_events = sum(n for e in engines.values() for _, n in e.warm)
    loop_events = sum(n for e in engines.values() for _, n in e.loop)
    loop_bytes = sum(len(p) for e in engines.values() for p, _ in e.loop)
    sys.stdout.write(json.dumps({"ready": True, "engines": info, "setup_s": time.perf_counter() - t0,
                                 "warm_block_events": warm_events, "loop_block_events": loop_events,
                                 "loop_payload_bytes": loop_bytes}) + "\n")
    sys.stdout.flush()
    try:
        Publisher(engines).serve()
    finally:
        ctx.destroy(linger=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
