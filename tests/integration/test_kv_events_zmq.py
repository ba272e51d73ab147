"""The router's ZMQ KV-event subscriber against the simulator's real publisher (and, for forced gaps
and restarts, a tiny hand-driven publisher): order, replay, resets, removal."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio

from infera.engine.sim.cache import block_hashes
from infera.engine.sim.kv_events import KvEventsConfig
from infera.engine.sim.server import SimEngine, SimServer, parse_args
from infera.transport.kv_events_zmq import ZmqKvEventSubscriber
from tests.conftest import free_port, wait_for

pytestmark = pytest.mark.integration

BS = 16
TOPIC = b"kv-events"


def decode(payload: bytes):
    return msgspec.msgpack.decode(payload)  # [ts, [events], dp_rank] as plain Python objects


class Sink:
    """Records what the subscriber hands over."""

    def __init__(self) -> None:
        self.sub: ZmqKvEventSubscriber | None = None
        self.replayed: list[tuple[str, int]] = []  # batches the subscriber said were replayed history
        self.batches: list[tuple[str, int, list]] = []
        self.resets: list[str] = []
        self.log: list[tuple] = []  # batches and resets interleaved, in call order

    def on_batch(self, key: str, seq: int, payload: bytes) -> None:
        batch = decode(payload)
        if self.sub is not None and self.sub.replaying(key):
            self.replayed.append((key, seq))
        self.batches.append((key, seq, batch[1]))
        self.log.append(("batch", key, seq))

    def on_reset(self, key: str) -> None:
        self.resets.append(key)
        self.log.append(("reset", key))

    def seqs(self, key: str) -> list[int]:
        return [s for k, s, _ in self.batches if k == key]

    def events(self, key: str) -> list[dict]:
        return [e for k, _, evs in self.batches if k == key for e in evs]


@pytest.fixture
async def subscriber():
    sink = Sink()
    sub = ZmqKvEventSubscriber(sink.on_batch, sink.on_reset, replay_timeout=1.0)
    sink.sub = sub
    await sub.start()
    yield sub, sink
    await sub.stop()


def kv_args(pub: int, replay: int | None, *extra: str, blocks: int = 40):
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}", "topic": "kv-events"}
    if replay:
        cfg["replay_endpoint"] = f"tcp://*:{replay}"
    return parse_args(["--model", "sim-model", "--host", "127.0.0.1", "--port", "0", "--speedup", "1000",
                       "--block-size", str(BS), "--num-gpu-blocks", str(blocks), "--max-model-len", "512",
                       "--kv-events-config", json.dumps(cfg), *extra])


@pytest.fixture
async def sim():
    servers: list[SimServer] = []

    async def factory(pub: int | None = None, replay: int | None | bool = True, **kw) -> SimServer:
        pub = pub or free_port()
        replay = free_port() if replay is True else (replay or None)
        server = SimServer(kv_args(pub, replay, **kw))
        await server.start()
        server.kv_pub, server.kv_replay = pub, replay
        servers.append(server)
        return server

    yield factory
    for s in servers:
        await s.stop()


def endpoints(server: SimServer) -> tuple[str, str | None]:
    replay = f"tcp://127.0.0.1:{server.kv_replay}" if server.kv_replay else None
    return f"tcp://127.0.0.1:{server.kv_pub}", replay


def prompt(k: int, n: int = 100) -> list[int]:
    return [1000 + 997 * k + i for i in range(n)]


async def complete(server: SimServer, *prompts: list[int], max_tokens: int = 30) -> None:
    async with aiohttp.ClientSession() as s:
        for p in prompts:
            async with s.post(server.url + "/v1/completions",
                              json={"prompt": p, "max_tokens": max_tokens, "ignore_eos": True}) as r:
                assert r.status == 200, await r.text()


def published(server: SimServer) -> int:
    return server.engine.kv_events.next_seq


async def wait_caught_up(sub: ZmqKvEventSubscriber, key: str, server: SimServer, timeout: float = 10) -> None:
    await wait_for(lambda: sub.stats(key)["last_seq"] == published(server) - 1, timeout,
                   message=f"{key} caught up with seq {published(server) - 1}")


# -- the real simulator ---------------------------------------------------------------------------------

async def test_batches_arrive_in_order_and_decode(sim, subscriber):
    sub, sink = subscriber
    server = await sim(blocks=40)
    sub.add("w1", *endpoints(server))
    await complete(server, *(prompt(k) for k in range(7)))  # 7 x 9 blocks > 40: evictions
    await wait_caught_up(sub, "w1", server)
    assert sink.seqs("w1") == list(range(published(server)))  # every batch, in order, once
    assert sink.resets == []

    events = sink.events("w1")
    stored = [e for e in events if e["type"] == "BlockStored"]
    removed = [e for e in events if e["type"] == "BlockRemoved"]
    assert stored and removed
    for e in stored:
        assert len(e["token_ids"]) == len(e["block_hashes"]) * e["block_size"] and e["block_size"] == BS
        assert e["medium"] == "GPU" and e["lora_id"] is None
    first = next(e for e in stored if e["parent_block_hash"] is None and e["token_ids"][:BS] == prompt(0)[:BS])
    assert first["token_ids"] == prompt(0)[: 6 * BS]  # the prompt's 6 full blocks, one event
    # Engine hashes are not the router's: a router must re-hash token_ids.
    assert not set(first["block_hashes"]) & set(block_hashes(first["token_ids"], BS))
    stored_hashes = {h for e in stored for h in e["block_hashes"]}
    assert all(e["block_hashes"][0] in stored_hashes for e in removed)
    st = sub.stats("w1")
    assert st["batches"] == published(server) and st["connected"] and st["endpoint"] == endpoints(server)[0]
    assert st["last_batch_at"] is not None and st["resets"] == 0


async def test_late_subscriber_recovers_by_replay_from_zero(sim, subscriber):
    sub, sink = subscriber
    server = await sim()
    await complete(server, prompt(0), prompt(1))
    n = published(server)
    assert n > 0
    sub.add("late", *endpoints(server))  # no new traffic: the proactive replay alone must deliver
    await wait_for(lambda: sink.seqs("late") == list(range(n)), 10, message="replayed batches")
    assert sub.stats("late")["replays"] >= 1 and sink.resets == []
    await wait_for(lambda: sub.stats("late")["caught_up"], 5, message="first-contact replay done")
    assert sink.replayed == [("late", s) for s in range(n)]  # said to be history while delivered
    # Then live batches continue the same sequence without duplicates.
    await complete(server, prompt(2))
    await wait_caught_up(sub, "late", server)
    assert sink.seqs("late") == list(range(published(server)))
    assert len(sink.replayed) == n and not sub.replaying("late")  # live batches are not history


async def test_reset_prefix_cache_emits_all_blocks_cleared(sim, subscriber):
    sub, sink = subscriber
    server = await sim()
    sub.add("w", *endpoints(server))
    await complete(server, prompt(0))
    await wait_caught_up(sub, "w", server)
    async with aiohttp.ClientSession() as s:
        async with s.post(server.url + "/reset_prefix_cache") as r:
            assert r.status == 200
    await wait_for(lambda: {"type": "AllBlocksCleared"} in sink.events("w"), 10, message="AllBlocksCleared")
    assert sink.batches[-1][2] == [{"type": "AllBlocksCleared"}]


async def test_publisher_restart_resets_the_view(sim, subscriber):
    sub, sink = subscriber
    a = await sim()
    sub.add("w", *endpoints(a))
    await complete(a, *(prompt(k) for k in range(4)))
    await wait_caught_up(sub, "w", a)
    before = published(a)
    assert before >= 8
    await a.stop()
    b = await sim(pub=a.kv_pub, replay=a.kv_replay)  # same ports, seq starts over at 0
    pokes = iter(range(10, 1000))

    async def poked() -> bool:  # the SUB reconnects on its own; a batch per poll until it shows
        if not sink.resets:
            await complete(b, prompt(next(pokes)), max_tokens=1)
        return bool(sink.resets)

    await wait_for(poked, 15, interval=0.2, message="on_reset after the restart")
    await wait_caught_up(sub, "w", b)
    assert published(b) < before
    after = sink.log.index(("reset", "w"))
    assert [e[2] for e in sink.log[after + 1:]] == list(range(published(b)))  # replayed from 0, in order
    assert sub.stats("w")["restarts"] == 1


async def test_remove_closes_the_socket(sim, subscriber):
    sub, sink = subscriber
    server = await sim()
    sub.add("gone", *endpoints(server))
    sub.add("witness", *endpoints(server))
    await complete(server, prompt(0))
    await wait_caught_up(sub, "gone", server)
    conn = sub._keys["gone"].conn
    assert conn.connected
    sub.remove("gone")
    await wait_for(lambda: not conn.connected and conn.protocol is None, 5, message="the connection closed")
    assert "gone" not in sub.keys()
    with pytest.raises(KeyError):
        sub.stats("gone")
    n = len(sink.seqs("gone"))
    await complete(server, prompt(1))
    await wait_caught_up(sub, "witness", server)
    assert len(sink.seqs("gone")) == n
    sub.remove("gone")  # idempotent


async def test_sglang_format_from_the_simulator(subscriber):
    sub, sink = subscriber
    port = free_port()
    args = kv_args(port, None)
    args.kv_events_config = KvEventsConfig.from_dict(
        {"publisher": "zmq", "endpoint": f"tcp://*:{port}", "topic": "kv-events"}, sglang=True)
    engine = SimEngine(args, kv_events_format="sglang")
    async with SimServer(args, engine) as server:
        sub.add("sg", f"tcp://127.0.0.1:{port}")
        pokes = iter(range(1000))

        async def poked() -> bool:  # no replay socket: traffic until the subscription is through
            if not sink.seqs("sg"):
                await complete(server, prompt(next(pokes)), max_tokens=4)
            return bool(sink.seqs("sg"))

        await wait_for(poked, 10, interval=0.1, message="a first sglang batch")
        await wait_for(lambda: sink.seqs("sg") and sink.seqs("sg")[-1] == published(server) - 1, 10,
                       message="sglang batches")
    ev = sink.events("sg")[0]
    # SGLang 0.5.22+ sends "type"-tagged maps (tests/fixtures/kv_events/README.md)
    assert ev["type"] == "BlockStored" and len(ev["token_ids"]) == len(ev["block_hashes"]) * ev["block_size"]
    assert ev["medium"] == "GPU"


# -- a hand-driven publisher: forced gaps and restarts ------------------------------------------------------

class TinyPublisher:
    """XPUB (so the test knows when the subscription arrived) + an optional vLLM-style replay ROUTER."""

    def __init__(self, replay: bool, sndhwm: int | None = None) -> None:
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if sndhwm is not None:  # before bind: a listener copies the options it accepts peers with
            self.pub.setsockopt(zmq.SNDHWM, sndhwm)
        self.pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.buffer: dict[int, bytes] = {}
        self.router = None
        self.replay_endpoint = None
        self.task = None
        self.served = 0
        if replay:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind("tcp://127.0.0.1:*")
            self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
            self.task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            ident, _, start = await self.router.recv_multipart()
            start = int.from_bytes(start, "big")
            for seq in sorted(self.buffer):
                if seq >= start:
                    await self.router.send_multipart([ident, b"", TOPIC, seq.to_bytes(8, "big"), self.buffer[seq]])
            await self.router.send_multipart([ident, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])
            self.served += 1

    async def subscribed(self) -> None:
        msg = await asyncio.wait_for(self.pub.recv(), 10)
        assert msg == b"\x01" + TOPIC

    def batch(self, seq: int, *, send: bool = True, tag: str = "") -> None:
        payload = msgspec.msgpack.encode([float(seq), [{"type": "BlockRemoved", "block_hashes": [seq],
                                                        "medium": tag or "GPU"}], 0])
        self.buffer[seq] = payload
        if send:
            self.pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload])

    async def close(self) -> None:
        if self.task:
            self.task.cancel()
            try:
                await self.task
            except asyncio.CancelledError:
                pass
        self.ctx.destroy(linger=0)


@pytest.fixture
async def tiny():
    pubs: list[TinyPublisher] = []

    async def factory(replay: bool) -> TinyPublisher:
        p = TinyPublisher(replay)
        pubs.append(p)
        return p

    yield factory
    for p in pubs:
        await p.close()


async def test_forced_gap_is_repaired_by_replay(subscriber, tiny):
    sub, sink = subscriber
    p = await tiny(replay=True)
    sub.add("w#dp0", p.endpoint, p.replay_endpoint)
    await p.subscribed()
    await wait_for(lambda: p.served == 1, 5, message="the initial (empty) replay")
    p.batch(0)
    p.batch(1)
    p.batch(2, send=False)  # lost on the way
    p.batch(3)
    p.batch(4)
    await wait_for(lambda: sink.seqs("w#dp0") == [0, 1, 2, 3, 4], 5, message="gap filled")
    st = sub.stats("w#dp0")
    assert (st["gaps"], st["replays"], st["resets"], st["last_seq"]) == (1, 2, 0, 4)
    assert sink.resets == []


async def test_forced_gap_without_replay_resets(subscriber, tiny):
    sub, sink = subscriber
    p = await tiny(replay=False)
    sub.add("w", p.endpoint)
    await p.subscribed()
    p.batch(0)
    p.batch(1)
    p.batch(2, send=False)
    p.batch(3)
    await wait_for(lambda: sink.seqs("w") == [0, 1, 3], 5, message="batches after the gap")
    assert sink.log == [("batch", "w", 0), ("batch", "w", 1), ("reset", "w"), ("batch", "w", 3)]
    assert sub.stats("w")["gaps"] == 1 and sub.stats("w")["resets"] == 1


async def test_failed_replay_resets(subscriber, tiny):
    sub, sink = subscriber
    p = await tiny(replay=False)
    dead = f"tcp://127.0.0.1:{free_port()}"  # nobody answers there
    sub.add("w", p.endpoint, dead)
    await p.subscribed()
    p.batch(0)
    await wait_for(lambda: sink.seqs("w") == [0], 5, message="seq 0")  # after the initial replay timed out
    assert sink.resets == []  # a failed replay on first contact loses nothing yet
    p.batch(2)
    await wait_for(lambda: sink.seqs("w") == [0, 2], 5, message="seq 2 after the failed replay")
    assert sink.resets == ["w"] and sub.stats("w")["replay_failures"] == 2


async def test_first_contact_without_replay_resets_unless_seq_zero(subscriber, tiny):
    sub, sink = subscriber
    p = await tiny(replay=False)
    sub.add("w", p.endpoint)
    await p.subscribed()
    p.batch(5)
    await wait_for(lambda: sink.seqs("w") == [5], 5, message="seq 5")
    assert sink.log == [("reset", "w"), ("batch", "w", 5)]


async def test_restart_resets_first_then_replays(subscriber, tiny):
    sub, sink = subscriber
    p = await tiny(replay=True)
    sub.add("w", p.endpoint, p.replay_endpoint)
    await p.subscribed()
    await wait_for(lambda: p.served == 1, 5, message="the initial (empty) replay")
    for s in range(4):
        p.batch(s)
    await wait_for(lambda: sink.seqs("w") == [0, 1, 2, 3], 5, message="first life")
    p.buffer.clear()  # the engine restarts: new buffer, seq from 0
    p.batch(0, send=False, tag="new")
    p.batch(1, tag="new")  # its seq 0 never reached us
    await wait_for(lambda: len(sink.seqs("w")) == 6, 5, message="second life")
    assert sink.log[4:] == [("reset", "w"), ("batch", "w", 0), ("batch", "w", 1)]
    assert [e["medium"] for e in sink.events("w")[4:]] == ["new", "new"]
    st = sub.stats("w")
    assert (st["restarts"], st["resets"], st["last_seq"]) == (1, 1, 1)


async def test_duplicates_after_replay_are_skipped_and_callback_errors_survive(subscriber, tiny):
    sub, sink = subscriber
    p = await tiny(replay=True)
    for s in range(3):
        p.batch(s, send=False)  # published before we subscribed: only replay has them
    failing = {"n": 0}

    def on_batch(key, seq, payload):
        sink.on_batch(key, seq, payload)
        if seq == 1 and not failing["n"]:
            failing["n"] += 1
            raise RuntimeError("boom")

    sub.on_batch = on_batch
    sub.add("w", p.endpoint, p.replay_endpoint)
    await p.subscribed()
    await wait_for(lambda: sink.seqs("w") == [0, 1, 2], 5, message="replayed")
    p.pub.send_multipart([TOPIC, (2).to_bytes(8, "big"), p.buffer[2]])  # a live copy of a replayed batch
    p.batch(3)
    await wait_for(lambda: sink.seqs("w") == [0, 1, 2, 3], 5, message="seq 3")
    st = sub.stats("w")
    assert (st["duplicates"], st["callback_errors"], st["resets"]) == (1, 1, 0)


async def test_restart_ahead_of_last_seq_is_caught_by_the_replay_anchor(subscriber, tiny):
    sub, sink = subscriber
    p = await tiny(replay=True)
    sub.add("w", p.endpoint, p.replay_endpoint)
    await p.subscribed()
    await wait_for(lambda: p.served == 1, 5, message="the initial (empty) replay")
    p.batch(0)
    p.batch(1)
    await wait_for(lambda: sink.seqs("w") == [0, 1], 5, message="first life")
    p.buffer.clear()  # restart; the new engine publishes 0..3 unseen, then 4 reaches us: looks like a gap
    for s in range(4):
        p.batch(s, send=False, tag="new")
    p.batch(4, tag="new")
    await wait_for(lambda: len(sink.seqs("w")) == 7, 5, message="second life")
    assert sink.log[2:] == [("reset", "w")] + [("batch", "w", s) for s in range(5)]
    assert [e["medium"] for e in sink.events("w")[2:]] == ["new"] * 5
    st = sub.stats("w")
    assert (st["restarts"], st["resets"], st["gaps"]) == (1, 1, 1)


async def test_re_adding_a_key_starts_over_with_a_replay(sim, subscriber):
    sub, sink = subscriber
    server = await sim()
    sub.add("w", *endpoints(server))
    await complete(server, prompt(0))
    await wait_caught_up(sub, "w", server)
    n = published(server)
    sub.add("w", *endpoints(server))  # e.g. the caller rebuilt its view: everything again, from 0
    await wait_for(lambda: sink.seqs("w") == list(range(n)) * 2, 10, message="replayed again from 0")
    assert sub.stats("w")["batches"] == n and sink.resets == []


# -- ATOM's publisher: no sequence frame, and no topic frame when its topic is empty ---------------------

@pytest.mark.parametrize("topic", ["", "kv-events"])
async def test_atom_publisher_one_and_two_frame_messages(topic):
    """The simulator publishing as ATOM v0.1.5 (``[payload]`` for an empty topic, else ``[topic,
    payload]``), read by a subscriber to every topic: each batch is delivered once, with seq -1 and
    no gap, restart or reset bookkeeping."""
    from infera.kv.events import Stored, decoder_for
    from infera.transport.kv_events_zmq import NO_SEQ

    sink = Sink()
    sub = ZmqKvEventSubscriber(sink.on_batch, sink.on_reset, replay_timeout=1.0, topic="")
    await sub.start()
    port = free_port()
    args = kv_args(port, None)
    args.kv_events_config = KvEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                           endpoint=f"tcp://127.0.0.1:{port}", topic=topic)
    engine = SimEngine(args, kv_events_format="atom")
    raw: list[list[bytes]] = []  # what a plain SUB sees on the same publisher: the frame layout
    ctx = zmq.asyncio.Context()
    probe = ctx.socket(zmq.SUB)
    probe.setsockopt(zmq.LINGER, 0)
    probe.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        async with SimServer(args, engine) as server:
            sub.add("atom", f"tcp://127.0.0.1:{port}")
            probe.connect(f"tcp://127.0.0.1:{port}")
            pokes = iter(range(1000))

            async def poked() -> bool:  # no replay socket: traffic until both subscriptions are through
                while await probe.poll(0):
                    raw.append(await probe.recv_multipart())
                if not (sink.batches and raw):
                    await complete(server, prompt(next(pokes)), max_tokens=4)
                return bool(sink.batches and raw)

            await wait_for(poked, 10, interval=0.1, message="a first ATOM batch on both sockets")
            first = len(sink.batches)
            await complete(server, prompt(10_000), max_tokens=4)
            await wait_for(lambda: len(sink.batches) > first, 10, message="the next ATOM batch")
    finally:
        probe.close()
        ctx.destroy(linger=0)
        await sub.stop()
    assert [len(m) for m in raw] == [1 if not topic else 2] * len(raw)  # the layout under test
    assert {seq for _, seq, _ in sink.batches} == {NO_SEQ}
    st = sub.stats("atom")
    assert (st["gaps"], st["restarts"], st["resets"], st["replays"]) == (0, 0, 0, 0) and sink.resets == []
    # the payload handed over is the whole batch, which the ATOM decoder reads
    dec = decoder_for("atom")
    stored = [ev for _, _, evs in sink.batches for ev in dec(msgspec.msgpack.encode([0.0, evs])).events
              if type(ev) is Stored]
    assert stored and all(len(ev.token_ids) == len(ev.block_hashes) * ev.block_size for ev in stored)


async def test_one_frame_message_from_a_hand_driven_publisher():
    """``[payload]`` alone, also when it is the first message and between sequenced ones."""
    sink = Sink()
    sub = ZmqKvEventSubscriber(sink.on_batch, sink.on_reset, replay_timeout=1.0, topic="")
    await sub.start()
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind("tcp://127.0.0.1:*")
    try:
        sub.add("a", pub.getsockopt_string(zmq.LAST_ENDPOINT))
        assert await asyncio.wait_for(pub.recv(), 10) == b"\x01"  # subscribed to every topic

        def payload(n: int) -> bytes:
            return msgspec.msgpack.encode([float(n), [["BlockRemoved", [n], "GPU"]], 0])

        await pub.send_multipart([payload(1)])
        await pub.send_multipart([payload(2)])
        await pub.send_multipart([TOPIC, (0).to_bytes(8, "big"), payload(3)])  # a sequenced one after
        await pub.send_multipart([payload(4)])
        await wait_for(lambda: len(sink.batches) == 4, 5, message="four batches")
    finally:
        ctx.destroy(linger=0)
        await sub.stop()
    assert [(seq, evs[0][1]) for _, seq, evs in sink.batches] == [(-1, [1]), (-1, [2]), (0, [3]), (-1, [4])]
    assert sink.resets == [] and sub.stats("a")["last_seq"] == 0


async def test_a_reader_whose_cancellation_is_lost_still_ends_when_its_key_is_removed(sim, subscriber, monkeypatch):
    """Python 3.11's wait_for can swallow a cancellation that lands just as its wait ends. A reader
    that lost one must still end with its key, not probe a removed worker forever (seen in CI: a
    server's shutdown hung on such a reader)."""
    sub, _ = subscriber
    server = await sim()
    probing, swallowed = asyncio.Event(), []

    async def probe_that_swallows_its_cancellation(st):
        probing.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            swallowed.append(st.key)

    monkeypatch.setattr(sub, "_probe", probe_that_swallows_its_cancellation)
    sub.add("w", *endpoints(server))
    await asyncio.wait_for(probing.wait(), 10)  # the first idle probe, 0.5 s after catching up
    reader = sub._keys["w"].task
    sub.remove("w")
    await wait_for(reader.done, 3, message="the reader ended although its cancellation was swallowed")
    assert swallowed == ["w"]


async def test_stop_is_bounded_by_a_task_that_ignores_cancellation(monkeypatch):
    import infera.transport.kv_events_zmq as module

    monkeypatch.setattr(module, "_STOP_WAIT_S", 0.5)
    sub = ZmqKvEventSubscriber(lambda *a: None, lambda *a: None)
    await sub.start()
    release = asyncio.Event()

    async def stubborn():
        while not release.is_set():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass

    task = asyncio.get_running_loop().create_task(stubborn())
    sub._closing.add(task)
    stopping = asyncio.ensure_future(sub.stop())
    await asyncio.wait({stopping}, timeout=3)  # not wait_for: cancelling a stop() stuck on the task hangs too
    release.set()
    assert stopping.done(), "stop() waited on a task that ignores cancellation"
    await stopping
    task.cancel()
    await asyncio.wait_for(task, 2)


# -- bounded messages from a real libzmq publisher (issue 26, item 7) ---------------------------------------

@pytest.mark.parametrize("splitter", ["native", "python"])
async def test_a_real_publishers_oversized_message_drops_the_connection_once_then_it_recovers(
        splitter, caplog, monkeypatch):
    """pyzmq's XPUB over tcp loopback, read by the ZMTP SUB with a 1 MiB / 64-frame message cap: a
    message under the caps arrives whole; one over either cap drops the connection at the header of
    the frame that passes it, with one warning naming only the limit; the SUB reconnects,
    resubscribes and reads on. (libzmq sends a multipart message only once its last part is queued,
    so a message that never ends cannot come from it: tests/unit/test_zmtp.py feeds that one from a
    raw socket.)"""
    import logging

    from infera.kv.native import native
    from infera.transport import zmtp
    from infera.transport.zmtp import ZmtpSubscription

    if splitter == "native":
        if native is None:
            pytest.skip("the C accelerator is not built")
    else:
        monkeypatch.setattr(zmtp, "_split", zmtp.split)
    caplog.set_level(logging.DEBUG, logger="infera.transport.zmtp")
    got: list[list[bytes]] = []
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every (re)subscription is seen, not only the first
    pub.bind("tcp://127.0.0.1:*")
    sub = ZmtpSubscription(pub.getsockopt_string(zmq.LAST_ENDPOINT), b"", got.append, reconnect_s=0.05,
                           max_message_bytes=1 << 20, max_message_frames=64)

    async def subscribed() -> None:
        while await asyncio.wait_for(pub.recv(), 10) != b"\x01":
            pass  # an unsubscription of the dropped connection

    secret = b"PROMPT-TEXT-"
    chunk = secret * (100_000 // len(secret))  # ~100 KB
    sub.start()
    try:
        await subscribed()
        under = [chunk] * 10 + [b"end"]  # ~1.0 MB in 11 frames: under both caps
        await pub.send_multipart(under)
        await wait_for(lambda: got == [under], 10, message="the message under the caps")

        await pub.send_multipart([chunk] * 12)  # ~1.2 MB
        await wait_for(lambda: sub.failures == 1, 10, message="the drop at the byte cap")
        await subscribed()
        await pub.send_multipart([b"after"])
        await wait_for(lambda: got[-1:] == [[b"after"]], 10, message="a message after the reconnection")

        await pub.send_multipart([b""] * 65)  # one frame over the frame cap
        await wait_for(lambda: sub.failures == 2, 10, message="the drop at the frame cap")
        await subscribed()
        await pub.send_multipart([b"again"])
        await wait_for(lambda: got[-1:] == [[b"again"]], 10, message="a message after the second reconnection")
    finally:
        await sub.close()
        ctx.destroy(linger=0)
    assert got == [under, [b"after"], [b"again"]] and sub.connects == 3
    lines = [r.getMessage() for r in caplog.records if r.name == "infera.transport.zmtp"]
    assert len(lines) == 2, lines  # one a drop: nothing per frame
    assert "a message of more than 1048576 bytes" in lines[0] and "a message of more than 64 frames" in lines[1]
    assert all(secret.decode() not in line for line in lines)


async def test_first_contact_replays_open_at_most_replay_concurrency_dealers():
    """A server meeting a fleet asks every engine's replay socket at once. At most
    ``replay_concurrency`` DEALERs are open together (each one's libzmq buffers stayed in the
    server's memory for good when 1,000 were opened at once); the other keys wait for a slot, and
    every key still catches up."""
    n, limit = 8, 3
    ctx = zmq.asyncio.Context()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    pub_ports, replay_ports = [free_port() for _ in range(n)], [free_port() for _ in range(n)]
    for port in pub_ports:
        pub.bind(f"tcp://127.0.0.1:{port}")
    for port in replay_ports:  # one ROUTER answers every engine's replay port
        router.bind(f"tcp://127.0.0.1:{port}")
    sink = Sink()
    sub = ZmqKvEventSubscriber(sink.on_batch, sink.on_reset, replay_timeout=10.0, replay_concurrency=limit)
    for i in range(n):
        sub.add(f"w{i}", f"tcp://127.0.0.1:{pub_ports[i]}", f"tcp://127.0.0.1:{replay_ports[i]}")
    end = [b"", (-1).to_bytes(8, "big", signed=True), b""]  # an empty history: the end marker only
    try:
        await sub.start()
        held = [await asyncio.wait_for(router.recv_multipart(), 10) for _ in range(limit)]
        await wait_for(lambda: sub.replay_load() == {"in_flight": limit, "waiting": n - limit, "limit": limit}, 10,
                       message=f"{limit} replays asked, {n - limit} waiting for a slot")
        assert not any(sub.stats(f"w{i}")["caught_up"] for i in range(n))
        for request in held:
            await router.send_multipart([request[0], *end])
        # Answer whatever comes (first contacts, then the caught-up keys' idle probes) until every
        # key has caught up, checking the bound at each request.
        deadline = asyncio.get_running_loop().time() + 10
        while not all(sub.stats(f"w{i}")["caught_up"] for i in range(n)):
            assert asyncio.get_running_loop().time() < deadline, "not every key caught up in 10 s"
            if await router.poll(100):
                request = await router.recv_multipart()
                assert sub.replay_load()["in_flight"] <= limit
                await router.send_multipart([request[0], *end])
        assert sum(sub.stats(f"w{i}")["replay_failures"] for i in range(n)) == 0
        assert sub.replay_load()["in_flight"] <= limit
    finally:
        await sub.stop()
        pub.close(linger=0)
        router.close(linger=0)
        ctx.term()


def test_replay_concurrency_must_be_positive():
    with pytest.raises(ValueError, match="replay_concurrency"):
        ZmqKvEventSubscriber(lambda k, s, p: None, lambda k: None, replay_concurrency=0)
