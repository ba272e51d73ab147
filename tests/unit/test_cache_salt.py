"""Cache isolation (issue 31 item 4), the pure parts: the router's salted hash chain partitions
blocks exactly as vLLM's salted hashes do (golden fixture from vLLM's own code), the salt read
back from a vLLM ``BlockStored``, the tenants' salts from ``--api-keys-file``, the salt written
into a request body, and the simulator's salted prefix cache."""
from __future__ import annotations

import hashlib
import json
import re
from array import array
from pathlib import Path

import msgspec
import pytest

from infera.api.errors import ApiError
from infera.api.requests import parse_request
from infera.engine.sim.cache import KVCache
from infera.engine.sim.schemas import ChatCompletionRequest as SimChatRequest
from infera.kv.hashing import ROUTER_SEED, _py_block_hashes, block_hash_array, block_hashes, event_salt, salt_root
from infera.server.api_keys import parse_keys
from infera.server.request_salt import salt_request, salt_translated

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "cache_salt"
ROWS = json.loads((FIXTURES / "vllm_salted.json").read_text())


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


# --- the router's hash space against vLLM's ------------------------------------------------------

def router_chain(row: dict) -> list[int]:
    """What the index makes of the row's BlockStored: the salt read from its extra keys."""
    salt = event_salt(row["event_extra_keys"], row["lora_name"])
    return block_hashes(row["tokens"], row["block_size"], salt_root(salt))


def test_router_hashes_partition_blocks_exactly_as_vllms_salted_hashes():
    engine_to_router: dict[str, int] = {}
    router_to_engine: dict[int, str] = {}
    rows = [r for r in ROWS if r["lora_name"] is None]  # (LoRA blocks share the base's router hashes)
    assert {r["cache_salt"] for r in rows} == {None, "salt-tenant-1", "salt-tenant-2"}
    for row in rows:
        for eh, rh in zip(row["engine_hashes"], router_chain(row), strict=True):
            assert engine_to_router.setdefault(eh, rh) == rh, row
            assert router_to_engine.setdefault(rh, eh) == eh, row
    # the fixture does share blocks (a prompt and its extension, per salt) and keeps salts apart
    assert len(engine_to_router) < sum(len(r["engine_hashes"]) for r in rows)
    by_case = {(r["case"], r["prompt"]): r for r in rows}
    for prompt in ("a", "b"):
        firsts = {by_case[(c, prompt)]["engine_hashes"][0] for c in ("plain", "tenant1", "tenant2")}
        assert len(firsts) == 3


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"{r['case']}-{r['prompt']}")
def test_the_salt_is_read_back_from_vllms_extra_keys(row):
    assert event_salt(row["event_extra_keys"], row["lora_name"]) == row["cache_salt"]


def test_the_salt_is_read_back_from_vllms_own_wire_bytes():
    ts, events = msgspec.msgpack.decode((FIXTURES / "vllm_salted.msgpack").read_bytes())[:2]
    assert len(events) == len(ROWS)
    for ev, row in zip(events, ROWS):
        assert ev["type"] == "BlockStored" and ev["parent_block_hash"] is None
        assert event_salt(ev.get("extra_keys"), ev.get("lora_name")) == row["cache_salt"]


@pytest.mark.parametrize("extra_keys, lora, salt", [
    (None, None, None),
    ([], None, None),
    ([None, None], None, None),
    ([["s"]], None, "s"),
    ([("s",), None], None, "s"),
    ([None, ["s"]], None, None),  # only the first block carries a salt
    ([["lora-a"]], "lora-a", None),  # the LoRA name alone
    ([["lora-a", "s"]], "lora-a", "s"),
    ([["x", "x"]], "x", "x"),  # a salt equal to the LoRA name still counts
    ([[["image-1", 0], "s", b"\x01digest"]], None, "s"),  # (mm pair, salt, prompt-embeds digest)
    ([[["image-1", 0]]], None, None),
    ([[""]], None, None),
    (["s"], None, None),  # not vLLM's shape
])
def test_event_salt(extra_keys, lora, salt):
    assert event_salt(extra_keys, lora) == salt


def test_salt_root():
    assert salt_root(None) == salt_root("") == ROUTER_SEED
    roots = {salt_root(f"s{i}") for i in range(1000)}
    assert len(roots) == 1000 and ROUTER_SEED not in roots
    tokens = list(range(64))
    plain, salted = block_hashes(tokens, 16), block_hashes(tokens, 16, salt_root("s"))
    assert not set(plain) & set(salted)  # every block apart, not just the first
    assert salted == _py_block_hashes(tokens, 16, salt_root("s"))  # the accelerator's chain is the same
    assert list(block_hash_array(array("I", tokens), 16, salt_root("s"))) == salted


# --- tenants' salts ------------------------------------------------------------------------------

def keys_text(*entries: str, secret: str | None = None) -> str:
    out = "keys:\n" + "".join(f"  - {e}\n" for e in entries)
    return out + (f"cache_salt_secret: {secret}\n" if secret else "")


def salts(text: str) -> dict[str, str | None]:
    return {k.tenant: k.cache_salt() for k in parse_keys(text).values()}


ISOLATED = (f"{{sha256: {sha('a1')}, tenant: a, cache_isolation: true}}",
            f"{{sha256: {sha('a2')}, tenant: a, cache_isolation: true}}",
            f"{{sha256: {sha('b')}, tenant: b, cache_isolation: true}}",
            f"{{sha256: {sha('c')}, tenant: c}}")
_VLLM_SALT = re.compile(r"[^@/\\\x00]{1,128}")


@pytest.mark.parametrize("secret", [None, "0123456789abcdef-fleet"])
def test_every_replica_derives_the_same_salt_and_tenants_differ(secret):
    first, again = salts(keys_text(*ISOLATED, secret=secret)), salts(keys_text(*reversed(ISOLATED), secret=secret))
    assert first == again  # another replica, the entries in another order
    assert first["c"] is None  # not isolated
    assert first["a"] != first["b"]
    assert all(_VLLM_SALT.fullmatch(first[t]) for t in "ab")  # what vLLM accepts as a salt
    keys = parse_keys(keys_text(*ISOLATED, secret=secret))
    assert len({k.cache_salt() for k in keys.values() if k.tenant == "a"}) == 1  # one salt for all a's keys


def test_the_secret_or_the_tenants_keys_make_the_salt():
    no_secret = salts(keys_text(*ISOLATED))
    assert salts(keys_text(*ISOLATED, secret="0123456789abcdef-one")) != no_secret
    assert salts(keys_text(*ISOLATED, secret="0123456789abcdef-one"))["a"] != \
        salts(keys_text(*ISOLATED, secret="0123456789abcdef-two"))["a"]
    rotated = salts(keys_text(f"{{sha256: {sha('a3')}, tenant: a, cache_isolation: true}}", *ISOLATED[1:]))
    assert rotated["a"] != no_secret["a"] and rotated["b"] == no_secret["b"]  # only a's own keys count
    # with the secret, a's salt survives the rotation
    with_secret = keys_text(*ISOLATED, secret="0123456789abcdef-one")
    rotated = keys_text(f"{{sha256: {sha('a3')}, tenant: a, cache_isolation: true}}", *ISOLATED[1:],
                        secret="0123456789abcdef-one")
    assert salts(rotated)["a"] == salts(with_secret)["a"]


def test_a_clients_salt_is_folded_into_the_tenants():
    key = next(k for k in parse_keys(keys_text(*ISOLATED)).values() if k.tenant == "a")
    assert key.cache_salt("user-1") not in (key.cache_salt(), key.cache_salt("user-2"))
    assert key.cache_salt("user-1") == key.cache_salt("user-1")


# --- the salt in the request body ----------------------------------------------------------------

def salted(body: bytes, key):
    """What the server does: the body parsed once, then salted with the client's salt it holds."""
    route = "/v1/chat/completions" if b'"messages"' in body else "/v1/completions"
    return salt_request(body, key, parse_request(route, body).cache_salt)


def tenant_keys():
    keys = parse_keys(keys_text(*ISOLATED))
    return (next(k for k in keys.values() if k.tenant == "a"), next(k for k in keys.values() if k.tenant == "c"))


@pytest.mark.parametrize("body", [
    b'{"model":"m","messages":[{"role":"user","content":"hi"}]}',
    b' \n{ "model" : "m", "prompt": "x"}',
])
def test_an_isolated_tenants_salt_is_spliced_in(body):
    isolated, _ = tenant_keys()
    out, salt = salted(body, isolated)
    assert salt == isolated.cache_salt()
    doc = json.loads(out)
    assert doc["cache_salt"] == salt and {k: v for k, v in doc.items() if k != "cache_salt"} == json.loads(body)


@pytest.mark.parametrize("body, client", [
    (b'{"model":"m","prompt":"x","cache_salt":"mine"}', "mine"),
    (b'{"model":"m","cache_salt":"first","prompt":"x","cache_salt":"mine"}', "mine"),  # the last, as parsers keep
    (b'{"model":"m","prompt":"x","cache\\u005fsalt":"mine"}', "mine"),  # spelled with an escape
    (b'{"model":"m","prompt":"\\u00e9t\\u00e9"}', None),  # escapes elsewhere: decoded, no salt
    (b'{"model":"m","prompt":"x","cache_salt":null}', None),
])
def test_a_client_salt_from_an_isolated_tenant_is_folded_not_kept(body, client):
    isolated, _ = tenant_keys()
    out, salt = salted(body, isolated)
    assert salt == isolated.cache_salt(client)
    assert out.count(b"cache_salt") == 1 and json.loads(out)["cache_salt"] == salt


@pytest.mark.parametrize("value", [b'""', b"1", b'["x"]'])
def test_a_bad_client_salt_from_an_isolated_tenant_is_a_400(value):
    isolated, _ = tenant_keys()
    with pytest.raises(ApiError) as err:
        salted(b'{"model":"m","prompt":"x","cache_salt":' + value + b"}", isolated)
    assert err.value.status == 400 and err.value.param == "cache_salt"


def test_other_requests_keep_their_own_salt():
    _, open_tenant = tenant_keys()
    for key in (None, open_tenant):
        body = b'{"model":"m","prompt":"x","cache_salt":"mine"}'
        assert salted(body, key) == (body, "mine")  # forwarded as sent; the router hashes with it
        body = b'{"model":"m","prompt":"x"}'
        assert salted(body, key) == (body, None)
        body = b'{"model":"m","prompt":"x","cache_salt":""}'
        assert salted(body, key) == (body, None)  # (the engine refuses it: not ours to)
        body = b'{"model":"m","prompt":"x","cache\\u005fsalt":"mine"}'
        assert salted(body, key) == (body, "mine")  # (an escaped key: what the engine reads)


def test_anthropic_requests_get_the_tenants_salt():
    isolated, open_tenant = tenant_keys()
    doc = {"model": "m", "messages": []}
    assert salt_translated(doc, isolated) == doc["cache_salt"] == isolated.cache_salt()
    doc = {"model": "m", "messages": []}
    assert salt_translated(doc, open_tenant) is None and "cache_salt" not in doc
    assert salt_translated(doc, None) is None


# --- the simulator's salted prefix cache ---------------------------------------------------------

def test_sim_cache_keeps_salted_prefixes_apart_and_announces_the_salt():
    stored, salted = [], []
    cache = KVCache(4, 64, on_stored=lambda h, p, t: stored.append((h, p, t)))
    cache.on_stored_salted = lambda h, s, t: salted.append((h, s, t))
    tokens = list(range(100, 113))  # 3 full blocks + 1
    assert cache.allocate("plain", tokens) == 0
    assert cache.allocate("t1", tokens, "s1") == 0  # the unsalted blocks are not its
    assert cache.allocate("t2", tokens, "s2") == 0
    assert cache.allocate("t1-again", tokens, "s1") == 12  # its own are
    assert cache.match_prefix(tokens, "s2") == 12 and cache.match_prefix(tokens, "s3") == 0
    assert cache.match_full_blocks(tokens, "s1") == 12
    assert [(s, t) for _, s, t in salted] == [("s1", tokens[:4]), ("s2", tokens[:4])]  # first blocks only
    assert salted[0][0] == block_hashes(tokens[:4], 4, salt_root("s1"))
    firsts = [p for _, p, _ in stored if p is None]
    assert len(firsts) == 1  # the unsalted prompt's first block; the salted ones' went to the salted hook
    seconds = [p for h, p, _ in stored if p == salted[0][0][0]]
    assert seconds, "a salted chain goes on from its salted first block"


def test_sim_cache_without_the_salted_hook_announces_a_plain_first_block():
    stored = []
    cache = KVCache(4, 16, on_stored=lambda h, p, t: stored.append((h, p)))
    cache.allocate("t1", list(range(8)), "s1")
    assert stored[0] == (block_hashes(list(range(4)), 4, salt_root("s1")), None)


def test_sim_generated_blocks_stay_salted():
    salted, stored = [], []
    cache = KVCache(4, 16, on_stored=lambda h, p, t: stored.append((h, p)))
    cache.on_stored_salted = lambda h, s, t: salted.append((h, s))
    cache.allocate("t1", [1, 2, 3], "s1")  # no full block yet: the first fills while generating
    assert cache.append_token("t1", 4)
    assert salted == [(block_hashes([1, 2, 3, 4], 4, salt_root("s1")), "s1")] and not stored


@pytest.mark.parametrize("salt, ok", [("s", True), ("x" * 128, True), ("", False), ("x" * 129, False),
                                      ("a/b", False), ("a@b", False), ("a\\b", False), ("a\x00", False)])
def test_sim_checks_cache_salt_as_vllm_does(salt, ok):
    body = json.dumps({"model": "m", "messages": [], "cache_salt": salt}).encode()
    if ok:
        assert msgspec.json.decode(body, type=SimChatRequest).cache_salt == salt
    else:
        with pytest.raises(msgspec.ValidationError, match="Parameter 'cache_salt' must"):
            msgspec.json.decode(body, type=SimChatRequest)


def test_sim_publishes_the_salt_as_vllm_does_and_the_chain_rehashes_from_it():
    from infera.engine.sim.kv_events import KvEventPublisher, KvEventsConfig

    cache = KVCache(4, 64)
    pub = KvEventPublisher(KvEventsConfig(enable_kv_cache_events=True, publisher="zmq"), block_size=4)
    pub.attach(cache)
    tokens = list(range(200, 213))
    cache.allocate("plain", tokens)
    cache.allocate("t1", tokens, "s1")
    seq = pub.flush()
    payload = dict(pub.buffered())[seq]
    events = msgspec.msgpack.decode(payload)[1]
    assert [ev["extra_keys"] for ev in events] == [[None, None, None], [["s1"], None, None]]
    engine_hashes = []
    for ev in events:
        assert ev["parent_block_hash"] is None
        salt = event_salt(ev["extra_keys"], ev["lora_name"])
        # the index's re-hash from the salt the event names is the cache's own chain (the router's space)
        assert block_hashes(ev["token_ids"], 4, salt_root(salt)) == block_hashes(tokens[:12], 4, salt_root(salt))
        assert all(cache.is_cached(h) for h in block_hashes(ev["token_ids"], 4, salt_root(salt)))
        engine_hashes += ev["block_hashes"]
    assert len(set(engine_hashes)) == 6  # the engine's own hashes keep them apart too
