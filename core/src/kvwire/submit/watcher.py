"""``NotificationWatcher``: the decode side's view of arrivals, polled on a thread of its own.

A decode process wants to learn "request 42's pages are here" without a loop
of its own around :meth:`kvwire.Connection.poll_notifications`. The watcher
polls on a daemon thread, notes when each notification was seen
(``time.monotonic()``), hands it to an optional callback at once (on the
watcher's thread: the place to digest or schedule the pages), and keeps it
until :meth:`NotificationWatcher.wait_for` takes it by message or
:meth:`NotificationWatcher.wait` reads the arrivals so far. Polling costs
CPU that the transfers it watches need: the default pause between empty polls,
200 µs, took a few percent of a core where 20 µs took 30%.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from kvwire.errors import ConfigError
from kvwire.submit.notifications import Notification

if TYPE_CHECKING:
    from kvwire.connection import Connection

__all__ = ["DEFAULT_POLL_S", "Arrival", "NotificationWatcher"]

#: Seconds between two polls that found nothing.
DEFAULT_POLL_S: Final = 200e-6


@dataclass(frozen=True)
class Arrival:
    """A notification and when the watcher saw it (``time.monotonic()``)."""

    notification: Notification
    seen: float


class NotificationWatcher:
    """Polls ``connection``'s notifications on a thread until :meth:`stop` (or ``with``-block exit).

    ``on_arrival(arrival)`` runs on the watcher's thread for each one, in arrival
    order, before it is kept; an exception from it or from polling stops the
    watcher and is raised by the next :meth:`wait`, :meth:`wait_for` or :meth:`stop`.
    ``poll_s`` is the pause after an empty poll (0: only yield the CPU).
    """

    def __init__(
        self,
        connection: Connection,
        on_arrival: Callable[[Arrival], None] | None = None,
        *,
        poll_s: float = DEFAULT_POLL_S,
        name: str = "kvwire-notification-watcher",
    ) -> None:
        if isinstance(poll_s, bool) or not isinstance(poll_s, (int, float)) or not 0 <= poll_s <= 1:
            raise ConfigError(f"poll_s must be a number of seconds in [0, 1], got {poll_s!r}")
        self._connection = connection
        self._on_arrival = on_arrival
        self._poll_s = float(poll_s)
        self._arrivals: list[Arrival] = []
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._stopped = threading.Event()
        # the first poll here: refused, typed, for a backend without 'notifications'; what it finds is kept
        first = connection.poll_notifications()
        self._thread = threading.Thread(target=self._run, args=(first,), name=name, daemon=True)
        self._thread.start()

    def _run(self, got: list[Notification]) -> None:
        try:
            while True:
                if got:
                    now = time.monotonic()
                    for note in got:
                        arrival = Arrival(note, now)
                        if self._on_arrival is not None:
                            self._on_arrival(arrival)
                        with self._cond:
                            self._arrivals.append(arrival)
                            self._cond.notify_all()
                else:
                    time.sleep(self._poll_s)
                if self._stopped.is_set():
                    return
                got = self._connection.poll_notifications()
        except BaseException as exc:  # raised to whoever waits next
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def wait(self, count: int, timeout_s: float) -> list[Arrival]:
        """The arrivals kept so far, once there are ``count`` or ``timeout_s`` passed."""
        with self._cond:
            self._cond.wait_for(lambda: len(self._arrivals) >= count or self._error is not None, timeout_s)
            self._raise()
            return list(self._arrivals)

    def wait_for(self, message: bytes, timeout_s: float) -> Arrival | None:
        """Take the first kept arrival of ``message``, waiting up to ``timeout_s``; None if it did not come."""

        def find() -> Arrival | None:
            return next((a for a in self._arrivals if a.notification.message == message), None)

        with self._cond:
            self._cond.wait_for(lambda: find() is not None or self._error is not None, timeout_s)
            self._raise()
            found = find()
            if found is not None:
                self._arrivals.remove(found)
            return found

    def stop(self) -> None:
        """Stop polling (joins the thread); raises what stopped it, if anything did."""
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        with self._cond:
            self._raise()

    def __enter__(self) -> NotificationWatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
