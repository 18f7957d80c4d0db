"""The side channel: a decode worker registers its blocks with the prefill worker of the same TP rank.

Built on :mod:`kvwire.control`: JSON lines over TCP with its bounds and deadlines,
and its mutual HMAC handshake when ``KVWIRE_CONTROL_KEY`` is set (required for a
non-loopback ``side_channel_host``). The prefill worker runs a
:class:`RegistrationServer` (one thread accepting, one per decode connection);
each message is answered by the handler it was given, a ``{"error": ...}``
reply for one it refuses. A decode worker keeps one
:class:`~kvwire.control.PeerConnection` per prefill worker in
:class:`RegistrationClient`, used from one thread per prefill so that a slow or
dead prefill never blocks vLLM's step.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvwire.control import Channel, ControlError, ControlTimeoutError, PeerConnection, check_listen_key
from kvwire.control.auth import server_handshake

__all__ = ["Handler", "RegistrationClient", "RegistrationServer", "ReplyCallback"]

log = logging.getLogger("kvwire.compat.vllm")

#: Answers one message from a decode (any exception becomes an ``{"error": ...}`` reply).
Handler = Callable[[dict[str, Any]], dict[str, Any]]
#: Called with the reply, or None and the reason when there is none.
ReplyCallback = Callable[[dict[str, Any] | None, str | None], None]

_POLL_S = 0.2  # how often blocked threads look at the stop flag


class RegistrationServer:
    """Listens on ``host:port`` and answers each decode's messages with ``handler`` until :meth:`close`."""

    def __init__(self, host: str, port: int, handler: Handler, key: bytes | None, timeout_s: float) -> None:
        warning = check_listen_key(host, key, "kv_connector_extra_config['side_channel_host']")
        if warning:
            log.warning("kvwire: %s", warning)
        self._handler = handler
        self._key = key
        self._timeout_s = timeout_s
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
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

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            with self._lock:
                self._conns.add(conn)
            name = f"decode at {peer[0]}:{peer[1]}"
            threading.Thread(
                target=self._serve, args=(conn, name), name="kvwire-vllm-registrations", daemon=True
            ).start()

    def _serve(self, conn: socket.socket, name: str) -> None:
        try:
            server_handshake(conn, self._key, name, self._timeout_s)
            fd = conn.fileno()
            channel = Channel(fd, fd, what=name, timeout_s=self._timeout_s)
            while not self._stop.is_set():
                try:
                    message = channel.read(timeout_s=_POLL_S)
                except ControlTimeoutError as exc:
                    if "stalled" in str(exc):
                        raise
                    continue
                if message.get("cmd") == "quit":
                    channel.send({})
                    return
                try:
                    answer = self._handler(message)
                except Exception as exc:  # the decode learns why; this server keeps serving
                    answer = {"error": f"{type(exc).__name__}: {exc}"}
                channel.send(answer)
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
    """A decode's connections to prefill workers: one connection and one thread per ``host:port``."""

    def __init__(self, key: bytes | None, timeout_s: float) -> None:
        self._key = key
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._threads: dict[tuple[str, int], ThreadPoolExecutor] = {}
        self._conns: dict[tuple[str, int], PeerConnection] = {}
        self._closed = False

    def send(self, host: str, port: int, message: dict[str, Any], on_reply: ReplyCallback) -> None:
        """Send ``message`` to the prefill at ``host:port`` on its thread; ``on_reply`` gets the answer."""
        address = (host, port)
        with self._lock:
            if self._closed:
                on_reply(None, "the connector is shut down")
                return
            pool = self._threads.get(address)
            if pool is None:
                pool = self._threads[address] = ThreadPoolExecutor(1, thread_name_prefix="kvwire-vllm-register")
        pool.submit(self._request, address, message, on_reply)

    def _request(self, address: tuple[str, int], message: dict[str, Any], on_reply: ReplyCallback) -> None:
        what = "the prefill's kvwire side channel"
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
            on_reply(None, str(exc))
            return
        on_reply(reply, None)

    def close(self) -> None:
        """Close every connection (a prefill that hangs is given up on after the channel's timeout)."""
        with self._lock:
            self._closed = True
            pools = list(self._threads.values())
        for pool in pools:
            pool.shutdown(wait=True, cancel_futures=True)
        for conn in list(self._conns.values()):
            with contextlib.suppress(ControlError, OSError):
                conn.close()
        self._conns.clear()
