"""Prometheus metrics for sends, submissions and notifications, as a ready middleware
(``pip install 'kvwire[metrics]'``).

::

    from kvwire.metrics import default_metrics

    conn = kvwire.connect("mooncake", middleware=[default_metrics().middleware("mooncake")])

Exported (labels ``backend`` and ``peer``; ``error`` on failures):

* ``kvwire_send_requests_total``, ``kvwire_send_bytes_total``: every send, blocking
  (``send_kvcache``) or submitted (``submit_kvcache``, on every backend: native or the
  core's pool); a submission's bytes and failure count when its future completes
* ``kvwire_send_failures_total{error}``: the kvwire error class the caller gets
  (anything else a backend raises reaches the caller as ``BackendError``)
* ``kvwire_send_seconds``: latency as the caller sees it, failures included (a
  submission: from the call to its future's completion)
* ``kvwire_submit_requests_total``: the submissions among the sends
* ``kvwire_notifications_sent_total``: ``send_notification`` calls, and submissions whose
  notification went out after their bytes; ``kvwire_notifications_received_total``
  (``backend`` only): what ``poll_notifications`` returned;
  ``kvwire_notifications_dropped_total`` (``backend`` only): what a receiver's bounded inbox
  (:data:`kvwire.MAX_UNPOLLED_NOTIFICATIONS`) dropped unpolled, counted at the next poll
* ``kvwire_send_descriptors_total``, ``kvwire_send_descriptors_before_coalescing_total``,
  ``kvwire_send_planning_seconds``, ``kvwire_send_transfer_seconds`` (``backend`` only):
  from :mod:`kvwire.transport.telemetry`, for backends that publish it (those built on
  :class:`kvwire.TransportBackend`)

A standalone process (no host with a ``/metrics`` of its own) serves them with :func:`serve`.
Inside sglang (``--enable-metrics``) and vLLM they appear on the host's own ``/metrics``
(docs/metrics.md lists every name, label and where it shows).

Label cardinality is bounded: the first ``max_peers`` distinct peers of a
:class:`Metrics` get their own ``peer`` label, later ones share ``"other"``.
prometheus_client is imported when a :class:`Metrics` is created, not before.
"""

from __future__ import annotations

import threading
from collections.abc import Generator, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from kvwire.errors import BackendError, KvwireError
from kvwire.process_wide import ProcessWide
from kvwire.spec.pluggy_project import hookimpl
from kvwire.transport import inbox, telemetry

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

__all__ = ["DEFAULT_BUCKETS", "OTHER_PEER", "Metrics", "MetricsMiddleware", "default_metrics", "serve"]

#: Latency buckets (seconds): KV sends range from ~100 us (a few pages) to seconds (a long prompt over TCP).
DEFAULT_BUCKETS: Final = (
    *(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025),
    *(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
#: The ``peer`` label of every peer past ``max_peers``.
OTHER_PEER: Final = "other"


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:
        raise ImportError(
            "kvwire.metrics needs prometheus_client: pip install 'kvwire[metrics]' (or prometheus_client)"
        ) from exc
    return prometheus_client


class Metrics:
    """The metric families on one prometheus registry; :meth:`middleware` makes one per connection."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        max_peers: int = 32,
        buckets: Sequence[float] = DEFAULT_BUCKETS,
    ) -> None:
        if isinstance(max_peers, bool) or not isinstance(max_peers, int) or max_peers < 0:
            raise ValueError(f"max_peers must be an int >= 0, got {max_peers!r}")
        prom = _prometheus()
        where: dict[str, Any] = {"registry": registry if registry is not None else prom.REGISTRY}
        peer = ["backend", "peer"]
        self.requests = prom.Counter("kvwire_send_requests", "send_kvcache calls", peer, **where)
        self.bytes = prom.Counter("kvwire_send_bytes", "Bytes moved by successful send_kvcache calls", peer, **where)
        self.failures = prom.Counter(
            "kvwire_send_failures", "Failed send_kvcache calls by kvwire error class", [*peer, "error"], **where
        )
        self.seconds = prom.Histogram(
            "kvwire_send_seconds", "send_kvcache latency as the caller sees it", peer, buckets=buckets, **where
        )
        self.descriptors = prom.Counter(
            "kvwire_send_descriptors", "Descriptors written, after coalescing", ["backend"], **where
        )
        self.descriptors_before = prom.Counter(
            "kvwire_send_descriptors_before_coalescing",
            "Descriptors before coalescing (one per page and buffer pair)",
            ["backend"],
            **where,
        )
        self.planning = prom.Histogram(
            "kvwire_send_planning_seconds", "Planning time of a send", ["backend"], buckets=buckets, **where
        )
        self.transfer = prom.Histogram(
            "kvwire_send_transfer_seconds", "Transport write time of a send", ["backend"], buckets=buckets, **where
        )
        self.submits = prom.Counter("kvwire_submit_requests", "submit_kvcache calls", peer, **where)
        self.notes_sent = prom.Counter("kvwire_notifications_sent", "Notifications sent", peer, **where)
        self.notes_received = prom.Counter(
            "kvwire_notifications_received", "Notifications polled", ["backend"], **where
        )
        self.notes_dropped = prom.Counter(
            "kvwire_notifications_dropped",
            "Notifications dropped unpolled: the receiver's inbox was full (the oldest go first)",
            ["backend"],
            **where,
        )
        self.max_peers = max_peers
        self._peers: set[str] = set()
        self._lock = threading.Lock()

    def peer_label(self, session_id: str) -> str:
        """``session_id`` for the first ``max_peers`` distinct peers, :data:`OTHER_PEER` after."""
        with self._lock:
            if session_id in self._peers:
                return session_id
            if len(self._peers) < self.max_peers:
                self._peers.add(session_id)
                return session_id
        return OTHER_PEER

    def middleware(self, backend: str) -> MetricsMiddleware:
        """A middleware recording into these metrics under ``backend`` (pass it to ``kvwire.connect``)."""
        return MetricsMiddleware(self, backend)


def _error_label(exc: BaseException) -> str:
    """The class the caller gets: a kvwire error's own, else BackendError (the Connection wraps the rest)."""
    return type(exc).__name__ if isinstance(exc, KvwireError) else BackendError.__name__


def _bytes(moved: object) -> int | None:
    ok = isinstance(moved, (int, np.integer)) and not isinstance(moved, bool) and moved >= 0
    return int(moved) if ok else None  # type: ignore[call-overload]


class MetricsMiddleware:
    """Wraps the sending hooks: counts, times and reads the backend's :mod:`kvwire.transport.telemetry` record."""

    def __init__(self, metrics: Metrics, backend: str) -> None:
        self.metrics = metrics
        self.backend = backend

    def _failed(self, peer: str, started: float, exc: BaseException) -> None:
        m = self.metrics
        m.seconds.labels(self.backend, peer).observe(telemetry.clock() - started)
        m.failures.labels(self.backend, peer, _error_label(exc)).inc()

    def _moved(self, peer: str, started: float, moved: object) -> None:
        m = self.metrics
        m.seconds.labels(self.backend, peer).observe(telemetry.clock() - started)
        nbytes = _bytes(moved)
        if nbytes is not None:
            m.bytes.labels(self.backend, peer).inc(nbytes)

    @hookimpl(wrapper=True)
    def send_kvcache(self, session_id: str) -> Generator[None, int, int]:
        m = self.metrics
        peer = m.peer_label(session_id)
        marker = telemetry.mark()
        started = telemetry.clock()
        m.requests.labels(self.backend, peer).inc()
        try:
            moved = yield
        except BaseException as exc:
            self._failed(peer, started, exc)
            raise
        self._moved(peer, started, moved)
        record = telemetry.since(marker)
        if record is not None:
            m.descriptors.labels(self.backend).inc(record.descriptors)
            m.descriptors_before.labels(self.backend).inc(record.descriptors_before)
            m.planning.labels(self.backend).observe(record.planning_s)
            m.transfer.labels(self.backend).observe(record.transfer_s)
        return moved

    @hookimpl(wrapper=True)
    def submit_kvcache(self, session_id: str, notification: bytes | None) -> Generator[None, Future[int], Future[int]]:
        m = self.metrics
        peer = m.peer_label(session_id)
        started = telemetry.clock()
        m.requests.labels(self.backend, peer).inc()
        m.submits.labels(self.backend, peer).inc()
        try:
            future = yield
        except BaseException as exc:
            self._failed(peer, started, exc)
            raise

        def completed(done: Future[int]) -> None:
            if done.cancelled():
                return
            exc = done.exception()
            if exc is not None:
                self._failed(peer, started, exc)
                return
            self._moved(peer, started, done.result())
            if notification is not None:
                m.notes_sent.labels(self.backend, peer).inc()

        if isinstance(future, Future):
            future.add_done_callback(completed)
        return future

    @hookimpl(wrapper=True)
    def send_notification(self, session_id: str) -> Generator[None, None, None]:
        yield
        self.metrics.notes_sent.labels(self.backend, self.metrics.peer_label(session_id)).inc()

    @hookimpl(wrapper=True)
    def poll_notifications(self) -> Generator[None, list[Any], list[Any]]:
        marker = inbox.mark_poll()
        got = yield
        if isinstance(got, list):
            self.metrics.notes_received.labels(self.backend).inc(len(got))
        record = inbox.poll_since(marker)
        if record is not None and record.dropped:
            self.metrics.notes_dropped.labels(self.backend).inc(record.dropped)
        return got


_default: ProcessWide[Metrics] = ProcessWide(Metrics)


def default_metrics() -> Metrics:
    """The process-wide :class:`Metrics` on prometheus_client's default registry (created once)."""
    return _default.get()


def serve(port: int, host: str = "127.0.0.1") -> Any:
    """Serve ``/metrics`` (prometheus_client's default registry, where :func:`default_metrics` records) on
    ``host:port`` from a daemon thread, for a process that has no metrics endpoint of its own.

    Loopback by default: the ``peer`` labels name this process's peers. ``port`` 0 picks a free port; the
    returned server's ``server_port`` says which. Returns the server (``shutdown()`` stops it).
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in 0..65535, got {port!r}")
    if not isinstance(host, str) or not host:
        raise ValueError(f"host must be a non-empty str, got {host!r}")
    server, _thread = _prometheus().start_http_server(port, addr=host)
    return server
