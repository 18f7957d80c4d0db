"""Mooncake's notify: kvwire's notifications on Mooncake's own mechanism.

``batch_transfer_sync(..., notify=TransferNotify(name, msg))`` sends the
notification once the whole batch has completed (over TCP: applied at the
destination), before the call returns, on a new connection to the peer's
handshake listener; the peer's ``get_notifies()`` drains what arrived. A batch
of one zero-length descriptor carries a notification alone (its addresses are
not used). Measured on this binding (0.3.13): 1,500 of 1,500 notifications
were seen only after their data, in send order; ``msg`` is a JSON string, so
non-UTF-8 bytes are mangled: kvwire sends ``kvwire1:`` + base64 and ignores
anything else. A notification that fails to send is not reported (the call
still returns 0): Mooncake offers no delivery receipt.

The engine keeps what arrived, without limit, until ``get_notifies()``: so
:class:`Received` drains it every :data:`DRAIN_INTERVAL_S` into a bounded
:class:`kvwire.transport.Inbox`, and a receiver that never polls holds at most
:data:`kvwire.transport.MAX_UNPOLLED_NOTIFICATIONS` (the oldest dropped, counted),
as on every kvwire backend.
"""

from __future__ import annotations

import base64
import binascii
import threading
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any, Final

from kvwire import MAX_NOTIFICATION_BYTES
from kvwire.errors import TransferError, TransferTimeoutError, UnsupportedFeatureError
from kvwire.transport import Inbox
from kvwire_mooncake.engine.periodic import Periodic
from kvwire_mooncake.engine.slots import Slots
from kvwire_mooncake.engine.workers import Workers

__all__ = ["DRAIN_INTERVAL_S", "PREFIX", "Received", "decode", "deliver", "encode", "received", "send"]

#: Marks kvwire's messages among whatever else reaches the engine's notify queue.
PREFIX: Final = "kvwire1:"
#: Seconds between two drains of the engine's notify queue into the bounded inbox.
DRAIN_INTERVAL_S: Final = 0.05


def _binding() -> Any:
    try:
        from mooncake import engine as binding
    except ImportError as exc:  # an engine double, or an engine without the notify API
        raise UnsupportedFeatureError(f"the Mooncake engine binding offers no notifications ({exc})") from exc
    if not hasattr(binding, "TransferNotify"):
        raise UnsupportedFeatureError("this Mooncake engine binding has no TransferNotify (upgrade mooncake)")
    return binding


def encode(message: bytes) -> str:
    return PREFIX + base64.b64encode(message).decode("ascii")


def decode(text: str) -> bytes | None:
    """The message kvwire encoded, or None for anything else."""
    if not text.startswith(PREFIX):
        return None
    try:
        return base64.b64decode(text[len(PREFIX) :], validate=True)
    except (binascii.Error, ValueError):
        return None


def send(engine: Any, session_id: str, sender: str, message: bytes, src: int) -> int:
    """One notification to ``session_id`` as ``sender``, on a zero-length write from local ``src``; the rc."""
    binding = _binding()
    note = binding.TransferNotify(sender, encode(message))
    return int(engine.batch_transfer_sync(session_id, [src], [src], [0], binding.TransferOpcode.Write, note))


def deliver(
    slots: Slots, workers: Workers, session_id: str, sender: str, message: bytes, src: int, timeout_s: float
) -> None:
    """:func:`send` through the current sending engine, in a worker, within ``timeout_s``; kvwire errors."""
    with slots.lock:
        slot = slots.pin()

    def call() -> int:
        try:
            engine = slot.engine
            return -1 if engine is None else send(engine, session_id, sender, message, src)
        finally:
            slots.release(slot)

    try:
        pending = workers.submit(call)
    except RuntimeError:  # the workers are closed: the call never ran, so its slot is released here
        slots.release(slot)
        raise TransferError("MooncakeEngine is closed", peer=session_id) from None
    try:
        rc = pending.result(timeout=timeout_s)
    except FutureTimeoutError:
        raise TransferTimeoutError(
            f"the notification to {session_id} was not sent within {timeout_s:g} s", peer=session_id
        ) from None
    if rc != 0:
        raise TransferError(
            f"Mooncake could not send the notification to {session_id} (rc={rc})", code=rc, peer=session_id
        )


def received(engine: Any) -> list[tuple[str, bytes]]:
    """``(sender, message)`` of every kvwire notification the engine received since the last call."""
    get = getattr(engine, "get_notifies", None)
    if get is None:
        raise UnsupportedFeatureError("this Mooncake engine has no get_notifies (an engine double, or too old)")
    out: list[tuple[str, bytes]] = []
    for note in get():
        try:
            name, text = str(note.name), str(note.msg)
        except UnicodeDecodeError:  # not kvwire's: kvwire sends ASCII
            continue
        message = decode(text)
        if message is not None and len(message) <= MAX_NOTIFICATION_BYTES:  # longer: not one kvwire sent
            out.append((name, message))
    return out


class Received:
    """The kvwire notifications an engine received, drained into a bounded inbox by a thread.

    ``engine_of()`` is the receiving engine (None once closed). Only for an
    engine kvwire owns: a host's engine may carry the host's own notifications,
    which draining would take from it.
    """

    def __init__(self, engine_of: Callable[[], Any], name: str) -> None:
        self.inbox: Inbox[tuple[str, bytes]] = Inbox()
        self._engine_of = engine_of
        self._lock = threading.Lock()  # one get_notifies at a time: arrival order is kept
        self._drainer = Periodic(self.pull, f"{name}-notifications", DRAIN_INTERVAL_S)  # stops when pull is False

    def pull(self) -> bool:
        """Move what the engine received into the inbox; False when there is no engine any more."""
        with self._lock:
            engine = self._engine_of()
            if engine is None:
                return False
            self.inbox.extend(received(engine))
            return True

    def take(self) -> list[tuple[str, bytes]]:
        """Every notification received since the last call, oldest first."""
        self.pull()
        return self.inbox.drain()

    def close(self) -> None:
        """Stop draining (idempotent); waits for a drain in progress."""
        self._drainer.close()
