#!/usr/bin/env python3
"""Does ``python -m infera.server --workers N`` scale? One server process against N, same fleet,
same load, interleaved, with the router's cores kept apart from the load where the machine allows.

Starts, as subprocesses: an embedded etcd, ``--fleet`` workers (``--worker fake``:
``bench/_fake_worker.py``, which answers at once and sends no KV events, so the router's own work
is what is measured; ``sim``: ``python -m infera.engine.sim`` at ``--speedup 1000``, whose KV events
every server process reads), one
``python -m infera.server --workers N`` per N in ``--server-workers`` (each on its own port, all
watching the same fleet), and the load generator ``bench/_loadgen.py`` (closed loops, its own
process). Each window sends ``--concurrency`` closed loops of chat requests to one of the servers;
every request has a unique question after one of a few shared system prompts (a repeated whole
prompt would be a router cache hit, which no real workload is).

Cores (``--pin``, ``os.sched_setaffinity`` on every thread, re-applied before every window):
``own``: the server's process ``i`` on core ``i``, the load generator, the workers and etcd on the
cores left; ``stacked``: every server process on the first core, the load on the others;
``shared``: nothing pinned. ``auto`` (default) is ``own`` where the machine has more cores than
server processes, else ``stacked``: on a 2-core machine, 1 process is ``own`` (server on core 0,
load on core 1) and 2 are ``stacked`` (both on core 0, load on core 1), so the load never shares
the router's core. Every window reports the server's **CPU per request**: the CPU time (all
threads of the supervisor and its children, from ``/proc/<pid>/task/*/schedstat``, ns) spent in
the window divided by the requests served. N processes that each cost what one process costs per
request serve N times as many requests on N cores: ``capacity = N / CPU per request``. The
measured throughput shows the scaling itself only where every process had a core of its own
(``own``, on a machine with more than N cores).

    python bench/server_workers.py                       # 1 vs 2 processes, kv-aware, 3 runs (~1 min)
    python bench/server_workers.py --replica-sync off    # without the processes' replica sync
    python bench/server_workers.py --worker sim          # with engines' KV events
    python bench/server_workers.py --quick               # smoke run (~20 s)

Prints a table and a summary; everything goes to ``--out`` as JSON. Exit status: 0 when no
request failed, 1 otherwise, 2 when the fleet could not start.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import aiohttp

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from infera.discovery.embedded_etcd import EmbeddedEtcd  # noqa: E402
from _main import run_bench  # noqa: E402
from infera.runtime import set_pdeathsig  # noqa: E402

DEFAULT_OUT = os.path.join(BENCH_DIR, "results", "server_workers.json")
MODEL = "bench-fake"
PREFIX = "/infera/bench-server-workers/"
WORDS = ("router", "engine", "cache", "prefix", "token", "block", "request", "replica", "worker", "fleet",
         "stream", "decode", "prefill", "latency", "throughput", "event", "index", "hash", "policy", "load")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python bench/server_workers.py", allow_abbrev=False,
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--server-workers", type=int, nargs="+", default=[1, 2], help="--workers of each server")
    p.add_argument("--router-policy", choices=("kv-aware", "round-robin"), default="kv-aware")
    p.add_argument("--replica-sync", choices=("default", "local", "off"), default="default",
                   help="--replica-sync of the servers with several processes (default: the server's, local)")
    p.add_argument("--fleet", type=int, default=2, help="workers behind the servers")
    p.add_argument("--worker", choices=("fake", "sim"), default="fake",
                   help="fake: bench/_fake_worker.py, answers at once, no KV events; sim: python -m infera.engine.sim "
                        "at --speedup 1000, with KV events (which every server process reads)")
    p.add_argument("--concurrency", type=int, default=32, help="closed loops of the load generator")
    p.add_argument("--runs", type=int, default=None, help="windows per server [3; --quick: 1]")
    p.add_argument("--duration", type=float, default=None, help="seconds per window [5; --quick: 2]")
    p.add_argument("--warmup", type=float, default=None, help="warm-up seconds before each window [1; --quick: 0.5]")
    p.add_argument("--system-words", type=int, default=400, help="words of each shared system prompt")
    p.add_argument("--groups", type=int, default=16, help="distinct system prompts")
    p.add_argument("--pin", choices=("auto", "own", "stacked", "shared"), default="auto",
                   help="own: server process i on core i, the load on the cores left; stacked: every server process "
                        "on the first core, the load on the others; shared: nothing pinned; auto: own where the "
                        "machine has more cores than processes, else stacked")
    p.add_argument("--ready-timeout", type=float, default=60.0)
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON results file")
    p.add_argument("--quick", action="store_true", help="small counts for a smoke run")
    return p


def resolve_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.runs = args.runs if args.runs is not None else (1 if args.quick else 3)
    args.duration = args.duration if args.duration is not None else (2.0 if args.quick else 5.0)
    args.warmup = args.warmup if args.warmup is not None else (0.5 if args.quick else 1.0)
    if min(args.server_workers) < 1 or args.runs < 1 or args.fleet < 1 or args.concurrency < 1:
        raise SystemExit("--server-workers, --runs, --fleet and --concurrency must be >= 1")
    args.server_workers = sorted(set(args.server_workers))
    return args


# ------------------------------------------------------------------------------------- processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    def __init__(self, name: str, cmd: list[str], log_dir: str) -> None:
        self.name, self.cmd = name, cmd
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self, **kwargs: Any) -> None:
        log = open(self.log_path, "wb")
        kwargs.setdefault("stdout", log)
        # Own session: a Ctrl-C reaches only us; PDEATHSIG: nothing outlives the benchmark.
        self.proc = await asyncio.create_subprocess_exec(
            *self.cmd, cwd=REPO, stderr=log, start_new_session=True, preexec_fn=set_pdeathsig,
            stdin=kwargs.pop("stdin", subprocess.DEVNULL), **kwargs)
        log.close()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    async def stop(self, grace: float = 20.0) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        self.proc.send_signal(signal.SIGTERM)  # a --workers N server forwards it and drains its children
        try:
            await asyncio.wait_for(self.proc.wait(), grace)
        except asyncio.TimeoutError:
            self.proc.kill()
            await self.proc.wait()

    def log_tail(self, n: int = 1500) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""


def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return out


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = children_of(todo.pop())
        out += kids
        todo += kids
    return out


def cpu_ns(pids: list[int]) -> int:
    """CPU time so far of every thread of ``pids`` (ns)."""
    total = 0
    for pid in pids:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                pass
    return total


def arrangement(mode: str, n: int, cores: list[int]) -> tuple[str, list[int], list[int]]:
    """(how, the core of each server process, the load's cores) for ``n`` server processes."""
    if mode == "auto":
        mode = "own" if len(cores) > n else "stacked" if len(cores) >= 2 else "shared"
    if mode == "own" and len(cores) > n:
        return "own", cores[:n], cores[n:]
    if mode in ("own", "stacked") and len(cores) >= 2:
        return "stacked", [cores[0]] * n, cores[1:]
    return "shared", list(cores) * n, list(cores)


def pin(pids: list[int], cpus: list[int]) -> None:
    """Every thread of ``pids`` on ``cpus`` (threads keep the mask they had: set each)."""
    for pid in pids:
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cpus)
            except OSError:
                pass


# ------------------------------------------------------------------------------------- workload
def bodies(args: argparse.Namespace, n: int, seed: int) -> list[str]:
    """``n`` unique chat bodies: one of ``--groups`` shared system prompts + a unique question."""
    rng = random.Random(seed)
    systems = [" ".join(random.Random(g).choice(WORDS) for _ in range(args.system_words)) for g in range(args.groups)]
    out = []
    for i in range(n):
        question = f"question {seed}-{i}: " + " ".join(rng.choice(WORDS) for _ in range(12))
        out.append(json.dumps({"model": MODEL, "max_tokens": 16, "messages": [
            {"role": "system", "content": systems[i % args.groups]}, {"role": "user", "content": question}]}))
    return out


class LoadGen:
    def __init__(self, proc: Proc) -> None:
        self.proc = proc

    async def run(self, job: dict) -> dict:
        p = self.proc.proc
        assert p is not None and p.stdin is not None and p.stdout is not None
        p.stdin.write((json.dumps(job) + "\n").encode())
        await p.stdin.drain()
        line = await p.stdout.readline()
        if not line:
            raise RuntimeError("the load generator exited: " + self.proc.log_tail())
        return json.loads(line)


async def wait_ready(server: Proc, port: int, processes: int, fleet: int, timeout: float) -> list[int]:
    """Until every process of the server answers /health with the whole fleet active; returns the
    pids serving (the children, or the server itself)."""
    deadline = time.monotonic() + timeout
    seen: dict[int, int] = {}
    while time.monotonic() < deadline:
        assert server.proc is not None
        if server.proc.returncode is not None:
            raise RuntimeError(f"{server.name} exited: {server.log_tail()}")
        serving = children_of(server.pid) if processes > 1 else [server.pid]
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
                for _ in range(4 * processes):
                    async with s.get(f"http://127.0.0.1:{port}/health") as r:
                        body = await r.json()
                    seen[body.get("process", {}).get("pid", server.pid)] = body["active_workers"]
        except (aiohttp.ClientError, OSError, KeyError, ValueError):
            pass
        if len(serving) == processes and all(seen.get(p, 0) >= fleet for p in serving):
            return serving
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{server.name}: not every process saw the fleet in {timeout:.0f}s")


# ------------------------------------------------------------------------------------- benchmark
async def run(args: argparse.Namespace) -> int:
    import tempfile

    log_dir = tempfile.mkdtemp(prefix="bench-server-workers-")
    cores = sorted(os.sched_getaffinity(0))
    py = sys.executable
    etcd = EmbeddedEtcd()
    fleet: list[Proc] = []
    servers: dict[int, tuple[Proc, int]] = {}
    loadgen = Proc("loadgen", [py, os.path.join(BENCH_DIR, "_loadgen.py")], log_dir)
    try:
        try:
            await etcd.start()
            for i in range(args.fleet):
                if args.worker == "fake":
                    cmd = [py, os.path.join(BENCH_DIR, "_fake_worker.py"), "--etcd-endpoint", etcd.url,
                           "--etcd-prefix", PREFIX, "--model", MODEL, "--port", str(free_port())]
                else:
                    cmd = [py, "-m", "infera.engine.sim", "--etcd-endpoint", etcd.url, "--etcd-prefix", PREFIX,
                           "--model", MODEL, "--port", str(free_port()), "--host", "127.0.0.1", "--speedup", "1000",
                           "--max-num-seqs", "256"]
                w = Proc(f"worker{i}", cmd, log_dir)
                await w.start()
                fleet.append(w)
            for n in args.server_workers:
                port = free_port()
                server = Proc(f"server-w{n}", [py, "-m", "infera.server", "--host", "127.0.0.1", "--port", str(port),
                                               "--etcd-endpoint", etcd.url, "--etcd-prefix", PREFIX, "--workers", str(n),
                                               "--router-policy", args.router_policy, "--log-level", "warning",
                                               *(["--replica-sync", args.replica_sync]
                                                 if n > 1 and args.replica_sync != "default" else [])],
                              log_dir)
                await server.start()
                servers[n] = (server, port)
            await loadgen.start(stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
            assert loadgen.proc is not None and loadgen.proc.stdout is not None
            hello = await asyncio.wait_for(loadgen.proc.stdout.readline(), 30)
            if not hello:
                raise RuntimeError("load generator did not start: " + loadgen.log_tail())
            serving = {n: await wait_ready(p, port, n, args.fleet, args.ready_timeout) for n, (p, port) in servers.items()}
        except Exception as exc:  # noqa: BLE001
            print(f"fleet failed to start: {exc}", file=sys.stderr)
            return 2
        gen = LoadGen(loadgen)
        client_pids = [loadgen.pid, *(p for w in fleet for p in (w.pid, *descendants(w.pid)))] + (
            [etcd.pid] if etcd.pid else [])  # a sim launcher's engine is its child
        print(f"cores {cores}; servers: " + ", ".join(f"--workers {n} on :{port}" for n, (_, port) in servers.items()))
        windows: list[dict] = []
        order = list(args.server_workers)
        for run_i in range(args.runs):
            for n in (order if run_i % 2 == 0 else order[::-1]):  # interleaved: drift hits both alike
                server, port = servers[n]
                procs = serving[n]
                how, per_process, client_cpus = arrangement(args.pin, n, cores)
                server_cpus = sorted(set(per_process))
                shared = how == "shared"
                if not shared:
                    pin([server.pid], server_cpus)  # the supervisor (idle but for the sync proxy)
                    for pid, cpu in zip(procs, per_process):
                        pin([pid], [cpu])
                    pin(client_pids, client_cpus)
                url = f"http://127.0.0.1:{port}/v1/chat/completions"
                seed = 1000 * run_i + n
                job = {"cmd": "run", "urls": [url], "concurrency": args.concurrency, "stream": False,
                       "requests": 10 ** 9, "duration": args.duration, "warmup": 0.0,
                       "bodies": bodies(args, int(args.concurrency * 50 * args.duration) + 2000, seed)}
                await gen.run({**job, "duration": args.warmup, "bodies": bodies(args, 4000, -seed)})  # warm-up
                all_pids = [server.pid, *procs] if n > 1 else [server.pid]
                cpu0, t0 = cpu_ns(all_pids), time.perf_counter()
                client0 = cpu_ns(client_pids)
                result = await gen.run(job)
                wall = time.perf_counter() - t0
                cpu_s = (cpu_ns(all_pids) - cpu0) / 1e9
                client_s = (cpu_ns(client_pids) - client0) / 1e9
                done = result.get("completed", 0)
                w = {"run": run_i, "server_workers": n, "arrangement": how, "shared": shared,
                     "server_cpus": server_cpus,
                     "client_cpus": client_cpus, "rps": result.get("rps"), "lat_p50_ms": result.get("lat_p50_ms"),
                     "lat_p99_ms": result.get("lat_p99_ms"), "completed": done, "errors": result.get("errors", 0),
                     "error_samples": result.get("error_samples", []), "server_cpu_s": round(cpu_s, 3),
                     "server_cores_busy": round(cpu_s / wall, 3), "client_cpu_s": round(client_s, 3),
                     "cpu_ms_per_request": round(1000 * cpu_s / done, 4) if done else None, "wall_s": round(wall, 3)}
                w["capacity_rps"] = round(n / (cpu_s / done), 1) if done and cpu_s else None
                windows.append(w)
                print(f"  run {run_i} --workers {n}: {w['rps']} req/s, p50 {w['lat_p50_ms']} ms, "
                      f"{w['cpu_ms_per_request']} ms CPU/req, server busy {w['server_cores_busy']} cores"
                      f" ({how}: server on cores {server_cpus}, load on {client_cpus})", flush=True)
    finally:
        try:
            if loadgen.proc is not None and loadgen.proc.returncode is None and loadgen.proc.stdin is not None:
                loadgen.proc.stdin.write(b'{"cmd": "quit"}\n')
        except (BrokenPipeError, ConnectionResetError):
            pass
        await asyncio.gather(loadgen.stop(5), *(p.stop() for p, _ in servers.values()), *(w.stop() for w in fleet))
        await etcd.stop()
    return report(args, windows, cores)


def median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 4) if values else None


def report(args: argparse.Namespace, windows: list[dict], cores: list[int]) -> int:
    rows = []
    for n in args.server_workers:
        ws = [w for w in windows if w["server_workers"] == n]
        rows.append({"server_workers": n, "arrangement": "/".join(sorted({w["arrangement"] for w in ws})),
                     "server_cpus": ws[0]["server_cpus"] if ws else [],
                     **{k: median([w[k] for w in ws]) for k in ("rps", "lat_p50_ms", "lat_p99_ms",
                                                                 "cpu_ms_per_request", "server_cores_busy",
                                                                 "capacity_rps")},
                     "errors": sum(w["errors"] for w in ws)})
    print(f"\n{args.router_policy} (replica sync {args.replica_sync}), {args.fleet} {args.worker} workers, "
          f"concurrency {args.concurrency}, "
          f"{args.runs} run(s) × {args.duration:g} s, medians; cores {cores}")
    head = f"{'--workers':>9} {'server cores':<18} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'CPU ms/req':>10} " \
           f"{'busy':>6} {'capacity req/s':>15} {'errors':>6}"
    print(head)
    print("-" * len(head))
    for r in rows:
        where = f"{r['arrangement']} {','.join(map(str, r['server_cpus']))}"
        print(f"{r['server_workers']:>9} {where:<18} {r['rps'] or 0:>8.0f} {r['lat_p50_ms'] or 0:>8.2f} "
              f"{r['lat_p99_ms'] or 0:>8.2f} {r['cpu_ms_per_request'] or 0:>10.3f} {r['server_cores_busy'] or 0:>6.2f} "
              f"{r['capacity_rps'] or 0:>15.0f} {r['errors']:>6}")
    summary: dict[str, Any] = {}
    base = rows[0]
    for r in rows[1:]:
        key = f"{r['server_workers']}_vs_{base['server_workers']}"
        summary[key] = {
            "rps_ratio": round(r["rps"] / base["rps"], 3) if r["rps"] and base["rps"] else None,
            "cpu_per_request_ratio": (round(r["cpu_ms_per_request"] / base["cpu_ms_per_request"], 3)
                                      if r["cpu_ms_per_request"] and base["cpu_ms_per_request"] else None),
            "capacity_ratio": (round(r["capacity_rps"] / base["capacity_rps"], 3)
                               if r["capacity_rps"] and base["capacity_rps"] else None),
            # measured throughput shows the scaling only where each process had a core of its own
            "throughput_comparable": r["arrangement"] == base["arrangement"] == "own"}
        s = summary[key]
        print(f"\n--workers {r['server_workers']} vs {base['server_workers']}: CPU per request ×{s['cpu_per_request_ratio']} "
              f"→ capacity on {r['server_workers']} vs {base['server_workers']} dedicated cores ×{s['capacity_ratio']}; "
              f"measured throughput ×{s['rps_ratio']}"
              + ("" if s["throughput_comparable"] else
                 f" (not a scaling measure here: {r['arrangement']} vs {base['arrangement']})"))
    failed = sum(r["errors"] for r in rows)
    out = {"args": {k: v for k, v in vars(args).items()}, "machine": {"cores": cores, "python": sys.version.split()[0],
                                                                      "platform": platform.platform()},
           "windows": windows, "medians": rows, "summary": summary}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"\nJSON: {args.out}" + (f"; {failed} request(s) FAILED" if failed else ""))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    return run_bench("server_workers", run(resolve_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
