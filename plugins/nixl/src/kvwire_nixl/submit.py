"""Non-blocking writes: one thread per transport posts submitted writes in order and completes their futures.

NIXL's asynchrony is post, then poll: ``transfer()`` starts a write and
``check_xfer_state`` reports (and, with no progress thread, drives) its
completion. Over UCX ``cma`` the post itself performs the copy, so
``submit_kvcache`` must not post on the caller's thread. The submitter thread
takes submitted writes in order and posts them: one alone across the streams,
like a blocking write; several queued side by side, each whole on its own
stream. It keeps the handles of every posted one, polls them all between posts,
and completes each future when its handles are done: after sending its
notification (NIXL's ``send_notif``, so it follows the data), or with the
typed error, or with :class:`kvwire.TransferTimeoutError` at its deadline.
Over RDMA several writes are in flight at once this way.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import kvwire
from kvwire_nixl.agent import NixlAgent
from kvwire_nixl.xfer import Group, poll, post, post_side_by_side, release, timed_out

__all__ = ["Job", "Submitter"]

_IDLE_POLL_S = 200e-6  # the longest pause between two polls of writes in flight


@dataclass(eq=False)
class Job:
    """One submitted write and, once posted, its handles and deadline."""

    session: str
    peer_agent: str
    groups: list[Group]
    notification: bytes | None
    timeout_s: float
    future: Future[None] = field(default_factory=Future)
    handles: list[Any] = field(default_factory=list)
    pending: list[Any] = field(default_factory=list)
    started: float = 0.0


class Submitter:
    """The thread that posts and completes the writes of one :class:`NixlAgent`."""

    def __init__(self, nixl: NixlAgent, name: str) -> None:
        self._nixl = nixl
        self._cond = threading.Condition()
        self._queue: deque[Job] = deque()
        self._inflight: list[Job] = []  # only the thread touches it
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> Future[None]:
        with self._cond:
            if self._closed:
                raise kvwire.TransferError("the NIXL transport is closed; nothing was sent", peer=job.session)
            self._queue.append(job)
            self._cond.notify()
        return job.future

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._queue or self._inflight or self._closed):
                    self._cond.wait()
                if self._closed:
                    return
                take = min(len(self._queue), self._nixl.streams)  # several queued: side by side
                jobs = [self._queue.popleft() for _ in range(take)]
            self._start(jobs)
            self._poll()
            if self._inflight:
                with self._cond:
                    if not self._queue and not self._closed:
                        waited = time.monotonic() - min(j.started for j in self._inflight)
                        self._cond.wait(timeout=min(_IDLE_POLL_S, waited / 20))

    def _start(self, jobs: list[Job]) -> None:
        """Post one queued write across the streams, or several side by side, one per stream."""
        jobs = [job for job in jobs if job.future.set_running_or_notify_cancel()]  # cancelled: never posted
        if not jobs:
            return
        if len(jobs) == 1:
            job = jobs[0]
            try:
                outcomes: list[tuple[list[Any], list[Any]] | BaseException] = [
                    post(self._nixl, job.groups, job.peer_agent, job.session)
                ]
            except BaseException as exc:
                outcomes = [exc]
        else:
            try:
                outcomes = post_side_by_side(self._nixl, [(j.groups, j.peer_agent, j.session) for j in jobs])
            except BaseException as exc:
                outcomes = [exc] * len(jobs)
        now = time.monotonic()
        for job, outcome in zip(jobs, outcomes):
            if isinstance(outcome, BaseException):
                job.future.set_exception(outcome)
                continue
            job.handles, job.pending = outcome
            job.started = now
            self._inflight.append(job)

    def _poll(self) -> None:
        for job in list(self._inflight):
            try:
                if job.pending:
                    job.pending = poll(self._nixl, job.pending, job.peer_agent, job.session)
                if not job.pending:
                    self._finish(job)
                elif (now := time.monotonic()) >= job.started + job.timeout_s:
                    raise timed_out(job.peer_agent, job.session, now - job.started)
            except BaseException as exc:
                self._end(job)
                job.future.set_exception(exc)

    def _finish(self, job: Job) -> None:
        """The write is done: release it, send its notification (it follows the data), complete the future."""
        self._end(job)
        message = job.notification
        try:
            if message is not None:
                self._nixl.call(
                    "sending a NIXL notification",
                    lambda agent: agent.send_notif(job.peer_agent, message),
                    peer=job.session,
                    posted=True,
                )
        except BaseException as exc:
            job.future.set_exception(exc)
            return
        job.future.set_result(None)

    def _end(self, job: Job) -> None:
        if job in self._inflight:
            self._inflight.remove(job)
        release(self._nixl, job.handles)
        job.handles.clear()

    def close(self) -> None:
        """Stop the thread; fail what it had not started and what was still in flight (typed)."""
        with self._cond:
            self._closed = True
            queued = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join(timeout=30)
        for job in queued:
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(
                    kvwire.TransferError("the NIXL transport was closed before this write started; nothing was sent")
                )
        for job in list(self._inflight):
            self._end(job)
            job.future.set_exception(
                kvwire.TransferError(
                    "the NIXL transport was closed with this write in flight; the destination may be partly written",
                    peer=job.session,
                )
            )
