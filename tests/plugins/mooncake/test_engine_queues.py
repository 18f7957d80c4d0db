"""``PeerQueues``: submitted writes per peer, in order, failing fast behind a failed write."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

import kvwire
from kvwire_mooncake.engine.queues import PeerQueues
from kvwire_mooncake.engine.workers import Workers


@pytest.fixture
def queues() -> Iterator[PeerQueues]:
    workers = Workers("test-queues")
    yield PeerQueues(workers)
    workers.close()


def test_jobs_to_one_peer_run_in_order_and_other_peers_side_by_side(queues: PeerQueues) -> None:
    gate, ran = threading.Event(), []

    def slow() -> None:
        gate.wait(10)
        ran.append("a1")

    first = queues.submit("a", slow)
    second = queues.submit("a", lambda: ran.append("a2"))
    other = queues.submit("b", lambda: ran.append("b1"))
    other.result(timeout=10)  # "b" is not behind "a"
    assert ran == ["b1"] and not second.done()
    gate.set()
    second.result(timeout=10)
    assert first.done() and ran == ["b1", "a1", "a2"]


def test_a_failed_write_fails_the_ones_queued_behind_it_without_running_them(queues: PeerQueues) -> None:
    gate, ran = threading.Event(), []

    def dead() -> None:
        gate.wait(10)
        raise kvwire.PeerUnreachableError("peer a is gone (rc=-1)", code=-1, peer="a")

    first = queues.submit("a", dead)
    behind = [queues.submit("a", lambda k=k: ran.append(k)) for k in range(3)]
    gate.set()
    with pytest.raises(kvwire.PeerUnreachableError, match="gone"):
        first.result(timeout=10)
    for future in behind:
        with pytest.raises(kvwire.PeerUnreachableError) as exc:
            future.result(timeout=10)
        assert str(exc.value) == "not started: an earlier write to a failed (peer a is gone (rc=-1)); nothing was sent"
        assert (exc.value.code, exc.value.peer) == (-1, "a")
    assert ran == []
    assert queues.submit("a", lambda: ran.append("later")).result(timeout=10) is None  # a new write is tried
    assert ran == ["later"]


def test_a_queued_job_can_be_cancelled_and_close_fails_the_rest(queues: PeerQueues) -> None:
    gate, ran = threading.Event(), []
    def hold() -> None:
        gate.wait(10)

    running = queues.submit("a", hold)
    cancelled = queues.submit("a", lambda: ran.append("cancelled"))
    queued = queues.submit("a", lambda: ran.append("queued"))
    assert cancelled.cancel()
    queues.close()
    with pytest.raises(kvwire.TransferError, match="closed before this write started; nothing was sent"):
        queued.result(timeout=10)
    with pytest.raises(kvwire.TransferError, match="closed"):
        queues.submit("a", lambda: None)
    gate.set()
    running.result(timeout=10)
    assert ran == []
