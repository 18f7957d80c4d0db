"""``TransportBackend``: the spec hooks implemented once, over a transport's engine-facing operations.

A backend built on it supplies a :class:`kvwire.Transport` (register memory,
write one plan, its endpoint, close; optionally submit a plan without blocking
and carry notifications) and declares its own ``spec_version`` and
``capabilities`` (``submit`` and ``notifications`` when its transport offers
them); the base does the rest the same way for every backend: the local and
peer layouts, the refusal of arguments for features the backend does not
declare, planning (with every bounds check) through the core planner, and
all-or-nothing registration.

Inheritance is what broke sglang (#33523): an override silently lost a
parameter. Here every backend class is validated when it loads, inherited hooks
included, and so is its transport class against :class:`kvwire.Transport`; a
spec change is made once, here, instead of in every backend.
"""

from __future__ import annotations

import threading
from abc import abstractmethod
from collections.abc import Sequence
from concurrent.futures import Executor, Future
from contextlib import suppress
from typing import ClassVar, get_type_hints

from kvwire.config import BackendConfig
from kvwire.errors import BackendError, InvalidTransferError, KvwireError, UnsupportedFeatureError
from kvwire.layout.kv_layout import KVLayout
from kvwire.layout.peer_table import PeerTable
from kvwire.planning.gate import Gate
from kvwire.planning.plan import TransferPlan
from kvwire.planning.planner import plan_request
from kvwire.spec.notifications import Notification
from kvwire.spec.pluggy_project import hookimpl
from kvwire.spec.request import SendAdapter, TransferRequest
from kvwire.transport import telemetry
from kvwire.transport.futures import TransferFuture, follow, run_into
from kvwire.transport.interface import RawWriter, Transport
from kvwire.transport.staging import Staging, gather_of

__all__ = ["TransportBackend", "offers_raw_write"]


class TransportBackend(SendAdapter):
    """A kvwire backend made of a :class:`Transport`; subclasses implement :meth:`open_transport`.

    Subclasses declare ``spec_version`` and ``capabilities`` like any backend;
    the validator checks each subclass on its own, inherited hooks included.
    """

    #: The features the base's planning serves over any transport (layer mapping, head slices, MHA and
    #: MLA pages): a subclass declares ``capabilities = TransportBackend.planned | {...its transport's}``.
    planned: ClassVar[frozenset[str]] = frozenset({"layer_ids", "head_slicing", "mha", "mla"})

    def __init__(self, config: BackendConfig) -> None:
        self.config = config
        self.transport = self.open_transport(config)
        self._lock = threading.Lock()
        self._local: KVLayout | None = None
        self._closed = False
        self._peers = PeerTable()
        self._gate = Gate(repr(type(self).__name__), type(self).capabilities_declared())
        # Many small slices with contiguous destinations go through a staging buffer (kvwire.transport.staging).
        self._staging = Staging(self.transport) if self.transport.tuning.staged_writes else None

    @abstractmethod
    def open_transport(self, config: BackendConfig) -> Transport:
        """Create the transport (heavy engine imports belong here, not at module import)."""

    @classmethod
    def availability(cls) -> str | None:
        """Why this backend cannot transfer on this host (a missing engine wheel, no device), or None.

        ``kvwire check`` asks it after validation, without instantiating the backend: answer without
        heavy imports and without blocking. The default: available.
        """
        return None

    # -- spec hooks (send_kvcache, the flat call, is SendAdapter's: it builds the request by keyword) ---

    @hookimpl
    def register_kv_buffers(self, layout: KVLayout) -> None:
        """Register every buffer of ``layout``, replacing the previous layout; all or nothing."""
        self._gate.layout(layout, "the local layout")
        for session_id, peer in self._peers.items():
            self._gate.pair(layout, peer, session_id)
        with self._lock:
            previous, self._local = self._local, None
        if previous is not None:
            self._unregister([b.base for b in previous.buffers])
        done: list[int] = []
        try:
            for buf in layout.buffers:
                self.transport.register_memory(buf.base, buf.nbytes)
                done.append(buf.base)
        except BaseException:
            with suppress(KvwireError):
                self._unregister(done)
            raise
        with self._lock:
            self._local = layout

    @hookimpl
    def endpoint(self) -> str:
        return self.transport.endpoint

    @hookimpl
    def add_peer(self, session_id: str, layout: KVLayout) -> None:
        self._gate.layout(layout, f"peer {session_id!r}")
        with self._lock:
            local = self._local
        if local is not None:
            self._gate.pair(local, layout, session_id)
        self.transport.add_peer(session_id, layout)
        self._peers.add(session_id, layout)

    @hookimpl
    def remove_peer(self, session_id: str) -> None:
        self._peers.remove(session_id)
        self.transport.forget_peer(session_id)

    def send_request(
        self,
        session_id: str,
        request: TransferRequest,
        executor: Executor | None = None,
        *,
        plan: TransferPlan | None = None,
    ) -> int:
        """Write ``request``'s pages into the peer; return the bytes moved.

        ``plan``: the request's plan when the caller made it (a :class:`kvwire.Connection` checks and
        plans against its own records of the same layouts): it is written as given. Without it the
        request is checked and planned here. ``executor`` is the host's (sglang's transfer pool); the
        transports write on their own threads and do not use it.
        """
        started = telemetry.clock()
        if plan is None:
            self._gate.require(request.features())
        local = self._local_layout("send_kvcache")
        if plan is None:
            plan = plan_request(request, local, self._peers.known(session_id))
        planned = telemetry.clock()
        if len(plan):
            gather = gather_of(plan, local, self._staging.max_item) if self._staging is not None else None
            if gather is not None and self._staging is not None:
                self._staging.write(session_id, gather)
            else:
                self.transport.write(session_id, plan)
        telemetry.publish(session_id, plan, started, planned)
        return plan.nbytes

    @hookimpl
    def submit_kvcache(
        self, session_id: str, request: TransferRequest, notification: bytes | None = None
    ) -> Future[int]:
        """Plan now (input errors raise here), then hand the plan to the transport's ``submit``."""
        needed = {"submit"} | ({"notifications"} if notification is not None else set())
        self._gate.require(request.features() | needed, "submit_kvcache")
        local, peer = self._layouts(session_id, "submit_kvcache")
        plan = plan_request(request, local, peer)
        future = TransferFuture(session_id, plan.nbytes, len(plan))
        if len(plan):
            return follow(future, self.transport.submit(session_id, plan, notification), lambda _: plan.nbytes)

        def notify_only() -> int:  # nothing to write: the notification alone, here and now
            if notification is not None:
                self.transport.notify(session_id, notification)
            return 0

        run_into(future, notify_only)
        return future

    @hookimpl
    def send_notification(self, session_id: str, message: bytes) -> None:
        self._gate.require({"notifications"}, "send_notification")
        self._layouts(session_id, "send_notification")  # a known peer
        self.transport.notify(session_id, message)

    @hookimpl
    def poll_notifications(self) -> list[Notification]:
        self._gate.require({"notifications"}, "poll_notifications")
        return self.transport.poll_notifications()

    @hookimpl
    def close(self) -> None:
        with self._lock:
            self._closed = True  # before the layout goes: a send racing close() is told so, not blamed
        try:
            if self._staging is not None:
                self._staging.close()
        finally:
            self._close_transport()

    def _close_transport(self) -> None:
        try:
            self.transport.close()
        finally:
            with self._lock:
                self._local = None
            self._peers.clear()

    # -- extension ------------------------------------------------------------

    def raw_write(self, session_id: str, plan: TransferPlan) -> None:
        """The transport's bare engine call on ``plan`` (the ``raw_write`` capability); no checks."""
        if not isinstance(self.transport, RawWriter):
            raise UnsupportedFeatureError(f"{type(self).__name__}'s transport offers no raw_write")
        self.transport.raw_write(session_id, plan)

    # -- helpers --------------------------------------------------------------

    @classmethod
    def capabilities_declared(cls) -> frozenset[str]:
        """The class's ``capabilities`` (empty when it declares none or something that is not a set)."""
        raw: object = getattr(cls, "capabilities", frozenset())
        return frozenset(str(c) for c in raw) if isinstance(raw, (set, frozenset)) else frozenset()

    def _local_layout(self, hook: str) -> KVLayout:
        """The registered layout; refused when the backend is closed or nothing is registered."""
        with self._lock:
            local, closed = self._local, self._closed
        if closed:
            raise BackendError(f"backend {type(self).__name__} is closed; nothing was sent")
        if local is None:
            raise InvalidTransferError(f"register_kv_buffers() must be called before {hook}()")
        return local

    def _layouts(self, session_id: str, hook: str) -> tuple[KVLayout, KVLayout]:
        """The local layout and the peer's (unknown peers refused by name)."""
        return self._local_layout(hook), self._peers.known(session_id)

    def _unregister(self, bases: Sequence[int]) -> None:
        """Unregister every range in ``bases``; raise the first failure after trying all."""
        first: KvwireError | None = None
        for base in bases:
            try:
                self.transport.unregister_memory(base)
            except KvwireError as exc:
                first = first or exc
        if first is not None:
            raise first


def offers_raw_write(cls: type) -> bool:
    """Whether backend class ``cls`` offers the bare engine call: a TransportBackend whose transport (as
    ``open_transport``'s return annotation names it) implements :class:`kvwire.RawWriter`."""
    if not (isinstance(cls, type) and issubclass(cls, TransportBackend)):
        return False
    try:
        returned = get_type_hints(cls.open_transport).get("return")
    except Exception:
        return False
    return isinstance(returned, type) and callable(getattr(returned, "raw_write", None))
