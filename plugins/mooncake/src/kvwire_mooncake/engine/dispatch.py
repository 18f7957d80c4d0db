"""One write's engine calls: chunked, bounded in flight per peer, each in a worker under a deadline.

More than about 2060 descriptors outstanding to one peer fail with ``-1`` and
can leave the session broken for that engine, so a write is cut into calls of
at most ``max_descriptors_per_call`` and the descriptors in flight to one peer
are bounded across threads (``max_inflight_per_peer``). A call past its
deadline is abandoned, not cancelled (the engine cannot be interrupted): its
peer's later calls wait for it to return instead of piling up behind it.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass
from typing import Final

from kvwire.errors import TransferError, TransferTimeoutError
from kvwire_mooncake.engine.slots import Slot, Slots
from kvwire_mooncake.engine.workers import Workers

__all__ = ["Chunk", "Dispatcher", "Outcome", "Peer"]

#: ``(first, end)`` descriptor indices of one engine call.
Chunk = tuple[int, int]
#: Source, destination and length lists of a whole write (pybind11 converts lists ~3x faster than arrays).
Lists = tuple[list[int], list[int], list[int]]

#: Mooncake's own rule for the time a batch may take: its timeout plus 1 s per GiB.
BYTES_PER_SECOND_ALLOWANCE: Final = float(1 << 30)


@dataclass(eq=False)
class Peer:
    """Per-session bookkeeping: descriptors in flight, calls abandoned in the engine, last renewal."""

    inflight: int = 0
    stuck: int = 0
    last_renewal: float = -math.inf
    forgotten: bool = False  # dropped when its last call returns


@dataclass(eq=False)
class _Call:
    """One engine call; ``abandoned``/``finished`` are guarded by the lock."""

    slot: Slot
    peer: Peer
    session_id: str
    count: int
    nbytes: int
    submitted: float = 0.0
    abandoned: bool = False
    finished: bool = False


@dataclass(frozen=True)
class Outcome:
    """Result of one failed chunk: engine code and seconds in the engine; rc None = Python deadline hit."""

    rc: int | None
    elapsed: float
    slot: Slot
    chunk: Chunk


class Dispatcher:
    """Runs chunks on :class:`Workers` through the current sending slot, within each peer's budget.

    ``cond`` is the wrapper's condition (over its state lock); :meth:`close`
    wakes writers waiting for budget.
    """

    def __init__(
        self, cond: threading.Condition, slots: Slots, workers: Workers, *, timeout_s: float, max_inflight: int
    ) -> None:
        self._cond = cond
        self._slots = slots
        self._workers = workers
        self._timeout = timeout_s
        self._limit = max_inflight
        self._peers: dict[str, Peer] = {}
        self.closed = False

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def peer(self, session_id: str) -> Peer:
        with self._cond:
            peer = self._peers.get(session_id)
            if peer is None:
                peer = self._peers[session_id] = Peer()
            peer.forgotten = False
            return peer

    def forget(self, session_id: str) -> None:
        """Drop the session's bookkeeping now, or when its last call returns (a stuck call still blocks it)."""
        with self._cond:
            peer = self._peers.get(session_id)
            if peer is None:
                return
            if peer.inflight or peer.stuck:
                peer.forgotten = True
            else:
                del self._peers[session_id]

    def run(
        self, session_id: str, peer: Peer, chunks: list[Chunk], nbytes: Mapping[Chunk, int], lists: Lists
    ) -> tuple[list[Outcome], list[Chunk]]:
        """Run the chunks, concurrently as the in-flight budget allows.

        Returns the failed calls and the chunks not sent because one had failed
        (both empty on success). Raises TransferTimeoutError if the in-flight
        budget stayed full for ``timeout_s`` or the peer has a call stuck in the engine.
        """
        timeout, limit = self._timeout, self._limit
        started: list[tuple[_Call, Future[tuple[int, float]], Chunk]] = []
        failed: list[Outcome] = []
        budget_error: TransferError | None = None
        unsent: list[Chunk] = []
        for k, chunk in enumerate(chunks):
            count = chunk[1] - chunk[0]
            if any(f.done() and (f.exception() is not None or f.result()[0] != 0) for _, f, _ in started):
                unsent = chunks[k:]
                break  # a call already failed: do not send more
            with self._cond:
                # Wait for room in the peer's budget, and for any call abandoned in the engine
                # (past its deadline) to return: no new call joins one that is stuck.
                room = limit - count
                ready = lambda: self.closed or (peer.stuck == 0 and peer.inflight <= room)  # noqa: B023, E731
                if not self._cond.wait_for(ready, timeout):
                    if peer.stuck:
                        why = "an earlier write to it passed its deadline and is still inside the engine"
                    else:
                        why = f"{peer.inflight} descriptors stayed in flight (max_inflight_per_peer={limit})"
                    budget_error = TransferTimeoutError(
                        f"waited {timeout:g} s to send to {session_id}: {why}", peer=session_id
                    )
                    break
                if self.closed:
                    budget_error = TransferError("MooncakeEngine was closed during the write", peer=session_id)
                    break
                peer.inflight += count
                slot = self._slots.pin()
            call = _Call(slot, peer, session_id, count, nbytes[chunk], time.monotonic())
            a, b = chunk
            args = (lists[0][a:b], lists[1][a:b], lists[2][a:b])
            try:
                fut = self._workers.submit(functools.partial(self._engine_call, call, args))
            except RuntimeError:
                self._finish(call)
                budget_error = TransferError("MooncakeEngine was closed during the write", peer=session_id)
                break
            started.append((call, fut, chunk))

        first_exc: BaseException | None = None
        for call, fut, chunk in started:
            # Mooncake's own allowance: the timeout plus 1 s per GiB, from submission.
            deadline = call.submitted + timeout + call.nbytes / BYTES_PER_SECOND_ALLOWANCE
            try:
                rc, elapsed = fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeoutError:
                with self._cond:
                    if not call.finished:
                        call.abandoned = True
                        peer.stuck += 1
                if call.abandoned:
                    failed.append(Outcome(None, time.monotonic() - call.submitted, call.slot, chunk))
                    continue
                rc, elapsed = fut.result()
            except BaseException as exc:  # the binding raised (e.g. TypeError); keep the first
                first_exc = first_exc or exc
                continue
            if rc != 0:
                failed.append(Outcome(rc, elapsed, call.slot, chunk))
        if first_exc is not None:
            message = f"Mooncake batch_transfer_sync_write raised {first_exc!r}"
            raise TransferError(message, peer=session_id) from first_exc
        if not failed and budget_error is not None:
            raise budget_error
        return failed, unsent

    def _engine_call(self, call: _Call, args: Lists) -> tuple[int, float]:
        """Runs in a worker: one ``batch_transfer_sync_write``; always releases budget and slot."""
        try:
            engine = call.slot.engine
            if engine is None:
                return -1, 0.0
            t0 = time.monotonic()
            rc = int(engine.batch_transfer_sync_write(call.session_id, *args))
            elapsed = time.monotonic() - t0
            if rc == 0:
                with self._cond:
                    call.slot.succeeded.add(call.session_id)
                    call.slot.forgotten.discard(call.session_id)  # back in use: no longer counts as gone
            return rc, elapsed
        finally:
            self._finish(call)

    def _finish(self, call: _Call) -> None:
        with self._cond:
            call.finished = True
            peer = call.peer
            if call.abandoned:
                peer.stuck -= 1
            peer.inflight -= call.count
            if peer.forgotten and not (peer.inflight or peer.stuck) and self._peers.get(call.session_id) is peer:
                del self._peers[call.session_id]
            self._cond.notify_all()
        self._slots.release(call.slot)
