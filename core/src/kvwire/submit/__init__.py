"""The old path of the transport authors' helpers, kept working: they live in :mod:`kvwire.transport` now.

``from kvwire.submit import run_into`` still works; write ``from kvwire.transport import run_into``.
"""

from kvwire.transport import (
    MAX_UNPOLLED_NOTIFICATIONS,
    BusyClock,
    Inbox,
    PollRecord,
    fail_unstarted,
    queued_behind,
    run_into,
    start,
)

__all__ = [
    "MAX_UNPOLLED_NOTIFICATIONS",
    "BusyClock",
    "Inbox",
    "PollRecord",
    "fail_unstarted",
    "queued_behind",
    "run_into",
    "start",
]
