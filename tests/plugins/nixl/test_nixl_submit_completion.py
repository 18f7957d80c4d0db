"""kvwire-nixl's ``Submitter``: writes complete in submission order per peer, and close() fails the unstarted.

NIXL is replaced by a stand-in agent (as in test_nixl_submitter.py) whose answers are set by events, so which
write is in flight, done or still queued is known exactly; nothing sleeps.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest
from standins import OneStream

import kvwire
from kvwire_nixl.feed import DONE, PROC, Group, Write
from kvwire_nixl.queues import Job, Submitter


class _Handle:
    def __init__(self, name: str) -> None:
        self.name = name

    def release(self) -> None:
        pass


class _Agent:
    """NIXL's calls the submitter makes. Each write is named by its table's address (``names``).

    Posting: the write named ``blocking`` waits inside its post for ``unblock``; every other post returns PROC.
    Polling: ``slow`` stays in flight until ``release_slow``; every other write is done at its first poll,
    and the poll of ``last`` sets ``last_done``.
    """

    def __init__(self, names: dict[int, str], *, blocking: str = "", slow: str = "", last: str = "") -> None:
        self.names = names
        self.blocking, self.slow, self.last = blocking, slow, last
        self.posting = threading.Event()
        self.unblock = threading.Event()
        self.release_slow = threading.Event()
        self.last_done = threading.Event()
        self.posted: list[str] = []
        self.notified: list[tuple[str, bytes]] = []

    def get_xfer_descs(self, table: Any, segment: object) -> Any:
        return table

    def initialize_xfer(self, op: str, local: Any, remote: object, peer: str) -> _Handle:
        return _Handle(self.names[int(local[0, 0])])

    def transfer(self, handle: _Handle) -> str:
        self.posted.append(handle.name)
        if handle.name == self.blocking:
            self.posting.set()
            assert self.unblock.wait(10), "the test never let the blocked post return"
            return DONE
        return PROC

    def check_xfer_state(self, handle: _Handle) -> str:
        if handle.name == self.slow:
            return DONE if self.release_slow.is_set() else PROC
        if handle.name == self.last:
            self.last_done.set()
        return DONE

    def send_notif(self, peer: str, message: bytes) -> None:
        self.notified.append((peer, message))


def _jobs(writes: list[tuple[str, str]]) -> tuple[dict[int, str], list[Job]]:
    """One job per ``(name, peer)``, each with its own table address and the notification ``name``."""
    names: dict[int, str] = {}
    jobs = []
    for k, (name, peer) in enumerate(writes):
        table = np.array([[0x1000 * (k + 1), 64, 0]], np.int64)
        names[0x1000 * (k + 1)] = name
        jobs.append(Job(Write(peer, peer, [Group(table, "DRAM", table, "DRAM")]), name.encode(), timeout_s=10.0))
    return names, jobs


def test_writes_to_one_peer_complete_in_submission_order_when_a_later_one_is_done_first() -> None:
    order = [("w1", "p"), ("w2", "p"), ("q1", "q"), ("w3", "p")]
    names, jobs = _jobs(order)
    agent = _Agent(names, slow="w1", last="w3")
    completed: list[str] = []

    def recorder(name: str) -> Callable[[Future[None]], None]:
        return lambda _: completed.append(name)

    for (name, _peer), job in zip(order, jobs):  # before submission: no job completes before its callback is in place
        job.future.add_done_callback(recorder(name))
    submitter = Submitter(OneStream(agent), "test-order")  # type: ignore[arg-type]
    try:
        futures = [submitter.submit(job) for job in jobs]
        assert agent.last_done.wait(10)  # w2 and w3 are done, w1 still in flight
        agent.release_slow.set()
        assert [f.result(timeout=10) for f in futures] == [None] * 4
    finally:
        agent.release_slow.set()
        submitter.close()
    assert completed == ["q1", "w1", "w2", "w3"]  # another peer's write does not wait for w1; p's follow it
    assert agent.notified == [("q", b"q1"), ("p", b"w1"), ("p", b"w2"), ("p", b"w3")]


def test_close_fails_the_writes_still_queued_without_posting_them() -> None:
    names, jobs = _jobs([("first", "p"), ("a", "p"), ("b", "q"), ("c", "p")])
    agent = _Agent(names, blocking="first")
    submitter = Submitter(OneStream(agent), "test-close")  # type: ignore[arg-type]
    closer = threading.Thread(target=submitter.close)
    try:
        first = submitter.submit(jobs[0])
        assert agent.posting.wait(10)  # the submitter thread is inside the post of the first write
        queued = [submitter.submit(job) for job in jobs[1:]]  # not taken: the thread is busy posting
        closer.start()
        with submitter._cond:  # close() has taken the queue (it notifies after it did)
            assert submitter._cond.wait_for(lambda: submitter._closed, timeout=10)
    finally:
        agent.unblock.set()
        if closer.ident is None:  # failed before close() began
            submitter.close()
        closer.join(timeout=30)
    assert not closer.is_alive()
    assert first.result(timeout=0) is None  # its post returned done: it completes
    for future in queued:
        with pytest.raises(kvwire.TransferError) as exc:
            future.result(timeout=0)  # close() returned: every future is complete
        assert type(exc.value) is kvwire.TransferError
        assert str(exc.value) == "the NIXL transport was closed before this write started; nothing was sent"
    assert [f.exception(timeout=0).peer for f in queued] == ["p", "q", "p"]  # each names its session
    assert agent.posted == ["first"]
    assert agent.notified == [("p", b"first")]
    with pytest.raises(kvwire.TransferError) as refused:
        submitter.submit(_jobs([("late", "p")])[1][0])
    assert str(refused.value) == "the NIXL transport is closed; nothing was sent"
