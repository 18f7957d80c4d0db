"""The failure notice: a prefill tells the decode at once that a write it had accepted failed.

Without it the decode learns it only at ``load_timeout_s``, holding the
request's blocks until then. The notice travels as a backend notification (the
channel the arrival notification takes), so a decode watches one channel:
``kvwire.vllm.failed:`` and a JSON object ``{"request": <decode request id>,
"rank": <prefill TP rank, or null between equal TP sizes>, "reason": <why>}``,
at most :data:`kvwire.MAX_NOTIFICATION_BYTES` (the reason is cut to fit). It
comes from another process, so :func:`parse_failure_notice` reads it strictly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Final

from kvwire.hosts.vllm.registration import with_token
from kvwire.spec.notifications import MAX_NOTIFICATION_BYTES

__all__ = ["FailureNotice", "failure_notice_for", "parse_failure_notice"]

_PREFIX: Final = b"kvwire.vllm.failed:"
_KEYS: Final = frozenset({"request", "rank", "reason"})


@dataclass(frozen=True)
class FailureNotice:
    """A parsed failure notice: which decode request, from which prefill rank (None: equal TP sizes), why."""

    request_id: str
    prefill_rank: int | None
    reason: str


def failure_notice_for(
    decode_request_id: str, prefill_rank: int | None, reason: str, token: str | None = None
) -> bytes:
    """The notice that the write of ``decode_request_id``'s blocks failed, ``reason`` cut to fit a notification;
    tagged with the registration's ``token`` when it carried one
    (:func:`~kvwire.hosts.vllm.registration.with_token`)."""

    def encode(why: str) -> bytes:
        body = {"request": decode_request_id, "rank": prefill_rank, "reason": why}
        return with_token(token, _PREFIX + json.dumps(body, ensure_ascii=True).encode())

    message = encode(reason)
    if len(message) > MAX_NOTIFICATION_BYTES:  # each character cut shortens the JSON by one byte or more
        cut = max(0, len(reason) - (len(message) - MAX_NOTIFICATION_BYTES) - 16)
        message = encode(reason[:cut] + " [cut]")
    return message  # still too long only for a request id of thousands of escaped characters: refused when sent


def parse_failure_notice(message: bytes) -> FailureNotice | None:
    """The notice ``message`` holds, or None: not a well-formed failure notice of this connector."""
    if not message.startswith(_PREFIX) or len(message) > MAX_NOTIFICATION_BYTES:
        return None
    try:
        body = json.loads(message[len(_PREFIX) :])
    except ValueError:  # bad JSON or bad UTF-8
        return None
    if not isinstance(body, dict) or set(body) != _KEYS:
        return None
    request, rank, reason = body["request"], body["rank"], body["reason"]
    if not isinstance(request, str) or not request or not isinstance(reason, str):
        return None
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < 1 << 20):
        return None
    return FailureNotice(request, rank, reason)
