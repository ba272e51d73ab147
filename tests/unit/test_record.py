import msgspec
import pytest

from infera.discovery.record import WorkerRecord, decode_record, encode_record, record_to_dict


def test_round_trip_keeps_every_field():
    rec = WorkerRecord(worker_id="10.0.0.1:30000", url="http://10.0.0.1:30000", model_name="m", engine="vllm",
                       disagg_mode="prefill", disagg_meta={"protocol": "vllm-nixl"}, kv_events_endpoint="tcp://h:5557",
                       kv_block_size=32, dp_rank=1, dp_size=4)
    assert decode_record(encode_record(rec)) == rec


@pytest.mark.parametrize(
    "raw, field, expected",
    [
        (b'{"worker_id":"a","url":"http://a","model_name":"m"}', "status", "active"),
        (b'{"worker_id":"a","url":"http://a","model_name":"m"}', "disagg_mode", "mixed"),
        (b'{"worker_id":"a","url":"http://a","model_name":"m"}', "request_transport", "http"),
        (b'{"worker_id":"a","url":"http://a","model_name":"m","future_field":{"x":1}}', "model_name", "m"),
        (b'{"worker_id":"a","url":"http://a","model_name":"m","kv":{"tiers":["device"]}}', "kv_block_size", None),
    ],
)
def test_defaults_and_unknown_fields(raw, field, expected):
    assert getattr(decode_record(raw), field) == expected


@pytest.mark.parametrize(
    "raw",
    [
        b'{"url":"http://a","model_name":"m"}',  # no worker_id
        b'{"worker_id":"a","url":"http://a","model_name":"m","engine":"tgi"}',  # unknown engine
        b'{"worker_id":"a","url":"http://a","model_name":"m","kv_block_size":"16"}',  # wrong type
        b'{"worker_id":"a","url":"http://a","model_name":"m","status":"dead"}',
        b"not json",
    ],
)
def test_bad_records_are_rejected(raw):
    with pytest.raises((msgspec.ValidationError, msgspec.DecodeError)):
        decode_record(raw)


def test_record_to_dict_is_json_ready():
    d = record_to_dict(WorkerRecord(worker_id="a", url="http://a", model_name="m"))
    assert d["worker_id"] == "a" and d["status"] == "active" and d["schema"] == 1


def test_tokenizer_fields_round_trip_and_old_records_still_decode():
    rec = WorkerRecord(worker_id="a", url="http://a", model_name="m", engine="vllm", tokenizer="/models/llama",
                       tokenizer_sha256="ab" * 32)
    back = decode_record(encode_record(rec))
    assert back == rec and (back.tokenizer, back.tokenizer_sha256) == ("/models/llama", "ab" * 32)
    old = decode_record(b'{"worker_id":"a","url":"http://a","model_name":"m","engine":"vllm","schema":1}')
    assert (old.tokenizer, old.tokenizer_sha256) == (None, None)
    # A record from this launcher read by an older server: the new fields are just unknown ones.
    assert msgspec.json.decode(encode_record(rec))["tokenizer"] == "/models/llama"


# -- signed records (--fleet-key-file) ------------------------------------------------------------

from infera.discovery.record import FleetKey, RecordSignatureError  # noqa: E402

KEY = FleetKey(b"k" * 32)


def _full_record() -> WorkerRecord:
    return WorkerRecord(worker_id="10.0.0.1:30000", url="http://10.0.0.1:30000", model_name="m", engine="vllm",
                        disagg_mode="prefill", disagg_meta={"protocol": "vllm-nixl", "é": [1, 2.5, None]},
                        kv_events_endpoint="tcp://h:5557", kv_block_size=32, dp_rank=1, dp_size=4,
                        tokenizer="/models/x", kvd_socket="/run/kvd.sock")


def test_signed_record_round_trips_and_reads_without_the_key():
    rec = _full_record()
    raw = encode_record(rec, KEY)
    assert decode_record(raw, KEY) == rec
    assert decode_record(raw) == rec  # a server without the key (or older than signing) reads it as before
    sig = msgspec.json.decode(raw)["signature"]
    assert sig["alg"] == "hmac-sha256" and sig["kid"] == KEY.kid and isinstance(sig["ts"], int)


def test_unsigned_record_is_refused_with_a_key():
    with pytest.raises(RecordSignatureError, match="unsigned"):
        decode_record(encode_record(_full_record()), KEY)


def test_record_signed_with_another_key_is_refused():
    with pytest.raises(RecordSignatureError, match="another fleet key"):
        decode_record(encode_record(_full_record(), FleetKey(b"o" * 32)), KEY)


def _tamper(raw: bytes, field: str, value: object) -> bytes:
    doc = msgspec.json.decode(raw)
    doc[field] = value
    return msgspec.json.encode(doc)


@pytest.mark.parametrize("field, value", [
    ("worker_id", "evil:1"), ("url", "http://evil:1"), ("model_name", "other"), ("engine", "sglang"),
    ("status", "draining"), ("disagg_mode", "decode"), ("disagg_meta", {"protocol": "x"}),
    ("kv_events_endpoint", "tcp://evil:5557"), ("kv_events_replay_endpoint", "tcp://evil:1"),
    ("kv_block_size", 16), ("dp_rank", 0), ("dp_size", 8), ("request_transport", "nats"),
    ("kv_event_transport", "nats"), ("tokenizer", "/evil"), ("tokenizer_sha256", "00"), ("kvd_socket", "/evil"),
    ("schema", 2), ("future_field", 1),
])
def test_every_field_is_covered_by_the_signature(field, value):
    raw = encode_record(_full_record(), KEY)
    assert decode_record(raw, KEY) == _full_record()
    with pytest.raises(RecordSignatureError, match="bad signature"):
        decode_record(_tamper(raw, field, value), KEY)


def test_signature_time_and_key_id_are_covered():
    raw = encode_record(_full_record(), KEY)
    sig = msgspec.json.decode(raw)["signature"]
    with pytest.raises(RecordSignatureError, match="bad signature"):
        decode_record(_tamper(raw, "signature", {**sig, "ts": sig["ts"] + 1}), KEY)
    for bad in ("x", {"alg": "hmac-sha256"}, {**sig, "alg": "none"}):
        with pytest.raises(RecordSignatureError):
            decode_record(_tamper(raw, "signature", bad), KEY)


def test_duplicate_keys_cannot_smuggle_an_unsigned_value():
    raw = encode_record(WorkerRecord(worker_id="a", url="http://a", model_name="m"), KEY)
    smuggled = raw[:-1] + b',"url":"http://evil:1"}'
    with pytest.raises(RecordSignatureError):
        decode_record(smuggled, KEY)


def test_fleet_key_file(tmp_path):
    good = tmp_path / "key"
    good.write_bytes(b"0123456789abcdef0123\n")
    key = FleetKey.from_file(str(good))
    assert key.kid == FleetKey(b"0123456789abcdef0123").kid  # the trailing newline is not part of the key
    assert "0123456789abcdef" not in repr(key)
    short = tmp_path / "short"
    short.write_bytes(b"tooshort\n")
    with pytest.raises(ValueError, match="too short: 8 bytes, at least 16"):
        FleetKey.from_file(str(short))
    with pytest.raises(ValueError, match="cannot read the fleet key file .*missing"):
        FleetKey.from_file(str(tmp_path / "missing"))


def test_fleet_key_flag_on_the_server(tmp_path, capsys):
    from infera.discovery import discovery_options
    from infera.server.cli import parse_args

    key = tmp_path / "key"
    key.write_bytes(b"s" * 16)
    args = parse_args(["--etcd-endpoint", "h:1"], environ={"INFERA_FLEET_KEY_FILE": str(key)})
    assert discovery_options(args)["fleet_key"].kid == FleetKey(b"s" * 16).kid
    assert discovery_options(parse_args(["--etcd-endpoint", "h:1"], environ={})) == {}
    with pytest.raises(SystemExit):
        parse_args(["--etcd-endpoint", "h:1", "--fleet-key-file", str(tmp_path / "nope")], environ={})
    assert "cannot read the fleet key file" in capsys.readouterr().err


def test_kubernetes_pod_annotation_is_signed_and_checked():
    from lightkube.resources.core_v1 import Pod

    from infera.discovery.kubernetes import ANNOTATION, pod_state

    def pod(annotation: bytes) -> Pod:
        return Pod.from_dict({"apiVersion": "v1", "kind": "Pod", "status": {"phase": "Running"},
                              "metadata": {"name": "p", "namespace": "ns", "annotations": {ANNOTATION: annotation.decode()}}})

    rec = _full_record()
    assert pod_state(pod(encode_record(rec, KEY)), KEY).record == rec
    assert pod_state(pod(encode_record(rec)), None).record == rec
    state = pod_state(pod(encode_record(rec)), KEY)
    assert (state.record, state.reason) == (None, "bad-signature")


async def test_kubernetes_registration_signs_and_discovery_logs_a_rejected_pod_once(caplog):
    import logging

    from lightkube import KubeConfig
    from lightkube.resources.core_v1 import Pod

    from infera.discovery import make_discovery, make_registration
    from infera.discovery.fleet import Fleet
    from infera.discovery.kubernetes import ANNOTATION

    config = KubeConfig.from_server("http://127.0.0.1:1")
    registration = make_registration("kubernetes", k8s_namespace="ns", k8s_pod_name="p-0", config=config,
                                     fleet_key=KEY)
    written: list[str | None] = []

    async def patch(value):
        written.append(value)

    registration._patch = patch
    registration.record = _full_record()
    await registration._write_record()
    assert decode_record(written[-1].encode(), KEY) == _full_record()

    def pod(name: str, annotation: str) -> Pod:
        return Pod.from_dict({"apiVersion": "v1", "kind": "Pod", "status": {"phase": "Running"},
                              "metadata": {"name": name, "namespace": "ns", "annotations": {ANNOTATION: annotation}}})

    caplog.set_level(logging.WARNING, logger="infera.discovery.kubernetes")
    discovery = make_discovery("kubernetes", k8s_label_selector="app=w", k8s_namespace="ns", config=config,
                               fleet_key=KEY)
    fleet = Fleet()
    rogue = WorkerRecord(worker_id="evil:1", url="http://evil:1", model_name="m")
    for i in range(3):  # MODIFIED events of the same Pod: one log line
        discovery._apply(fleet, "MODIFIED", pod("evil", encode_record(rogue).decode() + " " * i))
    discovery._apply(fleet, "ADDED", pod("good", written[-1]))
    assert [r.worker_id for r in fleet.all()] == [_full_record().worker_id]
    assert [r.getMessage() for r in caplog.records if "ignoring the worker record on Pod evil" in r.getMessage()] \
        and len(caplog.records) == 1


@pytest.mark.parametrize("key", [None, KEY])
def test_a_record_nested_too_deeply_is_a_bad_value(key):
    """msgspec raises RecursionError past its nesting limit: anyone able to write one record must not
    stop discovery (it re-listed and failed on it forever, freezing the fleet)."""
    deep = b'{"worker_id":"a","url":"http://a","model_name":"m","disagg_meta":{"x":' + b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(msgspec.DecodeError, match="nested too deeply"):
        decode_record(deep + b"}}", key)


def test_fleet_key_rotation(tmp_path):
    from infera.discovery import discovery_options
    from infera.server.cli import parse_args

    old, new = tmp_path / "old.key", tmp_path / "new.key"
    old.write_bytes(b"o" * 32)
    new.write_bytes(b"n" * 32)
    rotating = FleetKey.from_files(f"{new}, {old}")  # servers during a rotation
    rec = _full_record()
    assert decode_record(encode_record(rec, FleetKey(b"o" * 32)), rotating) == rec  # workers not yet switched
    assert decode_record(encode_record(rec, FleetKey(b"n" * 32)), rotating) == rec  # switched ones
    assert msgspec.json.decode(encode_record(rec, rotating))["signature"]["kid"] == FleetKey(b"n" * 32).kid
    with pytest.raises(RecordSignatureError, match="another fleet key"):  # rotation done: old records refused
        decode_record(encode_record(rec, FleetKey(b"o" * 32)), FleetKey.from_files(str(new)))
    args = parse_args(["--etcd-endpoint", "h:1", "--fleet-key-file", f"{new},{old}"], environ={})
    assert discovery_options(args)["fleet_key"].accepted_kids == rotating.accepted_kids
    with pytest.raises(ValueError, match="cannot read the fleet key file"):
        FleetKey.from_files(f"{new},{tmp_path / 'missing'}")
