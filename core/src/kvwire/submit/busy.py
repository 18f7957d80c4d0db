"""``BusyClock``: how long each of a transport's workers (a stream, a peer's queue) spent writing.

Requests in flight pay only if the transport's workers really run them back to
back, or side by side: that shows as the fraction of a stretch of time each
worker was busy, not in throughput alone (on a machine whose cores one
transfer already fills, throughput cannot rise). A transport that keeps a
clock sets :attr:`kvwire.Transport.busy` to it and wraps each worker's write
in :meth:`BusyClock.busy`; ``kvwire bench --inflight-requests`` samples it
around every wave of both phases and prints each worker's busy fraction.

The table is bounded (:data:`MAX_NAMES`, the longest idle name dropped first)
so that a server that met many peers holds a few kilobytes, not one entry per
peer ever seen.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Final

__all__ = ["MAX_NAMES", "BusyClock", "busy_fractions"]

#: Most names a clock keeps; a new name beyond it drops the one busy longest ago.
MAX_NAMES: Final = 256


class BusyClock:
    """Cumulative busy seconds per worker name (monotonic clock); thread-safe."""

    def __init__(self, max_names: int = MAX_NAMES) -> None:
        if max_names < 1:
            raise ValueError(f"max_names must be >= 1, got {max_names}")
        self._max = max_names
        self._lock = threading.Lock()
        self._seconds: dict[str, float] = {}  # insertion order = least recently busy first

    @contextmanager
    def busy(self, name: str) -> Iterator[None]:
        """Count the time the ``with`` block takes as busy time of ``name`` (also when it raises)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        """Add ``seconds`` to ``name``'s busy time; ``name`` becomes the most recently busy."""
        with self._lock:
            total = self._seconds.pop(name, 0.0) + seconds
            while len(self._seconds) >= self._max:
                del self._seconds[next(iter(self._seconds))]
            self._seconds[name] = total

    def snapshot(self) -> dict[str, float]:
        """Busy seconds per name so far (a copy)."""
        with self._lock:
            return dict(self._seconds)


def busy_fractions(before: Mapping[str, float], after: Mapping[str, float], seconds: float) -> dict[str, float]:
    """Each name's busy time between two snapshots as a fraction of ``seconds`` (the wall time between them)."""
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    return {name: (total - before.get(name, 0.0)) / seconds for name, total in sorted(after.items())}
