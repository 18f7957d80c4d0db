"""Non-blocking writes: one thread per transport keeps the streams fed with submitted writes and completes them.

NIXL's asynchrony is post, then poll: ``transfer()`` starts a write and
``check_xfer_state`` reports (and, with no progress thread, drives) its
completion. Over UCX ``cma`` the post itself performs the copy, so
``submit_kvcache`` must not post on the caller's thread.

The submitter thread cuts each submitted write into the same byte-balanced
chunks as a blocking write (one per stream) and feeds them, in submission
order, to whichever stream thread is free: a stream that finishes its chunk
takes the next one at once, the next write's if this one's are all taken, so
with writes queued no core waits for another at a write's end (a blocking
write's streams meet at every write's end). While it feeds the streams it
holds the agent's lock, as a blocking write does while posting; other calls
into the agent wait for the queued writes to be posted.

A write is done when every chunk is posted and every handle polled done; then
its notification is sent (NIXL's ``send_notif``, so it follows the data) and
its future completed, in submission order per peer agent, so notifications
arrive in send order. Futures are completed on a separate thread, never
while the lock is held, so a done-callback may call back into the transport.
Errors are typed; a write still in flight at its deadline fails with
:class:`kvwire.TransferTimeoutError`. Over RDMA several writes are in flight
at once this way.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Final

import kvwire
from kvwire.transport import fail_unstarted, queued_behind
from kvwire_nixl.agent import NixlAgent
from kvwire_nixl.errors import translate
from kvwire_nixl.feed import Group, Write, feed
from kvwire_nixl.workers import SerialThread
from kvwire_nixl.xfer import poll_locked, release, release_locked, timed_out

__all__ = ["Job", "Submitter"]

_IDLE_POLL_S: Final = 200e-6  # the longest pause between two polls of writes in flight


@dataclass(eq=False)
class Job:
    """One submitted write: what is fed to the streams, its notification, its future, and its deadline."""

    write: Write
    notification: bytes | None
    timeout_s: float
    future: Future[None] = field(default_factory=Future)
    started: float = 0.0
    behind: bool = False  # failed unstarted behind another write's failure (its own failure fails nothing more)


def _settle(future: Future[None], error: BaseException | None) -> None:
    """Complete ``future`` (on the completer thread: its callbacks run there, never under the agent's lock)."""
    if future.cancelled():  # before its first chunk was posted: nothing to report
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


class Submitter:
    """The thread that posts, polls and completes the submitted writes of one :class:`NixlAgent`."""

    def __init__(self, nixl: NixlAgent, name: str) -> None:
        self._nixl = nixl
        self._cond = threading.Condition()
        self._queue: deque[Job] = deque()
        self._inflight: list[Job] = []  # taken, not completed, in submission order; only the thread touches it
        self._closed = False
        self._completer = SerialThread(f"{name}-done")
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> Future[None]:
        with self._cond:
            if self._closed:
                raise kvwire.TransferError("the NIXL transport is closed; nothing was sent", peer=job.write.session)
            self._queue.append(job)
            self._cond.notify()
        return job.future

    def _take(self) -> list[Job]:
        """The queued jobs (each stays cancellable until its first chunk is posted)."""
        with self._cond:
            if self._closed:
                return []
            jobs = list(self._queue)
            self._queue.clear()
        return jobs

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._queue or self._inflight or self._closed):
                    self._cond.wait()
                if self._closed:
                    return
            work = self._start(self._take())
            try:
                with self._nixl.lock:
                    agent = self._nixl.raw()
                    if work:
                        self._feed(agent, work)
                    self._service(agent)
            except Exception as exc:  # the agent was closed under us (or a bug): fail what is held, typed
                self._abandon(exc)
            if self._inflight:
                with self._cond:
                    if not self._queue and not self._closed:
                        waited = time.monotonic() - min(j.started or time.monotonic() for j in self._inflight)
                        self._cond.wait(timeout=min(_IDLE_POLL_S, waited / 20))

    def _start(self, jobs: list[Job]) -> deque[tuple[Write, Sequence[Group]]]:
        """Cut each job into its chunks (as a blocking write is); its deadline runs from its first post."""
        work: deque[tuple[Write, Sequence[Group]]] = deque()
        for job in jobs:
            job.write.start = partial(self._begin, job)
            work.extend(job.write.chunks(self._nixl.streams))
            self._inflight.append(job)
        return work

    @staticmethod
    def _begin(job: Job) -> bool:
        job.started = time.monotonic()
        return job.future.set_running_or_notify_cancel()

    def _abandon(self, exc: Exception) -> None:
        error = (
            exc
            if isinstance(exc, kvwire.KvwireError)
            else kvwire.TransferError(f"kvwire-nixl's submitter failed ({type(exc).__name__}: {exc})")
        )
        for job in self._inflight:
            job.write.fail(error)
            job.write.unposted = 0
            job.write.pending.clear()
        self._service(None)

    # -- under the agent's lock ----------------------------------------------------

    def _feed(self, agent: Any, work: deque[tuple[Write, Sequence[Group]]]) -> None:
        """Feed ``work`` and the jobs queued meanwhile to the streams; poll and complete between posts."""

        def between() -> float | None:
            self._service(agent)
            work.extend(self._start(self._take()))
            return _IDLE_POLL_S if any(job.write.pending for job in self._inflight) else None

        feed(self._nixl, agent, work, between)

    def _service(self, agent: Any | None) -> None:
        """Poll what is in flight; complete, in order per peer, the writes that are done (``agent``: lock held)."""
        now = time.monotonic()
        blocked: set[str] = set()  # peers with an earlier write not yet complete: later ones wait (notification order)
        for job in list(self._inflight):
            write = job.write
            if write.failure is None and write.pending and agent is not None:
                self._check(agent, job, now)
            if write.unposted or (write.failure is None and write.pending) or write.peer_agent in blocked:
                blocked.add(write.peer_agent)
                continue
            self._inflight.remove(job)
            self._complete(agent, job)
            if isinstance(failed := write.error, kvwire.TransferError) and not job.behind:
                self._fail_queued(write.session, failed)  # not for one failed behind: a retry since is tried

    def _fail_queued(self, session: str, cause: kvwire.TransferError) -> None:
        """Fail the writes to ``session`` not started yet, with ``cause``'s class: nothing of theirs is sent."""
        for job in self._inflight:
            if job.write.session == session and not job.write.begun:
                job.behind = True
                job.write.fail(queued_behind(cause, session))  # its chunks are dropped, not posted
        with self._cond:
            queued = [job for job in self._queue if job.write.session == session]
            for job in queued:
                self._queue.remove(job)
        for job in queued:
            self._completer.submit(partial(fail_unstarted, job.future, queued_behind(cause, session)))

    def _check(self, agent: Any, job: Job, now: float) -> None:
        write = job.write
        try:
            write.pending = poll_locked(self._nixl, agent, write.pending, write.peer_agent, write.session)
        except kvwire.KvwireError as exc:
            write.fail(exc.with_traceback(None))  # its frames would hold the agent alive past close()
            return
        if write.pending and now >= job.started + job.timeout_s:
            write.fail(timed_out(write.peer_agent, write.session, now - job.started))

    def _complete(self, agent: Any | None, job: Job) -> None:
        """Release the write's handles, send its notification if it succeeded, hand its outcome to the completer."""
        write = job.write
        if agent is not None:
            release_locked(self._nixl, write.handles)
        write.handles.clear()  # agent closed: NIXL freed them with it
        write.pending.clear()
        if write.failure is None and job.notification is not None and agent is not None:
            message = job.notification
            with self._nixl.quiet:
                try:
                    agent.send_notif(write.peer_agent, message)
                except Exception as exc:
                    write.fail(translate(exc, "sending a NIXL notification", write.session, posted=True))
        self._completer.submit(partial(_settle, job.future, write.error))

    # -- closing ---------------------------------------------------------------------

    def close(self) -> None:
        """Stop the thread; fail what it had not started and what was still in flight (typed)."""
        with self._cond:
            self._closed = True
            queued = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join(timeout=30)
        unstarted = "the NIXL transport was closed before this write started; nothing was sent"
        for job in queued:
            refused = kvwire.TransferError(unstarted, peer=job.write.session)
            self._completer.submit(partial(fail_unstarted, job.future, refused))
        for job in self._inflight:
            release(self._nixl, job.write.handles)  # what NIXL refuses now is released with the agent
            closed = "the NIXL transport was closed " + (
                "with this write in flight; the destination may be partly written"
                if job.write.begun
                else "before this write started; nothing was sent"
            )
            error = job.write.error or kvwire.TransferError(closed, peer=job.write.session)
            self._completer.submit(partial(_settle, job.future, error))
        self._inflight.clear()
        self._completer.stop(timeout_s=30)
