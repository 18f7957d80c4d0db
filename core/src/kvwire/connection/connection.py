"""``Connection``: one backend instance behind pluggy, with the spec's guarantees.

Every call goes through ``pm.hook.<name>(...)`` with every argument by keyword.
Before ``send_kvcache`` reaches the backend, non-None arguments for features it
lacks (or that its older spec version lacks: the adapted mode) are refused
with :class:`UnsupportedFeatureError`, so nothing is silently dropped.

``submit_kvcache`` is the non-blocking send: the backend's own when it declares
``submit``, else the core's (:mod:`kvwire.connection.pool`); notifications need a
backend that declares ``notifications``.

A send is plain calls with arguments. For a :class:`kvwire.TransportBackend` at the
current spec with no middleware around ``send_kvcache``, the Connection checks the
request once (one capability gate, one peer lookup), plans it, and hands request,
executor and plan to the base's ``send_request`` on the caller's thread: its
transport ends every call within ``timeout_s`` by contract. Any other backend (a
hook-style third party, an adapted older spec) is called through pluggy on a call
thread under a deadline (:mod:`kvwire.connection.deadline`).
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
from kvwire.connection.deadline import CALL_GRACE_S, CallThreads, StuckCall
from kvwire.connection.guards import as_backend_error, backend_errors, check_middleware
from kvwire.connection.pool import Submissions
from kvwire.errors import BackendError, ConfigError, InvalidTransferError, KvwireError, UnsupportedFeatureError
from kvwire.layout.kv_layout import KVLayout
from kvwire.layout.peer_table import PeerTable, check_session_id
from kvwire.planning.gate import Gate
from kvwire.planning.plan import TransferPlan
from kvwire.planning.planner import check_peer_shape, plan_request
from kvwire.spec.history import CURRENT, SpecVersion
from kvwire.spec.hooks import BackendSpec
from kvwire.spec.notifications import Notification, check_message
from kvwire.spec.pluggy_project import PROJECT_NAME
from kvwire.spec.request import TransferRequest
from kvwire.transport.backend import TransportBackend, offers_raw_write
from kvwire.transport.futures import TransferFuture, follow

__all__ = ["Connection"]


def _dropped(hook: Any, calls: CallThreads | None) -> None:
    """A connection dropped unclosed: close the backend here, without a deadline, and end the call threads."""
    try:
        hook.close()
    finally:
        if calls is not None:
            calls.close()


def _bounded(backend: object, spec_version: str) -> bool:
    """A backend whose every call ends within ``timeout_s`` by contract: a TransportBackend at the current spec."""
    try:
        current = SpecVersion.parse(spec_version) == CURRENT
    except Exception:
        return False
    return current and isinstance(backend, TransportBackend)


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
        self._gate = Gate(f"{name!r} (spec {spec_version})", capabilities)
        self._local: KVLayout | None = None
        self._peers = PeerTable()
        # The caller's thread for a backend bounded by contract; a call thread under a deadline for the rest.
        bounded = _bounded(self.backend, spec_version)
        self._calls = None if bounded else CallThreads(name, config.timeout_s + CALL_GRACE_S)
        self._submissions = Submissions(name)
        self._pm.register(self.backend, name=name)
        for i, extra in enumerate(middleware):
            self._pm.register(extra, name=f"{name}.middleware[{i}]")
        self._hook = self._pm.hook
        # Sends go straight to TransportBackend.send_request unless a middleware wraps send_kvcache.
        self._direct = bounded and [i.plugin for i in self._hook.send_kvcache.get_hookimpls()] == [self.backend]
        # Submissions: the backend's own hook when it submits natively, else the middleware around the core's.
        self._native_submit = "submit" in capabilities
        self._core_submit = self._pm.subset_hook_caller("submit_kvcache", remove_plugins=[self.backend])
        # What a core-side submission runs: the backend's hooks without the middleware, which saw the submission.
        self._inner_send = self._pm.subset_hook_caller("send_kvcache", remove_plugins=middleware)
        self._inner_notify = self._pm.subset_hook_caller("send_notification", remove_plugins=middleware)
        # A dropped connection still unregisters its memory (stale registrations break later ones).
        self._finalizer = weakref.finalize(self, _dropped, self._hook, self._calls)

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise BackendError(f"connection to backend {self.name!r} is closed")

    def register_kv_buffers(self, layout: KVLayout) -> None:
        """Register the local KV memory (checked against the backend's capabilities first)."""
        self._check_open()
        if not isinstance(layout, KVLayout):
            raise ConfigError(f"layout must be a kvwire.KVLayout, got {type(layout).__name__}")
        self._gate.layout(layout, "the local layout")
        for session_id, peer in self._peers.items():
            self._gate.pair(layout, peer, session_id)
        self._local = None
        self._call("register_kv_buffers", layout=layout)
        self._local = layout

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
        self._gate.layout(layout, f"peer {session_id!r}")
        if self._local is not None:
            self._gate.pair(self._local, layout, session_id)
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
        request = TransferRequest(  # spec order (its fields are checked against it at import)
            prefill_kv_indices, dst_kv_ptrs, dst_kv_indices, dst_layer_ids, dst_device_kv_indices, dst_kv_item_len,
            dst_attn_tp_size,
        )  # fmt: skip
        self._admit(session_id, request)
        if self._direct:
            plan = self._plan(session_id, request, "send_kvcache")
            return self._send_planned(session_id, request, executor, plan)
        self._check_peer_shape(session_id, request)
        moved = self._call("send_kvcache", session_id=session_id, executor=executor, **request.arguments())
        return self._moved(moved, "send_kvcache")

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
        :data:`~kvwire.connection.pool.DEFAULT_SUBMIT_WORKERS` threads. The future
        fails with the typed kvwire error (a :class:`kvwire.TransferTimeoutError`
        within ``timeout_s`` of the transfer starting). ``cancel()`` succeeds only
        before the transfer starts. ``notification`` (bytes, at most
        :data:`kvwire.MAX_NOTIFICATION_BYTES`; feature ``notifications``) reaches
        the peer after this transfer's bytes, and only if it succeeded.
        """
        self._check_open()
        request = TransferRequest(  # spec order (its fields are checked against it at import)
            prefill_kv_indices, dst_kv_ptrs, dst_kv_indices, dst_layer_ids, dst_device_kv_indices, dst_kv_item_len,
            dst_attn_tp_size,
        )  # fmt: skip
        if notification is not None:
            notification = check_message(notification)
        arguments = {"session_id": session_id, "request": request, "notification": notification}
        self._admit(session_id, request, notification)
        if self._native_submit:
            self._check_peer_shape(session_id, request)
            self._submissions.require_open()
            returned = self._call_with(self._hook.submit_kvcache, "submit_kvcache", **arguments)
        else:
            plan = self._plan(session_id, request, "submit_kvcache")  # every input error now, before queueing
            self._submissions.require_open()
            core = self._on_pool(plan, executor)
            call = self._core_submit.call_extra
            returned = self._call_with(lambda **kw: call([core], kw), "submit_kvcache", **arguments)
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
        self._gate.require({"notifications"}, "send_notification")
        self._peers.known(session_id)
        self._call("send_notification", session_id=session_id, message=message)

    def poll_notifications(self) -> list[Notification]:
        """The notifications that arrived here since the last call, each once, in arrival order per sender."""
        self._check_open()
        self._gate.require({"notifications"}, "poll_notifications")
        got = self._call("poll_notifications")
        if not isinstance(got, list) or not all(isinstance(n, Notification) for n in got):
            raise BackendError(
                f"backend {self.name!r}: poll_notifications returned {got!r:.120}, expected a list of "
                "kvwire.Notification"
            )
        return got

    def _admit(self, session_id: str, request: TransferRequest, notification: bytes | None = None) -> None:
        """The session id, and the gate: the features the request (and a notification) use."""
        check_session_id(session_id)
        self._gate.require(request.features())
        if notification is not None:
            self._gate.require({"notifications"}, "notification")

    def _check_peer_shape(self, session_id: str, request: TransferRequest) -> None:
        """For a backend that plans itself: the caller's view of the peer's shape (an adapted one never sees it)."""
        peer = self._peers.get(session_id)
        item_len, tp_size = request.dst_kv_item_len, request.dst_attn_tp_size
        if (item_len is not None or tp_size is not None) and self._local and peer:
            check_peer_shape(self._local, peer, request.dst_layer_ids, item_len, tp_size)

    def _plan(self, session_id: str, request: TransferRequest, hook: str) -> TransferPlan:
        """Plan an admitted ``request`` against the recorded layouts: one peer lookup, every bound checked."""
        if self._local is None:
            raise InvalidTransferError(f"register_kv_buffers() must be called before {hook}()")
        return plan_request(request, self._local, self._peers.known(session_id))

    def _send_planned(
        self, session_id: str, request: TransferRequest, executor: Executor | None, plan: TransferPlan
    ) -> int:
        """The base's send of a checked, planned request (the direct path), on this thread."""
        try:
            moved = self.backend.send_request(session_id, request, executor, plan=plan)
        except KvwireError:
            raise
        except (Exception, SystemExit) as exc:  # as backend_errors() does, without a context manager per send
            raise as_backend_error(exc, self.name, "send_kvcache") from exc
        return self._moved(moved, "send_kvcache")

    def _on_pool(self, plan: TransferPlan, executor: Executor | None) -> Any:
        """The core's ``submit_kvcache`` for one submission of a backend that does not submit natively.

        Passed to pluggy as this call's implementation (``call_extra``), so a middleware still sees the
        submission once; the blocking send, then the notification, run on ``executor`` or the pool.
        """

        def submit_kvcache(session_id: str, request: TransferRequest, notification: bytes | None) -> Future[int]:
            def job() -> int:
                if self._direct:
                    moved = self._send_planned(session_id, request, None, plan)
                else:
                    sent = self._call_with(
                        self._inner_send, "send_kvcache", session_id=session_id, executor=None, **request.arguments()
                    )
                    moved = self._moved(sent, "send_kvcache")
                if notification is not None:
                    self._call_with(
                        self._inner_notify, "send_notification", session_id=session_id, message=notification
                    )
                return moved

            return self._submissions.run(TransferFuture(session_id, plan.nbytes, len(plan)), job, executor)

        return submit_kvcache

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
        """``caller(**kwargs)``: on this thread for a bounded backend, else under the call deadline."""
        with backend_errors(self.name, hook):
            if self._calls is None:
                return caller(**kwargs)
            return self._calls.call(hook, kwargs.get("session_id"), lambda: caller(**kwargs))

    @property
    def stuck_calls(self) -> tuple[StuckCall, ...]:
        """Backend calls that outlived their deadline (``timeout_s`` + ``CALL_GRACE_S``) and still run.

        Their callers got :class:`kvwire.TransferTimeoutError`; each leaves this
        list when the backend returns. A non-empty list means the backend broke
        its contract: the connection still serves other calls.
        """
        return self._calls.stuck if self._calls is not None else ()

    @property
    def state(self) -> str:
        """``"open"``, ``"degraded"`` (open, with :attr:`stuck_calls`) or ``"closed"``."""
        if not self._finalizer.alive:
            return "closed"
        return "degraded" if self.stuck_calls else "open"

    def raw_write(self, session_id: str, plan: TransferPlan) -> None:
        """The backend's bare engine call on ``plan``, for benchmarks (a bench seam, not a capability).

        Offered by a :class:`kvwire.TransportBackend` whose transport implements :class:`kvwire.RawWriter`.
        No checks beyond the engine's own: ``plan`` must come from
        :func:`kvwire.plan_transfer` between the registered layout and this peer's.
        """
        self._check_open()
        if not offers_raw_write(type(self.backend)):
            raise UnsupportedFeatureError(
                f"backend {self.name!r} offers no raw_write: it takes a kvwire.TransportBackend whose transport "
                "implements kvwire.RawWriter (raw_write(session_id, plan))"
            )
        if not isinstance(plan, TransferPlan):
            raise ConfigError(f"plan must be a kvwire.TransferPlan, got {type(plan).__name__}")
        self._call_with(self.backend.raw_write, "raw_write", session_id=session_id, plan=plan)

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
            if self._calls is not None:
                self._calls.close()

    def __enter__(self) -> Connection:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<kvwire.Connection backend={self.name!r} spec={self.spec_version} state={self.state}>"
