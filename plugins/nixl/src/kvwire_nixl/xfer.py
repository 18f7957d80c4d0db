"""NIXL descriptor tables for a plan, and the transfer loop (deadline, backoff, release).

A :class:`kvwire.TransferPlan` becomes Nx3 ``int64`` tables ``(address,
length, device)``, handed to NIXL as arrays (it copies them in one
``memcpy``): one table pair per (local segment, remote segment) group, so a
plan over DRAM only, the usual case, is one NIXL transfer per chunk.

Streams: with ``streams`` > 1 (see :mod:`kvwire_nixl.options`) a write of at
least 4 MiB per stream is cut into byte-balanced chunks of rows, and each
chunk is prepared and posted by the first free stream thread, on its own UCX
worker, while the calling thread holds the agent's lock (:mod:`kvwire_nixl.feed`);
over ``cma`` the posting thread performs the copy, so the chunks are copied in
parallel. :func:`raw_transfer` uses the very same chunks and threads.

Waiting: the initiator's NIXL offers no completion wait, only
``check_xfer_state``, which also progresses the UCX worker (with no progress
thread, that *is* the transfer's engine). The loop polls without pause for
the first millisecond, then yields the CPU between polls (``sleep(0)``), and
after 10 ms sleeps up to 200 µs between polls, so a slow peer never costs a
spinning core; it ends at the deadline.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

import kvwire
from kvwire_nixl.agent import NixlAgent
from kvwire_nixl.endpoint import Region
from kvwire_nixl.errors import translate
from kvwire_nixl.feed import DONE, PROC, Group, Write, feed, prepare
from kvwire_nixl.memory import DRAM, VRAM, Segment

__all__ = [
    "RegionIndex",
    "groups_of",
    "pause",
    "poll",
    "poll_locked",
    "post",
    "raw_transfer",
    "release",
    "release_locked",
    "timed_out",
    "transfer",
]

_SPIN_S: Final = 100e-6
_YIELD_S: Final = 1e-3
_MAX_SLEEP_S: Final = 200e-6


@dataclass(frozen=True)
class RegionIndex:
    """Registered regions sorted by base, for mapping addresses to (segment, device).

    Whether an address lies inside a region is :class:`kvwire.RegionSet`'s check.
    """

    starts: NDArray[np.int64]
    keys: NDArray[np.int64]  # segment code * 2**16 + device, per region
    uniform: int | None  # the one key of every region, when they share it

    @classmethod
    def of(cls, regions: Sequence[Region]) -> RegionIndex:
        ordered = sorted(regions, key=lambda r: r.base)
        keys = np.array([_key(r.segment, r.device) for r in ordered], dtype=np.int64)
        uniform = int(keys[0]) if keys.size and (keys == keys[0]).all() else None
        starts = np.array([r.base for r in ordered], dtype=np.int64)
        return cls(starts, keys, uniform)

    def keys_of(self, addresses: NDArray[np.int64]) -> NDArray[np.int64] | int:
        """Each address's region key (addresses are inside regions: checked before)."""
        if self.uniform is not None:
            return self.uniform
        idx = np.searchsorted(self.starts, addresses, side="right") - 1
        return self.keys[np.maximum(idx, 0)]


def _key(segment: Segment, device: int) -> int:
    return (1 if segment == VRAM else 0) << 16 | device


def _segment(key: int) -> tuple[Segment, int]:
    return (VRAM if key >> 16 else DRAM), key & 0xFFFF


def _table(addr: NDArray[np.int64], length: NDArray[np.int64], device: int | NDArray[np.int64]) -> NDArray[np.int64]:
    table = np.empty((addr.shape[0], 3), dtype=np.int64)
    table[:, 0] = addr
    table[:, 1] = length
    table[:, 2] = device
    return table


def groups_of(plan: kvwire.TransferPlan, local: RegionIndex, remote: RegionIndex) -> list[Group]:
    """The plan's descriptors as NIXL tables, one group per (local, remote) segment pair."""
    lkeys, rkeys = local.keys_of(plan.src), remote.keys_of(plan.dst)
    if isinstance(lkeys, int) and isinstance(rkeys, int):
        (lseg, ldev), (rseg, rdev) = _segment(lkeys), _segment(rkeys)
        return [Group(_table(plan.src, plan.length, ldev), lseg, _table(plan.dst, plan.length, rdev), rseg)]
    n = len(plan)
    lk = np.broadcast_to(np.asarray(lkeys, dtype=np.int64), (n,))
    rk = np.broadcast_to(np.asarray(rkeys, dtype=np.int64), (n,))
    combined = lk << 20 | rk
    groups = []
    for value in np.unique(combined):
        rows = np.flatnonzero(combined == value)
        (lseg, ldev), (rseg, rdev) = _segment(int(value) >> 20), _segment(int(value) & 0xFFFFF)
        length = plan.length[rows]
        groups.append(Group(_table(plan.src[rows], length, ldev), lseg, _table(plan.dst[rows], length, rdev), rseg))
    return groups


def post(nixl: NixlAgent, groups: Sequence[Group], peer_agent: str, session: str) -> tuple[list[Any], list[Any]]:
    """Prepare and post every group (in chunks, fed to the streams); ``(all handles, those still in flight)``.

    The lock is held while the chunks are prepared and posted (over ``cma`` that is the copy). On an
    error the handles already made are released before it is raised.
    """
    write = Write(session, peer_agent, groups)
    try:
        with nixl.lock:
            feed(nixl, nixl.raw(), deque(write.chunks(nixl.streams)))
        if (error := write.error) is not None:
            raise error
    except BaseException:
        release(nixl, write.handles)
        raise
    return write.handles, write.pending


def poll(nixl: NixlAgent, pending: Sequence[Any], peer_agent: str, session: str) -> list[Any]:
    """One look at ``pending`` (which also progresses the worker); the handles still in flight."""
    with nixl.lock:
        return poll_locked(nixl, nixl.raw(), pending, peer_agent, session)


def poll_locked(nixl: NixlAgent, agent: Any, pending: Sequence[Any], peer_agent: str, session: str) -> list[Any]:
    """:func:`poll`, by the holder of ``nixl.lock``; a failed write raises its kvwire error."""
    with nixl.quiet:
        try:
            states = [agent.check_xfer_state(h) for h in pending]
        except Exception as exc:
            raise translate(exc, "a NIXL write", session, posted=True) from exc.with_traceback(None)
    if any(s not in (DONE, PROC) for s in states):
        raise kvwire.TransferError(f"NIXL write to {peer_agent} failed ({states})", peer=session)
    return [h for h, s in zip(pending, states) if s == PROC]


def timed_out(peer_agent: str, session: str, waited: float) -> kvwire.TransferTimeoutError:
    return kvwire.TransferTimeoutError(
        f"NIXL write to {peer_agent} did not complete within the timeout "
        f"({waited:.2f} s waited); the destination may be partly written",
        peer=session,
    )


def pause(waited: float) -> None:
    """Between two polls, after ``waited`` seconds of polling: spin at first, then yield, then sleep up to 200 µs."""
    if waited >= _YIELD_S:
        time.sleep(min(_MAX_SLEEP_S, waited / 20))
    elif waited >= _SPIN_S:
        time.sleep(0)


def transfer(nixl: NixlAgent, groups: Sequence[Group], peer_agent: str, session: str, deadline: float) -> None:
    """Write every group to ``peer_agent``; a kvwire error on failure, TransferTimeoutError at ``deadline``.

    The lock is held while the chunks are prepared and posted (over ``cma`` that is the copy), then
    taken for each poll of what is still in flight.
    """
    handles, pending = post(nixl, groups, peer_agent, session)
    try:
        start = time.monotonic()
        while pending:
            pending = poll(nixl, pending, peer_agent, session)
            if not pending:
                return
            now = time.monotonic()
            if now >= deadline:
                raise timed_out(peer_agent, session, now - start)
            pause(now - start)
    finally:
        release(nixl, handles)


def release(nixl: NixlAgent, handles: Sequence[Any]) -> None:
    """Release every handle (taking the lock); one NIXL refuses (still in flight) is kept and released at close."""
    with nixl.lock:
        release_locked(nixl, handles)


def release_locked(nixl: NixlAgent, handles: Sequence[Any]) -> None:
    """:func:`release`, by the holder of ``nixl.lock``."""
    with nixl.quiet:
        for handle in handles:
            try:
                handle.release()
            except Exception:
                nixl.leak(handle)


def _raw_post(
    agent: Any, nixl: NixlAgent, part: Sequence[Group], peer_agent: str, session: str, handles: list[Any]
) -> list[str]:
    """The bare NIXL calls for one chunk: prepare, post, poll without pause, release."""
    made = [prepare(agent, g, peer_agent) for g in part]
    try:
        states = [agent.transfer(h) for h in made]
        for i, handle in enumerate(made):
            while states[i] == PROC:
                states[i] = agent.check_xfer_state(handle)
        return [str(state) for state in states]
    finally:
        for handle in made:
            handle.release()


def raw_transfer(nixl: NixlAgent, groups: Sequence[Group], peer_agent: str) -> None:
    """The bare NIXL calls on the same chunks and stream threads as :func:`transfer`; no deadline.

    The lock is held throughout; each chunk is prepared, posted, polled without pause and released by
    the stream that takes it (by this thread with one stream).
    """
    write = Write(peer_agent, peer_agent, groups)
    with nixl.lock:
        feed(nixl, nixl.raw(), deque(write.chunks(nixl.streams)), post=_raw_post)
    if (error := write.error) is not None:
        raise error
