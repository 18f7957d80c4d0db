"""``local``: the reference backend, moving bytes between buffers of one process.

It supports every send feature and does exactly what the spec says with the
core's base and planning and nothing else, so it is the yardstick the contract
test kit is run against. Its endpoints live in one process-wide directory, so
it reaches only endpoints of its own process (it does not declare
``interprocess``). Like a real engine it writes only inside memory the peer
registered: a peer description that claims more than the peer registered is
refused before any byte moves. It carries notifications (an in-process inbox
per endpoint, appended after the copy returns) and leaves non-blocking sends to
the core's pool, so the contract kit exercises both paths of the core.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
import weakref

from kvwire.config import BackendConfig
from kvwire.errors import PeerUnreachableError
from kvwire.planning.plan import TransferPlan
from kvwire.spec.notifications import Notification
from kvwire.transport.backend import TransportBackend
from kvwire.transport.inbox import Inbox
from kvwire.transport.interface import Transport, TransportTuning
from kvwire.transport.regions import RegionSet

__all__ = ["LocalBackend", "LocalTransport"]

_directory: weakref.WeakValueDictionary[str, LocalTransport] = weakref.WeakValueDictionary()
_counter = itertools.count(1)
# Re-entrant: a garbage collection while this thread holds it (inserting into the weak directory) may run
# the finalizer of a dropped Connection, which closes its transport and takes the lock again.
_lock = threading.RLock()


class LocalTransport(Transport):
    """memmove between registered regions of endpoints in this process."""

    tuning = TransportTuning(staged_writes=True)  # one memmove per descriptor: fewer, larger ones pay

    def __init__(self) -> None:
        self.regions = RegionSet()
        self._inbox: Inbox[Notification] = Inbox()
        with _lock:
            self._endpoint = f"local://{os.getpid()}/{next(_counter)}"
            _directory[self._endpoint] = self

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def register_memory(self, base: int, nbytes: int) -> None:
        self.regions.add(base, nbytes)

    def unregister_memory(self, base: int) -> None:
        self.regions.remove(base)

    def _peer(self, session_id: str) -> LocalTransport:
        peer = _directory.get(session_id)
        if peer is None:
            raise PeerUnreachableError(
                f"local endpoint {session_id!r} is not in this process or was closed (the local backend only "
                "reaches endpoints of its own process)",
                peer=session_id,
            )
        return peer

    def write(self, session_id: str, plan: TransferPlan) -> None:
        peer = self._peer(session_id)
        self.regions.check(plan.src, plan.length)
        peer.regions.check(plan.dst, plan.length, names=("dst", "length"), where=f"memory of peer {session_id!r}")
        for src, dst, length in zip(plan.src.tolist(), plan.dst.tolist(), plan.length.tolist()):
            ctypes.memmove(dst, src, length)

    def raw_write(self, session_id: str, plan: TransferPlan) -> None:
        """The bare call (capability ``raw_write``): :meth:`write` itself, whose peer-side range check any
        receiving side must make (the contract kit sends it a write past the peer's registered memory)."""
        self.write(session_id, plan)

    def notify(self, session_id: str, message: bytes) -> None:
        self._peer(session_id)._inbox.extend([Notification(self._endpoint, message)])

    def poll_notifications(self) -> list[Notification]:
        return self._inbox.drain()

    def close(self) -> None:
        with _lock:
            if _directory.get(self._endpoint) is self:
                del _directory[self._endpoint]
        self.regions.clear()


class LocalBackend(TransportBackend):
    """In-process transfers; every send feature supported."""

    spec_version = "1.5"
    capabilities = TransportBackend.planned | {"notifications", "device_kv_indices"}
    capabilities |= {"host_memory", "device_memory"}

    def open_transport(self, config: BackendConfig) -> LocalTransport:
        return LocalTransport()
