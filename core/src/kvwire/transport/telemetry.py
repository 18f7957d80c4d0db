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
from dataclasses import dataclass
from typing import Final

from kvwire.planning.plan import TransferPlan
from kvwire.records import LastRecord

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


_sends: LastRecord[SendRecord] = LastRecord("kvwire_telemetry")  # per caller (see kvwire.records)


def publish(session_id: str, plan: TransferPlan, started: float, planned: float) -> SendRecord:
    """Record a send that planned from ``started`` to ``planned`` (:func:`clock` values) and wrote until now."""
    done = clock()
    record = SendRecord(session_id, plan.nbytes, len(plan), plan.descriptors_before, planned - started, done - planned)
    return _sends.publish(record)


def mark() -> int:
    """A marker of this thread's records so far; :func:`since` returns only what is published after it."""
    return _sends.mark()


def since(marker: int) -> SendRecord | None:
    """The last record published on this thread after ``marker``, or None."""
    return _sends.since(marker)


def last_send() -> SendRecord | None:
    """The last record published on this thread, or None."""
    return _sends.last()
