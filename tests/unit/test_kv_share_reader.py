"""A reader process's KV views (infera/server/kv_share.py, ``SharedViewBridge``) as a state machine:
every target warms until the writer's rows say it caught up, a row's stream state reaches the
target's state, a writer lost makes every target warm again (picks by load), an engine restart seen
in the registry drops what this process's policy credited there; and the writer's rows are what its
bridge and index hold."""
from __future__ import annotations

import pytest

from infera.discovery.fleet import Fleet
from infera.discovery.record import WorkerRecord
from infera.kv.index import NativeKvIndex
from infera.kv.index_shared import SharedKvIndex
from infera.kv.native import native
from infera.server.kv import KvEventsBridge
from infera.server.kv_share import SharedViewBridge, arena_bytes, writer_rows

pytestmark = pytest.mark.skipif(native is None, reason="the C accelerator is not built")

BS = 4


def record(wid: str, port: int = 5557, **kw) -> WorkerRecord:
    return WorkerRecord(worker_id=wid, url=f"http://{wid}:1", model_name="m", engine="vllm", kv_block_size=BS,
                        kv_events_endpoint=f"tcp://127.0.0.1:{port}", **kw)


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def row(key: str, bit: int, *, blocks: int = 5, seq: int = -1, age: float = -1.0, degraded: str = "",
        warming: int = 0, restarts: int = 0) -> list:
    return [key, bit, BS, blocks, 12.5, seq, age, degraded, warming, 4, restarts]


def test_targets_warm_until_the_writer_says_and_follow_its_rows(tmp_path) -> None:
    fleet, clock = Fleet(), Clock()
    bridge = SharedViewBridge(fleet, SharedKvIndex(), str(tmp_path / "s.sock"), clock=clock)
    restarted: list[str] = []
    bridge.on_engine_restart.append(restarted.append)
    fleet.upsert(record("a"))
    fleet.upsert(record("b", 6000))
    assert bridge.warming == {"a", "b"}  # no writer yet: by load
    bridge.client.connected = True  # (as once a writer's hello came)
    bridge._rows({"t": [row("a", 0, seq=7, age=2.0), row("b", 1, warming=1), row("ghost", 2)], "n": 9})
    assert bridge.warming == {"b"}
    a = bridge.targets["a"]
    assert (a.last_seq, a.last_batch_at, a.degraded) == (7, 98.0, None)
    assert bridge.index.block_count("a") == 5 and bridge.index.events_made_until("a") == 12.5 and len(bridge.index) == 9
    assert bridge.index.evicted_entries("a") == 4 and bridge.index.tier_block_counts("a") == {}
    assert bridge.cache_view("a", None)["transport"] == "shared" and bridge.cache_view("a", None)["caught_up"]
    a.unconfirmed_since, a.silent = 99.0, True  # a routed miss waiting for events
    bridge._rows({"t": [row("a", 0, seq=8, age=0.0, degraded="gap"), row("b", 1)], "n": 9})
    assert a.unconfirmed_since is None and not a.silent and a.degraded == "gap"
    assert bridge.warming == set()
    bridge._rows({"t": [row("b", 1, restarts=1)], "n": 5})  # the writer dropped a's view (say, re-subscribing)
    assert bridge.warming == {"a"}
    assert restarted == ["b"]  # the writer found b's engine restarted in its stream
    assert bridge.targets["b"].restarts == 0  # (counted once, by the writer)
    bridge._rows({"t": [row("b", 1, restarts=1)], "n": 5})
    assert restarted == ["b"]
    bridge._lost()  # the writer died
    assert bridge.warming == {"a", "b"} and not bridge.index.attached and bridge.index.block_count("b") == 0
    fleet.upsert(record("b", 6100))  # b registers again with a new event stream: a new engine
    assert restarted == ["b", "b"] and "b" in bridge.warming
    fleet.remove("a")
    assert "a" not in bridge.targets and "a" not in bridge.warming
    assert bridge.index_role == "own"  # (the routing stack says reader)


def test_the_writer_rows_are_its_bridge_and_index(tmp_path) -> None:
    fleet, clock = Fleet(), Clock()
    index = NativeKvIndex(shared_bytes=arena_bytes(1 << 20))
    bridge = KvEventsBridge(fleet, index, clock=clock)
    fleet.upsert(record("a"))
    fleet.upsert(record("b", 6000))
    state = bridge.targets["a"]
    state.last_seq, state.last_batch_at, state.degraded = 3, 99.5, "history"
    bridge.warming.discard("a")
    msg = writer_rows(bridge)
    rows = {r[0]: r for r in msg["t"]}
    assert rows["a"][1:] == (index._targets["a"].bit, BS, 0, 0.0, 3, 0.5, "history", 0, 0, 0)
    assert rows["b"][5:] == (-1, -1.0, "", 1, 0, 0)
    assert msg["n"] == 0


@pytest.mark.parametrize("max_bytes, at_least", [(1 << 30, 2 << 30), (0, 64 << 20)])
def test_arena_room(max_bytes: int, at_least: int) -> None:
    assert arena_bytes(max_bytes) >= at_least


EVENT_STREAM_SERIES = {"infera_kv_event_batches", "infera_kv_block_events", "infera_kv_event_cpu_seconds",
                       "infera_kv_event_gaps", "infera_kv_view_resets", "infera_kv_event_delay_seconds",
                       "infera_kv_engine_restarts"}


def test_a_reader_exports_the_views_but_not_the_event_stream(tmp_path) -> None:
    fleet = Fleet()
    reader = SharedViewBridge(fleet, SharedKvIndex(), str(tmp_path / "s.sock"), clock=Clock())
    own = KvEventsBridge(fleet, NativeKvIndex())  # (never started: its collector reads its state)
    fleet.upsert(record("a"))
    own._on_fleet_change("a", fleet.get("a"))

    def families(bridge) -> dict[str, int]:
        return {f.name: len(f.samples) for f in bridge.collect()}

    mine, theirs = families(reader), families(own)
    assert EVENT_STREAM_SERIES <= set(theirs) and all(theirs[n] for n in EVENT_STREAM_SERIES)
    assert not EVENT_STREAM_SERIES & set(mine)  # the writer's carry them, once for the host
    for name in ("infera_kv_view_caught_up", "infera_policy_cache_view_size", "infera_kv_view_staleness_seconds"):
        assert mine[name] == theirs[name] == 1  # every process's own view of the target
