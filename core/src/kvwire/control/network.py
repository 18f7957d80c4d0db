"""The control channel over TCP, for a decode side on another machine (``kvwire bench --role decode``).

:class:`PeerConnection` is the parent's end (the same bounded :class:`Channel`
over a connected socket); :func:`accept_one` is the decode side's: it listens
where it is told, takes one connection, and hands back the reader and writer
that :func:`kvwire.control.serve` answers on. Both ends run the mutual HMAC
handshake of :mod:`kvwire.control.auth` before any command: with a key
(``KVWIRE_CONTROL_KEY`` or a key file) only a peer holding the same key gets
through; a wrong or missing key is :class:`ControlAuthError`, naming the peer.
With a key, every line after the handshake, both ways, is an authenticated frame
(:mod:`kvwire.control.frames`): :class:`PeerConnection` frames and checks its own,
and :func:`accept_one` hands back a reader and writer that do.
Listening on a non-loopback address without a key is refused
(:func:`check_listen_key`); on loopback it is allowed, with a warning.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable
from typing import IO, cast

from kvwire.control.auth import KEY_ENV, client_handshake, is_loopback, server_handshake
from kvwire.control.channel import Channel
from kvwire.control.errors import ControlAuthError, ControlClosedError, ControlError
from kvwire.control.frames import SignedWriter, VerifiedReader
from kvwire.control.jsonlines import DEFAULT_MAX_BUFFERED, DEFAULT_MAX_DEPTH, DEFAULT_MAX_LINE
from kvwire.errors import ConfigError

__all__ = ["PeerConnection", "accept_one", "check_listen_key", "parse_address"]


def parse_address(text: str, what: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) as (host, port); ConfigError naming ``what``."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{what} must be HOST:PORT, got {text!r}")
    return host, int(port)


def check_listen_key(host: str, key: bytes | None, what: str = "--listen") -> str | None:
    """ConfigError for a non-loopback ``host`` without a key; for loopback without one, the warning to print."""
    if key is not None:
        return None
    if not is_loopback(host):
        raise ConfigError(
            f"{what} {host}: the control channel would accept commands from anyone who reaches this address; "
            f"set {KEY_ENV} or pass --control-key-file (the same secret on both sides), or listen on 127.0.0.1"
        )
    return (
        f"warning: the control channel on {host} is unauthenticated (no {KEY_ENV} or --control-key-file): "
        "any local user can connect to it"
    )


class PeerConnection(Channel):
    """Parent side of a control channel to ``host:port``; ``key``: the control key (None: the peer must have none)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        what: str,
        timeout_s: float = 60.0,
        max_line: int = DEFAULT_MAX_LINE,
        max_buffered: int = DEFAULT_MAX_BUFFERED,
        max_depth: int = DEFAULT_MAX_DEPTH,
        key: bytes | None = None,
    ) -> None:
        self.check_limits(timeout_s=timeout_s, max_line=max_line, max_buffered=max_buffered, max_depth=max_depth)
        self.address = f"{host}:{port}"
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as exc:
            raise ControlClosedError(f"{what} at {self.address} could not be reached: {exc}") from None
        try:
            frames = client_handshake(self.sock, key, f"{what} at {self.address}", timeout_s)
        except ControlAuthError:
            self.sock.close()
            raise
        fd = self.sock.fileno()
        super().__init__(
            fd,
            fd,
            what=what,
            timeout_s=timeout_s,
            max_line=max_line,
            max_buffered=max_buffered,
            max_depth=max_depth,
            frames=frames,
        )

    @property
    def label(self) -> str:
        return f"{self.what} at {self.address}"

    def close(self) -> None:
        """Ask the peer to quit (briefly), then close the connection; never hangs."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._error is None:
                with contextlib.suppress(ControlError):
                    self.request({"cmd": "quit"}, timeout_s=min(self.timeout_s, 5.0))
        finally:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            self.sock.close()
            if self._error is None:
                self._poison(ControlClosedError(f"{self.label}: the channel is closed"))


def accept_one(
    host: str,
    port: int,
    announce: IO[str],
    key: bytes | None = None,
    *,
    handshake_s: float = 30.0,
    on_refused: Callable[[ControlAuthError], None] | None = None,
    notice: str | None = None,
) -> tuple[socket.socket, IO[bytes], IO[str]]:
    """Listen on ``host:port``, write ``listening on HOST:PORT`` (the bound port) to ``announce``, take one client.

    The announcement is the first line written (scripts wait for it); ``notice`` (a warning) follows it.

    Every connection first runs the handshake with ``key``; one that fails it is closed, reported to
    ``on_refused`` (default: a line on ``announce``) and the next is awaited: a stranger cannot end the wait.
    With a key, the reader and writer handed back open and seal every line as an authenticated frame
    (:mod:`kvwire.control.frames`): a frame that is not the next one with its tag raises ControlAuthError from
    the reader, and the caller closes the connection.
    """
    with socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET) as server:
        bound = server.getsockname()[1]
        announce.write(f"kvwire bench: decode side listening on {host}:{bound}\n")
        if notice is not None:
            announce.write(f"kvwire bench: {notice}\n")
        announce.flush()
        while True:
            conn, address = server.accept()
            try:
                frames = server_handshake(conn, key, f"prefill side at {address[0]}:{address[1]}", handshake_s)
            except ControlAuthError as exc:
                conn.close()
                if on_refused is not None:
                    on_refused(exc)
                else:
                    announce.write(f"kvwire bench: refused a connection: {exc}\n")
                    announce.flush()
                continue
            break
    reader, writer = conn.makefile("rb"), conn.makefile("w", encoding="utf-8")
    if frames is None:
        return conn, reader, writer
    return conn, cast(IO[bytes], VerifiedReader(reader, frames)), cast(IO[str], SignedWriter(writer, frames))
