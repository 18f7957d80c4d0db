"""Non-blocking sends for every backend: the in-flight set, the core's worker pool, and draining at close.

A backend that declares ``submit`` starts transfers itself (its
``submit_kvcache`` hook returns a future); for any other the core runs the
blocking ``send_kvcache`` hook on the caller's ``executor`` or on a small pool
of its own, so every backend, third-party ones included, offers the same API.
Either way the connection hands out a :class:`TransferFuture` and keeps it in
its in-flight set until it completes, so ``close()`` can end every one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from functools import partial
from typing import Final

from kvwire.errors import BackendError
from kvwire.transport.futures import TransferFuture, fail_unstarted, run_into

__all__ = ["DEFAULT_SUBMIT_WORKERS", "Submissions"]

#: Threads of the core's own pool (a caller who wants another bound passes an executor).
DEFAULT_SUBMIT_WORKERS: Final = 4


class Submissions:
    """The transfers of one connection that have not completed, and the pool that runs core-side ones."""

    def __init__(self, name: str, workers: int = DEFAULT_SUBMIT_WORKERS) -> None:
        self._name = name
        self._workers = workers
        self._lock = threading.Lock()
        self._inflight: set[TransferFuture] = set()
        self._pool: ThreadPoolExecutor | None = None
        self.closing = False

    def require_open(self) -> None:
        """BackendError once ``close()`` has begun: checked before a transfer is handed to anyone."""
        if self.closing:
            raise BackendError(f"connection to backend {self._name!r} is closing; nothing was sent")

    def track(self, future: TransferFuture) -> TransferFuture:
        """Keep ``future`` in the in-flight set until it completes."""
        with self._lock:
            if self.closing:
                raise BackendError(f"connection to backend {self._name!r} is closing; nothing was sent")
            self._inflight.add(future)
        future.add_done_callback(self._discard)
        return future

    def _discard(self, future: Future[int]) -> None:
        with self._lock:
            self._inflight.discard(future)

    def run(self, future: TransferFuture, job: Callable[[], int], executor: Executor | None) -> TransferFuture:
        """Run the blocking ``job`` on ``executor`` (or the core's pool) to complete ``future``.

        The future is tracked before it is queued; cancelling it before a worker
        picks it up means the job never runs.
        """
        self.track(future)
        runner = executor or self._own_pool()
        try:
            queued = runner.submit(run_into, future, job)
        except Exception as exc:  # shut down, or an executor of the caller's that refuses work
            future.cancel()
            raise BackendError(
                f"cannot queue the transfer on {type(runner).__name__}: {type(exc).__name__}: {exc}; nothing was sent"
            ) from exc
        queued.add_done_callback(partial(_dropped, future))
        return future

    def _own_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix=f"kvwire-{self._name}-submit")
            return self._pool

    def pending(self) -> list[TransferFuture]:
        with self._lock:
            return list(self._inflight)

    def drain(self, timeout_s: float) -> list[TransferFuture]:
        """Refuse new transfers, cancel those not started, wait up to ``timeout_s`` for the running ones.

        Returns the ones still running after the wait (the backend's close must end them).
        """
        with self._lock:
            self.closing = True
            inflight = list(self._inflight)
        for future in inflight:
            future.cancel()
        wait(inflight, timeout=timeout_s)
        return [f for f in inflight if not f.done()]

    def shutdown(self) -> None:
        """Stop the core's pool (its workers are idle once every transfer has ended)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def _dropped(future: TransferFuture, queued: Future[bool]) -> None:
    """End ``future`` when its executor dropped the job without running it (never leave it pending).

    A ``shutdown(cancel_futures=True)`` cancels the executor's future; a ``ProcessPoolExecutor``
    fails it (the job cannot be pickled). Once the job ran, ``future`` is already done.
    """
    if future.done():
        return
    if queued.cancelled():
        future.cancel()
        return
    exc = queued.exception()
    if exc is not None:
        dropped = f"the executor did not run the transfer ({type(exc).__name__}: {exc}); nothing was sent"
        fail_unstarted(future, BackendError(dropped))
