"""Submitted writes, one queue per peer, drained in order on the engine's worker threads.

Mooncake's non-blocking calls cannot carry a send safely
(``get_batch_transfer_status`` blocks until done and crashes the process when
asked twice about an id, or about id 0, which ``batch_transfer_async_write``
returns for an unreachable peer; ``transfer_check_status`` sees one descriptor
of a batch). So a submitted write is a job on the daemon workers the engine
already keeps for deadlines. Jobs to one peer run one after another, the next
starting as soon as the previous returns: one write already keeps up to
``max_inflight_per_peer`` descriptors in flight to its peer, so running two at
once would only split that budget and the cores between them; jobs to
different peers run side by side. A job still queued can be cancelled (it
never starts); one that started runs to its end. A write that fails with a
:class:`kvwire.TransferError` fails the jobs queued behind it to that peer at
once, with the same error class and nothing sent: they would meet the same
dead or frozen peer one timeout after another.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

from kvwire.errors import TransferError
from kvwire.transport import fail_unstarted, queued_behind, run_into
from kvwire_mooncake.engine.workers import Workers

__all__ = ["PeerQueues"]

_Job = tuple[Callable[[], None], "Future[None]"]


class PeerQueues:
    """A FIFO of jobs per peer; at most one worker drains each."""

    def __init__(self, workers: Workers) -> None:
        self._workers = workers
        self._lock = threading.Lock()
        self._queues: dict[str, deque[_Job]] = {}
        self._closed = False

    def submit(self, session_id: str, job: Callable[[], None]) -> Future[None]:
        future: Future[None] = Future()
        with self._lock:
            if self._closed:
                raise TransferError("MooncakeEngine is closed; nothing was sent", peer=session_id)
            queue = self._queues.get(session_id)
            start = queue is None
            if queue is None:
                queue = self._queues[session_id] = deque()
            queue.append((job, future))
        if start:
            try:
                self._workers.submit(lambda: self._drain(session_id))
            except RuntimeError:
                self.close()
        return future

    def _drain(self, session_id: str) -> None:
        while True:
            with self._lock:
                queue = self._queues.get(session_id)
                if not queue:
                    self._queues.pop(session_id, None)
                    return
                job, future = queue.popleft()
            if run_into(future, job) and isinstance(failed := future.exception(), TransferError):
                self._fail_queued(session_id, failed)

    def _fail_queued(self, session_id: str, cause: TransferError) -> None:
        """Fail the jobs queued to ``session_id`` now, with ``cause``'s class: nothing of theirs was sent."""
        with self._lock:
            queue = self._queues.get(session_id)
            queued = list(queue) if queue else []
            if queue:
                queue.clear()
        for _, future in queued:
            fail_unstarted(future, queued_behind(cause, session_id))

    def close(self) -> None:
        """Fail every job not yet started (typed); running ones end by their own deadline."""
        with self._lock:
            self._closed = True
            queued = [item for queue in self._queues.values() for item in queue]
            for queue in self._queues.values():
                queue.clear()
        closed = "MooncakeEngine was closed before this write started; nothing was sent"
        for _, future in queued:
            fail_unstarted(future, TransferError(closed))
