"""The /dashboard page in a real headless Chromium, driven over the Chrome DevTools Protocol with
aiohttp's websocket client: a sim fleet (two mixed workers and a 1P1D pair) in a real etcd, a real
server with an admin token; a ?token= link only gets the sign-in form, the page signs in through
that form (POST), shows every worker, and shows a worker
gone after its launcher is SIGKILLed. Screenshots land in $INFERA_TEST_ARTIFACTS (default
/tmp/infera-artifacts)."""
from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import wait_for
from tests.integration.conftest import wait_workers

pytestmark = pytest.mark.integration

TOKEN = "dashboard-e2e-token"
CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")
NIXL = {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"}


def chromium_path() -> str | None:
    for path in (os.environ.get("INFERA_CHROMIUM"), *CHROMIUM_CANDIDATES):
        if path and os.access(path, os.X_OK):
            return path
    return shutil.which("chromium")


def artifacts_dir() -> Path:
    path = Path(os.environ.get("INFERA_TEST_ARTIFACTS") or "/tmp/infera-artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


class Cdp:
    """One browser-level DevTools websocket; page commands go to a flattened target session."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self.events: list[dict] = []
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for msg in self.ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                break
            data = json.loads(msg.data)
            fut = self._pending.pop(data.get("id", -1), None)
            if fut is not None and not fut.done():
                fut.set_result(data)
            elif "method" in data:
                self.events.append(data)
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ConnectionError("DevTools websocket closed"))

    async def send(self, method: str, params: dict | None = None, session: str | None = None,
                   timeout: float = 30) -> dict:
        msg_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[msg_id] = fut
        msg: dict[str, Any] = {"id": msg_id, "method": method, "params": params or {}}
        if session is not None:
            msg["sessionId"] = session
        await self.ws.send_str(json.dumps(msg))
        reply = await asyncio.wait_for(fut, timeout)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    async def close(self) -> None:
        self._reader.cancel()
        await self.ws.close()


@pytest.fixture
async def browser():
    exe = chromium_path()
    if exe is None:
        if os.environ.get("INFERA_E2E_REQUIRED") == "1":
            pytest.fail("INFERA_E2E_REQUIRED=1 but no Chromium was found (apt-get install -y chromium)")
        pytest.skip("no Chromium at /usr/bin/chromium (apt-get install -y chromium; .ci/run installs it)")
    profile = tempfile.mkdtemp(prefix="infera-chromium-")
    proc = subprocess.Popen([exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                             "--disable-background-networking", "--disable-component-update", "--disable-sync",
                             "--disable-dev-shm-usage", "--window-size=1440,1000", f"--user-data-dir={profile}",
                             "--remote-debugging-port=0", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    active = Path(profile) / "DevToolsActivePort"
    session = aiohttp.ClientSession()
    cdp = None
    try:
        await wait_for(lambda: active.exists() and len(active.read_text().splitlines()) >= 2 or proc.poll() is not None,
                       30, message="Chromium's DevToolsActivePort")
        assert proc.poll() is None, f"Chromium exited with {proc.returncode}"
        port, path = active.read_text().splitlines()[:2]
        cdp = Cdp(await session.ws_connect(f"ws://127.0.0.1:{port}{path}", max_msg_size=64 * 1024 * 1024))
        yield cdp
    finally:
        if cdp is not None:
            await cdp.close()
        await session.close()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        shutil.rmtree(profile, ignore_errors=True)


async def open_page(cdp: Cdp, url: str) -> str:
    target = (await cdp.send("Target.createTarget", {"url": "about:blank"}))["targetId"]
    session = (await cdp.send("Target.attachToTarget", {"targetId": target, "flatten": True}))["sessionId"]
    await cdp.send("Runtime.enable", session=session)
    await cdp.send("Page.enable", session=session)
    await cdp.send("Log.enable", session=session)  # CSP violations and failed loads show here
    await cdp.send("Page.navigate", {"url": url}, session=session)
    return session


async def evaluate(cdp: Cdp, session: str, expression: str) -> Any:
    result = await cdp.send("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session=session)
    if "exceptionDetails" in result:
        raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
    return result["result"].get("value")


CARDS = """JSON.stringify(Object.fromEntries([...document.querySelectorAll('#models .worker')]
            .map(e => [e.dataset.workerId, e.dataset.health])))"""
RATES = """Object.fromEntries([...document.querySelectorAll('#models .worker')].map(e => [e.dataset.workerId,
            [...e.querySelectorAll('.grid > div')].find(c => c.querySelector('.k').textContent === 'req/s')
            .querySelector('.v').textContent]))"""
DEPARTED = "[...document.querySelectorAll('#departed .worker')].map(e => [e.dataset.workerId, e.dataset.health])"


async def screenshot(cdp: Cdp, session: str, name: str) -> Path:
    metrics = await cdp.send("Page.getLayoutMetrics", session=session)
    size = metrics.get("cssContentSize") or metrics["contentSize"]
    shot = await cdp.send("Page.captureScreenshot", {
        "format": "png", "captureBeyondViewport": True,
        "clip": {"x": 0, "y": 0, "width": max(1440, size["width"]), "height": size["height"], "scale": 1}},
        session=session)
    path = artifacts_dir() / name
    path.write_bytes(base64.b64decode(shot["data"]))
    print(f"dashboard screenshot: {path}")
    return path


async def test_dashboard_shows_the_fleet_and_a_killed_worker_leaving(browser, make_server, spawn_worker):
    server = await make_server("--admin-token", TOKEN)  # kv-aware, the default policy
    a, b = await spawn_worker(speedup=20.0), await spawn_worker(speedup=20.0)
    p = await spawn_worker("--kv-transfer-config", json.dumps({**NIXL, "kv_role": "kv_producer"}), model="pd")
    d = await spawn_worker("--kv-transfer-config", json.dumps({**NIXL, "kv_role": "kv_consumer"}), model="pd")
    ids = {a.worker_id, b.worker_id, p.worker_id, d.worker_id}
    await wait_workers(server, ids, timeout=60)
    base = f"http://127.0.0.1:{server.port}"
    statuses: dict[int, int] = {}
    stop = asyncio.Event()

    async def traffic() -> None:
        """Steady load while the page watches, so rates, sparklines, TTFT and KV blocks show."""
        async with aiohttp.ClientSession() as s:
            for i in itertools.count():
                if stop.is_set():
                    return
                for model in ("sim-model", "pd"):
                    topic = ("maps", "tides")[i % 2]  # two shared prefixes: kv-aware may spread them
                    body = {"model": model, "max_tokens": 6, "stream": i % 4 < 2,
                            "messages": [{"role": "system", "content": f"You answer questions on {topic}. " * 12},
                                         {"role": "user", "content": f"question {i}"}]}
                    try:
                        async with s.post(base + "/v1/chat/completions", json=body) as r:
                            await r.read()
                            status = r.status
                    except aiohttp.ClientError:
                        status = 0
                    statuses[status] = statuses.get(status, 0) + 1
                await asyncio.sleep(0.05)  # pacing: ~20 requests a second

    load = asyncio.create_task(traffic())
    try:
        await _watch(browser, base, a, b, p, d, ids)
    finally:
        stop.set()
        await load
    assert statuses.get(200, 0) >= 20, statuses


async def _watch(browser: Cdp, base: str, a, b, p, d, ids: set[str]) -> None:
    # a token in the URL signs nobody in (it would sit in access logs and history): the form does
    session = await open_page(browser, f"{base}/dashboard?token={TOKEN}")
    await wait_for(lambda: evaluate(browser, session, "!!document.getElementById('login')"), 10,
                   message="the sign-in form")
    await evaluate(browser, session, f"document.getElementById('token').value = {json.dumps(TOKEN)}; "
                                     "document.getElementById('login').submit(); true")

    async def signed_in() -> bool:
        try:  # (mid-navigation the page's context may be gone: not yet)
            return await evaluate(browser, session, "location.pathname === '/dashboard' && "
                                  "!document.getElementById('login') && document.readyState === 'complete'")
        except Exception:
            return False

    await wait_for(signed_in, 10, interval=0.1, message="signed in through the form")
    sign_in_events = len(browser.events)  # (the sign-in page itself is a 401: not an error of the dashboard)

    async def cards() -> dict[str, str]:
        return json.loads(await evaluate(browser, session, CARDS) or "{}")

    async def all_healthy() -> bool:
        shown = await cards()
        return set(shown) == ids and set(shown.values()) == {"healthy"}

    await wait_for(all_healthy, 30, interval=0.2, message="every worker healthy on the page")
    assert await evaluate(browser, session, "location.pathname + location.search") == "/dashboard"  # token gone
    pairs = await evaluate(browser, session, "document.querySelector('section[data-model=\"pd\"] .pairs').innerText")
    assert p.worker_id in pairs and d.worker_id in pairs and "nixl" in pairs.lower()
    roles = await evaluate(browser, session, "JSON.stringify([...document.querySelectorAll('.worker')]"
                                             ".map(e => [e.dataset.workerId, e.dataset.role]))")
    assert dict(json.loads(roles)) == {a.worker_id: "mixed", b.worker_id: "mixed", p.worker_id: "prefill",
                                       d.worker_id: "decode"}
    await wait_for(lambda: evaluate(browser, session, "document.getElementById('conn').className === 'ok'"), 10,
                   message="the page polling")

    async def rate_shown() -> bool:
        """Live rates (kv-aware keeps a shared prefix on one mixed worker: their sum) and sparklines."""
        rates = {w: float(v) for w, v in (await evaluate(browser, session, RATES)).items() if v != "–"}
        lines = await evaluate(browser, session, "document.querySelectorAll('#models .worker polyline').length")
        return (set(rates) == ids and rates[a.worker_id] + rates[b.worker_id] > 0 and rates[p.worker_id] > 0
                and rates[d.worker_id] > 0 and lines == 4)

    await wait_for(rate_shown, 20, interval=0.2, message="request rates and sparklines on the page")
    await screenshot(browser, session, "dashboard-before-kill.png")

    a.signal(signal.SIGKILL)  # the launcher's process group: its engine dies with it, its lease expires
    killed_at = time.monotonic()

    async def a_gone() -> bool:
        shown = await cards()
        return a.worker_id not in shown and [a.worker_id, "gone"] in await evaluate(browser, session, DEPARTED)

    await wait_for(a_gone, 15, interval=0.2, message="the killed worker gone from the page")
    assert set(await cards()) == ids - {a.worker_id}
    print(f"killed worker left the page {time.monotonic() - killed_at:.1f}s after SIGKILL")
    path = await screenshot(browser, session, "dashboard.png")
    assert path.stat().st_size > 10_000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    errors = [e for e in browser.events if e.get("method") == "Runtime.exceptionThrown"]
    assert errors == [], f"the page threw: {errors}"
    logged = [e["params"]["entry"] for e in browser.events[sign_in_events:] if e.get("method") == "Log.entryAdded"]
    assert [e for e in logged if e.get("level") == "error"] == [], logged
