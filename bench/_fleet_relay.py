"""``bench/fleet_scale.py --mode nats``: the launchers' JetStream relays of a share of the engines,
in one process. For each engine's worker record it runs ``infera.transport.kv_relay_nats.
KvEventNatsRelay`` -- what ``python -m infera.engine.*`` runs beside a real engine when its events
go over NATS: it tails the engine's ZMQ PUB (replay included) and republishes every batch verbatim
into JetStream -- on one shared NATS connection.

Commands, one JSON line each on stdin, one JSON line answered on stdout:

* ``{"cmd": "start", "records": [<worker record JSON>, ...]}``: a relay per record, started (each
  has read its engine's replay buffer and sent its start marker before the answer);
* ``{"cmd": "stop"}``: every relay flushed, stopped and its subjects purged (the engines "die");
* ``{"cmd": "quit"}``.

``--nats-server URL``; the first line out is ``{"ready": true}`` once the connection is up.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from infera.discovery.record import decode_record  # noqa: E402
from infera.transport.kv_relay_nats import KvEventNatsRelay  # noqa: E402
from infera.transport.nats_conn import NatsConnection  # noqa: E402

CONNECT_TIMEOUT_S = 30.0


def _say(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def serve(url: str) -> int:
    nats = NatsConnection(url, name="fleet-bench-relay")
    await nats.start()
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while not nats.connected:
        if time.monotonic() > deadline:
            _say({"ready": False, "error": f"no NATS connection to {url} in {CONNECT_TIMEOUT_S:.0f}s"})
            return 1
        await asyncio.sleep(0.05)
    _say({"ready": True})
    loop = asyncio.get_running_loop()
    relays: list[KvEventNatsRelay] = []
    try:
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                return 0
            cmd = json.loads(line)
            what = cmd.get("cmd")
            if what == "quit":
                return 0
            if what == "start":
                new = [KvEventNatsRelay(nats, decode_record(r), start_timeout=30.0) for r in cmd["records"]]
                t0 = time.monotonic()
                await asyncio.gather(*(r.start() for r in new))
                relays += new
                _say({"ok": True, "relays": len(relays), "start_s": time.monotonic() - t0})
            elif what == "stop":
                await asyncio.gather(*(r.stop() for r in relays))
                relays = []
                _say({"ok": True})
            else:
                _say({"error": f"unknown command {what!r}"})
    finally:
        await asyncio.gather(*(r.stop() for r in relays), return_exceptions=True)
        await nats.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nats-server", required=True)
    args = ap.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    return asyncio.run(serve(args.nats_server))


if __name__ == "__main__":
    sys.exit(main())
