"""The kvd Unix-socket server, and the daemon's assembly from its config."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import stat
from typing import Callable

from infera.kvd import protocol as p
from infera.kvd.arena import SharedArena, send_fd_async
from infera.kvd.config import KvdConfig
from infera.kvd.metrics import KvdMetrics
from infera.kvd.service import Connection, KvdService
from infera.kvd.store import HostStore
from infera.kvd.tablespace import Tablespace, selfcheck

log = logging.getLogger("infera.kvd.server")


class SocketInUse(RuntimeError):
    pass


def prepare_socket_path(path: str) -> None:
    """Unlink a stale socket file (nobody accepts on it); refuse a live one or a non-socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketInUse(f"{path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        log.info("unlinking stale socket %s", path)
        os.unlink(path)
        return
    except OSError as e:
        raise SocketInUse(f"{path}: cannot tell whether a daemon is listening ({e})") from e
    finally:
        probe.close()
    raise SocketInUse(f"another daemon is listening on {path}")


class KvdServer:
    def __init__(self, service: KvdService, socket_path: str):
        self.service = service
        self.socket_path = socket_path
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task | None = None
        self._conns: set[asyncio.Task] = set()

    async def start(self) -> None:
        prepare_socket_path(self.socket_path)
        os.makedirs(os.path.dirname(os.path.abspath(self.socket_path)), exist_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o077)  # the socket is born 0600: no window where others may connect
        try:
            sock.bind(self.socket_path)
        finally:
            os.umask(old)
        os.chmod(self.socket_path, 0o600)
        sock.listen(128)
        sock.setblocking(False)
        self._listener = sock
        self._accept_task = asyncio.get_running_loop().create_task(self._accept_loop(), name="kvd-accept")
        log.info("kvd listening on %s", self.socket_path)

    async def close(self) -> None:
        if self._accept_task is not None:
            self._accept_task.cancel()
            try:
                await self._accept_task
            except asyncio.CancelledError:
                pass
        if self._listener is not None:
            self._listener.close()
            try:
                os.unlink(self.socket_path)
            except FileNotFoundError:
                pass
        for task in list(self._conns):
            task.cancel()
        if self._conns:
            await asyncio.gather(*self._conns, return_exceptions=True)

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self._listener)
            conn.setblocking(False)
            task = loop.create_task(self._serve(conn))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    async def _serve(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        state = Connection()
        metrics = self.service.metrics
        metrics.connections.inc()
        try:
            while True:
                try:
                    body = await p.read_frame(loop, sock)
                except p.ProtocolError as e:
                    await p.write_msg(loop, sock, p.Error(code=e.code, message=e.message))
                    if e.code == p.FRAME_TOO_LARGE:
                        break  # the body was not read: the stream cannot be resynchronized
                    continue
                try:
                    req = p.decode_request(body)
                except p.ProtocolError as e:
                    await p.write_msg(loop, sock, p.Error(code=e.code, message=e.message))
                    continue
                del body
                if isinstance(req, p.Hello):
                    ack, pass_fd = self.service.hello(req, state)
                    await p.write_msg(loop, sock, ack)
                    if pass_fd:
                        await send_fd_async(loop, sock, self.service.arena.fd)
                    continue
                try:
                    resp = await self.service.handle(req, state)
                except Exception as e:  # one bad request must not take the connection down
                    log.exception("kvd: %s failed", type(req).__name__)
                    resp = p.Error(code=p.INTERNAL_ERROR, message=f"{type(e).__name__}: {e}")
                if resp is not None:
                    await p.write_msg(loop, sock, resp)
        except (p.PeerClosed, ConnectionError, BrokenPipeError):
            pass
        finally:
            if state.leases:
                self.service.disconnect(state)
            sock.close()
            metrics.connections.dec()


def build_service(config: KvdConfig, metrics: KvdMetrics | None = None) -> KvdService:
    """Arena, store and L3 region as the config says (blocking: call before serving)."""
    arena = None
    if config.arena_bytes > 0:
        arena = SharedArena(config.arena_bytes, pin=config.arena_pin, hugetlb=config.arena_hugetlb)
        log.info("shared arena: %d bytes, pinned=%s, hugetlb=%s", arena.capacity, arena.pinned, arena.hugetlb)
    store = HostStore(config.max_bytes, arena)
    long_region = None
    if config.long_path:
        os.makedirs(config.long_path, exist_ok=True)
        if config.selfcheck:
            try:
                write_gbs, read_gbs = selfcheck(config.long_path)
                log.info("L3 self-check %s: write %.2f GB/s, read %.2f GB/s", config.long_path, write_gbs, read_gbs)
            except OSError as e:
                log.warning("L3 self-check failed on %s: %s", config.long_path, e)
        long_region = Tablespace(config.long_path, config.long_bytes, container_bytes=config.container_bytes,
                                 slot_bytes=config.slot_bytes, flush_interval_ms=config.flush_interval_ms).open()
    return KvdService(store, long_region=long_region, metrics=metrics)


async def run(config: KvdConfig, *, on_ready: Callable[[KvdServer], None] | None = None,
              stop: asyncio.Event | None = None) -> None:
    """Serve until SIGTERM/SIGINT (or ``stop``), then close cleanly: L3 snapshot, socket unlinked."""
    loop = asyncio.get_running_loop()
    metrics = KvdMetrics()
    service = await loop.run_in_executor(None, build_service, config, metrics)
    http = None
    if config.metrics_port:
        from prometheus_client import start_http_server
        http = start_http_server(config.metrics_port, addr=config.metrics_host, registry=metrics.registry)
    service.start()
    server = KvdServer(service, config.socket)
    stop = stop or asyncio.Event()
    try:
        await server.start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        if on_ready is not None:
            on_ready(server)
        await stop.wait()
        log.info("kvd stopping")
    finally:
        await server.close()
        await service.close()
        if http is not None and isinstance(http, tuple):
            http[0].shutdown()
