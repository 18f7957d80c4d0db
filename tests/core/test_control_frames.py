"""Every control message after the handshake authenticated (:mod:`kvwire.control.frames`), over real sockets.

The bench's decode path (``accept_one`` + ``serve``) on one end, a :class:`PeerConnection` on the other, and a
man in the middle (``tests/mitm.py``) between them that alters, replays, reorders, drops, reflects or strips
frames in flight: each is refused with the exact error, the connection ends, and nothing of the frame reaches
a handler or the caller.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from echo_server import EchoServer
from mitm import DOWN, UP, Frame, Mitm, Relay, flip_last_digit, payload

from kvwire.control import (
    KEY_ENV,
    ControlAuthError,
    ControlClosedError,
    ControlError,
    ControlProtocolError,
    PeerConnection,
    read_command,
)
from kvwire.control.auth import client_handshake, server_handshake
from kvwire.control.channel import Channel
from kvwire.control.frames import FRAME_OVERHEAD, FrameAuth, SignedWriter, VerifiedReader, session_key

KEY = b"0123456789abcdef-the-right-key"
_CLOSED = "the connection is closed"
_TAMPERED = (
    "sent frame {n} with a wrong authentication tag: altered on the way, or not sent by the peer that completed "
    f"the handshake in this direction; {_CLOSED}"
)
_OUT_OF_ORDER = "sent frame {got} where frame {due} was due: a replayed, reordered or dropped frame; " + _CLOSED
_NO_TAG = (
    "sent a line without frame authentication where frame {n} was due: after the control-key handshake every "
    f"line carries a sequence number and a tag (both sides must run the same kvwire); {_CLOSED}"
)


@pytest.fixture(autouse=True)
def _no_key_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)


Hook = Callable[[Relay, Frame], None]


@pytest.fixture
def path() -> Iterator[Callable[..., tuple[EchoServer, Mitm, PeerConnection]]]:
    """A decode side, a man in the middle with ``hook``, and a keyed client connected through it."""
    opened: list[tuple[EchoServer, Mitm, PeerConnection]] = []

    def make(hook: Hook | None = None, key: bytes | None = KEY) -> tuple[EchoServer, Mitm, PeerConnection]:
        decode = EchoServer(key)
        mitm = Mitm(("127.0.0.1", decode.port), hook, keyed=key is not None)
        client = PeerConnection("127.0.0.1", mitm.port, what="decode side", timeout_s=5.0, key=key)
        opened.append((decode, mitm, client))
        return decode, mitm, client

    yield make
    for decode, mitm, client in opened:
        client.close()
        mitm.close()
        decode.thread.join(timeout=10)


def _server_sees(mitm: Mitm) -> str:
    """How the decode side names the client: the proxy's own address towards it."""
    return f"prefill side at 127.0.0.1:{mitm.relays[0].local_port}"


def _refused_by_server(decode: EchoServer, mitm: Mitm, client: PeerConnection, reason: str) -> None:
    """The decode side ended serve with exactly ``reason`` and closed the connection, which the client sees."""
    error = decode.finish()
    assert isinstance(error, ControlAuthError)
    assert str(error) == f"{_server_sees(mitm)} {reason}"
    with pytest.raises(ControlClosedError):
        client.request({"cmd": "echo", "v": 99})


# -- the happy path --------------------------------------------------------------------------------------------


def test_many_frames_both_ways_arrive_in_order_each_with_its_number_and_tag(path: Any) -> None:
    decode, mitm, client = path()
    for v in range(300):
        assert client.request({"cmd": "echo", "v": v}) == {"echo": v}
    client.close()
    assert decode.finish() is None
    assert [m["v"] for m in decode.commands] == list(range(300))
    for direction in (UP, DOWN):
        lines = mitm.lines(0, direction)
        assert len(lines) == 301  # and the quit, and its answer
        for n, line in enumerate(lines):
            assert re.fullmatch(rb"%d [0-9a-f]{64} \{.*\}\n" % n, line), line


def test_without_a_key_the_lines_stay_plain_json(path: Any) -> None:
    decode, mitm, client = path(key=None)
    assert client.request({"cmd": "echo", "v": 1}) == {"echo": 1}
    client.close()
    assert decode.finish() is None
    assert mitm.lines(0, UP) == [b'{"cmd":"echo","v":1}\n', b'{"cmd":"quit"}\n']
    assert mitm.lines(0, DOWN) == [b'{"echo":1}\n', b'{"ok":true}\n']


# -- what the decode side refuses (client to server) -----------------------------------------------------------


def test_a_frame_with_one_payload_byte_changed_in_flight_is_refused_and_never_handled(path: Any) -> None:
    def tamper(relay: Relay, frame: Frame) -> None:
        relay.send(
            frame.direction, flip_last_digit(frame.line) if (frame.direction, frame.index) == (UP, 1) else frame.line
        )

    decode, mitm, client = path(tamper)
    assert client.request({"cmd": "echo", "v": 1}) == {"echo": 1}
    with pytest.raises(ControlClosedError):
        client.request({"cmd": "echo", "v": 2})  # arrives as v: 3
    _refused_by_server(decode, mitm, client, _TAMPERED.format(n=1))
    assert decode.commands == [{"cmd": "echo", "v": 1}]


def test_a_recorded_frame_sent_again_is_refused_as_replayed(path: Any) -> None:
    def replay(relay: Relay, frame: Frame) -> None:
        relay.forward(frame)
        if (frame.direction, frame.index) == (UP, 0):
            relay.forward(frame)

    decode, mitm, client = path(replay)
    assert client.request({"cmd": "echo", "v": 1}) == {"echo": 1}
    _refused_by_server(decode, mitm, client, _OUT_OF_ORDER.format(got=0, due=1))
    assert decode.commands == [{"cmd": "echo", "v": 1}]  # once


def test_two_frames_swapped_in_flight_are_refused_as_reordered(path: Any) -> None:
    held: list[Frame] = []

    def swap(relay: Relay, frame: Frame) -> None:
        if (frame.direction, frame.index) == (UP, 0):
            held.append(frame)
            return
        relay.forward(frame)
        if held:
            relay.forward(held.pop())

    decode, mitm, client = path(swap)
    client.send({"cmd": "echo", "v": 1})
    client.send({"cmd": "echo", "v": 2})
    with pytest.raises(ControlClosedError):
        client.read()
    _refused_by_server(decode, mitm, client, _OUT_OF_ORDER.format(got=1, due=0))
    assert decode.commands == []


def test_a_frame_dropped_in_flight_makes_the_next_one_refused(path: Any) -> None:
    def drop(relay: Relay, frame: Frame) -> None:
        if (frame.direction, frame.index) != (UP, 1):
            relay.forward(frame)

    decode, mitm, client = path(drop)
    assert client.request({"cmd": "echo", "v": 1}) == {"echo": 1}
    client.send({"cmd": "echo", "v": 2})  # dropped
    client.send({"cmd": "echo", "v": 3})
    with pytest.raises(ControlClosedError):
        client.read()
    _refused_by_server(decode, mitm, client, _OUT_OF_ORDER.format(got=2, due=1))
    assert decode.commands == [{"cmd": "echo", "v": 1}]


def test_a_frame_with_its_number_and_tag_stripped_is_refused(path: Any) -> None:
    def strip(relay: Relay, frame: Frame) -> None:
        relay.send(frame.direction, payload(frame.line) if frame.direction == UP else frame.line)

    decode, mitm, client = path(strip)
    with pytest.raises(ControlClosedError):
        client.request({"cmd": "echo", "v": 1})
    _refused_by_server(decode, mitm, client, _NO_TAG.format(n=0))
    assert decode.commands == []


def test_a_command_injected_without_a_newline_before_the_end_is_not_run(path: Any) -> None:
    """A line cut by the end of the connection is never read as a command, framed or not."""

    def inject(relay: Relay, frame: Frame) -> None:
        relay.send(UP, b'{"cmd":"echo","v":666}')
        relay.end(UP)

    decode, mitm, client = path(inject)
    client.send({"cmd": "echo", "v": 1})
    error = decode.finish()
    assert isinstance(error, ControlClosedError)
    assert str(error) == (
        f"{_server_sees(mitm)} closed the connection in the middle of frame 0 (22 bytes, no newline); none of it "
        "was read as a command"
    )
    assert decode.commands == []


# -- what the client refuses (server to client) ----------------------------------------------------------------


def _refused_by_client(client: PeerConnection, reason: str, v: int = 1) -> None:
    expected = f"decode side at 127.0.0.1:{client.address.rsplit(':', 1)[1]} {reason}"
    with pytest.raises(ControlAuthError) as first:
        client.request({"cmd": "echo", "v": v})
    assert str(first.value) == expected
    with pytest.raises(ControlAuthError) as again:  # the channel is done: the same error, nothing sent
        client.request({"cmd": "echo", "v": v + 1})
    assert str(again.value) == expected


def test_a_reply_altered_in_flight_is_refused_by_the_client(path: Any) -> None:
    def tamper(relay: Relay, frame: Frame) -> None:
        relay.send(frame.direction, flip_last_digit(frame.line) if frame.direction == DOWN else frame.line)

    _, _, client = path(tamper)
    _refused_by_client(client, _TAMPERED.format(n=0))


def test_the_clients_own_frame_reflected_back_to_it_is_refused(path: Any) -> None:
    def reflect(relay: Relay, frame: Frame) -> None:
        relay.send(DOWN, frame.line) if frame.direction == UP else None

    decode, _, client = path(reflect)
    _refused_by_client(client, _TAMPERED.format(n=0))
    assert decode.commands == []


def test_a_reply_replayed_in_place_of_the_next_is_refused_by_the_client(path: Any) -> None:
    first: list[bytes] = []

    def replay(relay: Relay, frame: Frame) -> None:
        if frame.direction == DOWN:
            first.append(frame.line)
            relay.send(DOWN, first[0])
        else:
            relay.forward(frame)

    _, _, client = path(replay)
    assert client.request({"cmd": "echo", "v": 1}) == {"echo": 1}
    _refused_by_client(client, _OUT_OF_ORDER.format(got=0, due=1), v=2)


def test_a_reply_with_its_tag_stripped_is_refused_by_the_client(path: Any) -> None:
    def strip(relay: Relay, frame: Frame) -> None:
        relay.send(frame.direction, payload(frame.line) if frame.direction == DOWN else frame.line)

    _, _, client = path(strip)
    _refused_by_client(client, _NO_TAG.format(n=0))


# -- the framing itself ----------------------------------------------------------------------------------------


def _pair() -> tuple[FrameAuth, FrameAuth]:
    session = session_key(KEY, b"s" * 32, b"c" * 32)
    return FrameAuth(session, server=False, peer="client"), FrameAuth(session, server=True, peer="server")


def test_the_tag_covers_the_direction_the_number_and_the_payload_under_the_session_key() -> None:
    client, server = _pair()
    frame = client.seal(b'{"v":1}')
    session = hmac.new(KEY, b"kvwire-control session" + bytes([32]) + b"s" * 32 + b"c" * 32, hashlib.sha256)
    tag = hmac.new(session.digest(), b"client->server" + (0).to_bytes(8, "big") + b'{"v":1}', hashlib.sha256)
    assert frame == b"0 " + tag.hexdigest().encode() + b' {"v":1}'
    assert server.open(frame) == b'{"v":1}'
    # a frame of one side is not one of the other: the direction is in the tag
    reflected_client, _ = _pair()
    with pytest.raises(ControlAuthError, match=r"^client sent frame 0 with a wrong authentication tag"):
        reflected_client.open(frame)
    # another connection's session (other nonces) makes other tags
    other = FrameAuth(session_key(KEY, b"s" * 32, b"d" * 32), server=True, peer="server")
    with pytest.raises(ControlAuthError, match=r"^server sent frame 0 with a wrong authentication tag"):
        other.open(frame)


def test_after_a_refused_frame_even_the_genuine_one_is_refused() -> None:
    client, server = _pair()
    frame = client.seal(b'{"v":1}')
    with pytest.raises(ControlAuthError) as refused:
        server.open(frame[:-2] + b"2}")
    with pytest.raises(ControlAuthError) as again:
        server.open(frame)
    assert str(again.value) == str(refused.value) == f"server {_TAMPERED.format(n=0)}"


@pytest.mark.parametrize(
    "mangle",
    [
        lambda f: b"0" + f,  # a leading zero
        lambda f: b"+" + f,
        lambda f: f.replace(b" ", b"  ", 1),
        lambda f: f[: f.index(b" ") + 64],  # no payload, no space
        lambda f: f.replace(b" ", b" 00", 1)[:-1],  # a 66-character tag
    ],
)
def test_a_line_that_is_not_exactly_a_frame_is_refused_as_unauthenticated(mangle: Callable[[bytes], bytes]) -> None:
    client, server = _pair()
    with pytest.raises(ControlAuthError) as refused:
        server.open(mangle(client.seal(b'{"v":1}')))
    assert str(refused.value) == f"server {_NO_TAG.format(n=0)}"


def test_a_payload_over_the_line_limit_is_a_bad_command_and_a_frame_over_it_ends_the_connection() -> None:
    a, b = socket.socketpair()
    client, server = _pair()
    try:
        with a.makefile("w", encoding="utf-8") as raw_out, b.makefile("rb") as raw_in:
            out, reader = SignedWriter(raw_out, client), VerifiedReader(raw_in, server)
            out.write('{"v":"' + "x" * 92 + '"}\n')  # a payload of 100 bytes: the limit
            out.write('{"v":"' + "x" * 93 + '"}\n')  # 101: authentic, but too long a command (as unframed)
            out.write('{"v":2}\n')
            out.write('{"v":"' + "x" * 200 + '"}\n')  # a frame over the limit plus the frame overhead
            out.flush()
            assert read_command(reader, max_line=100) == {"v": "x" * 92}
            with pytest.raises(ControlProtocolError, match=r"^bad command: a line over 100 bytes: "):
                read_command(reader, max_line=100)
            assert read_command(reader, max_line=100) == {"v": 2}  # still in step
            with pytest.raises(ControlAuthError) as refused:
                read_command(reader, max_line=100)
            assert str(refused.value) == (
                f"server sent a frame longer than {100 + FRAME_OVERHEAD} bytes (frame 3): it is not read further; "
                "the connection is closed"
            )
    finally:
        a.close()
        b.close()


def test_the_parents_channel_bounds_a_frame_by_the_line_limit_plus_overhead_and_its_message_by_the_limit() -> None:
    a, b = socket.socketpair()
    client, server = _pair()

    class _Sock(Channel):
        def close(self) -> None:
            pass

    try:
        channel = _Sock(a.fileno(), a.fileno(), what="peer", timeout_s=5.0, max_line=100, frames=client)
        b.sendall(server.seal(b'{"v":"' + b"x" * 92 + b'"}') + b"\n")  # payload at the limit, frame over it
        assert channel.read() == {"v": "x" * 92}
        b.sendall(server.seal(b'{"v":"' + b"x" * 93 + b'"}') + b"\n")  # payload over it, frame within the bound
        with pytest.raises(ControlError, match=r"^peer sent a message over 100 bytes in one frame, starting "):
            channel.read()
        channel = _Sock(a.fileno(), a.fileno(), what="peer", timeout_s=5.0, max_line=100, frames=client)  # anew
        b.sendall(server.seal(b'{"v":"' + b"x" * 200 + b'"}') + b"\n")
        with pytest.raises(ControlError, match=rf"^peer sent a line over {100 + FRAME_OVERHEAD} bytes"):
            channel.read()
    finally:
        a.close()
        b.close()


def test_a_server_of_another_protocol_version_is_refused_naming_both() -> None:
    a, b = socket.socketpair()
    try:
        b.sendall(b'{"kvwire_control":1,"challenge":"' + b"ab" * 32 + b'"}\n')
        with pytest.raises(ControlAuthError) as refused:
            client_handshake(a, KEY, "decode side at 10.0.0.9:7000", timeout_s=5.0)
        assert str(refused.value) == (
            "decode side at 10.0.0.9:7000 speaks kvwire control protocol version 1, this side version 2 (every "
            "frame after the handshake authenticated): run the same kvwire version on both sides"
        )
    finally:
        a.close()
        b.close()


def test_both_handshakes_derive_the_same_session_and_only_a_keyed_one_frames() -> None:
    a, b = socket.socketpair()
    got: dict[str, Any] = {}
    try:
        thread = threading.Thread(target=lambda: got.update(server=server_handshake(b, KEY, "client", 5.0)))
        thread.start()
        client = client_handshake(a, KEY, "server", 5.0)
        thread.join(10)
        server = got["server"]
        assert client is not None and server is not None
        assert server.open(client.seal(b"{}")) == b"{}" and client.open(server.seal(b"[]")) == b"[]"
        thread = threading.Thread(target=lambda: got.update(server=server_handshake(b, None, "client", 5.0)))
        thread.start()
        assert client_handshake(a, None, "server", 5.0) is None
        thread.join(10)
        assert got["server"] is None
    finally:
        a.close()
        b.close()
