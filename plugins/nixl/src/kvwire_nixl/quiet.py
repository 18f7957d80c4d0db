"""Keeping NIXL's Python log lines (INFO, on stdout) out of kvwire's output, without touching the host's.

NIXL's Python layer logs through the ``nixl`` logger to a handler on *stdout*
(``Backend UCX was instantiated``...), which would corrupt a process whose
stdout carries data (the contract kit's and the bench's JSON-lines channels).
Instead of changing the level of a logger the host may use itself, kvwire adds
one filter to the ``nixl`` logger's handlers that drops records emitted in a
thread while that thread is inside a kvwire call (:class:`Quiet`). NIXL calls
the host makes itself log as before.
"""

from __future__ import annotations

import logging
import threading
from types import TracebackType
from typing import Final

__all__ = ["NIXL_LOGGER", "Quiet", "install_filter"]

NIXL_LOGGER: Final = "nixl"
_state = threading.local()


def _depth() -> int:
    return int(getattr(_state, "depth", 0))


class _KvwireCallFilter(logging.Filter):
    """Drops records emitted while the emitting thread is inside :class:`Quiet`."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _depth() == 0


_FILTER: Final = _KvwireCallFilter("kvwire_nixl")
_install_lock = threading.Lock()


def install_filter() -> None:
    """Add the filter to the ``nixl`` logger and its handlers (idempotent)."""
    logger = logging.getLogger(NIXL_LOGGER)
    with _install_lock:
        for target in (logger, *logger.handlers):
            if _FILTER not in target.filters:
                target.addFilter(_FILTER)


class Quiet:
    """Context: NIXL log records from this thread are dropped while it is active (when ``enabled``)."""

    __slots__ = ("enabled",)

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __enter__(self) -> None:
        if self.enabled:
            _state.depth = _depth() + 1

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.enabled:
            _state.depth = _depth() - 1
