"""kvwire-nixl's ``Submitter`` after a failed write: the writes queued behind it to that peer fail unstarted.

The same rule as kvwire-mooncake's ``PeerQueues`` (tests/plugins/mooncake/test_engine_queues.py), with
the same error (``kvwire.transport.queued_behind``). NIXL is replaced by a stand-in agent whose post to the
peer ``dead`` blocks until the test lets it fail, so which writes are still queued is known exactly.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest
from standins import OneStream

import kvwire
from kvwire_nixl.feed import DONE, Group, Write
from kvwire_nixl.queues import Job, Submitter


class _Handle:
    def __init__(self, peer: str) -> None:
        self.peer = peer

    def release(self) -> None:
        pass


class _Agent:
    """NIXL's calls the submitter makes; a post to ``dead`` waits for ``fail`` and then reports an error."""

    def __init__(self) -> None:
        self.fail = threading.Event()
        self.posting_dead = threading.Event()
        self.posted: list[str] = []
        self.notified: list[tuple[str, bytes]] = []

    def get_xfer_descs(self, table: object, segment: object) -> object:
        return table

    def initialize_xfer(self, op: str, local: object, remote: object, peer: str) -> _Handle:
        return _Handle(peer)

    def transfer(self, handle: _Handle) -> str:
        self.posted.append(handle.peer)
        if handle.peer == "dead":
            self.posting_dead.set()
            self.fail.wait(10)
            return "ERR"
        return DONE

    def check_xfer_state(self, handle: _Handle) -> str:
        return DONE

    def send_notif(self, peer: str, message: bytes) -> None:
        self.notified.append((peer, message))


class _Nixl(OneStream[_Agent]):
    """One stream around a fresh stand-in agent."""

    def __init__(self) -> None:
        super().__init__(_Agent())


def _job(peer: str, notification: bytes | None = None) -> Job:
    table = np.array([[0x1000, 64, 0]], np.int64)
    return Job(Write(peer, peer, [Group(table, "DRAM", table, "DRAM")]), notification, timeout_s=10.0)


@pytest.fixture
def nixl() -> Iterator[_Nixl]:
    yield _Nixl()


def test_a_failed_write_fails_the_ones_queued_behind_it_to_that_peer_and_no_other(nixl: _Nixl) -> None:
    submitter = Submitter(nixl, "test-submitter")  # type: ignore[arg-type]
    try:
        first = submitter.submit(_job("dead"))
        assert nixl.agent.posting_dead.wait(10)  # the submitter thread is inside the post of the first write
        behind = [submitter.submit(_job("dead", notification=b"n%d" % k)) for k in range(3)]
        other = submitter.submit(_job("alive", notification=b"other"))
        cancelled = submitter.submit(_job("dead"))
        assert cancelled.cancel()
        nixl.agent.fail.set()
        with pytest.raises(kvwire.TransferError) as failed:
            first.result(timeout=10)
        assert str(failed.value) == "NIXL write to dead failed when posted (['ERR'])"
        for future in behind:
            with pytest.raises(kvwire.TransferError) as exc:
                future.result(timeout=10)
            assert str(exc.value) == f"not started: an earlier write to dead failed ({failed.value}); nothing was sent"
            assert exc.value.peer == "dead"
        assert other.result(timeout=10) is None  # another peer's write is not behind the failed one
        assert cancelled.cancelled()
        assert nixl.agent.posted == ["dead", "alive"]  # none of the queued writes to dead was posted
        assert nixl.agent.notified == [("alive", b"other")]
        assert submitter.submit(_job("dead")).exception(timeout=10) is not None  # a later write is tried again
        assert nixl.agent.posted == ["dead", "alive", "dead"]
    finally:
        nixl.agent.fail.set()
        submitter.close()


def test_writes_taken_with_a_failed_one_but_not_yet_begun_are_failed_unposted(nixl: _Nixl) -> None:
    submitter = Submitter(nixl, "test-submitter")  # type: ignore[arg-type]
    try:
        with submitter._cond:  # the thread takes all three at once: B and C are in flight, not begun, behind A
            first = submitter.submit(_job("dead"))
            behind = [submitter.submit(_job("dead", notification=b"n%d" % k)) for k in range(2)]
        assert nixl.agent.posting_dead.wait(10)
        nixl.agent.fail.set()
        with pytest.raises(kvwire.TransferError) as failed:
            first.result(timeout=10)
        for future in behind:
            with pytest.raises(kvwire.TransferError) as exc:
                future.result(timeout=10)
            assert str(exc.value) == f"not started: an earlier write to dead failed ({failed.value}); nothing was sent"
        assert nixl.agent.posted == ["dead"]  # neither was posted
        assert nixl.agent.notified == []
    finally:
        nixl.agent.fail.set()
        submitter.close()


class _TwoStreams(OneStream[_Agent]):
    """Two streams, each a thread: a write to "alive" can be posting while one to "dead" fails."""

    streams = 2

    def __init__(self) -> None:
        super().__init__(_Agent())
        self.pools = [ThreadPoolExecutor(1) for _ in range(2)]

    def on_stream(self, index: int, fn: Callable[[], list[str]]) -> Future[list[str]]:
        return self.pools[index].submit(fn)


def test_a_retry_submitted_after_a_failure_was_reported_is_tried_not_failed_behind_it() -> None:
    """The write failed behind A must not, when it completes, fail what was submitted after A's failure."""
    nixl = _TwoStreams()
    agent = nixl.agent
    alive_posting, alive_go = threading.Event(), threading.Event()
    original = agent.transfer

    def transfer(handle: _Handle) -> str:
        if handle.peer == "alive":
            agent.posted.append("alive")
            alive_posting.set()
            alive_go.wait(10)  # holds its stream: B cannot be posted, nor completed, until released
            return DONE
        return original(handle)

    agent.transfer = transfer  # type: ignore[method-assign]
    submitter = Submitter(nixl, "test-retry")  # type: ignore[arg-type]
    try:
        with submitter._cond:  # A (dead), Y (alive), B (dead) are taken together
            a = submitter.submit(_job("dead"))
            y = submitter.submit(_job("alive"))
            b = submitter.submit(_job("dead"))
        assert agent.posting_dead.wait(10) and alive_posting.wait(10)
        agent.fail.set()
        assert a.exception(timeout=10) is not None  # A's failure is reported; B is failed behind it, not yet completed
        retry = submitter.submit(_job("dead"))  # the caller tries again
        alive_go.set()
        assert y.result(timeout=10) is None
        assert str(b.exception(timeout=10)).startswith("not started: an earlier write to dead failed")
        error = retry.exception(timeout=10)
        assert str(error) == "NIXL write to dead failed when posted (['ERR'])"  # its own failure: it was tried
        assert agent.posted == ["dead", "alive", "dead"]
    finally:
        agent.fail.set()
        alive_go.set()
        submitter.close()
        for pool in nixl.pools:
            pool.shutdown()
