"""The bounded inbox of notifications received and not yet polled, and what each poll of it lost.

One drop policy for every transport that keeps notifications for its next
poll: at most :data:`MAX_UNPOLLED_NOTIFICATIONS`, the oldest dropped past it
and counted. Each drain publishes a :class:`PollRecord` in the caller's context
(as :mod:`kvwire.transport.telemetry` does for sends), which the metrics
middleware turns into ``kvwire_notifications_dropped_total``.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvwire.records import LastRecord
from kvwire.spec.notifications import MAX_UNPOLLED_NOTIFICATIONS

__all__ = ["Inbox", "PollRecord", "mark_poll", "poll_since"]

T = TypeVar("T")
_log = logging.getLogger("kvwire.notifications")


@dataclass(frozen=True)
class PollRecord:
    """One drain of an :class:`Inbox`: what it returned, and what was dropped (inbox full) since the last."""

    received: int
    dropped: int


_polls: LastRecord[PollRecord] = LastRecord("kvwire_poll")  # per caller (see kvwire.records)


def publish_poll(received: int, dropped: int) -> PollRecord:
    """Record a drain that returned ``received`` notifications, ``dropped`` having been lost since the last."""
    return _polls.publish(PollRecord(received, dropped))


def mark_poll() -> int:
    """A marker of this caller's poll records so far (see :func:`poll_since`)."""
    return _polls.mark()


def poll_since(marker: int) -> PollRecord | None:
    """The last poll record published after ``marker``, or None (the backend keeps no bounded inbox)."""
    return _polls.since(marker)


class Inbox(Generic[T]):
    """Notifications received and not yet polled, at most ``limit``: the oldest are dropped past it, and counted.

    The one drop policy of every transport that keeps notifications for its next poll, so that a
    peer flooding a receiver that never polls costs it a bounded amount of memory.
    """

    def __init__(self, limit: int = MAX_UNPOLLED_NOTIFICATIONS) -> None:
        self._items: deque[T] = deque(maxlen=limit)
        self._lock = threading.Lock()
        self.dropped = 0
        self._reported = 0  # ``dropped`` at the last drain

    def extend(self, items: Iterable[T]) -> None:
        with self._lock:
            for item in items:
                if len(self._items) == self._items.maxlen:
                    self.dropped += 1
                self._items.append(item)

    def drain(self) -> list[T]:
        """Everything kept, oldest first; the inbox is then empty.

        Publishes a :class:`PollRecord` (what it returns, and
        what was dropped since the last drain), and logs a warning when something was.
        """
        with self._lock:
            out = list(self._items)
            self._items.clear()
            dropped, self._reported = self.dropped - self._reported, self.dropped
        publish_poll(len(out), dropped)
        if dropped:
            _log.warning(
                "%d notification(s) dropped since the last poll: more than %d arrived unpolled (the oldest go "
                "first); poll more often",
                dropped,
                self._items.maxlen,
            )
        return out

    def __len__(self) -> int:
        return len(self._items)
