"""The local replica sync's transport, in-process: kv-aware policies of two (three) server
processes connected over Unix sockets in a private runtime folder. The protocol is the NATS sync's
(tests/unit/test_replica_sync.py covers it over a fake broker); what is checked here is that the
bytes go round: starts, finishes, a sibling that starts late or restarts, one that stops reading,
and the supervisor's goodbye for a child that died."""
from __future__ import annotations

import os
import shutil
import stat

import pytest

import infera.transport.replica_sync_local as local
from infera.kv.prompt import PromptTokenizer
from infera.router.kv_aware import KvAwarePolicy
from infera.server.supervisor import make_runtime_dir
from infera.transport.replica_sync_local import LocalReplicaSync, announce_gone, frame, sync_socket
from tests.conftest import wait_for
from tests.unit.test_kv_aware_policy import PROMPT, FakeIndex, request, worker

A_, B_ = worker("a"), worker("b")
OTHER = list(range(500, 532))


@pytest.fixture
async def siblings():
    """``make(name, index, count)``: a policy with its local sync, started; replicas share one
    index (each reads every engine's events)."""
    runtime_dir = make_runtime_dir()
    index = FakeIndex()
    syncs: list[LocalReplicaSync] = []

    async def make(name: str, i: int, count: int = 2) -> tuple[KvAwarePolicy, LocalReplicaSync]:
        sync = LocalReplicaSync(runtime_dir, i, count, replica_id=name)
        policy = KvAwarePolicy(index, PromptTokenizer.from_path(None), overlap_weight=16.0, replica_sync=sync)
        await sync.start()
        syncs.append(sync)
        await wait_for(lambda: sync.subscribed, 10, interval=0.005, message=f"{name} listening")
        return policy, sync

    yield make, runtime_dir
    for sync in syncs:
        await sync.stop()
    shutil.rmtree(runtime_dir, ignore_errors=True)


async def start(policy: KvAwarePolicy, workers, prompt):
    req = request(prompt)
    await policy.prepare(req)
    w = policy.pick(workers, req, "mixed")
    policy.on_started(w, req)
    return w, req


def connected(*syncs: LocalReplicaSync) -> bool:
    return all(s.stats()["siblings_connected"] == s.count - 1 for s in syncs)


async def test_starts_and_finishes_go_round(siblings):
    make, runtime_dir = siblings
    assert stat.S_IMODE(os.stat(runtime_dir).st_mode) == 0o700  # the sockets are the server's alone
    (pa, sa), (pb, sb) = await make("A", 0), await make("B", 1)
    await wait_for(lambda: connected(sa, sb), 5, interval=0.005, message="siblings connected")
    w, req = await start(pa, [A_, B_], PROMPT)
    await wait_for(lambda: pb.active_blocks(w.worker_id) == 8, 5, interval=0.002, message="A's start at B")
    req.state["served"] = True
    pa.on_finished(w, req)
    await wait_for(lambda: pb.active_blocks(w.worker_id) == 0 and pb.replicas.remote_finished == 1, 5,
                   interval=0.002, message="A's finish at B")
    assert pb.landed.get(w.worker_id)  # its blocks count as cached there until the events catch up
    assert sa.stats()["gaps"] == sb.stats()["gaps"] == 0 and "A" not in pa.replicas.peers


async def test_a_late_sibling_learns_what_is_in_flight(siblings):
    make, _ = siblings
    pa, sa = await make("A", 0)
    await start(pa, [A_], PROMPT)  # B is not listening yet: skipped for it
    pb, sb = await make("B", 1)
    await wait_for(lambda: pb.active_blocks("a") == 8, 10, interval=0.01, message="B learns A's request")
    assert sa.frames_skipped >= 1


async def test_a_restarted_sibling_is_reconnected_and_told_everything(siblings):
    make, _ = siblings
    (pa, sa), (pb, sb) = await make("A", 0), await make("B", 1)
    await wait_for(lambda: connected(sa, sb), 5, interval=0.005, message="siblings connected")
    await start(pa, [A_], PROMPT)
    await wait_for(lambda: pb.active_blocks("a") == 8, 5, interval=0.002, message="A's start at B")
    await sb.stop()  # B goes away and a new B takes its place (a restarted child)
    pb2, sb2 = await make("B2", 1)
    await wait_for(lambda: pb2.active_blocks("a") == 8, 10, interval=0.01, message="the new B learns A's request")
    await start(pa, [B_], OTHER)
    await wait_for(lambda: pb2.active_blocks("b") == 8, 5, interval=0.002, message="and hears what follows")
    assert sa.reconnects >= 1


async def test_a_sibling_that_stops_reading_is_skipped_then_repaired(siblings, monkeypatch):
    """B stops reading (stuck, SIGSTOPped): A's writes back up past the kernel's buffers, then A
    skips B instead of queueing without bound. Once B reads again, the gap makes it ask for A's
    full state: it ends up with exactly what A has in flight (the finishes it missed included)."""
    monkeypatch.setattr(local, "MAX_BUFFERED_BYTES", 64 * 1024)
    make, _ = siblings
    (pa, sa), (pb, sb) = await make("A", 0), await make("B", 1)
    await wait_for(lambda: connected(sa, sb), 5, interval=0.005, message="siblings connected")
    live = [await start(pa, [A_], list(range(100 * i, 100 * i + 256))) for i in range(5)]  # 64 blocks each
    await wait_for(lambda: pb.active_blocks("a") == 5 * 64, 5, interval=0.002, message="B knows them")
    for t in [r.transport for r in sb._readers]:
        t.pause_reading()
    n = 0
    while sa.frames_skipped == 0:  # requests that start and finish: deltas pile up, A's state stays small
        n += 1
        assert n <= 20000, "A never saw a backlog"
        w, req = await start(pa, [A_], list(range(1000 * n, 1000 * n + 256)))
        req.state["served"] = True
        pa.on_finished(w, req)
        if n % 50 == 0:
            await wait_for(lambda: not sa.share.outbox, 5, interval=0.001, message="A's outbox sent")
    for t in [r.transport for r in sb._readers]:
        t.resume_reading()
    live.append(await start(pa, [A_], list(range(600, 856))))  # the next message shows B the gap
    await wait_for(lambda: len(pb.replicas.peers["A"].entries) == 6 and pb.active_blocks("a") == 6 * 64, 10,
                   interval=0.01, message="B converges on A's state (gap → full state, heartbeat)")
    assert sb.gaps >= 1


async def test_the_supervisor_says_goodbye_for_a_dead_child(siblings):
    make, runtime_dir = siblings
    (pa, sa), (pb, _) = await make("A", 0), await make("B", 1)
    await start(pa, [A_], PROMPT)
    await wait_for(lambda: pb.active_blocks("a") == 8, 5, interval=0.002, message="A's start at B")
    sa._task.cancel()
    await sa._close()  # A "dies": it says nothing more
    assert await announce_gone(runtime_dir, 2, "A") == 1  # B listens; A's socket does not any more
    await wait_for(lambda: pb.active_blocks("a") == 0 and "A" not in pb.replicas.peers, 2, interval=0.002,
                   message="B dropped A at once (not after the peer timeout)")


async def test_garbage_on_the_socket_is_counted_and_dropped(siblings):
    import asyncio

    make, runtime_dir = siblings
    pb, sb = await make("B", 1)
    _, writer = await asyncio.open_unix_connection(sync_socket(runtime_dir, 1))
    writer.write(frame("infera.replicas.x", b"\xc1 not msgpack") + b"\xff" * 6)  # then an absurd length
    await writer.drain()
    await wait_for(lambda: sb.decode_errors >= 2, 5, interval=0.005, message="both counted")
    writer.close()
    assert not pb.replicas.peers
