"""``TransportBackend``: the spec hooks implemented once, over a transport's engine-facing operations.

A backend built on it supplies a :class:`Transport` (register memory, write one
plan, its endpoint, close; optionally submit a plan without blocking and carry
notifications) and declares its own ``spec_version`` and ``capabilities``
(``submit`` and ``notifications`` when its transport offers them); the base
does the rest the same way for every backend: the
local and peer layouts, the refusal of arguments for features the backend does
not declare, planning (with every bounds check) through the core planner, and
all-or-nothing registration.

Inheritance is what broke sglang (#33523): an override silently lost a
parameter. Here every backend class is validated when it loads, inherited hooks
included, so a subclass of this base cannot drift unnoticed; and a spec change
is made once, here, instead of in every backend.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Executor, Future
from contextlib import suppress
from typing import Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from kvwire import telemetry
from kvwire.capabilities import FEATURE_DISTRIBUTIONS
from kvwire.config import BackendConfig
from kvwire.errors import InvalidTransferError, KvwireError, UnsupportedFeatureError
from kvwire.futures import TransferFuture, follow, run_into
from kvwire.layout import KVLayout
from kvwire.markers import hookimpl
from kvwire.notifications import Notification
from kvwire.planning import TransferPlan, TransferRequest

__all__ = ["RawWriter", "Transport", "TransportBackend"]


def _short(session_id: str, *, quote: bool = True, limit: int = 80) -> str:
    """A session id for an error message: whole, or its start and its length (some transports' ids are KBs)."""
    text = repr(session_id) if quote else session_id
    return text if len(text) <= limit else f"{text[: limit - 20]}... ({len(session_id)} chars)"


class Transport(ABC):
    """The engine-facing operations a :class:`TransportBackend` drives.

    The base calls them only with checked input: ``register_memory`` with a
    layout buffer's range, ``write`` with a non-empty plan whose every range lies
    inside the local layout and the peer's published layout.
    """

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


class TransportBackend(ABC):
    """A kvwire backend made of a :class:`Transport`; subclasses implement :meth:`open_transport`.

    Subclasses declare ``spec_version`` and ``capabilities`` like any backend;
    the validator checks each subclass on its own, inherited hooks included.
    """

    def __init__(self, config: BackendConfig) -> None:
        self.config = config
        self.transport = self.open_transport(config)
        self._lock = threading.Lock()
        self._local: KVLayout | None = None
        self._peers: dict[str, KVLayout] = {}

    @abstractmethod
    def open_transport(self, config: BackendConfig) -> Transport:
        """Create the transport (heavy engine imports belong here, not at module import)."""

    # -- spec hooks -----------------------------------------------------------

    @hookimpl
    def register_kv_buffers(self, layout: KVLayout) -> None:
        """Register every buffer of ``layout``, replacing the previous layout; all or nothing."""
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
        self.transport.add_peer(session_id, layout)
        with self._lock:
            self._peers[session_id] = layout

    @hookimpl
    def remove_peer(self, session_id: str) -> None:
        with self._lock:
            self._peers.pop(session_id, None)
        self.transport.forget_peer(session_id)

    @hookimpl
    def send_kvcache(
        self,
        session_id: str,
        prefill_kv_indices: NDArray[np.int32],
        dst_kv_ptrs: Sequence[int],
        dst_kv_indices: NDArray[np.int32],
        executor: Executor | None,
        dst_layer_ids: Sequence[int] | None = None,
        dst_device_kv_indices: NDArray[np.int32] | None = None,
        dst_kv_item_len: int | None = None,
        dst_attn_tp_size: int | None = None,
    ) -> int:
        request = TransferRequest(
            prefill_kv_indices,
            dst_kv_ptrs,
            dst_kv_indices,
            dst_layer_ids,
            dst_device_kv_indices,
            dst_kv_item_len,
            dst_attn_tp_size,
        )
        self._refuse_unsupported(request)
        local, peer = self._layouts(session_id)
        started = telemetry.clock()
        plan = request.plan(local, peer)
        planned = telemetry.clock()
        if len(plan):
            self.transport.write(session_id, plan)
        telemetry.publish(session_id, plan, started, planned)
        return plan.nbytes

    @hookimpl
    def submit_kvcache(
        self, session_id: str, request: TransferRequest, notification: bytes | None = None
    ) -> Future[int]:
        """Plan now (input errors raise here), then hand the plan to the transport's ``submit``."""
        needed = {"submit"} | ({"notifications"} if notification is not None else set())
        self._refuse_unsupported(request, frozenset(needed))
        local, peer = self._layouts(session_id)
        plan = request.plan(local, peer)
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
        self._refuse_unsupported(None, frozenset({"notifications"}))
        self._layouts(session_id)  # a known peer
        self.transport.notify(session_id, message)

    @hookimpl
    def poll_notifications(self) -> list[Notification]:
        self._refuse_unsupported(None, frozenset({"notifications"}))
        return self.transport.poll_notifications()

    @hookimpl
    def close(self) -> None:
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

    def _refuse_unsupported(self, request: TransferRequest | None, needed: frozenset[str] = frozenset()) -> None:
        """Direct callers (not through a Connection) get the same refusal the Connection gives."""
        used = needed | (request.features() if request is not None else frozenset())
        lacking = sorted(used - type(self).capabilities_declared())
        if lacking:
            params = TransferRequest.parameters_for(lacking)
            why = f" (passed {', '.join(params)})" if params else ""
            providers = sorted({FEATURE_DISTRIBUTIONS[f] for f in lacking if f in FEATURE_DISTRIBUTIONS})
            hint = f". Use a backend that supports it (pip install {' '.join(providers)})" if providers else ""
            raise UnsupportedFeatureError(
                f"backend {type(self).__name__} does not support {', '.join(map(repr, lacking))}{why}; "
                f"nothing was sent{hint}"
            )

    @classmethod
    def capabilities_declared(cls) -> frozenset[str]:
        """The class's ``capabilities`` (empty when it declares none or something that is not a set)."""
        raw: object = getattr(cls, "capabilities", frozenset())
        return frozenset(str(c) for c in raw) if isinstance(raw, (set, frozenset)) else frozenset()

    def _layouts(self, session_id: str) -> tuple[KVLayout, KVLayout]:
        with self._lock:
            local, peer = self._local, self._peers.get(session_id)
            known = sorted(self._peers)
        if local is None:
            raise InvalidTransferError("register_kv_buffers() must be called before send_kvcache()")
        if peer is None:
            listed = ", ".join(_short(k, quote=False) for k in known[:8])
            listed += f" and {len(known) - 8} more" if len(known) > 8 else ""
            raise InvalidTransferError(
                f"session_id {_short(session_id)} is unknown: call add_peer(session_id, layout) first "
                f"(known: {listed or 'none'})"
            )
        return local, peer

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
