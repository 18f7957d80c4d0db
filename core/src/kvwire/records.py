"""The last record of something a call published, per caller: what telemetry and the notification inbox share.

A record lives in context variables, not thread-locals: a Connection runs each
backend call on a call thread in a copy of the caller's context and hands what
the call set back to the caller (:mod:`kvwire.connection.deadline`), so a
middleware or the caller reads what its own call published, never another
thread's.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Generic, TypeVar

__all__ = ["LastRecord"]

R = TypeVar("R")


class LastRecord(Generic[R]):
    """The last ``R`` published in this context, and a count of them, to ask "anything since my marker?"."""

    def __init__(self, name: str) -> None:
        self._seq: ContextVar[int] = ContextVar(f"{name}_seq", default=0)
        self._record: ContextVar[R | None] = ContextVar(f"{name}_record", default=None)

    def publish(self, record: R) -> R:
        self._seq.set(self._seq.get() + 1)
        self._record.set(record)
        return record

    def mark(self) -> int:
        """A marker of the records so far; :meth:`since` returns only one published after it."""
        return self._seq.get()

    def since(self, marker: int) -> R | None:
        """The last record published after ``marker``, or None."""
        return self._record.get() if self._seq.get() > marker else None

    def last(self) -> R | None:
        """The last record published, or None."""
        return self._record.get()
