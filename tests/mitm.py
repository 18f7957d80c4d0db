"""A man in the middle for control-channel tests: relays TCP connections line by line and lets a test alter them.

:class:`Mitm` listens on 127.0.0.1 and relays every connection it accepts to ``target``, one thread per
direction. The handshake's lines pass unchanged (:data:`HANDSHAKE_LINES`); each
later line goes through ``hook(relay, frame)``, which forwards it (:meth:`Relay.forward`, the default),
drops it, alters it, holds it, sends it the other way or ends a direction. Every line read is recorded.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

UP, DOWN = "up", "down"  # client to server, server to client
#: Lines of the handshake per direction: with a key, the client's answer, the server's hello and its answer;
#: without one, the server's hello.
HANDSHAKE_LINES = {True: {UP: 1, DOWN: 2}, False: {UP: 0, DOWN: 1}}


@dataclass(frozen=True)
class Frame:
    conn: int  # the connection's number at the proxy, from 0
    direction: str  # UP or DOWN
    index: int  # the line's number in its direction after the handshake, from 0
    line: bytes  # with its newline


class Relay:
    """One relayed connection: the client's socket and the proxy's own to the server."""

    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.socks = {UP: server, DOWN: client}  # where a line going that way is written
        self.local_port = server.getsockname()[1]  # the server sees the proxy coming from here
        self._lock = threading.Lock()

    def send(self, direction: str, data: bytes) -> None:
        with self._lock, contextlib.suppress(OSError):
            self.socks[direction].sendall(data)

    def forward(self, frame: Frame) -> None:
        self.send(frame.direction, frame.line)

    def end(self, direction: str) -> None:
        """End the stream going ``direction`` (the reader there sees EOF)."""
        with contextlib.suppress(OSError):
            self.socks[direction].shutdown(socket.SHUT_WR)


Hook = Callable[[Relay, Frame], None]


class Mitm:
    """Relays connections to ``target``; ``hook`` sees every line after the handshake (``keyed``: skip it)."""

    def __init__(self, target: tuple[str, int], hook: Hook | None = None, *, keyed: bool = True) -> None:
        self.target, self.hook, self.keyed = target, hook, keyed
        self.relays: list[Relay] = []
        self.frames: list[Frame] = []  # every line after the handshake, as read
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)  # the accept loop looks at the stop flag
        self.port = self._listener.getsockname()[1]
        self._threads: list[threading.Thread] = []
        self._stop = False
        self._start(self._accept)

    def _start(self, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            server = socket.create_connection(self.target)
            relay = Relay(client, server)
            conn = len(self.relays)
            self.relays.append(relay)
            self._start(self._pump, relay, conn, UP, client)
            self._start(self._pump, relay, conn, DOWN, server)

    def _pump(self, relay: Relay, conn: int, direction: str, source: socket.socket) -> None:
        skip = HANDSHAKE_LINES[self.keyed][direction]
        index = 0
        with source.makefile("rb") as reader:
            while True:
                try:
                    line = reader.readline(1 << 22)
                except OSError:
                    line = b""
                if not line:
                    relay.end(direction)
                    return
                if skip:
                    skip -= 1
                    relay.send(direction, line)
                    continue
                frame = Frame(conn, direction, index, line)
                index += 1
                self.frames.append(frame)
                if self.hook is not None:
                    self.hook(relay, frame)
                else:
                    relay.forward(frame)

    def lines(self, conn: int, direction: str) -> list[bytes]:
        return [f.line for f in self.frames if f.conn == conn and f.direction == direction]

    def close(self) -> None:
        self._stop = True
        with contextlib.suppress(OSError):
            self._listener.close()
        for relay in self.relays:
            for sock in relay.socks.values():
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
        for thread in self._threads:
            thread.join(timeout=5)

    def __enter__(self) -> Mitm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def flip_last_digit(line: bytes) -> bytes:
    """``line`` with its payload's last digit changed (still valid JSON: a different number)."""
    at = max(i for i, b in enumerate(line) if 0x30 <= b <= 0x39 and i > line.rfind(b" {"))
    return line[:at] + bytes([0x30 + (line[at] - 0x30 + 1) % 10]) + line[at + 1 :]


def payload(line: bytes) -> bytes:
    """The JSON payload of a frame line (its newline kept): the line with its sequence number and tag stripped."""
    return line.split(b" ", 2)[2]
