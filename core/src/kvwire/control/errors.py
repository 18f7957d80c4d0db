"""The errors of the control channel: one class per way a peer process can fail the parent."""

from __future__ import annotations

from kvwire.errors import KvwireError

__all__ = ["ControlAuthError", "ControlClosedError", "ControlError", "ControlProtocolError", "ControlTimeoutError"]


class ControlError(KvwireError, RuntimeError):
    """The peer failed, exited, sent garbage, or did not answer in time (this class: it reported a failure)."""


class ControlProtocolError(ControlError):
    """The child sent something that is not a bounded JSON-object line (garbage, too long, too deep, a flood)."""


class ControlTimeoutError(ControlError):
    """The child did not answer, or stopped in the middle of a line, within the deadline."""


class ControlClosedError(ControlError):
    """The child could not start, exited, or closed its end of the channel."""


class ControlAuthError(ControlError):
    """The TCP peer failed the control-key handshake (wrong or missing key, not a kvwire control peer, another
    protocol version), or sent a frame after it that is not the next authenticated one (altered, replayed,
    reordered, reflected, or without its tag): the connection is done."""
