"""``Channel``: the parent's bounded, deadline-driven JSON-lines reader and writer over file descriptors.

It reads bytes only while waiting for a reply, so a peer can never get more
than one line limit plus one chunk into memory; every read and send has a
deadline; garbage poisons the channel (every later call raises the same error).
Subclasses say what the other end is: a child process, or a TCP peer. After a
keyed handshake every line is an authenticated frame (:mod:`kvwire.control.frames`):
a frame that is not the next one with its tag poisons the channel with
:class:`ControlAuthError`, and nothing of it is returned.
"""

from __future__ import annotations

import json
import os
import select
import time
from collections import deque
from typing import Any, TypeVar

from kvwire.control.errors import (
    ControlAuthError,
    ControlClosedError,
    ControlError,
    ControlProtocolError,
    ControlTimeoutError,
)
from kvwire.control.frames import FRAME_OVERHEAD, FrameAuth
from kvwire.control.jsonlines import (
    DEFAULT_MAX_BUFFERED,
    DEFAULT_MAX_DEPTH,
    DEFAULT_MAX_LINE,
    LineError,
    parse_object,
    preview,
)
from kvwire.errors import ConfigError

__all__ = ["Channel"]

_CHUNK = 1 << 16  # bytes per read from the peer
_SLICE_S = 0.05  # how often a waiting read checks whether the peer is gone


_C = TypeVar("_C", bound="Channel")


class Channel:
    """A bounded JSON-lines channel: ``read``, ``send``, ``request``. Not thread-safe: one caller at a time.

    ``frames``: the framing a keyed handshake returned (every line sealed and opened with it), None for plain lines.
    """

    def __init__(
        self,
        read_fd: int,
        write_fd: int,
        *,
        what: str,
        timeout_s: float,
        max_line: int = DEFAULT_MAX_LINE,
        max_buffered: int = DEFAULT_MAX_BUFFERED,
        max_depth: int = DEFAULT_MAX_DEPTH,
        frames: FrameAuth | None = None,
    ) -> None:
        self.what = what
        self._frames = frames  # after a keyed handshake: every line is an authenticated frame
        self.timeout_s = timeout_s
        self.max_line, self.max_buffered, self.max_depth = max_line, max_buffered, max_depth
        self._line_limit = max_line + (FRAME_OVERHEAD if frames is not None else 0)  # a frame's bytes, or a line's
        self._in, self._out = write_fd, read_fd
        os.set_blocking(self._in, False)  # sends have a deadline too
        self._readable, self._writable = select.poll(), select.poll()
        self._readable.register(self._out, select.POLLIN)
        self._writable.register(self._in, select.POLLOUT)
        self._lines: deque[bytes] = deque()  # complete lines not read yet
        self._queued = 0  # their bytes
        self._partial = bytearray()  # the line in progress
        self._eof = False
        self._error: ControlError | None = None  # set once the channel is poisoned
        self._closed = False

    @staticmethod
    def check_limits(**limits: float) -> None:
        for name, value in limits.items():
            if not value > 0:
                raise ConfigError(f"{name} must be > 0, got {value!r}")

    @property
    def label(self) -> str:
        return self.what

    @property
    def holds_data(self) -> bool:
        """True while bytes of an unread line (complete, or the start of one) are held: a read has them."""
        return bool(self._lines or self._partial)

    # what the other end is (subclasses)

    def _gone(self) -> bool:
        """True when the peer is gone although no EOF was seen (a child that exited)."""
        return False

    def _closed_error(self, deadline: float) -> ControlError:
        """The error for the end of the channel (EOF)."""
        cut = f" in the middle of a line ({preview(bytes(self._partial))})" if self._partial else ""
        return self._poison(ControlClosedError(f"{self.label} closed the connection before answering{cut}"))

    def _send_failed(self, exc: OSError) -> ControlError:
        return self._poison(ControlClosedError(f"{self.label} closed the connection before reading a command ({exc})"))

    def _error_reply(self, text: str) -> ControlError:
        return ControlError(f"{self.what} failed: {text[:1000]}")

    def __enter__(self: _C) -> _C:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError

    def _poison(self, error: ControlError) -> ControlError:
        self._error = error
        self._lines.clear()
        self._partial = bytearray()
        self._queued = 0
        return error

    def _raise_if_poisoned(self) -> None:
        if self._error is not None:
            raise self._error.with_traceback(None)

    # reading

    def _take(self, data: bytes) -> None:
        """Split ``data`` into lines, enforcing the line length and the buffer size."""
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            if len(self._partial) + end - start > self._line_limit:
                raise self._too_long((bytes(self._partial[:60]) + data[start : start + 60])[:60])
            line = bytes(self._partial) + data[start:end]
            self._partial.clear()
            self._lines.append(line)
            self._queued += len(line)
            start = end + 1
        self._partial += data[start:]
        if len(self._partial) > self._line_limit:
            raise self._too_long(bytes(self._partial[:60]))
        if self._queued + len(self._partial) > self.max_buffered:
            raise self._poison(
                ControlProtocolError(
                    f"{self.label} flooded the channel: {self._queued + len(self._partial)} bytes of unread lines, "
                    f"over the limit of {self.max_buffered}"
                )
            )

    def _too_long(self, head: bytes) -> ControlError:
        return self._poison(
            ControlProtocolError(
                f"{self.label} sent a line over {self._line_limit} bytes (no newline within the limit), "
                f"starting {preview(head)}"
            )
        )

    def _fill(self, deadline: float) -> None:
        """Wait up to one slice for bytes from the child and take them; raises when the channel ends."""
        slice_s = max(0.0, min(deadline - time.monotonic(), _SLICE_S))
        if not self._readable.poll(int(slice_s * 1000) + 1):
            if self._gone() and not self._readable.poll(0):  # e.g. a child that exited, its stdout held open
                raise self._closed_error(deadline)
            return
        try:
            data = os.read(self._out, _CHUNK)
        except OSError as exc:
            raise self._poison(ControlClosedError(f"{self.label}: reading failed: {exc}")) from None
        if not data:
            self._eof = True
            raise self._closed_error(deadline)
        self._take(data)

    def read(self, timeout_s: float | None = None) -> dict[str, Any]:
        """The child's next message; a ControlError subclass on garbage, exit or timeout, ControlError on its error."""
        self._raise_if_poisoned()
        wait = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait
        while not self._lines:
            if self._eof:
                raise self._closed_error(deadline)
            self._fill(deadline)  # at least one look, even with no time left
            if not self._lines and time.monotonic() >= deadline:
                if self._partial:
                    raise self._poison(
                        ControlTimeoutError(
                            f"{self.label} stalled in the middle of a line: {len(self._partial)} bytes and no newline "
                            f"within {wait:g} s: {preview(bytes(self._partial))}"
                        )
                    )
                raise ControlTimeoutError(f"{self.label} did not answer within {wait:g} s")
        line = self._lines.popleft()
        self._queued -= len(line)
        if self._frames is not None:
            try:
                line = self._frames.open(line)
            except ControlAuthError as exc:
                raise self._poison(exc) from None
            if len(line) > self.max_line:
                raise self._poison(
                    ControlProtocolError(
                        f"{self.label} sent a message over {self.max_line} bytes in one frame, starting {preview(line)}"
                    )
                )
        try:
            message = parse_object(line, self.max_depth)
        except LineError as exc:
            raise self._poison(ControlProtocolError(f"{self.label} sent {exc}")) from None
        if "error" in message:
            raise self._error_reply(str(message["error"]))
        return message

    # writing

    def send(self, message: dict[str, Any], timeout_s: float | None = None) -> None:
        """Send one message; ControlClosedError if the child is gone, ControlTimeoutError if it does not read."""
        self._raise_if_poisoned()
        payload = json.dumps(message, separators=(",", ":")).encode()
        if self._frames is not None:
            payload = self._frames.seal(payload)
        data = memoryview(payload + b"\n")
        wait = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait
        sent = 0
        while sent < len(data):
            try:
                sent += os.write(self._in, data[sent:])
                continue
            except BlockingIOError:
                pass
            except OSError as exc:  # EPIPE: the peer closed its end or exited
                raise self._send_failed(exc) from None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._poison(
                    ControlTimeoutError(
                        f"{self.label} did not read its input within {wait:g} s ({sent} of {len(data)} bytes sent)"
                    )
                )
            self._writable.poll(int(min(remaining, _SLICE_S) * 1000) + 1)

    def request(self, message: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        self.send(message, timeout_s)
        return self.read(timeout_s)
