"""Cache isolation, the router's half: the KV index roots a salted prompt's blocks at the salt a
vLLM ``BlockStored`` names (decoded events and undecoded payloads, the C view and the Python twin
alike), and the kv-aware policy hashes a request from the salt the server gave it, or routes it by
load where an engine does not salt."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
import pytest

from infera.api.requests import parse_request
from infera.discovery.record import WorkerRecord
from infera.kv.events import Stored, decoder_for
from infera.kv.hashing import block_hashes, salt_root
from infera.kv.index import PyKvIndex
from infera.kv.native import native
from infera.kv.prompt import PromptTokenizer
from infera.router.policy import RoutedRequest

pytestmark = pytest.mark.skipif(not hasattr(Stored, "root"),
                                reason="the router does not fold cache salts yet (/tmp/s39-requests/salt.patch)")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "cache_salt"
ROWS = json.loads((FIXTURES / "vllm_salted.json").read_text())
PAYLOAD = (FIXTURES / "vllm_salted.msgpack").read_bytes()


def indexes():
    out = [PyKvIndex()]
    if native is not None:
        from infera.kv.index import NativeKvIndex

        out.append(NativeKvIndex())
    return out


@pytest.mark.parametrize("make", ["decoded", "payload"])
@pytest.mark.parametrize("index", indexes(), ids=lambda i: type(i).__name__)
def test_the_index_roots_vllms_salted_stores_at_their_salt(index, make):
    """vLLM's own bytes (one store per tenant and prompt): each prompt's chain from its salt's root
    is held whole; from any other root (another tenant's, none) nothing of it, beyond what that
    tenant stored too."""
    index.add_target("w", 4)
    if make == "payload":
        done = index.apply_payload("w", PAYLOAD)
        assert done is None  # a salt in the payload: applied through the decoded events instead
    index.apply("w", decoder_for("vllm")(PAYLOAD))
    for row in ROWS:
        if row["lora_name"] is not None:
            continue
        own = block_hashes(row["tokens"], 4, salt_root(row["cache_salt"]))
        assert index.match(own, ["w"]) == [len(own)], row
    tenant1 = block_hashes(ROWS[0]["tokens"], 4, salt_root("salt-tenant-1"))
    assert index.match(tenant1, ["w"]) == [3]
    assert index.match(block_hashes(ROWS[0]["tokens"], 4, salt_root("salt-tenant-3")), ["w"]) == [0]


@pytest.mark.parametrize("payload, names", [
    (b"", False),
    (msgspec.msgpack.encode({"extra_keys": None}), False),
    (msgspec.msgpack.encode({"extra_keys": []}), False),
    (msgspec.msgpack.encode({"extra_keys": [None, ["s"]]}), False),  # (only a first block's keys matter)
    (msgspec.msgpack.encode({"extra_keys": [None] * 40}), False),  # array16
    (msgspec.msgpack.encode({"extra_keys": [None] * 70000}), False),  # array32
    (msgspec.msgpack.encode({"extra_keys": [["s"]]}), True),
    (msgspec.msgpack.encode({"extra_keys": [["s"]] + [None] * 40}), True),
    (msgspec.msgpack.encode([{"extra_keys": [None]}, {"extra_keys": [["s"], None]}]), True),
    (msgspec.msgpack.encode({"extra_keys": "odd"}), True),
    (PAYLOAD, True),
])
def test_payloads_naming_first_block_keys_are_left_to_the_decoder(payload, names):
    from infera.kv.index_native import names_first_block_keys

    assert names_first_block_keys(payload) is names


# --- the kv-aware policy ---------------------------------------------------------------------------

class SetIndex:
    def __init__(self):
        self.views: dict[str, set[int]] = {}

    def block_count(self, key):
        return len(self.views.get(key, ()))

    def match(self, hashes, keys):
        out = []
        for k in keys:
            view, n = self.views.get(k, set()), 0
            for h in hashes:
                if h not in view:
                    break
                n += 1
            out.append(n)
        return out


def routed(tokens, salt=None) -> RoutedRequest:
    body = json.dumps({"model": "m", "prompt": tokens}).encode()
    req = RoutedRequest(route="/v1/completions", body=body, parsed=parse_request("/v1/completions", body),
                        model="m", stream=False, request_id="r")
    if salt is not None:
        req.state["cache_salt"] = salt
    return req


def worker(wid, engine="vllm"):
    return WorkerRecord(worker_id=wid, url=f"http://{wid}", model_name="m", kv_block_size=4, engine=engine)


def pick(policy, workers, req):
    asyncio.run(policy.prepare(req))
    return policy.pick(workers, req)


TOKENS = list(range(100, 132))  # 8 blocks of 4


@pytest.mark.parametrize("n_tokens", [32, 4 * 5000])  # hashed in the pick; hashed ahead, a slice at a time
def test_a_salted_request_is_hashed_from_its_salt(n_tokens):
    from infera.router.kv_aware import KvAwarePolicy

    tokens = list(range(100, 100 + n_tokens))
    index = SetIndex()
    policy = KvAwarePolicy(index, PromptTokenizer.from_path(None))
    a, b = worker("a"), worker("b")
    index.views["a"] = set(block_hashes(tokens, 4))  # the unsalted prompt
    index.views["b"] = set(block_hashes(tokens, 4, salt_root("t1"))[:5])  # tenant t1's first 5 blocks
    pick(policy, [a, b], routed([1, 2, 3, 4, 5]))  # (the block sizes in use, for hashing ahead)
    req = routed(tokens, "t1")
    assert pick(policy, [a, b], req).worker_id == "b" and req.state["predicted_hit_blocks"] == 5
    req = routed(tokens, "t2")  # another tenant: nobody holds its blocks
    pick(policy, [a, b], req)
    assert req.state["predicted_hit_blocks"] == 0
    req = routed(tokens)
    assert pick(policy, [a, b], req).worker_id == "a" and req.state["predicted_hit_blocks"] == n_tokens // 4


@pytest.mark.parametrize("engine", ["sglang", "atom"])
def test_a_salted_request_is_routed_by_load_among_engines_without_the_salt(engine):
    from infera.router.kv_aware import KvAwarePolicy

    index = SetIndex()
    policy = KvAwarePolicy(index, PromptTokenizer.from_path(None))
    a, b = worker("a", engine), worker("b")
    index.views["a"] = set(block_hashes(TOKENS, 4, salt_root("t1")))
    req = routed(TOKENS, "t1")
    pick(policy, [a, b], req)
    assert req.state.get("kv_load_only") and req.state["predicted_hit_blocks"] == 0  # out of the self-check
    req = routed(TOKENS)  # unsalted: kv-aware as ever
    pick(policy, [a, b], req)
    assert not req.state.get("kv_load_only")
