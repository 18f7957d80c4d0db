"""``TransferFuture``: the handle :meth:`kvwire.Connection.submit_kvcache` returns.

It is a :class:`concurrent.futures.Future` (``done``, ``result(timeout)``,
``exception``, callbacks, ``asyncio.wrap_future``) whose result is the bytes
moved; a failure is the typed kvwire error. It may follow another future (a
transport's, or a worker pool's): cancelling it cancels that one, which
succeeds only while the transfer has not started.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures._base import CANCELLED
from contextlib import suppress
from typing import Any, TypeVar

from kvwire.errors import TransferError

__all__ = ["TransferFuture", "fail_unstarted", "follow", "queued_behind", "run_into", "start"]

T = TypeVar("T")


class TransferFuture(Future[int]):
    """A submitted transfer: its result is the bytes moved, or it raises the typed kvwire error.

    ``session_id`` is the peer it goes to; ``nbytes`` and ``descriptors`` are
    what was planned (known at submission, before anything moved; None when a
    third-party backend's own future does not say).
    """

    def __init__(self, session_id: str, nbytes: int | None, descriptors: int | None) -> None:
        super().__init__()
        self.session_id = session_id
        self.nbytes = nbytes
        self.descriptors = descriptors
        self._source: Future[Any] | None = None

    def cancel(self) -> bool:
        """Cancel the transfer if it has not started (then True); a started one runs to its end (False).

        A cancelled transfer future is also notified at once, so ``concurrent.futures.wait``
        counts it as done without waiting for a worker that may never pick it up.
        """
        source = self._source
        if source is not None and not source.cancel():
            return False
        if not super().cancel():
            return False
        start(self)  # CANCELLED -> CANCELLED_AND_NOTIFIED (returns False)
        return True

    def __repr__(self) -> str:
        return f"<kvwire.TransferFuture to {self.session_id[:60]!r} {self.nbytes} bytes {self._state.lower()}>"


def follow(
    target: TransferFuture,
    source: Future[T],
    result: Callable[[T], int],
    error: Callable[[BaseException], BaseException] = lambda exc: exc,
) -> TransferFuture:
    """Complete ``target`` when ``source`` completes: ``result(value)``, ``error(exc)``, or cancelled."""
    target._source = source

    def done(fut: Future[T]) -> None:
        if fut.cancelled():
            target.cancel()
            return
        exc = fut.exception()
        if not start(target):
            return
        if exc is not None:
            target.set_exception(error(exc))
            return
        try:
            target.set_result(result(fut.result()))
        except BaseException as wrong:  # a result the spec does not allow, as the error it is
            target.set_exception(error(wrong))

    source.add_done_callback(done)
    return target


def run_into(future: Future[T], fn: Callable[[], T]) -> bool:
    """Run ``fn`` for ``future`` unless it was cancelled first: its result, or what it raised, completes it.

    Returns False when the future had been cancelled (``fn`` never ran). The one place a worker
    turns a queued call into a completed future, for the core's pool and the engines' workers alike.
    """
    if not start(future):
        return False
    try:
        result = fn()
    except BaseException as exc:  # handed to whoever waits on the future
        future.set_exception(exc)
    else:
        future.set_result(result)
    return True


def fail_unstarted(future: Future[Any], error: BaseException) -> None:
    """Fail ``future`` with ``error`` unless it was cancelled (a queued call that will never run)."""
    if start(future):
        future.set_exception(error)


def queued_behind(cause: TransferError, session_id: str) -> TransferError:
    """The error of a write queued behind ``cause`` to ``session_id``, failed without being started.

    Same class, ``code`` and ``peer`` as ``cause`` (a plain :class:`kvwire.TransferError` when a
    subclass's constructor refuses those arguments). Both shipped transports fail the writes
    queued behind a failed one to the same peer with it: they would meet the same dead or frozen
    peer one timeout after another.
    """
    message = f"not started: an earlier write to {session_id} failed ({cause}); nothing was sent"
    try:
        return type(cause)(message, code=cause.code, peer=session_id)
    except TypeError:  # a subclass with a constructor of its own
        return TransferError(message, code=cause.code, peer=session_id)


def start(future: Future[Any]) -> bool:
    """Mark ``future`` running (True), or, when it was cancelled, notified (False), as often as asked.

    ``Future.set_running_or_notify_cancel`` raises for a future already notified of its
    cancellation; here that is one more "cancelled", since :meth:`TransferFuture.cancel` notifies.
    """
    if future.cancelled():
        if future._state == CANCELLED:  # not notified yet (there is no public way to ask)
            with suppress(RuntimeError):  # another thread notified it in between: still cancelled
                future.set_running_or_notify_cancel()
        return False
    return future.set_running_or_notify_cancel()
