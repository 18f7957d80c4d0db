"""The control channel over TCP, for a decode side on another machine (``kvwire bench --role decode``).

:class:`PeerConnection` is the parent's end (the same bounded :class:`Channel`
over a connected socket); :func:`accept_one` is the decode side's: it listens
where it is told, takes one connection, and hands back the reader and writer
that :func:`kvwire.control.serve` answers on. No authentication: bind it to a
private address.
"""

from __future__ import annotations

import contextlib
import socket
from typing import IO

from kvwire.control.channel import Channel
from kvwire.control.errors import ControlClosedError, ControlError
from kvwire.control.jsonlines import DEFAULT_MAX_BUFFERED, DEFAULT_MAX_DEPTH, DEFAULT_MAX_LINE
from kvwire.errors import ConfigError

__all__ = ["PeerConnection", "accept_one", "parse_address"]


def parse_address(text: str, what: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) as (host, port); ConfigError naming ``what``."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{what} must be HOST:PORT, got {text!r}")
    return host, int(port)


class PeerConnection(Channel):
    """Parent side of a control channel to ``host:port``."""

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
    ) -> None:
        self.check_limits(timeout_s=timeout_s, max_line=max_line, max_buffered=max_buffered, max_depth=max_depth)
        self.address = f"{host}:{port}"
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as exc:
            raise ControlClosedError(f"{what} at {self.address} could not be reached: {exc}") from None
        fd = self.sock.fileno()
        super().__init__(
            fd, fd, what=what, timeout_s=timeout_s, max_line=max_line, max_buffered=max_buffered, max_depth=max_depth
        )

    @property
    def label(self) -> str:
        return f"{self.what} at {self.address}"

    def __enter__(self) -> PeerConnection:
        return self

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


def accept_one(host: str, port: int, announce: IO[str]) -> tuple[socket.socket, IO[bytes], IO[str]]:
    """Listen on ``host:port``, write ``listening on HOST:PORT`` (the bound port) to ``announce``, take one client."""
    with socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET) as server:
        bound = server.getsockname()[1]
        announce.write(f"kvwire bench: decode side listening on {host}:{bound}\n")
        announce.flush()
        conn, _ = server.accept()
    return conn, conn.makefile("rb"), conn.makefile("w", encoding="utf-8")
