"""``Connection``: one backend instance behind pluggy, with the spec's guarantees.

Every call goes through ``pm.hook.<name>(...)`` with every argument by keyword.
Before ``send_kvcache`` reaches the backend, non-None arguments for features it
lacks (or that its older spec version lacks: the adapted mode) are refused
with :class:`UnsupportedFeatureError`, so nothing is silently dropped.

``submit_kvcache`` is the non-blocking send: the backend's own when it declares
``submit``, else the core's (:mod:`kvwire.submit.pool`); notifications need a
backend that declares ``notifications``.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from concurrent.futures import Executor, Future
from types import TracebackType
from typing import Any

import numpy as np
import pluggy
from numpy.typing import NDArray

from kvwire.config import BackendConfig
from kvwire.connection.core_submit import CoreSubmit, on_executor
from kvwire.connection.deadline import CALL_GRACE_S, CallThreads, StuckCall
from kvwire.connection.guards import as_backend_error, backend_errors, check_middleware
from kvwire.errors import BackendError, ConfigError, InvalidTransferError
from kvwire.layout.kv_layout import KVLayout
from kvwire.layout.peer_table import PeerTable, check_session_id
from kvwire.planning.head_slicing import needs_head_slicing
from kvwire.planning.plan import TransferPlan
from kvwire.planning.planner import check_peer_shape, plan_request
from kvwire.spec.capabilities import MEMORY_FEATURES, refuse_lacking
from kvwire.spec.hooks import BackendSpec
from kvwire.spec.pluggy_project import PROJECT_NAME
from kvwire.spec.request import TransferRequest, handing
from kvwire.submit.futures import TransferFuture, follow
from kvwire.submit.notifications import Notification, check_message
from kvwire.submit.pool import Submissions

__all__ = ["Connection"]


def _dropped(hook: Any, calls: CallThreads) -> None:
    """A connection dropped unclosed: close the backend here, without a deadline, and end the call threads."""
    try:
        hook.close()
    finally:
        calls.close()


class Connection:
    """A live backend. Create it with :func:`kvwire.connect`; close it (or use ``with``)."""

    def __init__(
        self,
        name: str,
        cls: type | None,
        capabilities: frozenset[str],
        config: BackendConfig,
        *,
        middleware: Sequence[object] = (),
        spec_version: str = "",
    ) -> None:
        if cls is None:
            raise BackendError(f"backend {name!r} has no class to instantiate")
        if not isinstance(config, BackendConfig):
            raise ConfigError(f"config must be a kvwire.BackendConfig, got {type(config).__name__}")
        self.name = name
        self.capabilities = capabilities
        self.spec_version = spec_version
        self.config = config
        for i, extra in enumerate(middleware):  # before the backend exists: a bad wrapper leaks nothing
            check_middleware(extra, f"middleware[{i}]")
        self._pm = pluggy.PluginManager(PROJECT_NAME)
        self._pm.add_hookspecs(BackendSpec)
        with backend_errors(name, "its constructor"):
            self.backend: Any = cls(config)
        self._local: KVLayout | None = None
        self._peers = PeerTable()
        self._calls = CallThreads(name, config.timeout_s + CALL_GRACE_S)
        self._submissions = Submissions(name)
        core = CoreSubmit(self._submissions, self._plan, self._send_inner, self._notify_inner)
        self._pm.register(core, name=f"{name}.core-submit")
        self._pm.register(self.backend, name=name)
        for i, extra in enumerate(middleware):
            self._pm.register(extra, name=f"{name}.middleware[{i}]")
        self._hook = self._pm.hook
        # Submissions: the backend's own hook when it submits natively, else the core's (CoreSubmit).
        self._submit = (
            self._hook.submit_kvcache
            if "submit" in capabilities
            else self._pm.subset_hook_caller("submit_kvcache", remove_plugins=[self.backend])
        )
        # What a core-side submission runs: the backend's hooks without the middleware, which saw the submission.
        inner = [core, *middleware]
        self._inner_send = self._pm.subset_hook_caller("send_kvcache", remove_plugins=inner)
        self._inner_notify = self._pm.subset_hook_caller("send_notification", remove_plugins=inner)
        # A dropped connection still unregisters its memory (stale registrations break later ones).
        self._finalizer = weakref.finalize(self, _dropped, self._hook, self._calls)

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise BackendError(f"connection to backend {self.name!r} is closed")

    def _require(self, features: frozenset[str], why: str | None = None) -> None:
        refuse_lacking(f"{self.name!r} (spec {self.spec_version})", self.capabilities, features, why)

    def register_kv_buffers(self, layout: KVLayout) -> None:
        """Register the local KV memory (checked against the backend's capabilities first)."""
        self._check_open()
        if not isinstance(layout, KVLayout):
            raise ConfigError(f"layout must be a kvwire.KVLayout, got {type(layout).__name__}")
        self._check_layout(layout, "the local layout")
        for session_id, peer in self._peers.items():
            self._check_pair(layout, peer, session_id)
        self._local = None
        self._call("register_kv_buffers", layout=layout)
        self._local = layout

    def _check_layout(self, layout: KVLayout, what: str) -> None:
        self._require(frozenset({layout.attention}), f"{what} ({layout.attention.upper()} buffers)")
        for kind in sorted({b.memory for b in layout.buffers}):
            self._require(frozenset({MEMORY_FEATURES[kind]}), f"{what} ({kind} buffers)")

    def _check_pair(self, local: KVLayout, peer: KVLayout, session_id: str) -> None:
        """Different attention TP sizes on the two sides need head slicing (checked before the first send)."""
        if needs_head_slicing(local, peer):
            self._require(
                frozenset({"head_slicing"}),
                f"peer {session_id!r}: attention TP size {local.attn_tp_size} here, {peer.attn_tp_size} there",
            )

    def endpoint(self) -> str:
        """The id a peer passes as ``session_id`` to reach this endpoint."""
        self._check_open()
        result = self._call("endpoint")
        if not isinstance(result, str) or not result:
            raise BackendError(f"backend {self.name!r}: endpoint() returned {result!r}, expected a str")
        return result

    def add_peer(self, session_id: str, layout: KVLayout) -> None:
        """Tell the backend a peer's layout (as the peer published it) before sending to it."""
        self._check_open()
        check_session_id(session_id)
        if not isinstance(layout, KVLayout):
            raise ConfigError(f"layout must be a kvwire.KVLayout, got {type(layout).__name__}")
        self._check_layout(layout, f"peer {session_id!r}")
        if self._local is not None:
            self._check_pair(self._local, layout, session_id)
        self._call("add_peer", session_id=session_id, layout=layout)
        self._peers.add(session_id, layout)

    def peer_layout(self, session_id: str) -> KVLayout | None:
        """The layout :meth:`add_peer` recorded for ``session_id``, or None for an unknown peer."""
        check_session_id(session_id)
        return self._peers.get(session_id)

    def remove_peer(self, session_id: str) -> None:
        """Forget a peer: its layout here and in the backend, and the engine's per-peer resources.

        Idempotent. A backend of spec < 1.4 (adapted) has no ``remove_peer`` hook:
        only the connection's own record is dropped, and the backend keeps what it
        holds for the peer until it is closed.
        """
        self._check_open()
        check_session_id(session_id)
        self._call("remove_peer", session_id=session_id)
        self._peers.remove(session_id)

    def send_kvcache(
        self,
        session_id: str,
        prefill_kv_indices: NDArray[np.int32],
        dst_kv_ptrs: Sequence[int],
        dst_kv_indices: NDArray[np.int32],
        executor: Executor | None = None,
        dst_layer_ids: Sequence[int] | None = None,
        dst_device_kv_indices: NDArray[np.int32] | None = None,
        dst_kv_item_len: int | None = None,
        dst_attn_tp_size: int | None = None,
    ) -> int:
        """Send pages to a peer; returns the bytes moved (see :class:`kvwire.BackendSpec`).

        Arguments for features the backend lacks are refused, and the caller's
        ``dst_kv_item_len`` / ``dst_attn_tp_size`` are checked against the peer's
        layout here, for every backend (an adapted one never receives them).
        """
        self._check_open()
        request = TransferRequest(
            prefill_kv_indices,
            dst_kv_ptrs,
            dst_kv_indices,
            dst_layer_ids,
            dst_device_kv_indices,
            dst_kv_item_len,
            dst_attn_tp_size,
        )
        self._check_request(session_id, request)
        return self._send(session_id, request, executor)

    def submit_kvcache(
        self,
        session_id: str,
        prefill_kv_indices: NDArray[np.int32],
        dst_kv_ptrs: Sequence[int],
        dst_kv_indices: NDArray[np.int32],
        executor: Executor | None = None,
        dst_layer_ids: Sequence[int] | None = None,
        dst_device_kv_indices: NDArray[np.int32] | None = None,
        dst_kv_item_len: int | None = None,
        dst_attn_tp_size: int | None = None,
        *,
        notification: bytes | None = None,
    ) -> TransferFuture:
        """Start a send and return at once; the future's result is the bytes moved.

        Takes :meth:`send_kvcache`'s arguments. Invalid input raises here, before
        anything is queued (the request is planned against the recorded layouts).
        A backend that declares ``submit`` runs the transfer itself; for any other
        the blocking send runs on ``executor`` (given None itself then, so it
        cannot wait on its own pool) or on the connection's pool of
        :data:`~kvwire.submit.pool.DEFAULT_SUBMIT_WORKERS` threads. The future
        fails with the typed kvwire error (a :class:`kvwire.TransferTimeoutError`
        within ``timeout_s`` of the transfer starting). ``cancel()`` succeeds only
        before the transfer starts. ``notification`` (bytes, at most
        :data:`kvwire.MAX_NOTIFICATION_BYTES`; feature ``notifications``) reaches
        the peer after this transfer's bytes, and only if it succeeded.
        """
        self._check_open()
        request = TransferRequest(
            prefill_kv_indices,
            dst_kv_ptrs,
            dst_kv_indices,
            dst_layer_ids,
            dst_device_kv_indices,
            dst_kv_item_len,
            dst_attn_tp_size,
        )
        self._check_request(session_id, request)
        if notification is not None:
            notification = check_message(notification)
            self._require(frozenset({"notifications"}), "notification")
        self._submissions.require_open()
        with on_executor(executor), handing(request):
            returned = self._call_with(
                self._submit, "submit_kvcache", session_id=session_id, request=request, notification=notification
            )
        if not isinstance(returned, Future):
            raise BackendError(
                f"backend {self.name!r}: submit_kvcache returned {type(returned).__name__}, expected a "
                "concurrent.futures.Future of the bytes moved"
            )
        planned = returned if isinstance(returned, TransferFuture) else None
        future = TransferFuture(
            session_id, planned.nbytes if planned else None, planned.descriptors if planned else None
        )
        self._submissions.track(future)
        return follow(
            future,
            returned,
            lambda moved: self._moved(moved, "submit_kvcache"),
            lambda exc: as_backend_error(exc, self.name, "submit_kvcache"),
        )

    def send_notification(self, session_id: str, message: bytes) -> None:
        """Send ``message`` to the peer, delivered after the bytes of every send to it that has completed.

        Needs a backend that declares ``notifications``. ``message`` is bytes, at
        most :data:`kvwire.MAX_NOTIFICATION_BYTES`. Notifications from one
        endpoint to one peer arrive in the order they were sent.
        """
        self._check_open()
        check_session_id(session_id)
        message = check_message(message, "message")
        self._require(frozenset({"notifications"}), "send_notification")
        self._peers.known(session_id)
        self._call("send_notification", session_id=session_id, message=message)

    def poll_notifications(self) -> list[Notification]:
        """The notifications that arrived here since the last call, each once, in arrival order per sender."""
        self._check_open()
        self._require(frozenset({"notifications"}), "poll_notifications")
        got = self._call("poll_notifications")
        if not isinstance(got, list) or not all(isinstance(n, Notification) for n in got):
            raise BackendError(
                f"backend {self.name!r}: poll_notifications returned {got!r:.120}, expected a list of "
                "kvwire.Notification"
            )
        return got

    def _check_request(self, session_id: str, request: TransferRequest) -> None:
        """Check a request: argument types, features the backend lacks, the caller's view of the peer."""
        check_session_id(session_id)
        self._require(request.features())
        peer = self._peers.get(session_id)
        item_len, tp_size = request.dst_kv_item_len, request.dst_attn_tp_size
        if (item_len is not None or tp_size is not None) and self._local and peer:
            check_peer_shape(self._local, peer, request.dst_layer_ids, item_len, tp_size)

    def _send(self, session_id: str, request: TransferRequest, executor: Executor | None) -> int:
        with handing(request):
            moved = self._call("send_kvcache", session_id=session_id, executor=executor, **request.arguments())
        return self._moved(moved, "send_kvcache")

    def _plan(self, session_id: str, request: TransferRequest) -> TransferPlan:
        """The plan of a core-side submission, against the recorded layouts (the backend's send reuses it)."""
        if self._local is None:
            raise InvalidTransferError("register_kv_buffers() must be called before submit_kvcache()")
        return plan_request(request, self._local, self._peers.known(session_id))

    def _send_inner(self, session_id: str, request: TransferRequest) -> int:
        with handing(request):
            moved = self._call_with(
                self._inner_send, "send_kvcache", session_id=session_id, executor=None, **request.arguments()
            )
        return self._moved(moved, "send_kvcache")

    def _notify_inner(self, session_id: str, message: bytes) -> None:
        self._call_with(self._inner_notify, "send_notification", session_id=session_id, message=message)

    def _moved(self, moved: object, hook: str) -> int:
        if isinstance(moved, bool) or not isinstance(moved, (int, np.integer)) or moved < 0:
            raise BackendError(
                f"backend {self.name!r}: {hook} returned {moved!r}; the spec requires the bytes moved "
                "(an int >= 0) and failures raised as kvwire.TransferError"
            )
        return int(moved)

    def _call(self, hook: str, **kwargs: Any) -> Any:
        """``pm.hook.<hook>(**kwargs)``; a non-kvwire exception becomes BackendError naming the backend."""
        return self._call_with(getattr(self._hook, hook), hook, **kwargs)

    def _call_with(self, caller: Any, hook: str, **kwargs: Any) -> Any:
        """``caller(**kwargs)`` under the call deadline (:mod:`kvwire.connection.deadline`)."""
        with backend_errors(self.name, hook):
            return self._calls.call(hook, kwargs.get("session_id"), lambda: caller(**kwargs))

    @property
    def stuck_calls(self) -> tuple[StuckCall, ...]:
        """Backend calls that outlived their deadline (``timeout_s`` + ``CALL_GRACE_S``) and still run.

        Their callers got :class:`kvwire.TransferTimeoutError`; each leaves this
        list when the backend returns. A non-empty list means the backend broke
        its contract: the connection still serves other calls.
        """
        return self._calls.stuck

    @property
    def state(self) -> str:
        """``"open"``, ``"degraded"`` (open, with :attr:`stuck_calls`) or ``"closed"``."""
        if not self._finalizer.alive:
            return "closed"
        return "degraded" if self._calls.stuck else "open"

    def raw_write(self, session_id: str, plan: TransferPlan) -> None:
        """The backend's bare engine call on ``plan`` (capability ``raw_write``), for benchmarks.

        No checks beyond the engine's own: ``plan`` must come from
        :func:`kvwire.plan_transfer` between the registered layout and this peer's.
        """
        self._check_open()
        self._require(frozenset({"raw_write"}), "raw_write")
        if not isinstance(plan, TransferPlan):
            raise ConfigError(f"plan must be a kvwire.TransferPlan, got {type(plan).__name__}")
        with backend_errors(self.name, "raw_write"):
            self._calls.call("raw_write", session_id, lambda: self.backend.raw_write(session_id, plan))

    def close(self) -> None:
        """Close the backend (idempotent).

        Transfers submitted and not yet started are cancelled; running ones get
        up to ``timeout_s`` (plus a second) to end, each by its own deadline;
        then the backend is closed, and a backend must fail whatever of its own
        is still running. Nothing submitted is left pending. A backend ``close``
        that does not return within the call deadline raises
        :class:`kvwire.TransferTimeoutError`; the connection is closed anyway.
        """
        if self._finalizer.alive:
            self._submissions.drain(self.config.timeout_s + 1.0)
        try:
            if self._finalizer.detach() is not None:
                self._call("close")
        finally:
            self._submissions.shutdown()
            self._calls.close()

    def __enter__(self) -> Connection:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<kvwire.Connection backend={self.name!r} spec={self.spec_version} state={self.state}>"
