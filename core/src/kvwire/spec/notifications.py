"""Arrival notifications: short messages a sender attaches to, or sends after, its writes.

A notification reaches the receiving endpoint only after the bytes of the
transfers it follows are visible in the receiver's memory, so a decode process
that sees "request 42 done" can read request 42's pages at once. Transports
deliver them with their own mechanism (NIXL's notifications, Mooncake's
notify); the core fixes the message type, its size limit and the ordering
promise, the same for every backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from kvwire.errors import InvalidTransferError

__all__ = ["MAX_NOTIFICATION_BYTES", "MAX_UNPOLLED_NOTIFICATIONS", "Notification", "check_message"]

#: The largest message a notification may carry: enough for a request id and a little state, small enough that
#: every transport carries it in one control message.
MAX_NOTIFICATION_BYTES: Final = 4096
#: How many notifications a receiving endpoint keeps until it polls: past it the oldest are dropped and counted
#: (anyone who reaches the endpoint can send them; at the message limit this bounds the inbox to 256 MiB).
MAX_UNPOLLED_NOTIFICATIONS: Final = 65536


@dataclass(frozen=True)
class Notification:
    """One message that arrived: ``sender`` is the sending endpoint's transport id, ``message`` its bytes."""

    sender: str
    message: bytes


def check_message(message: object, name: str = "notification") -> bytes:
    """``message`` as bytes, or InvalidTransferError naming ``name`` (bytes-like only, at most the limit)."""
    if isinstance(message, (bytearray, memoryview)):
        message = bytes(message)
    if not isinstance(message, bytes):
        raise InvalidTransferError(f"{name} must be bytes, got {type(message).__name__}")
    if len(message) > MAX_NOTIFICATION_BYTES:
        raise InvalidTransferError(
            f"{name} is {len(message)} bytes; a notification carries at most {MAX_NOTIFICATION_BYTES} bytes "
            "(send an id, not the payload)"
        )
    return message
