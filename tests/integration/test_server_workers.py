"""``python -m infera.server --workers 2`` as a subprocess, against real etcd and sim workers: the
children share the port, a SIGKILLed child is restarted under load without a failed request,
SIGTERM drains everything, ``/metrics`` on any child shows both, and kv-aware routing across the
two children is as good as one process's (their local replica sync)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time

import aiohttp
import pytest

from infera.engine.base.prom import samples
from infera.server.metrics import GATHER_TIMEOUT_S
from infera.server.supervisor import CHILD_ENV
from tests.conftest import alive, children_of, free_port, stop_process_group, wait_for
from tests.integration.test_kv_routing import chat, full_blocks, post

QUIET = ("--no-enable-kv-events",)  # no KV events: only the server processes themselves know


class ServerProcess:
    def __init__(self, proc: asyncio.subprocess.Process, port: int, log_path) -> None:
        self.proc = proc
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def children(self) -> list[int]:
        return [p for p in children_of(self.proc.pid) if alive(p)]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def fresh() -> aiohttp.ClientSession:
    """A session whose every request opens a new connection (the kernel picks the child)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


async def health(s: aiohttp.ClientSession, base: str) -> dict:
    async with s.get(base + "/health") as r:
        assert r.status == 200
        return await r.json()


async def pinned_sessions(server: ServerProcess, n: int) -> dict[int, aiohttp.ClientSession]:
    """One keep-alive session per child (index → session): each holds one connection, which the
    kernel gave to that child."""
    pinned: dict[int, aiohttp.ClientSession] = {}
    for _ in range(200):
        s = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
        index = (await health(s, server.base)).get("process", {}).get("index", 0)
        if index in pinned:
            await s.close()
        else:
            pinned[index] = s
        if len(pinned) == n:
            return pinned
    for s in pinned.values():
        await s.close()
    pytest.fail(f"could not reach {n} distinct server processes")


async def metrics(s: aiohttp.ClientSession, base: str) -> str:
    async with s.get(base + "/metrics") as r:
        assert r.status == 200
        return await r.text()


def by_process(text: str, name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for n, labels, value in samples(text):
        if n == name:
            process = labels.split('process="', 1)[1].split('"', 1)[0] if 'process="' in labels else ""
            out[process] = out.get(process, 0.0) + value
    return out


@pytest.fixture
async def start_server(etcd, prefix, tmp_path):
    servers: list[ServerProcess] = []

    async def factory(*flags: str, workers: int = 2, active: int = 0) -> ServerProcess:
        port = free_port()
        log_path = tmp_path / f"server-{port}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("INFERA_") and k != "NATS_SERVER"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "infera.server", "--host", "127.0.0.1", "--port", str(port), "--etcd-endpoint",
            etcd.endpoint, "--etcd-prefix", prefix, "--workers", str(workers), *flags,
            stdout=open(log_path, "wb"), stderr=asyncio.subprocess.STDOUT, start_new_session=True, env=env)
        server = ServerProcess(proc, port, log_path)
        servers.append(server)
        # Ready: every child answers /health and sees the `active` workers.
        seen: dict[int, int] = {}

        async def all_children_ready() -> bool:
            assert proc.returncode is None, server.log()
            try:
                async with fresh() as s:
                    for _ in range(4 * workers):
                        body = await health(s, server.base)
                        seen[body.get("process", {}).get("pid", proc.pid)] = body["active_workers"]
            except (aiohttp.ClientError, OSError):
                return False
            children = set(server.children()) if workers > 1 else {proc.pid}
            return set(seen) >= children and len(children) == workers and all(
                seen[p] >= active for p in children)

        await wait_for(all_children_ready, 60, interval=0.1, message=f"{workers} server processes ready")
        return server

    yield factory
    for server in servers:
        kids = server.children()
        await stop_process_group(server.proc, 30)
        for pid in kids:  # none should be left; never leak one into the next test
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


async def test_children_share_the_port_and_each_answers_health(start_server, spawn_worker):
    worker = await spawn_worker()
    server = await start_server(active=1)
    children = set(server.children())
    assert len(children) == 2 and server.pid not in children
    pids, indices = set(), set()
    async with fresh() as s:
        for _ in range(60):
            body = await health(s, server.base)
            assert body["active_workers"] == 1 and body["process"]["count"] == 2
            pids.add(body["process"]["pid"])
            indices.add(body["process"]["index"])
            _, reply = await post(s, server.base, {**chat(1, "hi"), "model": "sim-model"})
            assert reply["choices"][0]["message"]["content"]
    assert pids == children and indices == {0, 1}
    assert worker.proc.returncode is None


async def test_metrics_from_any_child_show_both_and_a_silent_sibling_is_skipped(start_server, spawn_worker):
    await spawn_worker()
    server = await start_server(active=1)
    pinned = await pinned_sessions(server, 2)
    try:
        await post(pinned[1], server.base, chat(1, "counted by process 1"))
        for index, s in pinned.items():
            text = await metrics(s, server.base)
            assert by_process(text, "infera_server_processes") == {"0": 2.0, "1": 2.0}, index
            assert by_process(text, "infera_workers") == {"0": 1.0, "1": 1.0}  # each one's own view
            assert by_process(text, "infera_requests_total").get("1", 0) >= 1
            assert text.count("# TYPE infera_requests_total counter") == 1  # one family, both processes
        # Process 1 stops answering (SIGSTOP): a scrape on process 0 waits at most the bound, then
        # leaves it out and counts it.
        stopped = (await health(pinned[1], server.base))["process"]["pid"]
        os.kill(stopped, signal.SIGSTOP)
        try:
            started = time.monotonic()
            text = await metrics(pinned[0], server.base)
            took = time.monotonic() - started
        finally:
            os.kill(stopped, signal.SIGCONT)
        assert GATHER_TIMEOUT_S * 0.9 <= took < GATHER_TIMEOUT_S + 1.5
        assert set(by_process(text, "infera_server_processes")) == {"0"}
        assert 'infera_server_metrics_siblings_skipped_total{process="0",sibling="1"} 1.0' in text
        text = await metrics(pinned[0], server.base)  # back: both again
        assert set(by_process(text, "infera_server_processes")) == {"0", "1"}
    finally:
        for s in pinned.values():
            await s.close()


async def test_a_sigkilled_child_is_restarted_and_no_request_fails(start_server, spawn_worker):
    """8 clients in closed loops; one child is SIGKILLed. The connections it held die with it: a
    client retries a request whose connection broke before any reply (as the OpenAI SDK does, twice
    by default). No request fails, none gets an HTTP error, and the child is back."""
    for _ in range(2):
        await spawn_worker()
    server = await start_server(active=2)
    before = set(server.children())
    victim = next(iter(before))
    done, retried, failures = [], [], []
    stop = asyncio.Event()

    async def client(i: int) -> None:
        async with fresh() as s:
            n = 0
            while not stop.is_set():
                n += 1
                body = chat(i, f"question {n}")
                for attempt in range(3):
                    try:
                        async with s.post(server.base + "/v1/chat/completions", json=body) as r:
                            text = await r.text()
                            if r.status != 200:
                                failures.append((r.status, text[:200]))
                            else:
                                assert json.loads(text)["choices"][0]["message"]["content"]
                                done.append(i)
                        break
                    except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                        if attempt == 2:
                            failures.append(repr(exc))
                        else:
                            retried.append((time.monotonic(), repr(exc)))

    clients = [asyncio.ensure_future(client(i)) for i in range(8)]
    try:
        await wait_for(lambda: len(done) >= 100, 60, message="load running")
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        at_kill = len(done)
        await wait_for(lambda: len(set(server.children()) - before) == 1 and victim not in server.children(), 30,
                       message="the killed child restarted")
        replaced_at = time.monotonic()  # the supervisor reaped it: the kernel had closed its sockets
        (new,) = set(server.children()) - before

        async def serving() -> bool:
            async with fresh() as s:
                return any([(await health(s, server.base))["process"]["pid"] == new for _ in range(10)])

        await wait_for(serving, 30, message="the new child answering")
        await wait_for(lambda: len(done) >= at_kill + 200, 60, message="load after the restart")
    finally:
        stop.set()
        await asyncio.gather(*clients)
    assert not failures, failures[:5]
    # Retried: the requests on the killed child's connections, and a reconnect that reached its
    # listener in the moment before the kernel closed it; all of them between the kill and the
    # replacement (the surviving and the new child reset nothing).
    assert all(killed_at <= t <= replaced_at for t, _ in retried), (killed_at, replaced_at, retried)
    async with fresh() as s:
        text = await metrics(s, server.base)
    assert sum(by_process(text, "infera_server_process_restarts_total").values()) == 1
    assert server.proc.returncode is None


async def test_sigterm_drains_every_child_and_leaves_no_process(start_server, spawn_worker):
    await spawn_worker(speedup=1.0)
    server = await start_server(active=1)
    kids = server.children()
    body = chat(3, "a long answer", max_tokens=40, stream=True)
    async with fresh() as s:
        async with s.post(server.base + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            first = await r.content.readany()
            assert first
            server.proc.send_signal(signal.SIGTERM)  # mid-stream: the stream still completes
            rest = first + await r.content.read()
    events = [line for line in rest.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events)
    assert await asyncio.wait_for(server.proc.wait(), 30) == 0
    await wait_for(lambda: not any(alive(p) for p in kids), 5, message="no child left")
    with pytest.raises(aiohttp.ClientConnectionError):
        async with fresh() as s:
            await health(s, server.base)
    assert "draining 2 server processes" in server.log()


async def test_no_child_outlives_a_killed_supervisor(start_server):
    server = await start_server()
    kids = server.children()
    assert len(kids) == 2
    server.proc.send_signal(signal.SIGKILL)
    await server.proc.wait()
    await wait_for(lambda: not any(alive(p) for p in kids), 15, message="children gone with their supervisor")


@pytest.mark.parametrize("sync, expected", [("one process", "all"), ("local", "all"), ("nats", "all"),
                                            ("off", "fewer")])
async def test_kv_aware_routing_across_children_matches_one_process(request, start_server, spawn_worker, sync,
                                                                    expected):
    """Turn 1 of a conversation through one child, turn 2 through the other, no KV event ever (as
    tests/integration/test_replica_sync.py does with two replicas over NATS): the second child
    sends turn 2 to the worker the first picked, as one process would. Without the sync it cannot
    know (the control: the test can fail). On the NATS plane the children sync over NATS."""
    workers = [await spawn_worker("--num-gpu-blocks", "2048", launcher_args=QUIET) for _ in range(2)]
    assert len(workers) == 2
    flags: tuple[str, ...] = ("--replica-sync", sync) if sync in ("local", "off") else ()
    if sync == "nats":
        flags = ("--replica-sync", "nats", "--nats-server", request.getfixturevalue("nats_server").url)
    n = 1 if sync == "one process" else 2
    server = await start_server(*flags, workers=n, active=2)
    if n == 1:
        only = aiohttp.ClientSession()
        a = b = only
        sessions = [only]
    else:
        pinned = await pinned_sessions(server, 2)
        a, b = pinned[0], pinned[1]
        sessions = list(pinned.values())
    hits, groups = 0, 4
    try:
        # B routed a request of its own first: its cold-pick rotation is out of step with A's, so
        # only what A tells it can send a follow-up to the right worker
        await post(b, server.base, chat(99, "unrelated"))
        for g in range(groups):
            await post(a, server.base, chat(g, "first question"))
            if sync in ("local", "nats"):  # B has heard of A's finished turn (as the in-process test waits)
                await wait_for(lambda: _heard(b, server.base, g + 1), 10, interval=0.01,
                               message="A's finish heard by B")
            _, reply = await post(b, server.base, chat(g, "second question"))
            hits += reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * 10
    finally:
        for s in sessions:
            await s.close()
    if expected == "all":
        assert hits == groups
    else:
        assert hits < groups


async def _heard(s: aiohttp.ClientSession, base: str, n: int) -> bool:
    """Process 1 has heard at least ``n`` requests of its sibling finish."""
    return by_process(await metrics(s, base), "infera_replica_sync_remote_finished_total").get("1", 0) >= n


# -- the supervisor alone, over stand-in children ---------------------------------------------------

def stand_in(tmp_path, code: str) -> str:
    """An executable that the supervisor runs in place of ``python`` (it gets ``-m infera.server
    …`` and ignores them): ``code`` runs with ``ctx``, the child context the supervisor passed."""
    path = tmp_path / "child.py"
    path.write_text(f"#!{sys.executable}\nimport json, os, sys, time\n"
                    f"ctx = json.loads(os.environ[{CHILD_ENV!r}])\n{code}\n")
    path.chmod(0o755)
    return str(path)


def supervisor_args(workers: int = 2):
    from infera.server.cli import parse_args

    return parse_args(["--host", "127.0.0.1", "--port", "0", "--etcd-endpoint", "unused:1", "--workers",
                       str(workers), "--router-policy", "round-robin"], environ={})


async def test_a_child_that_keeps_dying_stops_the_server(tmp_path, monkeypatch):
    import infera.server.supervisor as sup

    monkeypatch.setattr(sup, "RESTART_BACKOFF_S", 0.01)
    marks = tmp_path / "starts"
    child = stand_in(tmp_path, f"open({str(marks)!r}, 'a').write(str(ctx['index']) + ' ' + str(ctx['generation']) + '\\n')\n"
                               "os.write(ctx['ready_fd'], b'1')\n"
                               "time.sleep(3600) if ctx['index'] == 0 else sys.exit(3)")
    supervisor = sup.Supervisor(supervisor_args(), [], python=child, max_restarts=3, restart_window_s=60)
    assert await asyncio.wait_for(supervisor.run(), 30) == 1  # 1 start + 3 restarts; the 4th death stops it
    starts = marks.read_text().split("\n")
    assert sorted(s for s in starts if s.startswith("1 ")) == ["1 0", "1 1", "1 2", "1 3"]
    assert starts.count("0 0") == 1  # its sibling was stopped with it, never restarted
    assert not os.path.exists(supervisor.runtime_dir)


async def test_a_child_that_cannot_start_stops_the_server_at_once(tmp_path):
    from infera.server.supervisor import Supervisor

    child = stand_in(tmp_path, "sys.exit(2)")  # exits before it listens: a setting, not a crash
    supervisor = Supervisor(supervisor_args(), [], python=child)
    started = time.monotonic()
    assert await asyncio.wait_for(supervisor.run(), 30) == 1
    assert time.monotonic() - started < 10
    assert [s.generation for s in supervisor.slots] == [0, 0]  # no restart


async def test_a_port_taken_by_another_program_fails_before_any_child_starts(tmp_path):
    import socket

    from infera.server.supervisor import Supervisor

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    args = supervisor_args()
    args.port = taken.getsockname()[1]
    try:
        supervisor = Supervisor(args, [], python=stand_in(tmp_path, "raise SystemExit('must not run')"))
        assert await supervisor.run() == 1
        assert all(s.proc is None for s in supervisor.slots)
    finally:
        taken.close()


# -- one KV index per host (issue 30 item 4) --------------------------------------------------------


def _by_role(text: str) -> dict[str, str]:
    roles = {}
    for n, labels, value in samples(text):
        if n == "infera_kv_index_role" and value == 1.0:
            process = labels.split('process="', 1)[1].split('"', 1)[0]
            roles[process] = labels.split('role="', 1)[1].split('"', 1)[0]
    return roles


async def test_one_index_per_host_events_applied_once_and_the_reader_survives_the_writer(start_server,
                                                                                         spawn_worker):
    """--workers 2 (--kv-index-scope host, the default): process 0 applies every event, process 1
    none, yet process 1 routes a follow-up to the worker holding its prefix, with the replica sync
    off (only the shared index can tell it). The writer is SIGKILLed: process 1 goes on serving
    (by load: its views are warming), and once the restarted writer has caught up it routes by the
    shared index again."""
    for _ in range(3):  # a follow-up sent to the right one by chance: 1 in 3, four times over
        await spawn_worker("--num-gpu-blocks", "2048")
    server = await start_server("--replica-sync", "off", active=3)
    pinned = await pinned_sessions(server, 2)
    try:
        text = await metrics(pinned[1], server.base)
        assert _by_role(text) == {"0": "writer", "1": "reader"}
        assert [await _follow_up_hits(pinned, server.base, g) for g in range(4)] == [True] * 4
        text = await metrics(pinned[1], server.base)
        events = by_process(text, "infera_kv_block_events_total")
        assert events.get("0", 0) > 0 and "1" not in events, events  # applied once, by the writer
        assert "1" not in by_process(text, "infera_kv_event_delay_seconds_count")  # the reader has no stream
        assert by_process(text, "infera_kv_view_caught_up").keys() == {"0", "1"}  # the views: every process
        # the writer dies (maybe inside a change of the table): the reader serves on, by load
        writer_pid = (await health(pinned[0], server.base))["process"]["pid"]
        os.kill(writer_pid, signal.SIGKILL)
        await wait_for(lambda: _reader_warming(pinned[1], server.base), 10, interval=0.02,
                       message="the reader routing by load without its writer")
        for g in range(3, 6):
            await post(pinned[1], server.base, chat(g, "while the writer is down"))
        await wait_for(lambda: _new_writer_caught_up(pinned[1], server.base), 60, interval=0.1,
                       message="a new writer, caught up, read by the reader")
    finally:
        for s in pinned.values():
            await s.close()
    pinned = await pinned_sessions(server, 2)  # (process 0's connection died with it)
    try:
        assert (await health(pinned[0], server.base))["process"]["pid"] != writer_pid
        assert await _follow_up_hits(pinned, server.base, 9)
    finally:
        for s in pinned.values():
            await s.close()


async def _follow_up_hits(pinned: dict[int, aiohttp.ClientSession], base: str, group: int) -> bool:
    """Turn 1 through the writer; once the reader's shared view holds its blocks, turn 2 through
    the reader: did the engine find turn 1's prefix cached?"""
    before = by_process(await metrics(pinned[1], base), "infera_policy_cache_view_size").get("1", 0)
    _, first = await post(pinned[0], base, chat(group, "first question"))
    want = full_blocks(first)

    async def held() -> bool:
        sizes = by_process(await metrics(pinned[1], base), "infera_policy_cache_view_size")
        return sizes.get("1", 0) >= before + want

    await wait_for(held, 10, interval=0.02, message="the reader's shared view holds turn 1")
    _, second = await post(pinned[1], base, chat(group, "second question"))
    return second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * (want - 1)


async def _reader_warming(s: aiohttp.ClientSession, base: str) -> bool:
    caught_up = by_process(await metrics(s, base), "infera_kv_view_caught_up")
    return caught_up.get("1", 1) == 0


async def _new_writer_caught_up(s: aiohttp.ClientSession, base: str) -> bool:
    text = await metrics(s, base)
    caught_up = by_process(text, "infera_kv_view_caught_up")
    return _by_role(text) == {"0": "writer", "1": "reader"} and caught_up.get("1") == 3 and caught_up.get("0") == 3
