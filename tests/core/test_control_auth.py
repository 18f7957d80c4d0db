"""The TCP control channel's key handshake (:mod:`kvwire.control.auth`), over real sockets on 127.0.0.1."""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
from echo_server import EchoServer

from kvwire.cli import main
from kvwire.control import (
    KEY_ENV,
    ControlAuthError,
    PeerConnection,
    check_listen_key,
    load_key,
    read_command,
)
from kvwire.errors import ConfigError

KEY = b"0123456789abcdef-the-right-key"


@pytest.fixture(autouse=True)
def _no_key_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)


@pytest.fixture
def server_factory() -> Iterator[Any]:
    servers: list[EchoServer] = []

    def make(key: bytes | None, **kwargs: Any) -> EchoServer:
        server = EchoServer(key, **kwargs, record_refused=True)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


def test_the_right_key_gets_through_both_ways(server_factory: Any) -> None:
    server = server_factory(KEY)
    with PeerConnection("127.0.0.1", server.port, what="decode side", timeout_s=10.0, key=KEY) as channel:
        assert channel.request({"cmd": "echo", "v": 7}) == {"echo": 7}
    server.thread.join(timeout=10)
    assert (server.error, server.refused, server.commands) == (None, [], [{"cmd": "echo", "v": 7}])


def test_a_wrong_key_is_refused_on_both_sides_before_any_command(server_factory: Any) -> None:
    server = server_factory(KEY)
    with pytest.raises(ControlAuthError) as info:
        PeerConnection("127.0.0.1", server.port, what="decode side", timeout_s=10.0, key=b"not-the-key")
    assert re.fullmatch(
        rf"decode side at 127\.0\.0\.1:{server.port} refused the control key: authentication failed: wrong control key",
        str(info.value),
    ), str(info.value)
    deadline = time.monotonic() + 10
    while not server.refused and time.monotonic() < deadline:
        time.sleep(0.01)
    (refused,) = server.refused
    assert re.fullmatch(
        r"prefill side at 127\.0\.0\.1:\d+ answered the control-key challenge with a wrong key", str(refused)
    )
    assert server.commands == []
    # the server is still listening: a stranger cannot end its wait, the right client still gets through
    with PeerConnection("127.0.0.1", server.port, what="decode side", timeout_s=10.0, key=KEY) as channel:
        assert channel.request({"cmd": "echo", "v": "ok"}) == {"echo": "ok"}


def test_no_key_against_a_keyed_server_is_refused(server_factory: Any) -> None:
    server = server_factory(KEY)
    with pytest.raises(ControlAuthError, match=rf"^decode side at 127\.0\.0\.1:{server.port} requires a control key"):
        PeerConnection("127.0.0.1", server.port, what="decode side", timeout_s=10.0)
    assert server.commands == []


def test_a_client_with_a_key_never_downgrades_to_a_keyless_server(server_factory: Any) -> None:
    server = server_factory(None)
    with pytest.raises(ControlAuthError, match=r"does not authenticate \(it has no control key\) but this side has"):
        PeerConnection("127.0.0.1", server.port, what="decode side", timeout_s=10.0, key=KEY)
    assert server.commands == []


def test_keyless_on_both_sides_works_on_loopback(server_factory: Any) -> None:
    server = server_factory(None)
    with PeerConnection("127.0.0.1", server.port, what="decode side", timeout_s=10.0) as channel:
        assert channel.request({"cmd": "echo", "v": [1]}) == {"echo": [1]}


def test_a_client_that_never_answers_the_challenge_is_dropped(server_factory: Any) -> None:
    server = server_factory(KEY, handshake_s=0.5)
    with socket.create_connection(("127.0.0.1", server.port)) as silent:
        assert silent.recv(1024).startswith(b'{"kvwire_control":2,"challenge":"')
        deadline = time.monotonic() + 10
        while not server.refused and time.monotonic() < deadline:
            time.sleep(0.01)
    assert "did not complete the control-key handshake within 0.5 s" in str(server.refused[0])


def _fake_server(payload: bytes) -> tuple[socket.socket, threading.Thread]:
    listener = socket.create_server(("127.0.0.1", 0))

    def run() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(payload)
            time.sleep(1.0)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return listener, thread


@pytest.mark.parametrize(
    ("payload", "pattern"),
    [
        (b"HTTP/1.1 400 Bad Request\r\n\r\n", r"sent a line that is not JSON .* during the control-key handshake"),
        (b'{"cmd": "hello"}\n', r"did not open with a kvwire control hello"),
        (b"", r"did not complete the control-key handshake within 0.5 s"),
    ],
)
def test_a_server_that_is_not_a_kvwire_peer_is_an_auth_error(payload: bytes, pattern: str) -> None:
    listener, thread = _fake_server(payload)
    with listener:
        port = listener.getsockname()[1]
        with pytest.raises(ControlAuthError, match=rf"^decode side at 127\.0\.0\.1:{port} .*{pattern}"):
            PeerConnection("127.0.0.1", port, what="decode side", timeout_s=0.5, key=KEY)
        thread.join(timeout=5)


def test_an_impostor_server_without_the_key_is_refused_by_the_client() -> None:
    """A server that challenges but cannot answer the client's challenge (it lacks the key) is caught."""
    listener = socket.create_server(("127.0.0.1", 0))
    got: list[bytes] = []

    def run() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(b'{"kvwire_control":2,"challenge":"' + b"ab" * 32 + b'"}\n')
            got.append(conn.recv(4096))  # the client's answer: useless without the key
            conn.sendall(b'{"response":"' + b"00" * 32 + b'"}\n')
            got.append(conn.recv(4096))  # b"": the client hung up, sending nothing more

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    with listener:
        port = listener.getsockname()[1]
        with pytest.raises(
            ControlAuthError,
            match=rf"^decode side at 127\.0\.0\.1:{port} answered the control-key challenge with a wrong key$",
        ):
            PeerConnection("127.0.0.1", port, what="decode side", timeout_s=5.0, key=KEY)
        thread.join(timeout=5)
    assert got[0].startswith(b'{"response":"') and got[1] == b""


def test_listening_without_a_key_is_refused_off_loopback_and_warned_on_it() -> None:
    with pytest.raises(ConfigError, match=r"^--listen 0\.0\.0\.0: the control channel would accept commands"):
        check_listen_key("0.0.0.0", None)
    with pytest.raises(ConfigError, match=r"^--listen 10\.1\.2\.3: .*KVWIRE_CONTROL_KEY or pass --control-key-file"):
        check_listen_key("10.1.2.3", None)
    for host in ("127.0.0.1", "::1", "localhost"):
        warning = check_listen_key(host, None)
        assert warning is not None and "unauthenticated" in warning
    assert check_listen_key("0.0.0.0", KEY) is None


def test_the_key_comes_from_the_file_then_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert load_key(None) is None
    monkeypatch.setenv(KEY_ENV, " from-env-0123456789 \n")
    assert load_key(None) == b"from-env-0123456789"
    key_file = tmp_path / "key"
    key_file.write_bytes(b"from-file-0123456789\n")
    assert load_key(str(key_file)) == b"from-file-0123456789"
    key_file.write_bytes(b"\n")
    with pytest.raises(ConfigError, match=r"^--control-key-file '.*key' is empty"):
        load_key(str(key_file))
    with pytest.raises(ConfigError, match=r"^--control-key-file '.*missing' cannot be read: No such file"):
        load_key(str(tmp_path / "missing"))
    monkeypatch.setenv(KEY_ENV, "  ")
    with pytest.raises(ConfigError, match=r"^KVWIRE_CONTROL_KEY is set but empty"):
        load_key(None)


def test_bench_refuses_a_keyless_non_loopback_listen(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--role", "decode", "--listen", "0.0.0.0:0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvwire bench: error: --listen 0.0.0.0: the control channel would accept commands from ")
    assert err.count("\n") == 1


def test_bench_refuses_a_key_file_without_tcp(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "key").write_text("k")
    assert main(["bench", "--backend", "mooncake", "--control-key-file", str(tmp_path / "key")]) == 2
    assert capsys.readouterr().err.startswith("kvwire bench: error: --control-key-file is for the TCP control channel")


def test_read_command_after_the_handshake_sees_only_commands() -> None:
    """The handshake consumes exactly its own lines: the first command is intact."""
    left, right = socket.socketpair()
    with left, right:
        from kvwire.control.auth import client_handshake, server_handshake

        done: list[BaseException | None] = []

        def server() -> None:
            try:
                server_handshake(left, KEY, "prefill side")
                done.append(None)
            except BaseException as exc:
                done.append(exc)

        thread = threading.Thread(target=server)
        thread.start()
        client_handshake(right, KEY, "decode side")
        right.sendall(b'{"cmd": "start", "x": 1}\n')
        thread.join(timeout=10)
        assert done == [None]
        reader: IO[bytes] = left.makefile("rb")
        with reader:
            assert read_command(reader) == {"cmd": "start", "x": 1}


def test_a_key_shorter_than_16_bytes_is_refused_naming_its_source(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(KEY_ENV, "x")
    with pytest.raises(ConfigError) as exc:
        load_key(None)
    assert str(exc.value) == (
        "KVWIRE_CONTROL_KEY holds a key of 1 bytes; a control key needs at least 16 "
        "(e.g. `openssl rand -hex 32`, the same on both sides)"
    )
    key_file = tmp_path / "key"
    key_file.write_bytes(b"15-bytes-secret\n")
    with pytest.raises(ConfigError, match=r"^--control-key-file '.*key' holds a key of 15 bytes; .* at least 16 "):
        load_key(str(key_file))
    key_file.write_bytes(b"16-bytes-secret!\n")
    assert load_key(str(key_file)) == b"16-bytes-secret!"


# -- the handshake's own bounds, driven over a socket pair --------------------------------------------------------


def test_a_handshake_line_over_1024_bytes_is_refused_at_once_not_at_the_deadline() -> None:
    from kvwire.control.auth import server_handshake

    server, client = socket.socketpair()
    try:
        client.sendall(b"a" * 2000)  # no newline, and the connection stays open
        with pytest.raises(ControlAuthError) as exc:
            server_handshake(server, b"k" * 32, "peer 10.0.0.9", timeout_s=2.0)
        assert str(exc.value).startswith("peer 10.0.0.9 sent a handshake line over 1024 bytes")
    finally:
        server.close()
        client.close()


def test_a_client_challenge_under_16_bytes_is_refused_even_with_the_right_response() -> None:
    import hashlib
    import hmac
    import json

    from kvwire.control.auth import _CLIENT, server_handshake

    key = b"k" * 32
    server, client = socket.socketpair()
    failure: list[BaseException] = []

    def serve_one() -> None:
        try:
            server_handshake(server, key, "peer 10.0.0.9", timeout_s=10.0)
        except BaseException as exc:  # handed to the test below
            failure.append(exc)

    thread = threading.Thread(target=serve_one)
    thread.start()
    try:
        hello = json.loads(client.makefile("rb").readline())
        nonce = bytes.fromhex(hello["challenge"])
        response = hmac.new(key, _CLIENT + nonce, hashlib.sha256).hexdigest()
        client.sendall((json.dumps({"response": response, "challenge": "0badcafe"}) + "\n").encode())
        thread.join(10)
    finally:
        server.close()
        client.close()
    assert not thread.is_alive()
    (exc,) = failure
    assert isinstance(exc, ControlAuthError)
    assert str(exc) == "peer 10.0.0.9 sent a challenge of 4 bytes, under 16"
