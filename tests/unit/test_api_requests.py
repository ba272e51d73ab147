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
