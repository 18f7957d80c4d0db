"""A deadline around every backend call: a backend that never returns cannot hold its caller.

The Connection runs each hook call on one of its call threads while the caller
waits at most ``timeout_s + CALL_GRACE_S``. A backend is required to end each
call within ``timeout_s`` (a transfer by then fails with
:class:`kvwire.TransferTimeoutError`); the grace covers its own bookkeeping.
Past the deadline the caller gets :class:`kvwire.TransferTimeoutError` naming
the backend and the hook. Python cannot stop the call itself: it keeps its
thread and stays listed in :attr:`kvwire.Connection.stuck_calls` until it
returns, while the connection goes on serving other calls (other peers).

Threads are reused: a finished call's thread waits for the next one (at most
:data:`MAX_IDLE_THREADS` wait); a stuck call's thread is replaced, not waited for,
and at :data:`MAX_STUCK_CALLS` stuck at once new calls are refused, so a backend
that never returns cannot make the process start threads without bound.
"""

from __future__ import annotations

import contextvars
import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from kvwire.errors import BackendError, TransferTimeoutError

__all__ = ["CALL_GRACE_S", "MAX_IDLE_THREADS", "MAX_STUCK_CALLS", "CallThreads", "StuckCall"]

#: Seconds a backend call may run past ``BackendConfig.timeout_s`` before its caller gets TransferTimeoutError.
CALL_GRACE_S: Final = 2.0
#: Call threads kept waiting for the next call; more concurrent callers get fresh threads.
MAX_IDLE_THREADS: Final = 8
#: Calls past their deadline a connection tolerates at once: each holds a thread, so past this many new
#: calls are refused at once (BackendError) until some return, instead of taking one more thread each.
MAX_STUCK_CALLS: Final = 64

T = TypeVar("T")
_Answer = tuple[bool, Any, contextvars.Context]
_Job = tuple[contextvars.Context, Callable[[], Any], "queue.SimpleQueue[_Answer]", int]
_UNSET: Final = object()
_ids = itertools.count(1)


@dataclass(frozen=True)
class StuckCall:
    """A backend call that outlived its deadline and has not returned yet."""

    hook: str
    peer: str | None
    started: float  # time.monotonic() when the call began
    thread: str

    def running_s(self) -> float:
        """Seconds since the call began."""
        return time.monotonic() - self.started

    def __str__(self) -> str:
        to = f" to {self.peer!r}" if self.peer else ""
        return f"{self.hook}{to}, running {self.running_s():.1f} s on thread {self.thread!r}"


class CallThreads:
    """The threads one connection runs its backend calls on, each call under a deadline."""

    def __init__(self, backend: str, deadline_s: float) -> None:
        self._backend = backend
        self.deadline_s = deadline_s
        self._lock = threading.RLock()  # close() may run from a finalizer, in a GC inside a locked block
        self._idle: list[queue.SimpleQueue[_Job | None]] = []
        self._running: dict[int, tuple[str, str | None, float, str]] = {}
        self._stuck: set[int] = set()
        self._closed = False

    @property
    def stuck(self) -> tuple[StuckCall, ...]:
        """The calls past their deadline that are still running, oldest first."""
        with self._lock:
            calls = [StuckCall(*self._running[i]) for i in sorted(self._stuck)]
        return tuple(calls)

    def call(self, hook: str, peer: str | None, fn: Callable[[], T]) -> T:
        """``fn()`` (the hook call) on a call thread, in a copy of the caller's context; its result or exception.

        What the call sets in its context variables is set in the caller's when it returns.

        Raises TransferTimeoutError when it has not returned within the deadline.
        """
        reply: queue.SimpleQueue[_Answer] = queue.SimpleQueue()
        call_id = next(_ids)
        with self._lock:
            if len(self._stuck) >= MAX_STUCK_CALLS:
                raise BackendError(
                    f"backend {self._backend!r}: {len(self._stuck)} calls are still running past their deadline "
                    f"(the most a connection lets hold a thread); {hook}() was not called. They are listed in "
                    "Connection.stuck_calls; the backend must end every call within timeout_s"
                )
            inbox = self._idle.pop() if self._idle else None
            fresh = inbox is None
            if inbox is None:
                inbox = queue.SimpleQueue()
            thread = f"kvwire-call-{self._backend}-{call_id}" if fresh else ""
            self._running[call_id] = (hook, peer, time.monotonic(), thread)
        inbox.put((contextvars.copy_context(), fn, reply, call_id))
        if fresh:
            threading.Thread(target=self._serve, args=(inbox,), name=thread, daemon=True).start()
        try:
            answer = reply.get(timeout=self.deadline_s)
        except queue.Empty:
            with self._lock:
                late = call_id not in self._running  # it returned between the wait and the lock
                if not late:
                    self._stuck.add(call_id)
            if not late:
                raise self._timeout(hook, peer) from None
            answer = reply.get()
        ok, value, context = answer
        for var, set_there in context.items():  # what the call set in its context, the caller now sees
            if var.get(_UNSET) is not set_there:
                var.set(set_there)
        if ok:
            return value  # type: ignore[no-any-return]
        raise value

    def _timeout(self, hook: str, peer: str | None) -> TransferTimeoutError:
        stuck = self.stuck
        return TransferTimeoutError(
            f"backend {self._backend!r}: {hook}() did not return within {self.deadline_s:g} s (timeout_s plus "
            f"{CALL_GRACE_S:g} s grace); it keeps running on its own thread and the connection serves other "
            f"calls. {len(stuck)} call(s) past their deadline: {'; '.join(map(str, stuck))}. A backend must "
            "end every call within timeout_s: report this to its authors",
            peer=peer,
        )

    def _serve(self, inbox: queue.SimpleQueue[_Job | None]) -> None:
        name = threading.current_thread().name
        while (job := inbox.get()) is not None:
            context, fn, reply, call_id = job
            with self._lock:
                hook, peer, started, _ = self._running[call_id]
                self._running[call_id] = (hook, peer, started, name)
            try:
                result: _Answer = (True, context.run(fn), context)
            except BaseException as exc:  # handed to the caller, who raises it
                result = (False, exc, context)
            reply.put(result)
            del result, job, fn, context  # nothing of the call outlives it on this thread
            with self._lock:
                self._running.pop(call_id, None)
                self._stuck.discard(call_id)
                if self._closed or len(self._idle) >= MAX_IDLE_THREADS:
                    return
                self._idle.append(inbox)

    def close(self) -> None:
        """End the idle threads; a stuck one ends when its call returns."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for inbox in idle:
            inbox.put(None)
