"""Worker threads for blocking engine calls, so a caller can stop waiting at its deadline.

A Mooncake call cannot be interrupted (a first contact with a frozen peer
blocks 60 s whatever the settings), so each call runs in a worker and the
caller waits on a future with a timeout.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Final, TypeVar

from kvwire.transport import run_into

__all__ = ["Workers"]

T = TypeVar("T")

#: Keep at most this many idle worker threads per engine.
MAX_IDLE_WORKERS: Final = 8


class Workers:
    """Daemon threads that run blocking engine calls.

    Threads are daemons because a call stuck in the engine must not block
    interpreter exit; one is started whenever no idle thread is free, so a stuck
    call never delays another.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._started = 0
        self._closed = False

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` in a worker; RuntimeError once closed."""
        fut: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("workers are closed")
            spawn = self._idle == 0
            if not spawn:
                self._idle -= 1
            else:
                self._started += 1
                index = self._started
        self._queue.put((fn, fut))
        if spawn:
            threading.Thread(target=self._run, name=f"{self._name}-{index}", daemon=True).start()
        return fut

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, fut = item
            run_into(fut, fn)
            del item, fn, fut
            with self._lock:
                if self._closed or self._idle >= MAX_IDLE_WORKERS:
                    return
                self._idle += 1

    def close(self) -> None:
        """Stop idle threads; busy ones stop when their call returns."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, 0
        for _ in range(idle):
            self._queue.put(None)
