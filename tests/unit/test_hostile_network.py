"""Issue 27 (a hostile network), items 4 and 11 without a server: upper bounds of ``n`` and
``max_tokens``, and the worker's address kept out of what a client is told of a failure."""
from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from infera.api.errors import ApiError
from infera.api.requests import MAX_N, MAX_TOKENS, parse_request
from infera.discovery.record import WorkerRecord
from infera.router.upstream import LegFailure, midstream_error_event, open_upstream, public_text
from infera.transport.http import UpstreamError, UpstreamTimeout

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


def body(route: str, **fields) -> bytes:
    base = {"model": "m", **({"messages": MESSAGES} if route == CHAT else {"prompt": "hi"})}
    return msgspec.json.encode({**base, **fields})


@pytest.mark.parametrize("route, field, most", [
    (CHAT, "n", MAX_N), (COMPLETIONS, "n", MAX_N), (CHAT, "max_tokens", MAX_TOKENS),
    (COMPLETIONS, "max_tokens", MAX_TOKENS), (CHAT, "max_completion_tokens", MAX_TOKENS),
])
def test_n_and_max_tokens_have_upper_bounds(route, field, most):
    assert (MAX_N, MAX_TOKENS) == (128, 1_048_576)
    assert getattr(parse_request(route, body(route, **{field: most})), field) == most
    for bad in (most + 1, 2**62):
        with pytest.raises(ApiError) as info:
            parse_request(route, body(route, **{field: bad}))
        err = json.loads(info.value.body())["error"]
        assert info.value.status == 400 and err["param"] == field and err["code"] == "invalid_request"
        assert str(most) in err["message"]


@pytest.mark.parametrize("text, wid, want", [
    ("worker 127.0.0.1:8001 stalled: nothing received for 0.5s (idle timeout)", "127.0.0.1:8001",
     "the worker stalled: nothing received for 0.5s (idle timeout)"),
    ("cannot connect to 10.0.0.5:8000: Connect call failed ('10.0.0.5', 8000)", "10.0.0.5:8000",
     "cannot connect to the worker: Connect call failed <address>"),
    ("NATS is not connected (nats://10.1.1.1:4222,nats://b.example:4222): cannot reach worker w1", "w1",
     "NATS is not connected (<address>,<address>): cannot reach the worker"),
    ("connect to [fd00::1]:8000 timed out after 5s", "x", "connect to <address> timed out after 5s"),
    ("reply frames from w were lost; worker was fine", "w", "reply frames from the worker were lost; worker was fine"),
])
def test_public_text_drops_addresses_and_the_worker_id(text, wid, want):
    assert public_text(text, wid) == want


class FailingTransport:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    async def send(self, *args, **kwargs):
        raise self.exc


WORKER = WorkerRecord(worker_id="10.9.8.7:8123", url="http://10.9.8.7:8123", model_name="m")


@pytest.mark.parametrize("exc, reason", [
    (UpstreamError("cannot connect to 10.9.8.7:8123: Connection refused", before_response=True), "unreachable"),
    (UpstreamTimeout("worker 10.9.8.7:8123 sent no reply within 0.5s (first-byte timeout)", before_response=True),
     "timeout"),
])
def test_a_leg_failure_tells_the_client_no_address_and_the_log_all(exc, reason):
    with pytest.raises(LegFailure) as info:
        asyncio.run(open_upstream(FailingTransport(exc), WORKER, CHAT, b"{}", (), stream=True))
    f = info.value
    assert f.reason == reason and "10.9.8.7" not in f.message and "8123" not in f.message
    assert f.body is None or b"10.9.8.7" not in f.body
    assert "10.9.8.7:8123" in f.detail  # the log keeps which worker


def test_midstream_events_name_no_worker():
    for exc in (UpstreamTimeout("worker 10.9.8.7:8123 stalled: nothing received for 1s (idle timeout)"), None):
        event = midstream_error_event("10.9.8.7:8123", exc)
        assert b"10.9.8.7" not in event and b"8123" not in event
    assert b"idle timeout" in midstream_error_event("10.9.8.7:8123", UpstreamTimeout("worker x stalled (idle timeout)"))


def test_a_misconfigured_pd_worker_is_named_in_the_log_not_to_the_client(caplog):
    from infera.router.pd.base import misconfigured

    worker = WorkerRecord(worker_id="10.9.8.7:8123", url="http://10.9.8.7:8123", model_name="m", disagg_mode="prefill")
    err = misconfigured("vllm-mori", worker, "advertises kv_connector_extra_config.host_ip '10.9.8.6'")
    assert err.status == 500 and err.code == "pd_misconfigured" and "prefill" in err.message
    assert "10.9.8" not in err.message and "8123" not in err.message
    assert "10.9.8.7:8123" in caplog.text and "10.9.8.6" in caplog.text
