"""The front door's limits against a hostile network (infera/server/limits.py), on a real
``python -m infera.server`` process over loopback: slowloris heads and trickled bodies are closed
after their timeouts while ``/health`` keeps answering; idle connections are closed after the
keep-alive timeout; under a low ``RLIMIT_NOFILE`` more idle connections than the cap do not starve
``accept`` (``/health`` answers); request bodies past the in-flight cap get 503 with Retry-After in
the OpenAI error shape. Timeouts are short (1 s); every wait has a deadline."""
from __future__ import annotations

import asyncio
import os
import resource
import sys
import time

import aiohttp
import pytest

from infera.engine.base.prom import sample_sum, samples
from tests.conftest import free_port, stop_process_group, wait_for

T = 1.0  # the timeouts under test
SLACK = 3.0  # loaded CI: "closed within T + SLACK", never exactly T


class Server:
    def __init__(self, proc: asyncio.subprocess.Process, port: int, log_path) -> None:
        self.proc, self.port, self.log_path = proc, port, log_path
        self.base = f"http://127.0.0.1:{port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture
async def start_server(etcd, prefix, tmp_path):
    servers: list[Server] = []

    async def factory(*flags: str, workers: int = 1, nofile: int | None = None) -> Server:
        port = free_port()
        log_path = tmp_path / f"server-{port}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("INFERA_") and k != "NATS_SERVER"}

        def limit_fds() -> None:  # in the child, between fork and exec
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "infera.server", "--host", "127.0.0.1", "--port", str(port), "--etcd-endpoint",
            etcd.endpoint, "--etcd-prefix", prefix, "--workers", str(workers), *flags,
            stdout=open(log_path, "wb"), stderr=asyncio.subprocess.STDOUT, start_new_session=True, env=env,
            preexec_fn=limit_fds)
        server = Server(proc, port, log_path)
        servers.append(server)

        async def ready() -> bool:
            assert proc.returncode is None, server.log()
            try:
                return await health(server) == 200
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                return False

        await wait_for(ready, 60, interval=0.1, message="the server answers /health")
        return server

    yield factory
    for server in servers:
        await stop_process_group(server.proc, 20)


async def health(server: Server, timeout: float = 3.0) -> int:
    """One /health on a fresh connection, bounded."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                     timeout=aiohttp.ClientTimeout(total=timeout)) as s:
        async with s.get(server.base + "/health") as r:
            await r.read()
            return r.status


async def metric(server: Server, name: str, label: str = "") -> float:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
        async with s.get(server.base + "/metrics") as r:
            return sample_sum(await r.text(), name, label)


async def connect(server: Server) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.wait_for(asyncio.open_connection("127.0.0.1", server.port), 5)


async def is_closed(reader: asyncio.StreamReader, wait: float) -> bool:
    """Whether the server closed the connection (EOF or reset) within ``wait`` s, no reply bytes."""
    try:
        data = await asyncio.wait_for(reader.read(65536), wait)
    except asyncio.TimeoutError:
        return False
    except (ConnectionResetError, BrokenPipeError):
        return True
    return data == b"" or data.startswith(b"HTTP/1.1 408")


async def trickle(writer: asyncio.StreamWriter, piece: bytes, every: float, stop: asyncio.Event) -> None:
    try:
        while not stop.is_set():
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(every)
    except (ConnectionError, OSError):
        pass


async def health_while(server: Server, seconds: float) -> list[int]:
    """/health every 0.25 s for ``seconds``: the statuses (0: no answer in time)."""
    statuses = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            statuses.append(await health(server))
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            statuses.append(0)
        await asyncio.sleep(0.25)
    return statuses


async def attack(server: Server, n: int, head: bytes, piece: bytes) -> tuple[list[bool], list[int], float]:
    """``n`` connections that send ``head`` and then ``piece`` every 0.3 s; returns which were closed
    by the server within T + SLACK, the /health statuses meanwhile and the slowest close."""
    conns = [await connect(server) for _ in range(n)]
    stop = asyncio.Event()
    start = time.monotonic()
    for _, w in conns:
        w.write(head)
    tricklers = [asyncio.create_task(trickle(w, piece, 0.3, stop)) for _, w in conns]
    closes: list[float] = []

    async def watch(reader) -> bool:
        closed = await is_closed(reader, T + SLACK)
        if closed:
            closes.append(time.monotonic() - start)
        return closed

    try:
        closed, statuses = await asyncio.gather(asyncio.gather(*(watch(r) for r, _ in conns)),
                                                health_while(server, T + 0.5))
    finally:
        stop.set()
        await asyncio.gather(*tricklers)
        for _, w in conns:
            w.close()
    return list(closed), statuses, max(closes, default=0.0)


async def test_slowloris_heads_are_closed_after_the_header_timeout(start_server):
    server = await start_server("--header-timeout", str(T))
    closed, statuses, slowest = await attack(server, 30, b"GET /health HTTP/1.1\r\nHost: x\r\n", b"X-A: b\r\n")
    assert all(closed), f"{closed.count(False)} of 30 trickling heads still open after {T + SLACK} s"
    assert slowest >= T * 0.9
    assert statuses and all(s == 200 for s in statuses), statuses
    assert await health(server) == 200
    assert await metric(server, "infera_http_connections_closed_total", 'reason="header_timeout"') >= 30


async def test_connect_and_say_nothing_is_closed_after_the_header_timeout(start_server):
    server = await start_server("--header-timeout", str(T))
    conns = [await connect(server) for _ in range(10)]
    assert all(await asyncio.gather(*(is_closed(r, T + SLACK) for r, _ in conns)))
    for _, w in conns:
        w.close()


async def test_a_later_request_head_on_a_kept_alive_connection_is_timed_too(start_server):
    server = await start_server("--header-timeout", str(T), "--keepalive-timeout", "60")
    reader, writer = await connect(server)
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200")
    length = int(head.lower().split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
    await asyncio.wait_for(reader.readexactly(length), 5)
    await asyncio.sleep(T + 0.5)  # idle between requests: the keep-alive timeout's business, not the head's
    writer.write(b"GET /health HTTP/1.1\r\n")  # ... and then a head that never completes
    stop = asyncio.Event()
    task = asyncio.create_task(trickle(writer, b"X-A: b\r\n", 0.3, stop))
    try:
        assert await is_closed(reader, T + SLACK)
    finally:
        stop.set()
        await task
        writer.close()


async def test_trickled_bodies_are_closed_after_the_body_timeout(start_server):
    server = await start_server("--body-timeout", str(T))
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000\r\n\r\n{")
    closed, statuses, slowest = await attack(server, 30, head, b" ")
    assert all(closed), f"{closed.count(False)} of 30 trickling bodies still open after {T + SLACK} s"
    assert slowest >= T * 0.9
    assert statuses and all(s == 200 for s in statuses), statuses
    assert await metric(server, "infera_http_connections_closed_total", 'reason="body_timeout"') >= 30
    assert await metric(server, "infera_http_inflight_request_bytes") == 0  # released with the requests


async def test_idle_connections_are_closed_after_the_keepalive_timeout(start_server):
    server = await start_server("--keepalive-timeout", str(T))
    reader, writer = await connect(server)
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    length = int(head.lower().split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
    await asyncio.wait_for(reader.readexactly(length), 5)
    assert await is_closed(reader, T + SLACK)
    writer.close()


async def test_more_idle_connections_than_file_descriptors_leave_health_answering(start_server):
    """256 fds, 300 idle connections: without a cap ``accept`` fails with EMFILE and /health is never
    accepted; with the cap derived from the limit ((256 - 64) / 2 = 96) new connections close the
    oldest idle ones, so the process never runs out of descriptors."""
    server = await start_server("--header-timeout", "60", "--keepalive-timeout", "60", nofile=256)
    conns = []
    try:
        for _ in range(300):
            conns.append(await connect(server))
            conns[-1][1].write(b"GET /health HTTP/1.1\r\n")  # a head that is never finished
        statuses = await health_while(server, 2.0)
        assert statuses and all(s == 200 for s in statuses), statuses
        closed = await asyncio.gather(*(is_closed(r, 0.5) for r, _ in conns))
        assert closed.count(True) >= 300 - 96, f"only {closed.count(True)} of 300 idle connections were closed"
        assert await metric(server, "infera_http_connections") <= 96
        assert await metric(server, "infera_http_connections_closed_total", 'reason="evicted"') >= 300 - 96
        assert server.proc.returncode is None
        assert "Too many open files" not in server.log()
    finally:
        for _, w in conns:
            w.close()


async def test_request_bytes_past_the_inflight_cap_get_503(start_server):
    server = await start_server("--max-inflight-bytes", "1000000", "--max-request-bytes", "900000")
    # One request holds 800 kB in flight: its body is coming (slowly).
    reader, writer = await connect(server)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 800000\r\n\r\n{")
    await writer.drain()
    body = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * 790000 + b'"}]}'
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        async def big() -> tuple[int, str | None, dict]:
            async with s.post(server.base + "/v1/chat/completions", data=body,
                              headers={"Content-Type": "application/json"}) as r:
                return r.status, r.headers.get("Retry-After"), await r.json(content_type=None)

        await asyncio.sleep(0.2)
        replies = await asyncio.gather(*(big() for _ in range(4)))
        for status, retry_after, payload in replies:
            assert status == 503, payload
            assert retry_after == "1"
            assert payload["error"]["code"] == "server_busy"
            assert payload["error"]["type"] and "--max-inflight-bytes" in payload["error"]["message"]
        assert await metric(server, "infera_http_busy_rejections_total") == 4
        assert await metric(server, "infera_http_inflight_request_bytes") == 800000
        # a body over --max-request-bytes is still a 413
        async with s.post(server.base + "/v1/chat/completions", data=b"x" * 950000) as r:
            assert r.status == 413
        writer.close()  # the held request ends: its bytes are released
        assert await is_closed(reader, 5)

        async def admitted() -> bool:
            status, _, payload = await big()
            return payload.get("error", {}).get("code") != "server_busy"

        await wait_for(admitted, 10, interval=0.1, message="a request admitted once the held bytes are released")


async def test_every_process_of_a_workers_server_has_the_limits(start_server):
    """--workers 2: the kernel spreads the connections over both children; each closes its share."""
    server = await start_server("--header-timeout", str(T), workers=2)
    closed, statuses, _ = await attack(server, 30, b"GET /health HTTP/1.1\r\nHost: x\r\n", b"X-A: b\r\n")
    assert all(closed), f"{closed.count(False)} of 30 trickling heads still open after {T + SLACK} s"
    assert statuses and all(s == 200 for s in statuses), statuses
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
        async with s.get(server.base + "/metrics") as r:
            text = await r.text()
    per_process = [v for n, labels, v in samples(text)
                   if n == "infera_http_connections_closed_total" and 'reason="header_timeout"' in labels]
    assert sum(per_process) >= 30
    assert len(per_process) == 2 and all(v > 0 for v in per_process), per_process  # both children closed some


def peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def test_concurrent_big_bodies_do_not_multiply_the_servers_memory(start_server):
    """The probe of issue 27 item 7: 16 concurrent 30 MB requests took the router from 231 MB to a
    2,081 MB peak. With 64 MiB in flight at most, two are read at a time and the rest get 503 before
    their bodies are read: the peak grows ~100 MB here (without the cap: ~650 MB for these bodies)."""
    server = await start_server("--max-inflight-bytes", str(64 * 1024 * 1024))
    before = peak_rss_mb(server.proc.pid)
    content = "word " * (6 * 1024 * 1024)  # 30 MiB of prompt
    body = ('{"model": "m", "messages": [' + ",".join(
        '{"role": "user", "content": "%s"}' % content[i::8] for i in range(8)) + "]}").encode()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        async def one() -> str:
            async with s.post(server.base + "/v1/chat/completions", data=body,
                              headers={"Content-Type": "application/json"}) as r:
                payload = await r.json(content_type=None)
                return payload.get("error", {}).get("code") or str(r.status)

        codes = await asyncio.gather(*(one() for _ in range(16)), return_exceptions=True)
    assert sum(1 for c in codes if c == "server_busy") >= 8, codes
    grew = peak_rss_mb(server.proc.pid) - before
    assert grew < 350, f"peak RSS grew {grew:.0f} MB"
