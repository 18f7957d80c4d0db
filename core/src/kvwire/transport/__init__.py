"""The short path for backend authors: :class:`Transport` (the engine's operations, and the rules it keeps)
and :class:`TransportBackend` (every spec hook, implemented once over them), with what transports share.

The helpers here are public for transport authors (kvwire-mooncake and kvwire-nixl use them): completing
futures the way the core does (:func:`run_into`, :func:`start`, :func:`fail_unstarted`, :func:`queued_behind`),
the bounded :class:`Inbox` every transport keeps unpolled notifications in, the registered-memory checks
(:class:`RegionSet`), and the bench instrumentation :class:`BusyClock`. Import them from here:
``from kvwire.transport import run_into``.
"""

from kvwire.spec.notifications import MAX_UNPOLLED_NOTIFICATIONS
from kvwire.transport.backend import TransportBackend
from kvwire.transport.busy import BusyClock
from kvwire.transport.futures import fail_unstarted, queued_behind, run_into, start
from kvwire.transport.inbox import Inbox, PollRecord
from kvwire.transport.interface import RawWriter, Transport, TransportTuning
from kvwire.transport.regions import RegionSet

__all__ = [
    "MAX_UNPOLLED_NOTIFICATIONS",
    "BusyClock",
    "Inbox",
    "PollRecord",
    "RawWriter",
    "RegionSet",
    "Transport",
    "TransportBackend",
    "TransportTuning",
    "fail_unstarted",
    "queued_behind",
    "run_into",
    "start",
]
