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
