"""kvd host store semantics (reference §8.3), table-driven, plus the store over the shared arena."""
from __future__ import annotations

import pytest

from infera.kvd.arena import SharedArena
from infera.kvd.store import (LARGER_THAN_STORE, RETENTION_DOWNGRADE, TTL_EXPIRED, UNKNOWN_RETENTION, WOULD_DISPLACE,
                              HostStore, Namespaced)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def ns(name: str, model: str = "m", compat: str = "c") -> Namespaced:
    return Namespaced(model, compat, name.encode())


# Each step: ("set", key, size, retention, ttl, (accepted, reason)) | ("get", key, present) | ("tick", seconds)
# "end" lists the keys that must remain, in any order.
CASES = {
    "plain set and get": (100, [
        ("set", "a", 10, "short", None, (True, "")),
        ("get", "a", True), ("get", "b", False)], {"a"}),
    "unknown retention is rejected": (100, [
        ("set", "a", 10, "forever", None, (False, UNKNOWN_RETENTION)), ("get", "a", False)], set()),
    "every known class is accepted": (100, [
        ("set", "a", 10, "none", None, (True, "")), ("set", "b", 10, "ephemeral", None, (True, "")),
        ("set", "c", 10, "short", None, (True, "")), ("set", "d", 10, "long", None, (True, ""))], {"a", "b", "c", "d"}),
    "ttl <= 0 is counted but not stored": (100, [
        ("set", "a", 10, "short", 0, (True, TTL_EXPIRED)), ("set", "b", 10, "short", -5, (True, TTL_EXPIRED)),
        ("get", "a", False), ("get", "b", False)], set()),
    "ttl is lazy and expires on get": (100, [
        ("set", "a", 10, "short", 5, (True, "")), ("tick", 4.9), ("get", "a", True), ("tick", 0.2),
        ("get", "a", False)], set()),
    "overwrite refreshes ttl": (100, [
        ("set", "a", 10, "short", 5, (True, "")), ("tick", 4), ("set", "a", 10, "short", 5, (True, "")),
        ("tick", 4), ("get", "a", True)], {"a"}),
    "downgrade is refused, upgrade allowed": (100, [
        ("set", "a", 10, "long", None, (True, "")), ("set", "a", 10, "short", None, (False, RETENTION_DOWNGRADE)),
        ("set", "b", 10, "ephemeral", None, (True, "")), ("set", "b", 10, "long", None, (True, "")),
        ("set", "b", 10, "long", None, (True, ""))], {"a", "b"}),
    "an expired entry does not block a downgrade": (100, [
        ("set", "a", 10, "long", 1, (True, "")), ("tick", 2), ("set", "a", 10, "short", None, (True, ""))], {"a"}),
    "larger than the store": (100, [
        ("set", "a", 101, "long", None, (False, LARGER_THAN_STORE)), ("set", "b", 100, "short", None, (True, ""))],
        {"b"}),
    "lowest priority evicted first": (30, [
        ("set", "s", 10, "short", None, (True, "")), ("set", "e", 10, "ephemeral", None, (True, "")),
        ("set", "n", 10, "none", None, (True, "")), ("set", "x", 10, "short", None, (True, ""))], {"s", "e", "x"}),
    "then least recently accessed": (30, [
        ("set", "a", 10, "short", None, (True, "")), ("set", "b", 10, "short", None, (True, "")),
        ("set", "c", 10, "short", None, (True, "")), ("get", "a", True),
        ("set", "d", 10, "short", None, (True, ""))], {"a", "c", "d"}),
    "several victims for one big value": (30, [
        ("set", "a", 10, "short", None, (True, "")), ("set", "b", 10, "short", None, (True, "")),
        ("set", "c", 10, "short", None, (True, "")), ("set", "big", 25, "short", None, (True, ""))], {"big"}),
    "never displaces higher priority": (30, [
        ("set", "a", 10, "long", None, (True, "")), ("set", "b", 10, "long", None, (True, "")),
        ("set", "c", 10, "long", None, (True, "")), ("set", "d", 10, "short", None, (False, WOULD_DISPLACE))],
        {"a", "b", "c"}),
    "a refused set evicts nothing": (30, [
        ("set", "a", 10, "short", None, (True, "")), ("set", "b", 20, "long", None, (True, "")),
        ("set", "c", 25, "short", None, (False, WOULD_DISPLACE))], {"a", "b"}),
    "same priority may evict same priority": (20, [
        ("set", "a", 10, "long", None, (True, "")), ("set", "b", 10, "long", None, (True, "")),
        ("set", "c", 10, "long", None, (True, ""))], {"b", "c"}),
    "overwrite reuses its own space": (20, [
        ("set", "a", 10, "long", None, (True, "")), ("set", "b", 10, "long", None, (True, "")),
        ("set", "a", 10, "long", None, (True, ""))], {"a", "b"}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_store_semantics(name):
    max_bytes, steps, end = CASES[name]
    clock = Clock()
    store = HostStore(max_bytes, clock=clock)
    for step in steps:
        if step[0] == "set":
            _, key, size, retention, ttl, expected = step
            out = store.set(ns(key), bytes([len(key)]) * size, retention, ttl_seconds=ttl)
            assert (out.accepted, out.reason) == expected, step
        elif step[0] == "get":
            assert (store.lookup(ns(step[1])) is not None) == step[2], step
        else:
            clock.now += step[1]
    assert {k.key.decode() for k in store.keys() if store.contains(k)} == end
    assert store.inline_bytes <= max_bytes
    assert store.inline_bytes == sum(store.lookup(k, touch=False).length for k in store.keys() if store.contains(k))


def test_namespaces_are_separate_and_clear_filters():
    store = HostStore(1000)
    for model in ("m1", "m2"):
        for compat in ("tp0", "tp1"):
            store.set(Namespaced(model, compat, b"k"), model.encode() + compat.encode())
    assert store.value_of(store.lookup(Namespaced("m1", "tp1", b"k"))) == b"m1tp1"
    assert store.clear(model="m1", compat_key="tp0") == [Namespaced("m1", "tp0", b"k")]
    assert len(store.clear(compat_key="tp1")) == 2
    assert len(store.clear()) == 1
    assert len(store) == 0 and store.inline_bytes == 0


def test_evictions_are_counted_and_reported():
    seen = []
    store = HostStore(20, on_evict=lambda k, e: seen.append(k.key))
    for key in (b"a", b"b", b"c"):
        store.set(Namespaced("", "", key), b"x" * 10)
    assert seen == [b"a"] and store.evictions_total == 1


def test_promotion_never_replaces_a_newer_value():
    store = HostStore(100)
    k = Namespaced("", "", b"k")
    assert store.insert_if_absent(k, b"old", "long")
    store.set(k, b"new", "long")
    assert not store.insert_if_absent(k, b"old", "long")
    assert store.value_of(store.lookup(k)) == b"new"


# --- over the shared arena ------------------------------------------------------------------------

@pytest.fixture
def arena():
    a = SharedArena(4 * 128, pin=False)  # room for four 128-byte slots once the first put fixes the size
    yield a
    a.close()


def test_arena_values_live_in_slots_and_do_not_count_toward_max_bytes(arena):
    store = HostStore(10, arena)
    assert store.set(ns("a"), b"x" * 100).accepted  # fixes slot size: 100 + 16 header -> 128
    assert arena.slot_size == 128 and arena.num_slots == 4
    entry = store.lookup(ns("a"))
    assert entry.in_arena and store.inline_bytes == 0 and store.arena_bytes == 100
    assert store.value_of(entry) == b"x" * 100
    assert entry.version % 2 == 0 and arena.version(entry.slot) == entry.version


def test_oversize_values_fall_back_to_inline(arena):
    store = HostStore(500, arena)
    store.set(ns("a"), b"x" * 100)
    assert store.set(ns("big"), b"y" * 200).accepted
    big = store.lookup(ns("big"))
    assert not big.in_arena and store.inline_bytes == 200


def test_arena_lru_evicts_and_store_drains(arena):
    store = HostStore(0, arena)
    for i in range(4):
        store.set(ns(f"k{i}"), bytes([i]) * 100)
    store.lookup(ns("k0"))  # refresh k0: k1 is now the least recently used slot
    old_version = store.lookup(ns("k1"), touch=False).version
    slot_k1 = store.lookup(ns("k1"), touch=False).slot
    store.set(ns("k4"), b"z" * 100)
    assert not store.contains(ns("k1")) and store.contains(ns("k0")) and store.contains(ns("k4"))
    assert store.evictions_total == 1 and len(store) == 4
    assert store.lookup(ns("k4")).slot == slot_k1 and arena.version(slot_k1) != old_version


def test_overwrite_in_arena_frees_the_old_slot(arena):
    store = HostStore(0, arena)
    store.set(ns("a"), b"1" * 100)
    store.set(ns("a"), b"2" * 100)
    assert arena.used_slots == 1 and store.value_of(store.lookup(ns("a"))) == b"2" * 100
    assert store.remove(ns("a")) and arena.used_slots == 0
