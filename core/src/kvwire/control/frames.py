"""Every line after the control-key handshake authenticated: a sequence number and an HMAC per frame.

The handshake (:mod:`kvwire.control.auth`) proves both sides hold the key; this keeps an attacker on the
path from altering, replaying, reordering, dropping, reflecting or injecting the lines that follow. Both
sides derive a per-connection session key from the control key and the two handshake nonces,
``HMAC-SHA256(key, "kvwire-control session" + len(server nonce) as 1 byte + server nonce + client nonce)``,
and send each line as one frame::

    <seq> <tag> <payload>\\n

``seq`` counts the frames one side sends on the connection from 0 (ASCII decimal, no leading zeros, at most
19 digits); ``tag`` is ``HMAC-SHA256(session key, direction + seq as 8 bytes big-endian + payload)`` in
lowercase hex (64 characters), with ``direction`` ``b"client->server"`` or ``b"server->client"`` (the client
is the side that connected); ``payload`` is the JSON line itself, unchanged. A frame is at most
:data:`FRAME_OVERHEAD` bytes longer than its payload, and every read stays bounded by the channel's line
limit plus that overhead.

A receiver accepts only the next sequence number with its tag and otherwise raises
:class:`~kvwire.control.ControlAuthError` naming what was wrong: a line without a frame's sequence number
and tag, a frame whose number is not the next one (replayed, reordered or one dropped before it), a wrong
tag (altered on the way, or a frame of the other direction reflected back). Nothing of that frame reaches
the application, and the connection is done: every later read raises the same error, and the caller closes
it. Both sides must run a kvwire with this framing: the handshake's hello carries protocol version 2, and a
peer of another version is refused there, by name, before any frame.

What this does not do: payloads are not encrypted (an attacker on the path reads them), and an attacker
can still cut the connection or delay it until a deadline passes. Channels without a key (loopback only)
are not framed.
"""

from __future__ import annotations

import hashlib
import hmac
import io
from typing import IO, Final

from kvwire.control.errors import ControlAuthError, ControlClosedError, ControlError
from kvwire.control.jsonlines import DEFAULT_MAX_LINE

__all__ = ["FRAME_OVERHEAD", "FrameAuth", "SignedWriter", "VerifiedReader", "session_key"]

_SESSION: Final = b"kvwire-control session"
_TO_SERVER: Final = b"client->server"
_TO_CLIENT: Final = b"server->client"
_TAG_CHARS: Final = 64
_MAX_SEQ_CHARS: Final = 19  # up to 2**63 - 1
_MAX_SEQ: Final = 2**63 - 1
#: Bytes a frame adds to its payload at most: the sequence number, the tag and two spaces.
FRAME_OVERHEAD: Final = _MAX_SEQ_CHARS + _TAG_CHARS + 2


def session_key(key: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """The key both sides frame with after a handshake with these nonces (each at most 255 bytes)."""
    message = _SESSION + len(server_nonce).to_bytes(1, "big") + server_nonce + client_nonce
    return hmac.new(key, message, hashlib.sha256).digest()


class FrameAuth:
    """One side's framing of one connection: seals what it sends, opens what it receives (not thread-safe).

    ``server``: this side accepted the connection. After one refused frame every later :meth:`open` raises
    the same error: a connection that carried a forged frame is not trusted again.
    """

    def __init__(self, session: bytes, *, server: bool, peer: str) -> None:
        self._key = session
        self._out, self._in = (_TO_CLIENT, _TO_SERVER) if server else (_TO_SERVER, _TO_CLIENT)
        self.peer = peer
        self.sent = 0  # the number of the next frame this side sends
        self.received = 0  # the number of the next frame this side accepts
        self.failed: ControlError | None = None

    def _tag(self, direction: bytes, seq: int, payload: bytes) -> bytes:
        return hmac.new(self._key, direction + seq.to_bytes(8, "big") + payload, hashlib.sha256).hexdigest().encode()

    def seal(self, payload: bytes) -> bytes:
        """``payload`` (one line, without its newline) as the next frame this side sends (no newline)."""
        seq = self.sent
        if seq > _MAX_SEQ:
            raise ControlAuthError(f"the connection to {self.peer} sent {seq} frames, its most; reconnect")
        self.sent += 1
        return b"%d %s %s" % (seq, self._tag(self._out, seq, payload), payload)

    def fail(self, error: ControlError) -> ControlError:
        """Mark the connection as done with ``error`` (returned, to raise)."""
        if self.failed is None:
            self.failed = error
        return self.failed

    def open(self, frame: bytes) -> bytes:
        """The payload of ``frame`` (one line, without its newline) if it is the next frame; else ControlAuthError."""
        if self.failed is not None:
            raise self.failed.with_traceback(None)
        expected = self.received
        seq_text, _, rest = frame.partition(b" ")
        tag, _, payload = rest.partition(b" ")
        if not (
            0 < len(seq_text) <= _MAX_SEQ_CHARS
            and seq_text.isdigit()
            and (seq_text == b"0" or not seq_text.startswith(b"0"))
            and len(tag) == _TAG_CHARS
            and rest[_TAG_CHARS : _TAG_CHARS + 1] == b" "
        ):
            raise self.fail(
                ControlAuthError(
                    f"{self.peer} sent a line without frame authentication where frame {expected} was due: after "
                    "the control-key handshake every line carries a sequence number and a tag (both sides must "
                    "run the same kvwire); the connection is closed"
                )
            )
        seq = int(seq_text)
        if seq != expected:
            raise self.fail(
                ControlAuthError(
                    f"{self.peer} sent frame {seq} where frame {expected} was due: a replayed, reordered or "
                    "dropped frame; the connection is closed"
                )
            )
        if not hmac.compare_digest(tag, self._tag(self._in, seq, payload)):
            raise self.fail(
                ControlAuthError(
                    f"{self.peer} sent frame {seq} with a wrong authentication tag: altered on the way, or not "
                    "sent by the peer that completed the handshake in this direction; the connection is closed"
                )
            )
        self.received += 1
        return payload


class VerifiedReader(io.RawIOBase):
    """A binary line reader over ``raw`` that hands on each frame's payload (``readline`` only).

    ``readline(size)`` reads at most ``size`` (default: one more than the default line limit) plus
    :data:`FRAME_OVERHEAD` bytes; a frame longer than that,
    or a connection that ends in the middle of one, ends the connection too: none of it is handed on.
    """

    def __init__(self, raw: IO[bytes], frames: FrameAuth) -> None:
        super().__init__()
        self._raw, self._frames = raw, frames

    def readable(self) -> bool:
        return True

    def readline(self, size: int | None = -1) -> bytes:
        frames = self._frames
        if frames.failed is not None:
            raise frames.failed.with_traceback(None)
        limit = (DEFAULT_MAX_LINE + 1 if size is None or size < 0 else size) + FRAME_OVERHEAD
        line = self._raw.readline(limit)
        if line.endswith(b"\n"):
            return frames.open(line[:-1]) + b"\n"
        if not line:
            return b""  # the end of the connection, between frames
        if len(line) == limit:
            raise frames.fail(
                ControlAuthError(
                    f"{frames.peer} sent a frame longer than {limit - 1} bytes (frame {frames.received}): it is not "
                    "read further; the connection is closed"
                )
            )
        raise frames.fail(
            ControlClosedError(
                f"{frames.peer} closed the connection in the middle of frame {frames.received} "
                f"({len(line)} bytes, no newline); none of it was read as a command"
            )
        )

    def close(self) -> None:
        try:
            super().close()  # flushes first
        finally:
            self._raw.close()


class SignedWriter(io.TextIOBase):
    """A text writer over ``raw`` that sends each complete line as a frame (``write`` and ``flush``)."""

    def __init__(self, raw: IO[str], frames: FrameAuth) -> None:
        super().__init__()
        self._raw, self._frames = raw, frames
        self._pending = ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._pending += text
        *lines, self._pending = self._pending.split("\n")
        for line in lines:
            self._raw.write(self._frames.seal(line.encode()).decode() + "\n")
        return len(text)

    def flush(self) -> None:
        self._raw.flush()

    def close(self) -> None:
        try:
            super().close()  # flushes first
        finally:
            self._raw.close()
