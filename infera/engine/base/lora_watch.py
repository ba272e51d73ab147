"""A worker record's ``lora_adapters``, read from the engine and kept current.

vLLM (and the sim) list every loaded LoRA adapter in ``/v1/models`` with the base model as its
``parent``: static ``--lora-modules`` and runtime loads (``/v1/load_lora_adapter``, which a client
may send to the engine directly) alike. So the launcher observes rather than proxies: it reads the
list at registration (``probe_lora_adapters``) and, while registered, :class:`LoraWatch` polls it at
a bounded interval (``--lora-poll-interval``) and re-registers the record (``registration.update``)
whenever the set changes. Only engines started with ``--enable-lora`` are watched; every request
has a timeout, and a failed read keeps the last known list.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import aiohttp
import msgspec

from infera.config import add_flag, positive_float
from infera.discovery.record import WorkerRecord
from infera.runtime import cancel_and_wait, wait_for

log = logging.getLogger("infera.launcher.lora")

MODELS_TIMEOUT_S = 5.0
DEFAULT_POLL_INTERVAL_S = 2.0
POLL_INTERVAL_ENV = "INFERA_LORA_POLL_INTERVAL"


def lora_enabled(engine_argv: list[str]) -> bool:
    return "--enable-lora" in engine_argv or any(
        a.startswith("--enable-lora=") and a[14:].lower() in ("1", "true") for a in engine_argv
    )


DEFAULT_MAX_LORAS = 1  # vLLM's --max-loras default


def max_loras(engine_argv: list[str]) -> int:
    """The engine's ``--max-loras`` (``N`` or ``=N``; absent or unreadable: vLLM's default, 1), for
    the record's ``lora_max``; 0 when LoRA is off."""
    if not lora_enabled(engine_argv):
        return 0
    value: str | None = None
    for i, arg in enumerate(engine_argv):
        if arg == "--max-loras" and i + 1 < len(engine_argv):
            value = engine_argv[i + 1]
        elif arg.startswith("--max-loras="):
            value = arg.split("=", 1)[1]
    try:
        n = int(value) if value is not None else DEFAULT_MAX_LORAS
    except ValueError:
        return DEFAULT_MAX_LORAS  # the engine refuses it at start; the record's bound is moot
    return n if n > 0 else DEFAULT_MAX_LORAS


def adapters_from_models(data: Any, base_names: Iterable[str]) -> list[str] | None:
    """The adapters in a ``/v1/models`` body (entries whose ``parent`` is a base model), sorted;
    None when the body is not a model list."""
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        return None
    bases = set(base_names)
    found = {
        m["id"]
        for m in data["data"]
        if isinstance(m, dict) and isinstance(m.get("id"), str) and m.get("parent") is not None and m["id"] not in bases
    }
    return sorted(found)


async def probe_lora_adapters(
    session: aiohttp.ClientSession, base_url: str, base_names: Iterable[str]
) -> list[str] | None:
    """The engine's loaded adapters now (None: could not be read)."""
    try:
        async with session.get(base_url + "/v1/models", timeout=aiohttp.ClientTimeout(total=MODELS_TIMEOUT_S)) as resp:
            if resp.status != 200:
                return None
            return adapters_from_models(await resp.json(content_type=None), base_names)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        log.debug("cannot read /v1/models: %s", exc)
        return None


class LoraWatch:
    """Polls the engine's adapters and re-registers the record when they change."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        base_names: Iterable[str],
        get_record: Callable[[], WorkerRecord | None],
        set_record: Callable[[WorkerRecord], None],
        update: Callable[[WorkerRecord], Awaitable[Any]],
        interval: float = DEFAULT_POLL_INTERVAL_S,
    ) -> None:
        if interval <= 0:
            raise ValueError("the LoRA poll interval must be positive")
        self._session = session
        self._url = base_url
        self._bases = list(base_names)
        self._get_record = get_record
        self._set_record = set_record
        self._update = update
        self.interval = interval
        self.updates = 0  # records re-registered after a change
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="lora-watch")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def check(self) -> bool:
        """One poll: True when the record changed and was re-registered."""
        record = self._get_record()
        if record is None:
            return False
        adapters = await probe_lora_adapters(self._session, self._url, self._bases)
        if adapters is None or adapters == sorted(record.lora_adapters):
            return False
        record = msgspec.structs.replace(record, lora_adapters=adapters)
        self._set_record(record)
        await wait_for(self._update(record), MODELS_TIMEOUT_S * 2)
        self.updates += 1
        log.info("LoRA adapters now %s: record re-registered", adapters or "none")
        return True

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the next poll tries again; the record keeps its last list
                log.warning("LoRA adapter poll failed: %s", exc)


def add_lora_watch_flag(parser: Any, environ: Any = None) -> None:
    """``--lora-poll-interval`` (env ``INFERA_LORA_POLL_INTERVAL``), on the launcher's parser."""
    add_flag(
        parser,
        "--lora-poll-interval",
        env=POLL_INTERVAL_ENV,
        default=DEFAULT_POLL_INTERVAL_S,
        type=positive_float,
        environ=environ,
        help="seconds between reads of a LoRA engine's /v1/models (--enable-lora), so the record's "
        "adapters follow runtime loads and unloads",
    )


def lora_poll_interval(args: Any, environ: Any = None) -> float:
    """``--lora-poll-interval`` where the launcher has the flag (vLLM's), else ``INFERA_LORA_POLL_INTERVAL``
    (the sim launcher, whose flag list the operator mirrors), else the default."""
    value = getattr(args, "lora_poll_interval", None)
    if value is None:
        raw = (os.environ if environ is None else environ).get(POLL_INTERVAL_ENV, "").strip()
        value = positive_float(raw) if raw else DEFAULT_POLL_INTERVAL_S
    return float(value)


def start_lora_watch(launcher: Any, session: aiohttp.ClientSession) -> LoraWatch | None:
    """Start watching a just-registered engine's adapters (``launcher``: the ``Launcher``, its
    ``record``, ``registration``, ``engine_url``, ``spec``/``engine_argv`` and ``args``); None when
    the engine was not started with ``--enable-lora``. The caller stops it before deregistering."""
    argv = (launcher.spec.argv if launcher.spec is not None else None) or launcher.engine_argv
    record = launcher.record
    update = getattr(launcher.registration, "update", None)  # (etcd and Kubernetes registrations have it)
    if record is None or update is None or not lora_enabled(argv):
        return None
    watch = LoraWatch(
        session,
        launcher.engine_url,
        [record.model_name],
        lambda: launcher.record,
        lambda r: setattr(launcher, "record", r),
        update,
        interval=lora_poll_interval(launcher.args),
    )
    watch.start()
    return watch
