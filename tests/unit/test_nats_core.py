"""The lean NATS client's protocol parser and URL handling, fed bytes the way a socket would."""
from __future__ import annotations

import pytest

from infera.transport.nats_core import NatsCoreClient, NatsError, _Protocol, _Server


class _Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.aborted = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def abort(self) -> None:
        self.aborted = True

    def is_closing(self) -> bool:
        return self.aborted


def _parser(**subs):
    client = NatsCoreClient("nats://127.0.0.1:1")
    got: list[tuple] = []
    for sid, fail in subs.items():
        def cb(subject, reply, data, status, sid=sid, fail=fail):
            got.append((sid, subject, reply, data, status))
            if fail:
                raise RuntimeError("subscriber bug")
        client._subs[sid.encode()] = cb
    proto = _Protocol(client)
    transport = _Transport()
    proto.connection_made(transport)
    return client, proto, transport, got


STREAM = (b"INFO {\"max_payload\": 2048}\r\n"  # a second INFO (cluster update) after the handshake
          b"MSG a.b 1 3\r\nxyz\r\n"
          b"PING\r\n"
          b"MSG _INBOX.p.7 1 _INBOX.r 0\r\n\r\n"
          b"HMSG _INBOX.p.8 1 16 16\r\nNATS/1.0 503\r\n\r\n\r\n"
          b"HMSG h 1 r.1 18 21\r\nNATS/1.0\r\nA: b\r\n\r\nabc\r\n"
          b"MSG bin 1 4\r\n\r\n\r\n\r\n"  # a payload that itself holds CRLF
          b"+OK\r\n"
          b"MSG other 9 1\r\nq\r\n")  # a sid nobody holds (unsubscribed meanwhile): skipped

EXPECTED = [("1", b"a.b", b"", b"xyz", 0),
            ("1", b"_INBOX.p.7", b"_INBOX.r", b"", 0),
            ("1", b"_INBOX.p.8", b"", b"", 503),
            ("1", b"h", b"r.1", b"abc", 0),
            ("1", b"bin", b"", b"\r\n\r\n", 0)]


@pytest.mark.parametrize("step", [len(STREAM), 1, 2, 3, 7, 16, 41])
async def test_messages_parse_whatever_the_read_boundaries(step):
    client, proto, transport, got = _parser(**{"1": False})
    proto.info.set_result({})  # the handshake's INFO was read already
    for i in range(0, len(STREAM), step):
        proto.data_received(STREAM[i:i + step])
    assert got == EXPECTED
    assert transport.written == [b"PONG\r\n"] and not transport.aborted
    assert client.max_payload == 2048
    assert proto.buf == b""


async def test_a_failing_callback_does_not_drop_the_connection():
    _, proto, transport, got = _parser(**{"1": True})
    proto.info.set_result({})
    proto.data_received(b"MSG a 1 1\r\nx\r\nMSG b 1 1\r\ny\r\n")
    assert [g[1] for g in got] == [b"a", b"b"] and not transport.aborted


@pytest.mark.parametrize("garbage", [b"MSG a 1 notanumber\r\n", b"X" * (70 * 1024)])
async def test_protocol_garbage_drops_the_connection(garbage):
    _, proto, transport, _ = _parser(**{"1": False})
    proto.info.set_result({})
    proto.data_received(garbage)
    assert transport.aborted and proto.buf == b""


async def test_first_info_completes_the_handshake_future():
    _, proto, _, _ = _parser()
    proto.data_received(b'INFO {"server_id":"x","max_payload":4096,"headers":true}\r\n')
    assert (await proto.info)["max_payload"] == 4096


@pytest.mark.parametrize("url,expect", [
    ("nats://127.0.0.1:4222", ("127.0.0.1", 4222, False, None, None, None)),
    ("127.0.0.1:5000", ("127.0.0.1", 5000, False, None, None, None)),
    ("nats://h", ("h", 4222, False, None, None, None)),
    ("tls://h:1", ("h", 1, True, None, None, None)),
    ("nats://alice:s%40cret@h:1", ("h", 1, False, "alice", "s@cret", None)),
    ("nats://tok@h:1", ("h", 1, False, None, None, "tok")),
])
def test_server_urls(url, expect):
    s = _Server(url)
    assert (s.host, s.port, s.tls, s.user, s.password, s.token) == expect


@pytest.mark.parametrize("url", ["http://h:1", "ws://h"])
def test_unsupported_schemes_are_refused(url):
    with pytest.raises(ValueError, match="scheme"):
        _Server(url)


async def test_publish_while_disconnected_raises():
    client = NatsCoreClient("nats://127.0.0.1:1")
    with pytest.raises(NatsError):
        client.publish(b"x", b"y")
    with pytest.raises(NatsError):
        await client.flush()
