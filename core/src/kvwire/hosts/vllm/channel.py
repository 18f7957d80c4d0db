"""The side channel: a decode worker registers its blocks with the prefill worker of the same TP rank.

Built on :mod:`kvwire.control`: JSON lines over TCP with its bounds and deadlines,
and its mutual HMAC handshake when ``KVWIRE_CONTROL_KEY`` is set (required for a
non-loopback ``side_channel_host``), after which every registration and every
reply is a frame with a sequence number and an HMAC tag
(:mod:`kvwire.control.frames`): a frame altered, replayed or reordered on the
way closes that connection with a warning naming it, and nothing of it reaches
the handler; the other connections are served on. The prefill worker runs a
:class:`RegistrationServer`: one thread accepting, one per decode connection, at
most :data:`MAX_CONNECTIONS` connections at once (one more is closed as it is
accepted), each closed once idle for :data:`IDLE_TIMEOUT_S`; a line that has
started may take the channel's ``timeout_s`` to end; running out of file
descriptors (EMFILE) pauses accepting, it never ends it. Each message is
answered by the handler it was given, a ``{"error": ...}`` reply for one it
refuses. A decode worker keeps one :class:`~kvwire.control.PeerConnection` per
prefill worker in :class:`RegistrationClient`, used from a pool of at most
:data:`MAX_CLIENT_THREADS` threads (one request at a time per prefill), so that
a slow or dead prefill never blocks vLLM's step, and a prefill of many ranks
does not take a thread each.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

from kvwire.control import (
    Channel,
    ControlAuthError,
    ControlClosedError,
    ControlError,
    PeerConnection,
    check_listen_key,
)
from kvwire.control.auth import server_handshake

__all__ = [
    "IDLE_TIMEOUT_S",
    "MAX_CLIENT_THREADS",
    "MAX_CONNECTIONS",
    "Handler",
    "RegistrationClient",
    "RegistrationServer",
    "ReplyCallback",
]

log = logging.getLogger("kvwire.hosts.vllm")

#: Answers one message from a decode (any exception becomes an ``{"error": ...}`` reply).
Handler = Callable[[dict[str, Any]], dict[str, Any]]
#: Called with the reply, or None and the reason when there is none.
ReplyCallback = Callable[[dict[str, Any] | None, str | None], None]

_POLL_S = 0.2  # how often blocked threads look at the stop flag
#: Most decode connections a prefill worker's side channel serves at once (a thread each).
MAX_CONNECTIONS: Final = 128
#: Seconds a side-channel connection may stay without a message before the prefill closes it (a decode reconnects).
IDLE_TIMEOUT_S: Final = 60.0
#: Most threads a decode worker's registrations take, over every prefill rank it registers with.
MAX_CLIENT_THREADS: Final = 16
_OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_BACKOFF_S = (0.01, 1.0)  # the first and longest pause of the accept loop when descriptors run out


class RegistrationServer:
    """Listens on ``host:port`` and answers each decode's messages with ``handler`` until :meth:`close`.

    ``max_connections`` and ``idle_s`` bound the connections (see the module docstring); ``timeout_s`` is the
    deadline of a handshake, of a line once it has started, and of a reply's send.
    """

    def __init__(
        self,
        host: str,
        port: int,
        handler: Handler,
        key: bytes | None,
        timeout_s: float,
        *,
        max_connections: int = MAX_CONNECTIONS,
        idle_s: float = IDLE_TIMEOUT_S,
    ) -> None:
        warning = check_listen_key(host, key, "kv_connector_extra_config['side_channel_host']")
        if warning:
            log.warning("kvwire: %s", warning)
        self._handler = handler
        self._key = key
        self._timeout_s = timeout_s
        self._max_connections, self._idle_s = max_connections, idle_s
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        #: Connections closed as they were accepted, at ``max_connections``; and connections closed for idling.
        self.turned_away = 0
        self.idled_out = 0
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._sock = socket.create_server((host, port), family=family)
        except OSError as exc:
            raise ControlError(
                f"the prefill's side channel cannot listen on {host}:{port}: {exc}; set "
                "kv_connector_extra_config['side_channel_port'] to a free port (TP rank r uses port + r)"
            ) from None
        self._sock.settimeout(_POLL_S)
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._accept, name="kvwire-vllm-side-channel", daemon=True)
        self._thread.start()

    @property
    def connections(self) -> int:
        """Decode connections open now."""
        with self._lock:
            return len(self._conns)

    def _accept(self) -> None:
        pause, full_logged, out_logged = _BACKOFF_S[0], False, False
        while not self._stop.is_set():
            try:
                conn, peer = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stop.is_set() or exc.errno not in _OUT_OF_DESCRIPTORS:
                    if not self._stop.is_set():
                        log.error("kvwire: the side channel at %s stopped accepting: %s", self.address, exc)
                    return
                if not out_logged:  # once per shortage: connections wait in the backlog meanwhile
                    log.warning(
                        "kvwire: the side channel at %s cannot accept a decode's connection (%s); retrying as "
                        "descriptors free up",
                        self.address,
                        exc,
                    )
                    out_logged = True
                self._stop.wait(pause)
                pause = min(2 * pause, _BACKOFF_S[1])
                continue
            pause, out_logged = _BACKOFF_S[0], False
            conn.settimeout(None)
            name = f"decode at {peer[0]}:{peer[1]}"
            with self._lock:
                full = len(self._conns) >= self._max_connections
                if not full:
                    self._conns.add(conn)
            if full:
                self.turned_away += 1
                if not full_logged:
                    log.warning(
                        "kvwire: the side channel at %s serves %d connections, its most; closing %s's (and further "
                        "ones while it is full)",
                        self.address,
                        self._max_connections,
                        name,
                    )
                    full_logged = True
                with contextlib.suppress(OSError):
                    conn.close()
                continue
            full_logged = False
            threading.Thread(
                target=self._serve, args=(conn, name), name="kvwire-vllm-registrations", daemon=True
            ).start()

    def _serve(self, conn: socket.socket, name: str) -> None:
        try:
            frames = server_handshake(conn, self._key, name, self._timeout_s)
            fd = conn.fileno()
            channel = Channel(fd, fd, what=name, timeout_s=self._timeout_s, frames=frames)
            readable = select.poll()
            readable.register(fd, select.POLLIN)
            idle_since = time.monotonic()
            while not self._stop.is_set():
                if not channel.holds_data and not readable.poll(int(_POLL_S * 1000)):
                    if time.monotonic() - idle_since >= self._idle_s:
                        with self._lock:
                            self.idled_out += 1
                        log.debug("kvwire: side channel to %s closed: idle for %g s", name, self._idle_s)
                        return
                    continue
                message = channel.read()  # a line that has started gets the channel's timeout_s to end
                if message.get("cmd") == "quit":
                    channel.send({})
                    return
                try:
                    answer = self._handler(message)
                except Exception as exc:  # the decode learns why; this server keeps serving
                    answer = {"error": f"{type(exc).__name__}: {exc}"}
                channel.send(answer)
                idle_since = time.monotonic()
        except ControlAuthError as exc:  # a frame altered, replayed or forged on the way: operators want to know
            log.warning("kvwire: side channel to %s closed: %s", name, exc)
        except ControlError as exc:
            log.debug("kvwire: side channel to %s ended: %s", name, exc)
        finally:
            with self._lock:
                self._conns.discard(conn)
            with contextlib.suppress(OSError):
                conn.close()

    def close(self) -> None:
        """Stop listening and end every connection (idempotent)."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=2 * _POLL_S + 1)


class RegistrationClient:
    """A decode's connections to prefill workers: one connection per ``host:port``, reused, one request at a
    time on it; the requests run on a pool of at most ``max_threads`` threads shared by every prefill."""

    def __init__(self, key: bytes | None, timeout_s: float, *, max_threads: int = MAX_CLIENT_THREADS) -> None:
        self._key = key
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_threads, thread_name_prefix="kvwire-vllm-register")
        self._queued: dict[tuple[str, int], deque[tuple[dict[str, Any], ReplyCallback]]] = {}
        self._conns: dict[tuple[str, int], PeerConnection] = {}
        self._closed = False

    def send(self, host: str, port: int, message: dict[str, Any], on_reply: ReplyCallback) -> None:
        """Send ``message`` to the prefill at ``host:port`` from the pool; ``on_reply`` gets the answer."""
        address = (host, port)
        with self._lock:
            if self._closed:
                on_reply(None, "the connector is shut down")
                return
            queue = self._queued.get(address)
            if queue is not None:  # a request to this prefill is running: this one follows it
                queue.append((message, on_reply))
                return
            self._queued[address] = deque([(message, on_reply)])
        self._pool.submit(self._next, address)

    def _next(self, address: tuple[str, int]) -> None:
        """Run the next request to ``address``, then hand the thread back (the prefill's next one queues behind
        every other prefill's)."""
        with self._lock:
            queue = self._queued.get(address)
            if self._closed or not queue:
                self._queued.pop(address, None)
                return
            message, on_reply = queue.popleft()
        try:
            self._request(address, message, on_reply)
        finally:
            with self._lock:
                more = bool(self._queued.get(address)) and not self._closed
                if not more:
                    self._queued.pop(address, None)
            if more:
                with contextlib.suppress(RuntimeError):  # the pool shut down meanwhile
                    self._pool.submit(self._next, address)

    def _request(self, address: tuple[str, int], message: dict[str, Any], on_reply: ReplyCallback) -> None:
        what = "the prefill's kvwire side channel"
        for attempt in (1, 2):
            reused = address in self._conns
            try:
                conn = self._conns.get(address)
                if conn is None:
                    conn = self._conns[address] = PeerConnection(
                        *address, what=what, timeout_s=self._timeout_s, key=self._key
                    )
                reply = conn.request(message)
            except ControlError as exc:  # a refusal ({"error": ...}) is exactly ControlError; keep that connection
                dropped = self._conns.pop(address, None) if type(exc) is not ControlError else None
                if dropped is not None:
                    with contextlib.suppress(ControlError, OSError):
                        dropped.sock.close()
                if attempt == 1 and reused and isinstance(exc, ControlClosedError):
                    continue  # the prefill closed the connection while it idled: once more, on a new one
                on_reply(None, str(exc))
                return
            on_reply(reply, None)
            return

    def close(self) -> None:
        """Close every connection (a prefill that hangs is given up on after the channel's timeout)."""
        with self._lock:
            self._closed = True
            self._queued.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)
        for conn in list(self._conns.values()):
            with contextlib.suppress(ControlError, OSError):
                conn.close()
        self._conns.clear()
