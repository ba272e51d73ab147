"""Our mirrors of the engines' KV-event schemas (tests/fixtures/kv_events/wire_schemas.py) against
the engines' own structs, imported from the installed vLLM 0.32 (``vllm.distributed.kv_events``,
in the vLLM venv) and SGLang 0.5.23 (``sglang.srt.disaggregation.kv_events``, from the wheel that
``make setup-sglang`` unpacks): struct options, field names and order, wire names, types and
defaults must be equal (schema_shape.py). The fixtures are generated from the mirrors, so without
this the check would be circular. The simulator's bytes must also decode with the engines' own
structs to the events our decoders read. ATOM is not installable here: its mirror stays a
documented copy (tag and commit in wire_schemas.py)."""
from __future__ import annotations

import json

import pytest

from infera.kv.events import decoder_for
from tests.real_engines import run_engine_python

pytestmark = pytest.mark.integration

STRUCTS = ("KVEventBatch", "EventBatch", "BlockStored", "BlockRemoved", "AllBlocksCleared")

DUMP = r'''
import json, importlib.metadata, msgspec
import vllm
from vllm.distributed import kv_events as vllm_events
from sglang.srt.disaggregation import kv_events as sglang_events
from sglang import version as sglang_version
from tests.fixtures.kv_events import wire_schemas as ws
from tests.fixtures.kv_events.schema_shape import shape
from infera.engine.sim.kv_events import StoredEvent, RemovedEvent, ClearedEvent, encode_batch

out = {"versions": {"vllm": vllm.__version__, "sglang": sglang_version.__version__}, "shapes": {}, "sim": {}}
for engine, real, mirror in (("vllm", vllm_events, ws.VLLM_0_32), ("sglang", sglang_events, ws.SGLANG_0_5_23)):
    for name in STRUCTS:
        out["shapes"][f"{engine}.{name}"] = [shape(getattr(real, name)), shape(getattr(mirror, name))]
    # the simulator's bytes, read back with the engine's own batch struct
    events = [StoredEvent([11, 12], None, list(range(32)), 16), StoredEvent([13], 12, list(range(32, 48)), 16),
              RemovedEvent([11]), ClearedEvent()]
    payload = encode_batch(events, engine, ts=1.5)
    decoded = msgspec.msgpack.Decoder(real.KVEventBatch).decode(payload)
    out["sim"][engine] = {"payload": payload.hex(), "engine": msgspec.to_builtins(decoded.events)}
print("RESULT " + json.dumps(out))
'''


@pytest.fixture(scope="module")
def engines() -> dict:
    done = run_engine_python(f"STRUCTS = {STRUCTS!r}\n" + DUMP, sglang=True)
    lines = [l for l in done.stdout.splitlines() if l.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_the_installed_engines_are_the_mirrored_releases(engines):
    # the mirror names these releases; a venv with other versions would compare the wrong code
    assert engines["versions"]["vllm"].startswith("0.32.0")
    assert engines["versions"]["sglang"] == "0.5.23"


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("name", STRUCTS)
def test_mirror_matches_the_engines_struct(engines, engine, name):
    real, mirror = engines["shapes"][f"{engine}.{name}"]
    assert mirror == real, (f"{engine}.{name}: the mirror differs from the installed engine's struct\n"
                            f"engine: {json.dumps(real, indent=1)}\nmirror: {json.dumps(mirror, indent=1)}")


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_sim_bytes_decode_with_the_engines_struct_to_what_we_read(engines, engine):
    sim = engines["sim"][engine]
    real = sim["engine"]
    assert [e["type"] for e in real] == [
        "BlockStored", "BlockStored", "BlockRemoved", "AllBlocksCleared"]
    ours = decoder_for(engine)(bytes.fromhex(sim["payload"]))
    # the same events, field by field, as our decoder normalizes them
    stored = [e for e in real if e["type"] == "BlockStored"]
    assert [(list(s.block_hashes), s.parent, list(s.token_ids), s.block_size, s.medium) for s in ours.events[:2]] == [
        (e["block_hashes"], e["parent_block_hash"], e["token_ids"], e["block_size"], e.get("medium")) for e in stored]
    assert list(ours.events[2].block_hashes) == real[2]["block_hashes"]
    assert ours.events[2].medium == real[2].get("medium") and ours.events[3].medium == real[3].get("medium")
