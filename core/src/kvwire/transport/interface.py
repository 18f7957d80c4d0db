"""``Transport``: the engine-facing operations a :class:`kvwire.TransportBackend` drives.

This class is the contract of the short path, validated at load like the
hooks: the validator compares a backend's transport class (from
``open_transport``'s return annotation) method by method with this one. The
spec version that added each method is in :mod:`kvwire.spec.history`; which
optional method a declared capability needs is in
:data:`kvwire.spec.capabilities.CAPABILITY_REQUIREMENTS`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

from kvwire.errors import UnsupportedFeatureError
from kvwire.layout.kv_layout import KVLayout
from kvwire.planning.plan import TransferPlan
from kvwire.spec.notifications import Notification
from kvwire.transport.busy import BusyClock

__all__ = ["RawWriter", "Transport", "TransportTuning"]


@dataclass(frozen=True)
class TransportTuning:
    """How a transport wants its writes shaped: the one optional declaration of its tuning knobs.

    ``staged_writes``: a plan of many small slices whose destinations are contiguous (head slices
    across attention-TP sizes) is gathered into a staging buffer the base registers through
    :meth:`Transport.register_memory`, and written in whole destination runs
    (:mod:`kvwire.transport.staging`); worth it when one large descriptor costs the engine less than
    many small ones, as every network engine's does. ``staging_max_item`` (None: no limit): slices of
    this many bytes or more are written as planned, where the engine's cost per descriptor is already
    small next to the gather's extra copy.
    """

    staged_writes: bool = False
    staging_max_item: int | None = None


class Transport(ABC):
    """The engine-facing operations a :class:`TransportBackend` drives.

    The base calls them only with checked input: ``register_memory`` with a
    layout buffer's range, ``write`` with a non-empty plan whose every range lies
    inside the local layout and the peer's published layout.

    Rules (the contract kit, :mod:`kvwire.testing.contract`, exercises each):

    1. **Concurrency.** ``write``, ``submit``, ``notify`` and ``poll_notifications`` may be called
       from several threads at once, to one peer or to several; each call's bytes land as if it ran
       alone (the base never sends overlapping destinations in calls that run together).
    2. **close races them.** ``close`` may run while writes and submissions are in flight: each of
       them then completes or fails with a :class:`kvwire.KvwireError`; none is left pending and none
       touches memory after ``close`` returns. ``close`` is idempotent.
    3. **submit returns at once.** ``submit`` queues the write and returns its future without
       waiting for the peer; errors of the transfer go into the future.
    4. **Every call ends within ``timeout_s``.** A transfer to a peer that is dead or frozen fails
       with a :class:`kvwire.TransferError` (:class:`kvwire.TransferTimeoutError` at the deadline)
       within the config's ``timeout_s``. The Connection relies on it: a
       :class:`kvwire.TransportBackend` runs on the caller's thread, with no deadline thread of its own.
    5. **A failure is the failed write's alone.** Work queued behind a failed write (to the same peer
       or others) still runs and succeeds or fails on its own; the notification of a failed
       submission is not delivered.

    ``tuning`` (a :class:`TransportTuning`; default: none) shapes the writes. ``busy`` (default
    None) is bench instrumentation: a :class:`kvwire.transport.BusyClock` the transport's workers count
    their writing time in, so a bench can show whether requests in flight keep them busy.
    """

    tuning: ClassVar[TransportTuning] = TransportTuning()
    busy: BusyClock | None = None

    @property
    @abstractmethod
    def endpoint(self) -> str:
        """The id peers pass as ``session_id`` to reach this transport."""

    @abstractmethod
    def register_memory(self, base: int, nbytes: int) -> None:
        """Make ``nbytes`` at ``base`` a source or destination of transfers."""

    @abstractmethod
    def unregister_memory(self, base: int) -> None:
        """Undo :meth:`register_memory` of the range starting at ``base``."""

    @abstractmethod
    def write(self, session_id: str, plan: TransferPlan) -> None:
        """Write every descriptor of ``plan`` into the peer; raise a :class:`kvwire.TransferError` on failure."""

    def add_peer(self, session_id: str, layout: KVLayout) -> None:  # noqa: B027 - optional, no-op by default
        """A peer published ``layout`` (optional: a transport that needs the peer's layout keeps it)."""

    def forget_peer(self, session_id: str) -> None:  # noqa: B027 - optional, no-op by default
        """Release what the transport holds for a peer that is gone (optional)."""

    def submit(self, session_id: str, plan: TransferPlan, notification: bytes | None) -> Future[None]:
        """Start writing a non-empty ``plan`` and return at once (optional; the backend declares ``submit``).

        The future completes when every byte is in the peer's memory (then
        ``notification``, if given, is delivered after them) or fails with a
        :class:`kvwire.TransferError` within the config's ``timeout_s``;
        cancelling it succeeds only before the write has started.
        """
        raise UnsupportedFeatureError(f"{type(self).__name__} offers no non-blocking submit")

    def notify(self, session_id: str, message: bytes) -> None:
        """Deliver ``message`` to the peer after the bytes of every write to it that has completed
        (optional; the backend declares ``notifications``)."""
        raise UnsupportedFeatureError(f"{type(self).__name__} carries no notifications")

    def poll_notifications(self) -> list[Notification]:
        """The notifications that arrived since the last call, each once, in arrival order per sender (optional)."""
        raise UnsupportedFeatureError(f"{type(self).__name__} carries no notifications")

    @abstractmethod
    def close(self) -> None:
        """Release the engine; idempotent."""


@runtime_checkable
class RawWriter(Protocol):
    """The optional raw extension: the bare engine call on a plan, without kvwire's checks.

    A backend that offers it declares the ``raw_write`` capability; benchmarks
    reach it through :meth:`kvwire.Connection.raw_write` to compare kvwire's
    send with the engine call it wraps, on identical descriptors.
    """

    def raw_write(self, session_id: str, plan: TransferPlan) -> None: ...
