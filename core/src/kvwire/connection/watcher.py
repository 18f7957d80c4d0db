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
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from kvwire.config import check_seconds
from kvwire.errors import ConfigError, TransferTimeoutError
from kvwire.spec.notifications import Notification

if TYPE_CHECKING:
    from kvwire.connection import Connection

__all__ = ["DEFAULT_MAX_KEPT", "DEFAULT_POLL_S", "Arrival", "NotificationWatcher"]

#: Seconds between two polls that found nothing.
DEFAULT_POLL_S: Final = 200e-6
#: Arrivals kept for wait/wait_for by default (the oldest is dropped past it): 4 MiB of 1 KiB messages.
DEFAULT_MAX_KEPT: Final = 4096


@dataclass(frozen=True)
class Arrival:
    """A notification and when the watcher saw it (``time.monotonic()``)."""

    notification: Notification
    seen: float


class NotificationWatcher:
    """Polls ``connection``'s notifications on a thread until :meth:`stop` (or ``with``-block exit).

    ``on_arrival(arrival)`` runs on the watcher's thread for each one, in arrival
    order, before it is kept; an exception from it or from polling stops the
    watcher and is raised by the next :meth:`wait`, :meth:`wait_for` or :meth:`stop`
    (the arrivals of that poll are kept all the same, in :attr:`kept`, and the callback
    is not run on the rest). ``poll_s`` is the pause after an empty poll (0: only yield the CPU).

    At most ``max_kept`` arrivals are kept for :meth:`wait` and :meth:`wait_for`
    (0: none, for a watcher used only through ``on_arrival``); past it the oldest is
    dropped and counted in :attr:`dropped`, so a peer that floods notifications
    nobody takes cannot grow this process without bound.
    """

    def __init__(
        self,
        connection: Connection,
        on_arrival: Callable[[Arrival], None] | None = None,
        *,
        poll_s: float = DEFAULT_POLL_S,
        max_kept: int = DEFAULT_MAX_KEPT,
        name: str = "kvwire-notification-watcher",
    ) -> None:
        if isinstance(poll_s, bool) or not isinstance(poll_s, (int, float)) or not 0 <= poll_s <= 1:
            raise ConfigError(f"poll_s must be a number of seconds in [0, 1], got {poll_s!r}")
        if isinstance(max_kept, bool) or not isinstance(max_kept, int) or max_kept < 0:
            raise ConfigError(f"max_kept must be an int >= 0, got {max_kept!r}")
        self._connection = connection
        self._on_arrival = on_arrival
        self._poll_s = float(poll_s)
        self._max_kept = max_kept
        self._kept: OrderedDict[int, Arrival] = OrderedDict()  # by arrival number, oldest first
        self._by_message: dict[bytes, deque[int]] = {}  # message -> its kept arrival numbers, oldest first
        self._count = 0
        self.dropped = 0
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
                    self._arrived(got, time.monotonic())
                else:
                    time.sleep(self._poll_s)
                if self._stopped.is_set():
                    return
                got = self._connection.poll_notifications()
        except BaseException as exc:  # raised to whoever waits next
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _arrived(self, got: list[Notification], now: float) -> None:
        for i, note in enumerate(got):
            arrival = Arrival(note, now)
            if self._on_arrival is not None:
                try:
                    self._on_arrival(arrival)
                except BaseException:
                    self._keep([Arrival(n, now) for n in got[i:]])  # this one and the rest: not lost
                    raise
            self._keep([arrival])

    def _keep(self, arrivals: list[Arrival]) -> None:
        with self._cond:
            for arrival in arrivals:
                if self._max_kept == 0:
                    self.dropped += 1
                    continue
                if len(self._kept) >= self._max_kept:
                    number, oldest = self._kept.popitem(last=False)
                    self._forget(oldest.notification.message, number)
                    self.dropped += 1
                self._count += 1
                self._kept[self._count] = arrival
                self._by_message.setdefault(arrival.notification.message, deque()).append(self._count)
            self._cond.notify_all()

    @property
    def running(self) -> bool:
        """False once the watcher stopped: by :meth:`stop`, or by an exception (:attr:`error`)."""
        return self._thread.is_alive()

    @property
    def error(self) -> BaseException | None:
        """What stopped the watcher's thread (polling or ``on_arrival`` raised), or None."""
        with self._cond:
            return self._error

    @property
    def kept(self) -> list[Arrival]:
        """The arrivals kept now, oldest first, without waiting and without raising what stopped the watcher."""
        with self._cond:
            return list(self._kept.values())

    def _forget(self, message: bytes, number: int) -> None:
        numbers = self._by_message[message]
        numbers.remove(number)  # the oldest of its message: at the left, found at once
        if not numbers:
            del self._by_message[message]

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def wait(self, count: int, timeout_s: float) -> list[Arrival]:
        """The arrivals kept so far, once there are ``count`` or ``timeout_s`` passed."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ConfigError(f"count must be an int >= 0, got {count!r}")
        if count > self._max_kept:
            raise ConfigError(f"count {count} is more than this watcher keeps (max_kept={self._max_kept})")
        timeout = _timeout(timeout_s)
        with self._cond:
            self._cond.wait_for(lambda: len(self._kept) >= count or self._error is not None, timeout)
            self._raise()
            return list(self._kept.values())

    def wait_for(self, message: bytes, timeout_s: float) -> Arrival | None:
        """Take the first kept arrival of ``message``, waiting up to ``timeout_s``; None if it did not come."""
        if not isinstance(message, bytes):
            raise ConfigError(f"message must be bytes (notifications are bytes), got {type(message).__name__}")
        timeout = _timeout(timeout_s)
        with self._cond:
            self._cond.wait_for(lambda: message in self._by_message or self._error is not None, timeout)
            self._raise()
            numbers = self._by_message.get(message)
            if numbers is None:
                return None
            number = numbers[0]
            self._forget(message, number)
            return self._kept.pop(number)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop polling and join the thread; raises what stopped it, if anything did.

        :class:`kvwire.TransferTimeoutError` when the thread is still running ``timeout_s`` later
        (an ``on_arrival`` that does not return): it stops after that call, polling no more.
        """
        timeout = _timeout(timeout_s)
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout)
            if self._thread.is_alive():
                raise TransferTimeoutError(
                    f"the notification watcher's thread is still running {timeout} s after stop(): "
                    "its on_arrival callback has not returned; it stops polling once it does"
                )
        with self._cond:
            self._raise()

    def __enter__(self) -> NotificationWatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _timeout(timeout_s: object) -> float:
    return check_seconds(timeout_s, "timeout_s", zero=True)
