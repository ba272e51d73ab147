"""``python -m infera.server --workers N``: N server processes on one port.

The process the user started becomes a supervisor. It reserves the port, starts N children (each
``python -m infera.server`` with the same flags, told by :data:`CHILD_ENV` which one it is), and
each child binds the port with ``SO_REUSEPORT``: the kernel spreads incoming connections over
them. Every child is a full server replica: it watches the registry, reads every engine's KV
events and routes on its own. What only one child knows (its requests in flight, what it just
served) it shares with its siblings through the replica sync (over NATS on the NATS plane, else
directly, :mod:`infera.transport.replica_sync_local`), and a scrape of ``/metrics`` on any child
gathers all of them (:class:`infera.server.metrics.ProcessMetrics`); both over Unix sockets in a
private 0700 runtime folder.

Lifecycle:

* A child that dies unexpectedly is restarted after a backoff (0.1 s, doubling, at most 5 s);
  more than :data:`MAX_RESTARTS` deaths of one child within :data:`RESTART_WINDOW_S` stop the
  server (exit 1: a crash loop is for whoever runs us to see). A child of the first start that
  dies before it listens (a port taken, a bad setting) stops the server at once.
* SIGTERM or SIGINT is forwarded once to every child, which drains (stops accepting, finishes its
  requests) and exits; the supervisor exits when all have, killing what is left after
  :data:`DRAIN_GRACE_S`. A second signal kills them at once.
* No child outlives the supervisor: each is started with ``PR_SET_PDEATHSIG`` (SIGTERM: it drains
  and exits, as the engines' launchers do), in its own session so that a terminal's Ctrl-C reaches
  only the supervisor, which forwards it once.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections import deque
from dataclasses import asdict, dataclass
from typing import Mapping, MutableMapping, Sequence

from infera.runtime import set_pdeathsig, wait_for

log = logging.getLogger("infera.server.supervisor")

CHILD_ENV = "INFERA_SERVER_CHILD"  # set by the supervisor only: JSON of the child's ChildContext
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
RESTART_BACKOFF_S = 0.1
RESTART_BACKOFF_MAX_S = 5.0
DRAIN_GRACE_S = 75.0  # a child drains for up to aiohttp's 60 s shutdown timeout, then stops its parts
_SOCKET_PATH_MAX = 100  # AF_UNIX paths are limited to 107 bytes


@dataclass
class ChildContext:
    """What a child is told about its place among the supervisor's processes."""

    index: int
    count: int
    runtime_dir: str  # private (0700): the replica sync's and the metrics channel's sockets
    port: int  # the port every child binds (the supervisor resolved --port 0)
    generation: int = 0  # restarts of this slot so far
    replica_id: str = ""  # its replica sync id (the supervisor says "bye" under it if it dies)
    ready_fd: int | None = None  # pipe end: one byte once it listens

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def take(cls, environ: MutableMapping[str, str]) -> "ChildContext | None":
        """The context the supervisor passed, removed from ``environ`` (nothing this process
        starts should believe it is a server child); None in a process the user started."""
        raw = environ.pop(CHILD_ENV, None)
        return None if raw is None else cls(**json.loads(raw))

    def metrics_socket(self, index: int) -> str:
        return metrics_socket(self.runtime_dir, index)

    def notify_ready(self) -> None:
        if self.ready_fd is None:
            return
        try:
            os.write(self.ready_fd, b"1")
            os.close(self.ready_fd)
        except OSError as exc:  # the supervisor is gone: PDEATHSIG stops us anyway
            log.debug("ready notification failed: %s", exc)
        self.ready_fd = None

    def leave(self) -> None:
        """On the way out: the last process out removes the runtime folder (the supervisor does
        too, but it may have been killed)."""
        try:
            os.rmdir(self.runtime_dir)  # only once empty: the siblings' sockets are gone
        except OSError:
            pass

    def info(self) -> dict:
        """For ``/health``: which process answered."""
        return {"index": self.index, "count": self.count, "pid": os.getpid(), "restarts": self.generation}


def metrics_socket(runtime_dir: str, index: int) -> str:
    return os.path.join(runtime_dir, f"metrics-{index}.sock")


def make_runtime_dir() -> str:
    """A fresh 0700 folder for the server's private sockets (short enough for AF_UNIX paths)."""
    base = tempfile.gettempdir()
    if len(base) > _SOCKET_PATH_MAX - 40:
        base = "/tmp"
    path = tempfile.mkdtemp(prefix="infera-server-", dir=base)  # mkdtemp: 0700, ours alone
    os.chmod(path, 0o700)
    return path


def reserve_port(host: str, port: int) -> socket.socket:
    """Bind (never listen) ``host:port`` with SO_REUSEPORT: ``--port 0`` gets one port for every
    child, a port held by another program fails here with a clear error, and nothing else (not
    of our user) can take it between a child's death and its restart."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, type_, proto, _, addr = infos[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


def uses_local_sync(args: argparse.Namespace) -> bool:
    return args.router_policy == "kv-aware" and args.replica_sync == "local"


def _child_preexec(parent: int) -> None:  # in the child, between fork and exec
    set_pdeathsig()
    if os.getppid() != parent:  # the supervisor died before the death signal was armed
        os._exit(1)


class _Slot:
    def __init__(self, index: int) -> None:
        self.index = index
        self.generation = -1
        self.proc: asyncio.subprocess.Process | None = None
        self.replica_id = ""
        self.deaths: deque[float] = deque()
        self.ready = False


class Supervisor:
    """Runs ``args.workers`` children of ``python -m infera.server <argv>`` until a signal."""

    def __init__(self, args: argparse.Namespace, argv: Sequence[str], *, python: str = sys.executable,
                 environ: Mapping[str, str] | None = None, drain_grace_s: float = DRAIN_GRACE_S,
                 max_restarts: int = MAX_RESTARTS, restart_window_s: float = RESTART_WINDOW_S) -> None:
        self.args = args
        self.argv = list(argv)
        self.python = python
        self.environ = dict(os.environ if environ is None else environ)
        self.count = args.workers
        self.drain_grace_s = drain_grace_s
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.token = uuid.uuid4().hex[:8]
        self.slots = [_Slot(i) for i in range(self.count)]
        self.runtime_dir: str | None = None
        self.port: int | None = None
        self.exit_code = 0
        self.stopping = False
        self._stop_event: asyncio.Event | None = None
        self._kill_timer: asyncio.TimerHandle | None = None
        self._all_ready_logged = False

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        reserved: socket.socket | None = None
        self.runtime_dir = make_runtime_dir()
        try:
            try:
                reserved = reserve_port(self.args.host, self.args.port)
            except OSError as exc:
                log.error("cannot bind %s:%s: %s", self.args.host, self.args.port, exc)
                return 1
            self.port = reserved.getsockname()[1]
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._on_signal, sig)
            await asyncio.gather(*(self._keep(slot) for slot in self.slots))
            return self.exit_code
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            if self._kill_timer is not None:
                self._kill_timer.cancel()
            for slot in self.slots:  # only on an error of our own: normally all have exited
                if slot.proc is not None and slot.proc.returncode is None:
                    slot.proc.kill()
                    await slot.proc.wait()
            if reserved is not None:
                reserved.close()
            shutil.rmtree(self.runtime_dir, ignore_errors=True)
            log.info("infera server stopped (exit %d)", self.exit_code)

    # -- stopping ------------------------------------------------------------------------------
    def _on_signal(self, sig: int) -> None:
        if self.stopping:
            log.warning("second %s: killing the server processes now", signal.Signals(sig).name)
            self._kill_all()
            return
        log.info("%s: draining %d server processes", signal.Signals(sig).name, self.count)
        self.begin_stop()

    def begin_stop(self, exit_code: int = 0) -> None:
        """Forward SIGTERM once to every child (each drains and exits); kill what is left after
        the grace period."""
        self.exit_code = self.exit_code or exit_code
        if self.stopping:
            return
        self.stopping = True
        assert self._stop_event is not None
        self._stop_event.set()
        for slot in self.slots:
            self._signal(slot, signal.SIGTERM)
        self._kill_timer = asyncio.get_running_loop().call_later(self.drain_grace_s, self._kill_all)

    def _kill_all(self) -> None:
        for slot in self.slots:
            self._signal(slot, signal.SIGKILL)

    @staticmethod
    def _signal(slot: _Slot, sig: int) -> None:
        if slot.proc is not None and slot.proc.returncode is None:
            try:
                slot.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    # -- one slot ------------------------------------------------------------------------------
    async def _keep(self, slot: _Slot) -> None:
        """Run the slot's child, restart it when it dies unexpectedly, until the server stops."""
        while not self.stopping:
            ready, code = await self._run_child(slot)
            if self.stopping:
                return
            if uses_local_sync(self.args):  # its siblings drop its requests now, not after the peer timeout
                from infera.transport.replica_sync_local import announce_gone

                assert self.runtime_dir is not None
                await announce_gone(self.runtime_dir, self.count, slot.replica_id)
            if not ready and not slot.ready:
                log.error("server process %d exited with code %s before it listened: stopping", slot.index, code)
                self.begin_stop(exit_code=1)
                return
            now = time.monotonic()
            slot.deaths.append(now)
            while slot.deaths and now - slot.deaths[0] > self.restart_window_s:
                slot.deaths.popleft()
            if len(slot.deaths) > self.max_restarts:
                log.error("server process %d died %d times in %.0f s: stopping the server", slot.index,
                          len(slot.deaths), self.restart_window_s)
                self.begin_stop(exit_code=1)
                return
            delay = min(RESTART_BACKOFF_S * 2 ** (len(slot.deaths) - 1), RESTART_BACKOFF_MAX_S)
            log.warning("server process %d (pid %s) exited unexpectedly with code %s: restarting in %.1f s",
                        slot.index, slot.proc.pid if slot.proc else "?", code, delay)
            assert self._stop_event is not None
            try:
                await wait_for(self._stop_event.wait(), delay)
                return  # stopping meanwhile
            except asyncio.TimeoutError:
                pass

    async def _run_child(self, slot: _Slot) -> tuple[bool, int | None]:
        """Start the slot's next child; returns (it listened, its exit code) once it exited."""
        loop = asyncio.get_running_loop()
        slot.generation += 1
        slot.replica_id = f"{self.token}-{slot.index}.{slot.generation}"
        assert self.runtime_dir is not None and self.port is not None
        ctx = ChildContext(index=slot.index, count=self.count, runtime_dir=self.runtime_dir, port=self.port,
                           generation=slot.generation, replica_id=slot.replica_id)
        r, w = os.pipe()
        ctx.ready_fd = w
        try:
            slot.proc = await asyncio.create_subprocess_exec(
                self.python, "-m", "infera.server", *self.argv, env={**self.environ, CHILD_ENV: ctx.to_env()},
                stdin=asyncio.subprocess.DEVNULL, pass_fds=(w,), start_new_session=True,
                preexec_fn=functools.partial(_child_preexec, os.getpid()))
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)
        proc = slot.proc
        log.info("server process %d started (pid %d)", slot.index, proc.pid)
        if self.stopping:  # a signal came while it was being started
            self._signal(slot, signal.SIGTERM)
        ready = await _read_ready(loop, r)
        if ready:
            slot.ready = True
            self._log_when_all_ready()
        code = await proc.wait()
        return ready, code

    def _log_when_all_ready(self) -> None:
        if self._all_ready_logged or not all(s.ready for s in self.slots):
            return
        self._all_ready_logged = True
        pids = ", ".join(str(s.proc.pid) for s in self.slots if s.proc is not None)
        log.info("infera server listening on %s:%s with %d processes (pids %s; replica sync %s)", self.args.host,
                 self.port, self.count, pids, self.args.replica_sync)


def _read_ready(loop: asyncio.AbstractEventLoop, fd: int) -> "asyncio.Future[bool]":
    """True once the child wrote its ready byte; False if the pipe closed first (it died)."""
    done: asyncio.Future[bool] = loop.create_future()

    def readable() -> None:
        try:
            data = os.read(fd, 1)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        loop.remove_reader(fd)
        os.close(fd)
        if not done.done():
            done.set_result(bool(data))

    def cancelled(fut: "asyncio.Future[bool]") -> None:
        if fut.cancelled():  # the supervisor is unwinding: let go of the pipe
            loop.remove_reader(fd)
            os.close(fd)

    os.set_blocking(fd, False)
    loop.add_reader(fd, readable)
    done.add_done_callback(cancelled)
    return done
