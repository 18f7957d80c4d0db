"""A stand-in for kvwire-nixl's ``NixlAgent`` around a stand-in NIXL agent, for driving ``Submitter`` and ``feed``.

One stream: each chunk is posted at once, on the calling thread (the submitter's), so a test decides with
events exactly which write is where. The NIXL agent itself (``get_xfer_descs``, ``transfer``,
``check_xfer_state``, ``send_notif``) is each test's own.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

__all__ = ["OneStream", "run_now"]

A = TypeVar("A")
T = TypeVar("T")


def run_now(fn: Callable[[], T]) -> Future[T]:
    """``fn()`` run here and now, as a completed future (its result or what it raised)."""
    future: Future[T] = Future()
    try:
        future.set_result(fn())
    except BaseException as exc:  # handed over, as a stream thread would
        future.set_exception(exc)
    return future


class OneStream(Generic[A]):
    """``NixlAgent`` as ``Submitter`` and ``feed`` use it: its lock, its quiet context, one stream, ``raw()``."""

    streams = 1

    def __init__(self, agent: A) -> None:
        self.agent = agent
        self.lock = threading.Lock()
        self.quiet = contextlib.nullcontext()

    def raw(self) -> A:
        return self.agent

    def on_stream(self, index: int, fn: Callable[[], list[str]]) -> Future[list[str]]:
        return run_now(fn)

    def leak(self, handle: Any) -> None:
        pass
