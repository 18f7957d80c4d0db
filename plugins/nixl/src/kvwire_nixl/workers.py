"""``SerialThread``: one daemon thread running the callables handed to it, in order, each into a future.

kvwire-nixl's stream threads (each posts chunks on its own UCX worker) and the
submitter's completer (it completes futures away from the agent's lock) are
both this.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from kvwire.transport import run_into

__all__ = ["SerialThread"]

_T = TypeVar("_T")
_Task = tuple[Callable[[], Any], "Future[Any]"]


class SerialThread:
    """Runs each submitted callable on its own thread, in submission order, until :meth:`stop`."""

    def __init__(self, name: str) -> None:
        self._tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (task := self._tasks.get()) is not None:
            fn, future = task
            run_into(future, fn)  # a cancelled task does not run
            del task, fn, future

    def submit(self, fn: Callable[[], _T]) -> Future[_T]:
        future: Future[_T] = Future()
        self._tasks.put((fn, future))
        return future

    def stop(self, timeout_s: float) -> None:
        """Run what was submitted before, then end the thread (waiting up to ``timeout_s`` for it)."""
        self._tasks.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
