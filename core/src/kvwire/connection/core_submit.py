"""The core's ``submit_kvcache``: the implementation that answers for a backend that does not submit natively.

The Connection registers it with every backend, last in line. A backend that
declares ``submit`` answers the hook itself; for any other the Connection calls
the hook without the backend's own implementation, so this one plans the request
now (input errors raise before anything is queued) and runs the blocking send,
then the notification, on the caller's executor or the connection's pool. Either
way a middleware sees each submission once, as ``submit_kvcache``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from kvwire.errors import BackendError
from kvwire.planning.plan import TransferPlan
from kvwire.spec.pluggy_project import hookimpl
from kvwire.spec.request import TransferRequest
from kvwire.submit.futures import TransferFuture
from kvwire.submit.pool import Submissions

__all__ = ["CoreSubmit", "on_executor"]

_EXECUTOR: ContextVar[Executor | None] = ContextVar("kvwire_submit_executor", default=None)


@contextmanager
def on_executor(executor: Executor | None) -> Iterator[None]:
    """While the block runs, a submission made on this thread runs on ``executor`` (None: the pool)."""
    token = _EXECUTOR.set(executor)
    try:
        yield
    finally:
        _EXECUTOR.reset(token)


def _weak(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (a bound method) without keeping its object alive."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        bound = ref()
        if bound is None:
            raise BackendError("the connection was dropped; nothing was sent")
        return bound(*args)

    return call


class CoreSubmit:
    """``submit_kvcache`` over the blocking hooks, on a worker pool (see the module docstring)."""

    def __init__(
        self,
        submissions: Submissions,
        plan: Callable[[str, TransferRequest], TransferPlan],
        send: Callable[[str, TransferRequest], int],
        notify: Callable[[str, bytes], None],
    ) -> None:
        # Weakly: the connection's finalizer holds its hooks, and through them this plugin.
        self._submissions = submissions
        self._plan = _weak(plan)
        self._send = _weak(send)
        self._notify = _weak(notify)

    @hookimpl(trylast=True)
    def submit_kvcache(
        self, session_id: str, request: TransferRequest, notification: bytes | None = None
    ) -> Future[int]:
        plan = self._plan(session_id, request)  # every input error now, before queueing
        future = TransferFuture(session_id, plan.nbytes, len(plan))

        def job() -> int:
            moved: int = self._send(session_id, request)
            if notification is not None:
                self._notify(session_id, notification)
            return moved

        return self._submissions.run(future, job, _EXECUTOR.get())
