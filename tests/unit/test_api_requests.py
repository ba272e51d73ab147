import pytest

from infera.api.errors import ApiError, error_body, sse_error_event
from infera.api.requests import parse_request

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"


@pytest.mark.parametrize(
    "route, body, model, stream",
    [
        (CHAT, b'{"model":"m","messages":[{"role":"user","content":"hi"}]}', "m", False),
        (CHAT, b'{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],"stream":true}', "m", True),
        (COMP, b'{"model":"m","prompt":"hi","stream":true,"stream_options":{"include_usage":true}}', "m", True),
        (COMP, b'{"model":"m","prompt":[1,2,3]}', "m", False),
        (COMP, b'{"model":"m","prompt":"x","vendor_extra":{"a":1}}', "m", False),  # unknown fields pass
    ],
)
def test_valid(route, body, model, stream):
    req = parse_request(route, body)
    assert req.model == model and bool(req.stream) is stream


@pytest.mark.parametrize(
    "route, body, fragment",
    [
        (CHAT, b"", "empty"),
        (CHAT, b"{not json", "malformed JSON"),
        (CHAT, b"[1,2]", "invalid request"),
        (CHAT, b'{"model":"m"}', "messages"),
        (CHAT, b'{"model":5,"messages":[]}', "model"),
        (CHAT, b'{"model":"m","messages":"hi"}', "messages"),
        (CHAT, b'{"model":"m","messages":[],"stream":"yes"}', "stream"),
        (CHAT, b'{"model":"m","messages":[],"max_tokens":0}', "max_tokens"),
        (CHAT, b'{"messages":[]}', "model"),
        (COMP, b'{"model":"m","prompt":{"a":1}}', "prompt"),
        (COMP, b'{"model":"m","prompt":"x","max_tokens":"10"}', "max_tokens"),
    ],
)
def test_invalid_is_400(route, body, fragment):
    with pytest.raises(ApiError) as info:
        parse_request(route, body)
    assert info.value.status == 400
    assert fragment in info.value.message


@pytest.mark.parametrize("status, typ", [(400, "invalid_request_error"), (404, "not_found_error"),
                                         (413, "invalid_request_error"), (502, "server_error"), (503, "server_error")])
def test_error_shape(status, typ):
    err = error_body("boom", status, "c")["error"]
    assert err["message"] == "boom" and err["type"] == typ and err["code"] == "c"


def test_sse_error_event_framing():
    frame = sse_error_event("worker w failed mid-stream")
    assert frame.startswith(b"data: {") and frame.endswith(b"\n\n") and frame.count(b"\n") == 2
    assert b'"error":' in frame and b"mid-stream" in frame


# -- hostile input (issue 11, item 4): every rejection a 400 with the field named ------------------------

@pytest.mark.parametrize(
    "route, body, param",
    [
        (CHAT, b'{"model":5,"messages":[{"role":"user"}]}', "model"),
        (CHAT, b'{"model":"m","messages":"hi"}', "messages"),
        (CHAT, b'{"model":"m","messages":[{"role":7,"content":"x"}]}', "messages[0].role"),
        (CHAT, b'{"model":"m","messages":[{"role":"user","content":5}]}', "messages[0].content"),
        (CHAT, b'{"model":"m"}', "messages"),  # missing
        (CHAT, b'{"model":"m","messages":[{"role":"user"}],"stream":"yes"}', "stream"),
        (CHAT, b'{"model":"m","messages":[{"role":"user"}],"n":"2"}', "n"),
        (CHAT, b'{"model":"m","messages":[{"role":"user"}],"n":0}', "n"),
        (CHAT, b'{"model":"m","messages":[{"role":"user"}],"max_tokens":1.5}', "max_tokens"),
        (CHAT, b'{"model":"m","messages":[{"role":"user"}],"max_completion_tokens":0}', "max_completion_tokens"),
        (CHAT, b'{"model":"m","messages":[{"role":"user"}],"temperature":1e999}', "temperature"),
        (CHAT, b'{"model":"m","messages":[{"role":"user"}],"stream_options":[]}', "stream_options"),
        (CHAT, b'{"model":"m","messages":[]}', "messages"),
        (COMP, b'{"model":"m","prompt":[]}', "prompt"),
        (COMP, b'{"model":"m","prompt":[1.5]}', "prompt[0]"),
        (COMP, b'{"model":"m","prompt":"x","max_tokens":true}', "max_tokens"),
    ],
)
def test_wrong_types_name_the_param(route, body, param):
    with pytest.raises(ApiError) as info:
        parse_request(route, body)
    assert info.value.status == 400 and info.value.param == param, info.value.message
    assert error_body(info.value.message, 400, info.value.code, info.value.param)["error"]["param"] == param


@pytest.mark.parametrize("depth", [65, 500, 1000, 50_000])
@pytest.mark.parametrize("where", ["content", "unknown", "images"])
def test_deep_nesting_is_a_400_before_any_decode(depth, where):
    # today: 1000 deep raised RecursionError (a 500); 500 deep passed and broke the PD legs' deepcopy
    inner = b"[" * depth + b"]" * depth
    body = {
        "content": b'{"model":"m","messages":[{"role":"user","content":[{"type":"text","x":' + inner + b'}]}]}',
        "unknown": b'{"model":"m","messages":[{"role":"user"}],"vendor":' + inner + b'}',
        "images": b'{"model":"m","messages":[{"role":"user"}],"images":' + inner + b'}',
    }[where]
    with pytest.raises(ApiError) as info:
        parse_request(CHAT, body)
    assert info.value.status == 400 and info.value.code == "json_too_complex"
    assert "deeper than 64" in info.value.message


def test_nesting_up_to_the_limit_and_brackets_in_strings_pass():
    inner = b"[" * 62 + b"]" * 62  # + the top-level object and the "vendor" value: 63 levels
    assert parse_request(CHAT, b'{"model":"m","messages":[{"role":"user"}],"vendor":' + inner + b'}').model == "m"
    text = b'"' + b"[{" * 5000 + b'\\"' + b"[" * 100 + b'"'  # brackets and an escaped quote inside a string
    assert parse_request(CHAT, b'{"model":"m","messages":[{"role":"user","content":' + text + b'}]}').model == "m"


def test_too_many_containers_is_a_400():
    body = b'{"model":"m","messages":[{"role":"user"}],"vendor":[' + b",".join([b"[]"] * 100_001) + b"]}"
    with pytest.raises(ApiError) as info:
        parse_request(CHAT, body)
    assert info.value.status == 400 and "more than 100000 arrays/objects" in info.value.message
    assert parse_request(CHAT, body, max_containers=200_000).model == "m"


def test_client_kv_transfer_params_need_the_operators_leave():
    body = (b'{"model":"m","messages":[{"role":"user"}],'
            b'"kv_transfer_params":{"do_remote_prefill":true,"remote_host":"10.9.9.9","remote_port":1}}')
    with pytest.raises(ApiError) as info:
        parse_request(CHAT, body)
    assert info.value.status == 400 and info.value.param == "kv_transfer_params"
    assert "--allow-client-kv-transfer-params" in info.value.message
    assert parse_request(CHAT, body, allow_kv_transfer_params=True).kv_transfer_params["remote_host"] == "10.9.9.9"
    # null is the engines' "absent"; a wrong type is a 400 either way
    assert parse_request(COMP, b'{"model":"m","prompt":"x","kv_transfer_params":null}').model == "m"
    with pytest.raises(ApiError):
        parse_request(COMP, b'{"model":"m","prompt":"x","kv_transfer_params":"x"}', allow_kv_transfer_params=True)


# -- duplicate keys (issue 27): a guarded key twice is a 400, never forwarded for an engine to pick one --
CHAT_HEAD = b'{"model":"m","messages":[{"role":"user","content":"hi"}]'


@pytest.mark.parametrize("route, body, key", [
    # the probe's body: a bad value first, null last (msgspec, keeping the last, saw no kv_transfer_params)
    (CHAT, CHAT_HEAD + b',"kv_transfer_params":{"remote_host":"10.9.9.9"},"kv_transfer_params":null}',
     "kv_transfer_params"),
    (CHAT, CHAT_HEAD + b',"priority":2147483647,"priority":1}', "priority"),
    (CHAT, b'{"model":"other","model":"m","messages":[{"role":"user","content":"hi"}]}', "model"),
    (CHAT, CHAT_HEAD + b',"stream":true, "stream" :false}', "stream"),
    (CHAT, CHAT_HEAD + b',"max_tokens":99999999,"max_tokens":4}', "max_tokens"),
    (CHAT, CHAT_HEAD + b',"n":1000,"n":1}', "n"),
    (CHAT, CHAT_HEAD + b',"infera_retention":"long","infera_retention":"none"}', "infera_retention"),
    (COMP, b'{"model":"m","prompt":"x","max_completion_tokens":1,"max_completion_tokens":2}', "max_completion_tokens"),
    # one spelled with escapes: a parser's "priority", invisible to a byte scan; alone or beside the plain one
    (CHAT, CHAT_HEAD + b',"\\u0070riority":5}', "priority"),
    (CHAT, CHAT_HEAD + b',"kv_transfer_para\\u006ds":null,"kv_transfer_params":null}', "kv_transfer_params"),
])
def test_duplicate_guarded_key_is_400(route, body, key):
    with pytest.raises(ApiError) as info:
        parse_request(route, body, allow_kv_transfer_params=True)
    err = info.value
    assert (err.status, err.code, err.param) == (400, "duplicate_key", key)
    assert error_body(err.message, err.status, err.code, err.param)["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("body", [
    # the names inside text, or nested, or an unguarded key twice: fine
    b'{"model":"m","messages":[{"role":"user","content":"\\"model\\": 1, \\"model\\": 2, \\"priority\\""}]}',
    b'{"model":"m","messages":[{"role":"user","content":"hi","model":1},{"role":"user","content":"x","model":2}]}',
    b'{"model":"m","messages":[{"role":"user","content":"hi"}],"vendor":1,"vendor":2}',
    # text escapes (non-ASCII, and an escaped ASCII letter in a value) are not keys
    b'{"model":"m","messages":[{"role":"user","content":"caf\\u00e9 \\u4e2d \\u0041"}]}',
])
def test_no_duplicate_guarded_key_passes(body):
    assert parse_request(CHAT, body).model == "m"
