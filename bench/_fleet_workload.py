"""The fleet benchmark's engine workload (``bench/fleet_scale.py``): per engine, a chat workload on
an LRU pool of full KV blocks, as the vLLM KV events it makes, encoded once, replayed forever.

Conversations: a system prompt (one of 48, Zipf-chosen, 4-96 blocks), then 1-8 turns of a user
message (first turn 2-40 blocks, later 1-12, plus a partial block) and a reply of 1-2 blocks;
token ids are random in a 150k vocabulary. A conversation is **fleet** (probability ``sharing``:
one of a catalog every engine draws from, same tokens, so the same blocks, with fleet system
prompts) or **private** (this engine's own tokens and system prompts). Requests: with probability
0.5 the next turn of one of the engine's open conversations (at most 16), else a new one.

Each request is what vLLM does to its pool (block size 16): the prompt's cached prefix is hit, its
other full blocks are stored as one ``BlockStored`` (parent: the last hit block), each block the
reply fills as a ``BlockStored`` of its own, and blocks the pool has no room for are evicted
least-recently-used first, one ``BlockRemoved`` each, ahead of the stores. A request's blocks are
touched tail first (vLLM frees a finished request's blocks in reverse), so a chain is evicted from
its tail and what stays cached of a conversation is always a prefix. One batch per request.

Periodic: the engine's request sequence is a fixed **period** that touches at least ``1.5 × pool``
distinct blocks. An LRU pool's content and order after a sequence that touches at least ``pool``
distinct blocks depend on that sequence alone, so after the first period (the warm-up, which fills
the pool from empty) every later period emits exactly the same events: the second period's batches
are encoded once and sent in a loop. Payloads are vLLM 0.32's bytes (``infera.engine.sim``'s
encoder, every field vLLM writes) with the batch timestamp at a fixed offset, re-stamped at send.
"""
from __future__ import annotations

import random
import struct
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable

import xxhash

from infera.engine.sim.kv_events import RemovedEvent, StoredEvent, encode_batch

VOCAB = 150_000
SYSTEM_PROMPTS = 48
MAX_OPEN = 16
CONTINUE_P = 0.5
PERIOD_POOLS = 1.5  # distinct blocks a period touches, in pools (>= 1 makes the events periodic)
CATALOG_POOLS = 3.0  # distinct blocks of the fleet catalog, in pools
ENGINE_HASH_SEED = 0x5EED
TS_OFFSET = 2  # msgpack [ts, events, rank]: 0x93, 0xcb (float64), then the 8 bytes of ts
_TS = struct.Struct(">d")


@dataclass
class Conversation:
    tokens: array  # 'I'
    hashes: list[int]  # engine hash of every full block of ``tokens``
    turns: list[tuple[int, int]]  # (prompt end, reply end) token offsets of each turn


@dataclass
class Batch:
    """One request's events (structured, before encoding)."""
    removed: list[int] = field(default_factory=list)
    stored: list[tuple[list[int], int | None, list[int]]] = field(default_factory=list)  # (hashes, parent, tokens)

    @property
    def block_events(self) -> int:
        return len(self.removed) + sum(len(h) for h, _, _ in self.stored)


def _tokens(rng: random.Random, n: int) -> array:
    out = array("I", rng.randbytes(4 * n))
    return array("I", (x % VOCAB for x in out))


def chain(tokens: array, bs: int, parent: int = 0, start: int = 0) -> list[int]:
    """Engine hashes of the full blocks of ``tokens`` from block ``start`` on, chained from ``parent``."""
    out = []
    raw = tokens.tobytes()
    for b in range(start, len(tokens) // bs):
        parent = xxhash.xxh64_intdigest(parent.to_bytes(8, "little") + raw[4 * b * bs:4 * (b + 1) * bs],
                                        seed=ENGINE_HASH_SEED)
        out.append(parent)
    return out


class Source:
    """System prompts and conversations from one seed: the fleet's catalog, or one engine's own."""

    def __init__(self, seed: int | str, bs: int) -> None:
        self.rng = random.Random(f"fleet-src-{seed}")
        self.bs = bs
        self.system = []
        for _ in range(SYSTEM_PROMPTS):
            toks = _tokens(self.rng, bs * self.rng.randint(4, 96))
            self.system.append((toks, chain(toks, bs)))
        self.weights = [1.0 / (i + 1) for i in range(SYSTEM_PROMPTS)]

    def conversation(self) -> Conversation:
        rng, bs = self.rng, self.bs
        sys_toks, sys_hashes = rng.choices(self.system, self.weights)[0]
        toks = array("I", sys_toks)
        turns = []
        for t in range(rng.randint(1, 8)):
            toks.extend(_tokens(rng, bs * (rng.randint(2, 40) if t == 0 else rng.randint(1, 12)) + rng.randrange(bs)))
            prompt_end = len(toks)
            toks.extend(_tokens(rng, bs * rng.randint(1, 2)))
            turns.append((prompt_end, len(toks)))
        hashes = sys_hashes + chain(toks, bs, sys_hashes[-1], len(sys_hashes))
        return Conversation(toks, hashes, turns)


class Catalog:
    """The fleet conversations every engine draws from (same tokens everywhere): conversations are
    made until they hold ``CATALOG_POOLS × pool`` distinct blocks."""

    def __init__(self, seed: int, bs: int, pool: int) -> None:
        src = Source(f"catalog-{seed}", bs)
        self.conversations: list[Conversation] = []
        seen: set[int] = set()
        while len(seen) < CATALOG_POOLS * pool:
            conv = src.conversation()
            self.conversations.append(conv)
            seen.update(conv.hashes)
        self.distinct_blocks = len(seen)


def requests(engine: int, seed: int, bs: int, pool: int, sharing: float,
             catalog: Catalog) -> list[tuple[Conversation, int]]:
    """One period of (conversation, turn) requests for ``engine``: until ``PERIOD_POOLS × pool``
    distinct blocks are touched."""
    rng = random.Random(f"fleet-req-{seed}-{engine}")
    own = Source(f"engine-{seed}-{engine}", bs)
    out: list[tuple[Conversation, int]] = []
    open_convs: list[list] = []  # [conversation, next turn]
    touched: set[int] = set()
    target = PERIOD_POOLS * pool
    while len(touched) < target:
        if open_convs and rng.random() < CONTINUE_P:
            i = rng.randrange(len(open_convs))
            conv, turn = open_convs[i]
            if turn + 1 < len(conv.turns):
                open_convs[i][1] += 1
            else:
                open_convs.pop(i)
        else:
            if rng.random() < sharing:
                conv = catalog.conversations[rng.randrange(len(catalog.conversations))]
            else:
                conv = own.conversation()
            turn = 0
            if len(conv.turns) > 1:
                open_convs.append([conv, 1])
                if len(open_convs) > MAX_OPEN:
                    open_convs.pop(0)
        out.append((conv, turn))
        touched.update(conv.hashes[:conv.turns[turn][1] // bs])
        if len(out) > 1000 * pool:  # a catalog too small for the period
            raise ValueError("the workload cannot touch enough distinct blocks")
    return out


def simulate(reqs: Iterable[tuple[Conversation, int]], pool: int, bs: int,
             lru: "OrderedDict[int, None]") -> list[Batch]:
    """vLLM's events for ``reqs`` on the LRU pool ``lru`` (most recent last; updated in place)."""
    out = []
    for conv, turn in reqs:
        prompt_end, full_end = conv.turns[turn]
        n_prompt, n_full = prompt_end // bs, full_end // bs
        hashes = conv.hashes[:n_full]
        if n_full > pool:
            raise ValueError(f"a request of {n_full} blocks does not fit a pool of {pool}")
        hit = 0  # (a reply's blocks can be cached too: the same turn of a fleet conversation, again)
        while hit < n_full and hashes[hit] in lru:
            hit += 1
        for h in reversed(hashes[:hit]):  # in use: the most recent (evicting never takes them)
            lru.move_to_end(h)
        batch = Batch()
        # What stays cached of a chain is a prefix (a block's parent is touched after it, so it is
        # evicted after it): every block past the hit is absent.
        while len(lru) + n_full - hit > pool:
            batch.removed.append(lru.popitem(last=False)[0])
        toks = conv.tokens
        if hit < n_prompt:
            batch.stored.append((hashes[hit:n_prompt], hashes[hit - 1] if hit else None,
                                 toks[hit * bs:n_prompt * bs].tolist()))
        for b in range(max(hit, n_prompt), n_full):  # reply-filled blocks, one event each
            batch.stored.append(([hashes[b]], hashes[b - 1] if b else None, toks[b * bs:(b + 1) * bs].tolist()))
        for h in reversed(hashes[hit:]):  # tail first: the head is the most recent, evicted last
            lru[h] = None
        for h in reversed(hashes[:hit]):
            lru.move_to_end(h)
        out.append(batch)
    return out


def encode(batch: Batch, bs: int) -> bytes:
    """vLLM 0.32's msgpack payload, timestamp 0.0 (``stamp`` sets it)."""
    events: list = [RemovedEvent([h]) for h in batch.removed]
    events += [StoredEvent(list(h), p, t, bs) for h, p, t in batch.stored]
    payload = encode_batch(events, "vllm", ts=0.0)
    assert payload[:TS_OFFSET] == b"\x93\xcb"
    return payload


def stamp(payload: bytes, ts: float) -> bytes:
    """``payload`` with its batch timestamp set to ``ts``."""
    return payload[:TS_OFFSET] + _TS.pack(ts) + payload[TS_OFFSET + 8:]


@dataclass
class EngineEvents:
    warm: list[tuple[bytes, int]]  # first period from an empty pool: (payload, block events)
    loop: list[tuple[bytes, int]]  # every later period (sent in a loop)


def engine_events(engine: int, seed: int, bs: int, pool: int, sharing: float, catalog: Catalog) -> EngineEvents:
    reqs = requests(engine, seed, bs, pool, sharing, catalog)
    lru: OrderedDict[int, None] = OrderedDict()
    warm = [(encode(b, bs), b.block_events) for b in simulate(reqs, pool, bs, lru)]
    loop = [(encode(b, bs), b.block_events) for b in simulate(reqs, pool, bs, lru)]
    return EngineEvents(warm, loop)
