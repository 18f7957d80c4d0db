"""``BusyClock``: how long each of a transport's workers (a stream, a peer's queue) spent writing.

Requests in flight pay only if the transport's workers really run them back to
back, or side by side: that shows as the fraction of a stretch of time each
worker was busy, not in throughput alone (on a machine whose cores one
transfer already fills, throughput cannot rise). A transport that keeps a
clock sets :attr:`kvwire.Transport.busy` to it and wraps each worker's write
in :meth:`BusyClock.busy`; ``kvwire bench --inflight-requests`` samples it
around every wave of both phases and prints each worker's busy fraction.

A name is busy while at least one ``busy(name)`` block runs: overlapping
blocks of one name (two threads writing to one peer) count their union once,
so a name's busy time never exceeds the wall time. The table is bounded
(:data:`MAX_NAMES`, the longest idle name dropped first) so that a server that
met many peers holds a few kilobytes, not one entry per peer ever seen.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Final

__all__ = ["MAX_NAMES", "BusyClock", "busy_between", "busy_fractions"]

#: Most names a clock keeps; a new name beyond it drops the one idle longest (never a busy one).
MAX_NAMES: Final = 256


@dataclass
class _Entry:
    total: float = 0.0  # busy seconds of the stretches that ended
    running: int = 0  # busy(name) blocks running now
    since: float = 0.0  # when the current stretch began (running > 0)


class BusyClock:
    """Busy seconds per worker name, overlapping blocks of a name counted once; thread-safe.

    ``clock`` is the time source in seconds (default :func:`time.perf_counter`).
    """

    def __init__(self, max_names: int = MAX_NAMES, clock: Callable[[], float] = time.perf_counter) -> None:
        if max_names < 1:
            raise ValueError(f"max_names must be >= 1, got {max_names}")
        self._max = max_names
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}  # insertion order = least recently busy first

    @contextmanager
    def busy(self, name: str) -> Iterator[None]:
        """``name`` is busy while the ``with`` block runs (also when it raises)."""
        with self._lock:
            entry = self._entries.pop(name, None) or _Entry()
            if not entry.running:
                entry.since = self._clock()
            entry.running += 1
            self._evict()
            self._entries[name] = entry  # now the most recently busy
        try:
            yield
        finally:
            with self._lock:
                entry.running -= 1
                if not entry.running:
                    entry.total += self._clock() - entry.since

    def _evict(self) -> None:
        """Drop idle names, longest idle first, until one more fits (busy names are never dropped)."""
        while len(self._entries) >= self._max:
            idle = next((name for name, e in self._entries.items() if not e.running), None)
            if idle is None:
                return
            del self._entries[idle]

    def snapshot(self) -> dict[str, float]:
        """Busy seconds per name so far, a stretch still running counted up to now (a copy)."""
        with self._lock:
            now = self._clock()
            return {name: e.total + (now - e.since if e.running else 0.0) for name, e in self._entries.items()}


def busy_between(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """Each name's busy seconds between two snapshots, by name.

    A name the clock dropped and met again in between restarts from 0: its difference is clamped at 0.
    """
    return {name: max(0.0, total - before.get(name, 0.0)) for name, total in sorted(after.items())}


def busy_fractions(before: Mapping[str, float], after: Mapping[str, float], seconds: float) -> dict[str, float]:
    """Each name's busy time between two snapshots (:func:`busy_between`) as a fraction of ``seconds``."""
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    return {name: busy / seconds for name, busy in busy_between(before, after).items()}
