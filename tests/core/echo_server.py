"""A control-channel server for the tests: ``accept_one`` in a thread on 127.0.0.1, then an echo service.

What the bench's decode side does on ``--listen``: the tests of the key handshake (test_control_auth) and of the
per-frame authentication after it (test_control_frames) both talk to it.
"""

from __future__ import annotations

import io
import re
import threading
from typing import Any

from kvwire.control import ControlAuthError, ControlError, PeerConnection, accept_one, serve


class Announce(io.StringIO):
    """What ``accept_one`` announces; :meth:`port` waits for its "listening on" line."""

    def __init__(self) -> None:
        super().__init__()
        self._ready = threading.Event()

    def write(self, text: str) -> int:
        n = super().write(text)
        if "listening on" in text:
            self._ready.set()
        return n

    def port(self) -> int:
        assert self._ready.wait(10), "the server did not announce its port"
        match = re.search(r"listening on 127\.0\.0\.1:(\d+)", self.getvalue())
        assert match is not None, self.getvalue()
        return int(match.group(1))


class EchoServer:
    """The client ``accept_one`` lets through gets ``{"echo": v}`` for ``{"cmd": "echo", "v": v}``.

    ``commands``: what reached the handler, from any client. ``error``: what ended ``serve`` (None: EOF or quit).
    With ``record_refused``, refused clients go to ``refused`` instead of a line on the announce stream.
    """

    def __init__(self, key: bytes | None, handshake_s: float = 10.0, *, record_refused: bool = False) -> None:
        self.key = key
        self.refused: list[ControlAuthError] = []
        self.commands: list[dict[str, Any]] = []
        self.error: BaseException | None = None
        self.announce = Announce()
        on_refused = self.refused.append if record_refused else None
        self.thread = threading.Thread(target=self._run, args=(handshake_s, on_refused), daemon=True)
        self.thread.start()
        self.port = self.announce.port()

    def _run(self, handshake_s: float, on_refused: Any) -> None:
        try:
            sock, reader, writer = accept_one(
                "127.0.0.1", 0, self.announce, self.key, handshake_s=handshake_s, on_refused=on_refused
            )
            with sock, reader, writer:
                serve({"echo": self._echo}, stdin=reader, stdout=writer)
        except BaseException as exc:  # the test reads it
            self.error = exc

    def _echo(self, message: dict[str, Any]) -> dict[str, Any]:
        self.commands.append(message)
        return {"echo": message.get("v")}

    def finish(self) -> BaseException | None:
        """Wait for ``serve`` to end (it must); what ended it."""
        self.thread.join(timeout=10)
        assert not self.thread.is_alive(), "serve did not end"
        return self.error

    def stop(self) -> None:
        """Let the server's accept return (one keyless-or-right connection, closed at once), then join."""
        if self.thread.is_alive():
            try:
                with PeerConnection("127.0.0.1", self.port, what="stopper", timeout_s=5.0, key=self.key):
                    pass
            except ControlError:
                pass
        self.thread.join(timeout=10)
