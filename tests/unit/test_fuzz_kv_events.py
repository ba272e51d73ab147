"""Fuzzing the KV-event payload parsers (issue 26, item 5): the decoders (``decoder_for``: vLLM and
the simulator's map form, SGLang's and ATOM's array form) and the C accelerator's
``GpuView.apply_payload`` (through :meth:`NativeKvIndex.apply_payload`), on arbitrary bytes, on
structure-aware payloads (every event form, odd values in every field, msgpack written in every
width it allows) and on the golden fixtures, mutated.

The contract, for every input: a decoder returns an :class:`EventBatch` of the public event types
or raises :class:`KvEventDecodeError`, nothing else (no RecursionError, TypeError...), in bounded
time; :meth:`PyKvIndex.apply` takes any batch a decoder returns. Where the accelerator is built,
the fast path and the decoders give the same verdict: ``apply_payload`` takes a payload only if
every decoder accepts it (then with the same counts and timestamp as decoding and applying), and
when it declines (None) it changed nothing; either way the native index ends in the state of
:class:`PyKvIndex` fed the decoded batches. (``INFERA_NATIVE=0``: those tests are skipped, the
decoder ones run.)
"""
from __future__ import annotations

import math
import random
import struct
import time
from pathlib import Path

import msgspec
import pytest
from hypothesis import example, given, settings, strategies as st

from infera.kv.events import (Cleared, EventBatch, KvEventDecodeError, Removed, Stored, decode_array_form,
                              decode_map_form, decoder_for)
from infera.kv.index import NativeKvIndex, PyKvIndex
from infera.kv.native import native, why_not
from tests.fuzzing import mutated

needs_native = pytest.mark.skipif(native is None, reason=f"C accelerator: {why_not}")

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "kv_events"
# single payloads (the *_frames / *_replay files are captures of whole exchanges)
FIXTURES = {p.stem: p.read_bytes() for p in sorted(FIX.glob("*.msgpack"))
            if not p.stem.endswith(("_frames", "_replay"))}
DECODERS = {"vllm": decoder_for("vllm"), "sglang": decoder_for("sglang"), "atom": decoder_for("atom"),
            "sim": decoder_for("sim")}
BS = 4

# Payloads that once escaped the decoders (msgspec refuses nesting past the recursion limit with a
# RecursionError): as events, as an unknown key's value in a known event, as the batch itself.
DEEP_EVENT = b"\x92\xcb" + bytes(8) + b"\x91" + b"\x91" * 20_000 + b"\xc0"
DEEP_FIELD = (b"\x92\xcb" + bytes(8) + b"\x91\x82\xa4type\xabBlockStored\xa1x" + b"\x91" * 20_000 + b"\xc0")
DEEP_BATCH = b"\x91" * 20_000 + b"\xc0"
# A key given twice: msgspec keeps the last value, and the fast path once kept a skipping kind
# ("sliding_window") through a later nil, skipping a store the decoders take.
KIND_TWICE = (b"\x92\xcb" + bytes(8) + b"\x91\x87\xa4type\xabBlockStored\xacblock_hashes\x91\x07"
              b"\xb1parent_block_hash\xc0\xa9token_ids\x94\x00\x01\x02\x03\xaablock_size\x04"
              b"\xb2kv_cache_spec_kind\xaesliding_window\xb2kv_cache_spec_kind\xc0")


# -- checks ----------------------------------------------------------------------------------------------
def _decode(decode, payload: bytes) -> EventBatch | None:
    """The decoder's verdict: a well-formed batch, or None for a KvEventDecodeError (anything else
    raised fails the test)."""
    try:
        batch = decode(payload)
    except KvEventDecodeError:
        return None
    assert type(batch) is EventBatch
    assert isinstance(batch.ts, float)
    assert batch.dp_rank is None or type(batch.dp_rank) is int
    for ev in batch.events:
        assert type(ev) in (Stored, Removed, Cleared), ev
        if type(ev) is Cleared:
            assert ev.medium is None or isinstance(ev.medium, str)
            continue
        assert all(type(h) in (int, bytes) for h in ev.block_hashes), ev
        assert ev.medium is None or isinstance(ev.medium, str)
        if type(ev) is Stored:
            assert ev.parent is None or type(ev.parent) in (int, bytes), ev
            assert all(type(t) is int for t in ev.token_ids), ev
            assert type(ev.block_size) is int
            assert ev.spec_kind is None or isinstance(ev.spec_kind, str)
    return batch


def _every_decoder_copes(payload: bytes) -> dict[str, EventBatch | None]:
    """Each engine's verdict; whatever a decoder returns, the Python index applies."""
    out = {}
    for engine, decode in DECODERS.items():
        batch = out[engine] = _decode(decode, payload)
        if batch is not None:
            idx = PyKvIndex()
            idx.add_target("w", BS)
            idx.apply("w", EventBatch(0.0, [SEED]))
            idx.apply("w", batch)
    return out


_STAT_FIELDS = ("stored_events", "stored_blocks", "removed_events", "removed_blocks", "dropped_events",
                "skipped_events", "misaligned_events", "cleared", "lower_events", "lower_stored_blocks",
                "lower_removed_blocks", "lower_cleared", "resets", "batches", "last_batch_ts")


def _same(py: PyKvIndex, nat: NativeKvIndex, key: str = "w") -> None:
    """The two indexes hold the same view of ``key``: counts, stats, the router hashes held (the
    Python set, all held natively, and as many) and the engine-to-router map, entry by entry."""
    assert len(py) == len(nat)
    assert py.block_count(key) == nat.block_count(key)
    assert py.mapped_count(key) == nat.mapped_count(key)
    assert py.tier_block_counts(key) == nat.tier_block_counts(key)
    assert py.lower_block_count(key) == nat.lower_block_count(key)
    ps, ns = py.stats(key), nat.stats(key)
    for f in _STAT_FIELDS:
        assert getattr(ps, f) == getattr(ns, f), f
    t = py._targets[key]
    held = [h for h, m in py._holders.items() if m & t.mask]
    assert len(held) == nat.block_count(key) and all(nat.holds(key, h) for h in held)
    nt = nat._targets[key]
    for eh, h in t.emap.items():
        assert nat._gpu_parent(nt, eh) == h, eh


def _same_result(got: tuple[int, float], want: tuple[int, float]) -> bool:
    return got[0] == want[0] and (got[1] == want[1] or (math.isnan(got[1]) and math.isnan(want[1])))


# Something for removals and parents to find: engine hashes 1, 2 (ints) and a 32-byte digest.
SEED = Stored([1, 2], None, list(range(2 * BS)), BS)
SEED_BYTES = Stored([b"a" * 32], None, list(range(100, 100 + BS)), BS)


def _indexes(block_size: int = BS) -> tuple[PyKvIndex, NativeKvIndex]:
    py, nat = PyKvIndex(), NativeKvIndex()
    for idx in (py, nat):
        idx.add_target("w", block_size)
        if block_size == BS:
            idx.apply("w", EventBatch(0.5, [SEED, SEED_BYTES]))
    return py, nat


def _differential(payloads: list[bytes], engine: str = "vllm", block_size: int = BS) -> int:
    """Feed ``payloads`` to the native index as the bridge does (fast path, else decode and apply)
    and to the Python one decoded; the verdicts and the states must agree after each. Returns how
    many took the fast path."""
    py, nat = _indexes(block_size)
    fast = 0
    for payload in payloads:
        done = nat.apply_payload("w", payload)
        if done is None:
            _same(py, nat)  # declined: nothing changed (py has not applied it yet)
        verdicts = _every_decoder_copes(payload) if done is not None else {engine: _decode(DECODERS[engine], payload)}
        batch = verdicts[engine]
        if done is not None:
            fast += 1
            # the fast path takes only what every engine's decoder takes, as the same batch
            assert all(b is not None for b in verdicts.values()), (payload, verdicts)
            first = verdicts["vllm"]
            assert all(b == first or _nan_ts_equal(b, first) for b in verdicts.values()), verdicts
        if batch is None:
            continue
        want = (py.apply("w", batch), batch.ts)
        got = done if done is not None else (nat.apply("w", batch), batch.ts)
        assert _same_result(got, want), (got, want, payload)
        _same(py, nat)
    return fast


def _nan_ts_equal(a: EventBatch, b: EventBatch) -> bool:
    return math.isnan(a.ts) and math.isnan(b.ts) and a.events == b.events and a.dp_rank == b.dp_rank


# -- msgpack written in any width it allows (the encoder always picks the shortest) ---------------------
def _pack(obj, rnd, out: bytearray) -> None:
    if obj is None:
        out += b"\xc0"
    elif obj is True or obj is False:
        out += b"\xc3" if obj else b"\xc2"
    elif isinstance(obj, int):
        forms = []
        if 0 <= obj <= 0x7f or -32 <= obj < 0:
            forms.append(struct.pack("b" if obj < 0 else "B", obj))
        for code, fmt, lo, hi in ((0xcc, ">B", 0, 0xff), (0xcd, ">H", 0, 0xffff), (0xce, ">I", 0, 2**32 - 1),
                                  (0xcf, ">Q", 0, 2**64 - 1), (0xd0, ">b", -128, 127), (0xd1, ">h", -2**15, 2**15 - 1),
                                  (0xd2, ">i", -2**31, 2**31 - 1), (0xd3, ">q", -2**63, 2**63 - 1)):
            if lo <= obj <= hi:
                forms.append(bytes((code,)) + struct.pack(fmt, obj))
        out += rnd.choice(forms)
    elif isinstance(obj, float):
        as32 = struct.pack(">f", obj) if math.isnan(obj) or math.isinf(obj) or abs(obj) < 3e38 else None
        if as32 is not None and struct.unpack(">f", as32)[0] == obj and rnd.random() < 0.5:
            out += b"\xca" + as32
        else:
            out += b"\xcb" + struct.pack(">d", obj)
    elif isinstance(obj, (str, bytes)):
        data = obj.encode("utf-8", "surrogatepass") if isinstance(obj, str) else obj
        n = len(data)
        if isinstance(obj, str):
            forms = ([bytes((0xa0 | n,))] if n < 32 else []) + [b"\xd9" + struct.pack(">B", n)] * (n < 256)
            forms += [b"\xda" + struct.pack(">H", n), b"\xdb" + struct.pack(">I", n)]
        else:
            forms = [b"\xc4" + struct.pack(">B", n)] * (n < 256) + [b"\xc5" + struct.pack(">H", n),
                                                                    b"\xc6" + struct.pack(">I", n)]
        out += rnd.choice(forms) + data
    elif isinstance(obj, (list, tuple)):
        n = len(obj)
        out += rnd.choice(([bytes((0x90 | n,))] if n < 16 else []) + [b"\xdc" + struct.pack(">H", n),
                                                                      b"\xdd" + struct.pack(">I", n)])
        for item in obj:
            _pack(item, rnd, out)
    elif isinstance(obj, dict):
        n = len(obj)
        out += rnd.choice(([bytes((0x80 | n,))] if n < 16 else []) + [b"\xde" + struct.pack(">H", n),
                                                                      b"\xdf" + struct.pack(">I", n)])
        for k, v in obj.items():
            _pack(k, rnd, out)
            _pack(v, rnd, out)
    elif isinstance(obj, _Map):
        n = len(obj.pairs)
        out += bytes((0x80 | n,)) if n < 16 else b"\xde" + struct.pack(">H", n)
        for k, v in obj.pairs:
            _pack(k, rnd, out)
            _pack(v, rnd, out)
    elif isinstance(obj, _Ext):
        out += obj.data
    else:  # pragma: no cover
        raise TypeError(obj)


class _Ext:
    """Raw msgpack bytes spliced in as one value (ext types, odd forms)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __repr__(self) -> str:
        return f"_Ext({self.data!r})"


class _Map:
    """A msgpack map with a key repeated (no dict can say that)."""

    def __init__(self, pairs: list) -> None:
        self.pairs = pairs

    def __repr__(self) -> str:
        return f"_Map({self.pairs!r})"


# -- strategies: events in every form, with odd values ---------------------------------------------------
odd_scalars = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=6)
               | st.binary(max_size=6)
               | st.sampled_from([_Ext(b"\xd4\x01\x00"), _Ext(b"\xd6\xff" + bytes(4)),  # ext; a timestamp
                                  _Ext(b"\xc7\x0c\xff" + bytes(12)), _Ext(b"\xd4\xff\x00"),  # and bad ones
                                  _Ext(b"\xc7\x00\x05")]))
BAD_UTF8_KEY = _Ext(b"\xa2\xff\xfe")  # a key that is no UTF-8 (skipped by both, as unknown keys are)
odd = st.recursive(odd_scalars, lambda inner: st.lists(inner, max_size=3)
                   | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=8)


@st.composite
def hashes(draw, unsigned: bool):
    # one engine's hashes are all unsigned or all signed 64-bit ints (or digests): the native view
    # folds an int to its 64-bit two's complement, so -1 and 2**64 - 1 are one block there by design
    ints = st.integers(0, 2**64 - 1) if unsigned else st.integers(-2**63, 2**63 - 1)
    known = st.sampled_from([1, 2, 3, 4, 5, b"a" * 32, b"b" * 32])
    return draw(st.one_of(known, known, ints, st.binary(min_size=0, max_size=40)))


# The weighted choices come from a seeded Random: hypothesis's own (``st.randoms``, a weighted
# ``one_of``) favour boundary values, which made an odd value the common case.
SEEDS = st.integers(0, 2**32 - 1)
TOKEN_EDGES = [-1, 2**32 - 1, 2**32, 2**64 - 1, -2**63]
MEDIA = ["GPU", "gpu", "Gpu", "CPU", "cpu_pinned", "DISK", "", "GPU ", "\u01f5pu"]
KINDS = ["full_attention", "mla_attention", "sliding_window", "mamba", "", "full_attention\x00"]


@st.composite
def events(draw, unsigned: bool, rnd):
    """One event: map form mostly (what the fast path reads), array form sometimes. ``rnd`` makes
    the weighted choices: an odd value in a field one time in twenty-five (one odd field spoils a
    batch), keys left out and keys in any order now and then."""
    h = hashes(unsigned)

    def odd_or(strategy):
        return draw(odd) if rnd.random() < 0.04 else draw(strategy)

    def tokens():
        r = rnd.random()
        if r < 0.1:
            return draw(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)).map(list), max_size=2 * BS))
        if r < 0.2:
            return draw(st.lists(st.integers(0, 40) | st.sampled_from(TOKEN_EDGES), max_size=3 * BS))
        return draw(st.lists(st.integers(0, 40), max_size=3 * BS + 2))

    r = rnd.random()
    if r < 0.9:
        r = rnd.random()
        form = "stored" if r < 0.55 else "removed" if r < 0.85 else "cleared" if r < 0.93 else "unknown"
        tag = {"stored": "BlockStored", "removed": "BlockRemoved", "cleared": "AllBlocksCleared",
               "unknown": draw(st.sampled_from(["BlockTransferred", "blockstored", "", "BlockStored\x00"]))}[form]
        ev = {"type": odd_or(st.just(tag))}
        if form == "stored" or rnd.random() < 0.1:  # a removal with a store's keys: ignored there
            ev["block_hashes"] = odd_or(st.lists(h, max_size=4))
            ev["parent_block_hash"] = odd_or(st.none() | h)
            ev["token_ids"] = draw(odd) if rnd.random() < 0.04 else tokens()
            ev["block_size"] = odd_or(st.just(BS)) if rnd.random() < 0.9 else draw(st.sampled_from([2 * BS, 0, -1]))
            if rnd.random() < 0.3:
                ev["kv_cache_spec_kind"] = odd_or(st.none() | st.sampled_from(KINDS))
            if rnd.random() < 0.3:
                ev.update(lora_id=None, lora_name=draw(st.none() | st.text(max_size=4)), group_idx=0)
        elif form == "removed":
            ev["block_hashes"] = odd_or(st.lists(h, max_size=4))
        if rnd.random() < 0.4:
            ev["medium"] = odd_or(st.none() | st.sampled_from(MEDIA))
        if rnd.random() < 0.15:
            ev["extra"] = draw(odd)
        if rnd.random() < 0.05:
            ev[BAD_UTF8_KEY] = draw(odd)
        if rnd.random() < 0.08:
            del ev[rnd.choice(sorted(ev, key=str))]  # a key left out
        if rnd.random() < 0.2:
            items = list(ev.items())
            rnd.shuffle(items)
            ev = dict(items)
        if ev and rnd.random() < 0.1:  # a key twice (msgspec keeps the last value; so must the fast path)
            key = rnd.choice(sorted(ev, key=str))
            again = {"type": st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"]),
                     "medium": st.none() | st.sampled_from(MEDIA),
                     "kv_cache_spec_kind": st.none() | st.sampled_from(KINDS),
                     "block_hashes": st.lists(h, max_size=4), "parent_block_hash": st.none() | h,
                     "block_size": st.sampled_from([BS, 2 * BS]),
                     "token_ids": st.lists(st.integers(0, 40), max_size=3 * BS)}.get(key, odd)
            pairs = list(ev.items())
            pairs.insert(rnd.randrange(len(pairs) + 1), (key, draw(again)))
            return _Map(pairs)
        return ev
    # array form (SGLang <= 0.5.19, ATOM, the first vLLM): the fast path leaves it to Python
    tag = draw(st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"]))
    if tag == "BlockStored":
        items = [tag, draw(st.lists(h, max_size=4)), draw(st.none() | h), tokens(), BS]
        items += draw(st.lists(st.none() | st.sampled_from(["GPU", "CPU"]) | odd, max_size=3))
    elif tag == "BlockRemoved":
        items = [tag, draw(st.lists(h, max_size=4))] + draw(st.lists(st.sampled_from(["GPU", "CPU"]) | odd, max_size=2))
    else:
        items = [tag] + draw(st.lists(st.sampled_from(["GPU", "CPU"]), max_size=1))
    return items


@st.composite
def payload_objects(draw):
    rnd = random.Random(draw(SEEDS))
    unsigned = draw(st.booleans())
    evs = [draw(events(unsigned, rnd)) for _ in range(draw(st.integers(0, 5)))]
    r = rnd.random()
    ts = 1.5 if r < 0.6 else draw(st.floats() | st.integers(-2**63, 2**64 - 1))
    r = rnd.random()
    tail = [] if r < 0.5 else [None] if r < 0.65 else [draw(st.integers(-2, 2**64 - 1))] if r < 0.85 else \
        draw(st.lists(odd, min_size=1, max_size=2))  # [ts, events] or [ts, events, dp_rank], or more
    r = rnd.random()
    if r < 0.9:
        return [ts, evs, *tail]
    return draw(st.sampled_from([evs, {"ts": ts, "events": evs}, [ts]]) | odd)


@st.composite
def structured_payloads(draw) -> bytes:
    obj = draw(payload_objects())
    data = bytearray()
    rnd = random.Random(draw(SEEDS))
    _pack(obj, rnd, data)
    return draw(mutated(bytes(data))) if rnd.random() < 0.2 else bytes(data)


@st.composite
def fixture_payloads(draw) -> tuple[str, bytes]:
    name = draw(st.sampled_from(sorted(FIXTURES)))
    return name, draw(mutated(FIXTURES[name]))


# -- the decoders (with or without the accelerator) -------------------------------------------------------
@settings(max_examples=300)
@given(payload=st.binary(max_size=200))
@example(payload=DEEP_EVENT)
@example(payload=DEEP_FIELD)
@example(payload=DEEP_BATCH)
@example(payload=b"\x92\xcb" + bytes(8) + b"\xdd\xff\xff\xff\xff")  # 4 G events announced, none sent
def test_decoders_on_arbitrary_bytes(payload):
    _every_decoder_copes(payload)


@settings(max_examples=250)
@given(payload=structured_payloads())
def test_decoders_on_structured_payloads(payload):
    _every_decoder_copes(payload)


@settings(max_examples=150)
@given(case=fixture_payloads())
def test_decoders_on_mutated_fixtures(case):
    _every_decoder_copes(case[1])


@pytest.mark.parametrize("payload", [
    DEEP_EVENT, DEEP_FIELD, DEEP_BATCH,
    b"\x92\xcb" + bytes(8) + b"\xdd\xff\xff\xff\xff",  # 4 G events announced
    b"\x92\xcb" + bytes(8) + b"\x91\xdf\xff\xff\xff\xff",  # an event of 4 G keys
    b"\x92\xcb" + bytes(8) + b"\x91\x81\xa4type\xdb\xff\xff\xff\xff",  # a 4 GiB string
    b"\x92\xcb" + bytes(8) + b"\x91\x81\xa1x\xc6\xff\xff\xff\xff",  # a 4 GiB bin
    b"\x92\xcb" + bytes(8) + b"\x91\x81\xa1x\xc9\xff\xff\xff\xff\x01",  # a 4 GiB ext
    b"\x92\xcb" + bytes(8) + b"\x91\x84\xa4type\xabBlockStored\xacblock_hashes\xdd\xff\xff\xff\xff",
    b"\x92\xcb" + bytes(8) + b"\x91" + b"\x91" * 30 + b"\xdd\xff\xff\xff\xff",
], ids=["deep-event", "deep-field", "deep-batch", "events-4g", "keys-4g", "str-4g", "bin-4g", "ext-4g",
        "hashes-4g", "nested-then-4g"])
def test_hostile_lengths_and_depths_are_refused_quickly(payload):
    """Lengths announced and never sent, and nesting far past any real event: refused at once (the
    bound is loose on purpose; these take microseconds to milliseconds)."""
    for decode in DECODERS.values():
        started = time.monotonic()
        with pytest.raises(KvEventDecodeError):
            decode(payload)
        assert time.monotonic() - started < 2.0
    if native is not None:
        nat = NativeKvIndex()
        nat.add_target("w", BS)
        started = time.monotonic()
        assert nat.apply_payload("w", payload) is None
        assert time.monotonic() - started < 2.0


# -- the C fast path against the decoders ------------------------------------------------------------------
@needs_native
@settings(max_examples=300)
@given(payload=st.binary(max_size=200), engine=st.sampled_from(sorted(DECODERS)))
@example(payload=DEEP_FIELD, engine="vllm")
def test_fast_path_agrees_on_arbitrary_bytes(payload, engine):
    _differential([payload], engine)


@needs_native
@settings(max_examples=300)
@given(payloads=st.lists(structured_payloads(), min_size=1, max_size=4), engine=st.sampled_from(sorted(DECODERS)))
@example(payloads=[KIND_TWICE], engine="vllm")
def test_fast_path_agrees_on_structured_payloads(payloads, engine):
    _differential(payloads, engine)


@needs_native
@pytest.mark.parametrize("first, last, stored", [(b"\xaesliding_window", b"\xc0", True),
                                                 (b"\xc0", b"\xaesliding_window", False),
                                                 (b"\xaesliding_window", b"\xaefull_attention", True),
                                                 (b"\xaefull_attention", b"\xa5mamba", False)])
def test_a_repeated_kind_is_its_last_value(first, last, stored):
    payload = KIND_TWICE.replace(b"\xaesliding_window\xb2kv_cache_spec_kind\xc0",
                                 first + b"\xb2kv_cache_spec_kind" + last)
    assert (DECODERS["vllm"](payload).events[0].spec_kind in (None, "full_attention")) == stored
    assert _differential([payload]) == 1  # taken by the fast path, with the decoders' result


@needs_native
@settings(max_examples=150)
@given(case=fixture_payloads())
def test_fast_path_agrees_on_mutated_fixtures(case):
    name, payload = case
    engine = name.split("_")[0]
    _differential([payload], engine, 32 if engine == "vllm" and name != "vllm_legacy_array" else 16)


@needs_native
def test_the_structured_payloads_reach_the_fast_path():
    """The strategies are not all noise: valid map-form GPU batches among them take the fast path."""
    rnd = random.Random(5)
    store = {"type": "BlockStored", "block_hashes": [7, 8], "parent_block_hash": 2, "token_ids": list(range(2 * BS)),
             "block_size": BS, "kv_cache_spec_kind": "full_attention", "medium": "gpu", "extra": [1, {"a": b"z"}]}
    remove = {"type": "BlockRemoved", "block_hashes": [1, 7, 99]}
    payloads = []
    for _ in range(20):
        data = bytearray()
        _pack([1.25, [store, remove], rnd.choice([None, 0, 7])], rnd, data)
        payloads.append(bytes(data))
    assert _differential(payloads) == 20
