"""Non-blocking sends and arrivals: futures, the in-flight set and pool, notifications, the watcher.

This package's own names are public for transport authors: the helpers a transport's worker
threads need to complete futures the way the core does (kvwire-mooncake and kvwire-nixl both
use them), and the bounded inbox every transport keeps unpolled notifications in. Import them
from here, ``from kvwire.submit import run_into``.
"""

from kvwire.submit.busy import BusyClock
from kvwire.submit.futures import fail_unstarted, queued_behind, run_into, start
from kvwire.submit.inbox import Inbox, PollRecord
from kvwire.submit.notifications import MAX_UNPOLLED_NOTIFICATIONS

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
