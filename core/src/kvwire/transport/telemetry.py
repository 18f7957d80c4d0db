"""Per-send telemetry: what the last ``send_kvcache`` on this thread planned, moved, and how long it took.

A backend built on :class:`kvwire.TransportBackend` publishes one
:class:`SendRecord` per successful send (bytes, descriptors before and after
coalescing, planning and transfer time); a failed send publishes none. Any
middleware reads it without re-planning::

    @kvwire.hookimpl(wrapper=True)
    def send_kvcache(self, session_id):
        mark = telemetry.mark()
        moved = yield
        record = telemetry.since(mark)  # None: the backend publishes no telemetry
        ...

The record is per caller: a send runs its middleware and its backend in the
caller's context (on a Connection's call thread, whose context changes return
to the caller), so concurrent sends on other threads never mix. Publishing
costs two clock reads and one small object per send.
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Final

from kvwire.planning.plan import TransferPlan

__all__ = ["SendRecord", "clock", "last_send", "mark", "publish", "since"]

#: The clock of every duration in a record (monotonic, seconds).
clock: Final = time.perf_counter


@dataclass(frozen=True)
class SendRecord:
    """One successful send as the backend saw it.

    ``descriptors`` is the plan's length after coalescing; ``descriptors_before``
    one descriptor per page and buffer pair (their ratio is the coalescing gain).
    ``planning_s`` covers planning with every bounds check, ``transfer_s`` the
    transport's write.
    """

    session_id: str
    nbytes: int
    descriptors: int
    descriptors_before: int
    planning_s: float
    transfer_s: float


# Context variables, not thread-locals: a Connection runs each backend call on a call
# thread in a copy of the caller's context, and hands what the call set back to the caller.
_SEQ: ContextVar[int] = ContextVar("kvwire_telemetry_seq", default=0)
_RECORD: ContextVar[SendRecord | None] = ContextVar("kvwire_telemetry_record", default=None)


def publish(session_id: str, plan: TransferPlan, started: float, planned: float) -> SendRecord:
    """Record a send that planned from ``started`` to ``planned`` (:func:`clock` values) and wrote until now."""
    done = clock()
    record = SendRecord(session_id, plan.nbytes, len(plan), plan.descriptors_before, planned - started, done - planned)
    _SEQ.set(_SEQ.get() + 1)
    _RECORD.set(record)
    return record


def mark() -> int:
    """A marker of this thread's records so far; :func:`since` returns only what is published after it."""
    return _SEQ.get()


def since(marker: int) -> SendRecord | None:
    """The last record published on this thread after ``marker``, or None."""
    return _RECORD.get() if _SEQ.get() > marker else None


def last_send() -> SendRecord | None:
    """The last record published on this thread, or None."""
    return _RECORD.get()
