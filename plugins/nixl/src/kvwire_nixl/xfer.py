"""NIXL descriptor tables for a plan, and the transfer loop (deadline, backoff, release).

A :class:`kvwire.TransferPlan` becomes Nx3 ``int64`` tables ``(address,
length, device)``, handed to NIXL as arrays (it copies them in one
``memcpy``): one table pair per (local segment, remote segment) group, so a
plan over DRAM only, the usual case, is one NIXL transfer per stream.

Streams: with ``streams`` > 1 (see :mod:`kvwire_nixl.options`) a write of at
least 4 MiB per stream is cut into byte-balanced chunks of rows
(:func:`chunks_of`), and stream thread ``i`` prepares and posts chunk ``i`` on
its own UCX worker while the calling thread holds the agent's lock; over
``cma`` the posting thread performs the copy, so the chunks are copied in
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
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any, Final, TypeVar

import numpy as np
from numpy.typing import NDArray

import kvwire
from kvwire_nixl.agent import NixlAgent
from kvwire_nixl.endpoint import Region
from kvwire_nixl.errors import translate
from kvwire_nixl.memory import DRAM, VRAM, Segment

__all__ = [
    "Group",
    "RegionIndex",
    "chunks_of",
    "groups_of",
    "pause",
    "poll",
    "post",
    "post_side_by_side",
    "raw_transfer",
    "release",
    "timed_out",
    "transfer",
]

_SPIN_S: Final = 100e-6
_YIELD_S: Final = 1e-3
_MAX_SLEEP_S: Final = 200e-6
_DONE, _PROC = "DONE", "PROC"
_MIN_CHUNK: Final = 4 << 20  # bytes per stream below which a write is not split further
_T = TypeVar("_T")


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


@dataclass(frozen=True)
class Group:
    """One NIXL transfer: local and remote Nx3 tables and their segments."""

    local: NDArray[np.int64]
    local_segment: Segment
    remote: NDArray[np.int64]
    remote_segment: Segment


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


def chunks_of(groups: Sequence[Group], streams: int, min_chunk: int = _MIN_CHUNK) -> list[list[Group]]:
    """The groups cut into at most ``streams`` byte-balanced chunks of rows, one list of groups per stream.

    No chunk is smaller than ``min_chunk`` bytes (except the only one); every list is non-empty.
    """
    nbytes = sum(int(g.local[:, 1].sum()) for g in groups)
    k = max(1, min(streams, nbytes // max(1, min_chunk)))
    if k == 1:
        return [list(groups)]
    parts: list[list[Group]] = [[] for _ in range(k)]
    for group in groups:
        ends = np.cumsum(group.local[:, 1])
        n = int(ends.shape[0])
        targets = ends[-1] * np.arange(1, k, dtype=np.float64) / k
        cuts = np.minimum(np.searchsorted(ends, targets, side="left") + 1, n)
        bounds = [0, *np.maximum.accumulate(cuts).tolist(), n]
        for i in range(k):
            lo, hi = bounds[i], bounds[i + 1]
            if hi > lo:
                parts[i].append(
                    Group(group.local[lo:hi], group.local_segment, group.remote[lo:hi], group.remote_segment)
                )
    return [part for part in parts if part]


def _prepare(agent: Any, group: Group, peer: str) -> Any:
    local = agent.get_xfer_descs(group.local, group.local_segment)
    remote = agent.get_xfer_descs(group.remote, group.remote_segment)
    return agent.initialize_xfer("WRITE", local, remote, peer)


def _run(nixl: NixlAgent, fns: Sequence[Callable[[], _T]]) -> list[Future[_T]]:
    """Each ``fns[i]`` on stream ``i``, or here when the agent has one stream; holding the lock."""
    if nixl.streams > 1:
        return nixl.on_streams(fns)
    future: Future[_T] = Future()
    try:
        future.set_result(fns[0]())
    except BaseException as exc:  # re-raised by the caller, as from a stream
        future.set_exception(exc)
    return [future]


def _prepare_and_post(
    agent: Any, nixl: NixlAgent, part: Sequence[Group], peer_agent: str, session: str, handles: list[Any]
) -> list[str]:
    """Prepare and post one chunk (on the calling stream's worker); appends its handles, returns their states."""
    with nixl.quiet:
        try:
            for group in part:
                handles.append(_prepare(agent, group, peer_agent))
        except Exception as exc:
            raise translate(exc, "preparing a NIXL write", session, posted=False) from exc.with_traceback(None)
        states = []
        for handle in handles:
            try:
                states.append(str(agent.transfer(handle)))
            except Exception as exc:
                raise translate(exc, "posting a NIXL write", session, posted=True) from exc.with_traceback(None)
        return states


def post(nixl: NixlAgent, groups: Sequence[Group], peer_agent: str, session: str) -> tuple[list[Any], list[Any]]:
    """Prepare and post every group (in chunks, on the streams); ``(all handles, those still in flight)``.

    The lock is held while the chunks are prepared and posted (over ``cma`` that is the copy). On an
    error the handles already made are released before it is raised.
    """
    parts = chunks_of(groups, nixl.streams)
    handles: list[list[Any]] = [[] for _ in parts]

    def made() -> list[Any]:
        return [h for part_handles in handles for h in part_handles]

    try:
        with nixl.lock:
            agent = nixl.raw()
            futures = _run(
                nixl,
                [partial(_prepare_and_post, agent, nixl, p, peer_agent, session, h) for p, h in zip(parts, handles)],
            )
        errors = [e for f in futures if (e := f.exception()) is not None]
        if errors:
            first = errors[0]
            if isinstance(first, kvwire.InvalidTransferError) and len(errors) < len(futures):
                raise kvwire.TransferError(
                    f"{first}; other chunks of this write were posted: the destination may be partly written",
                    peer=session,
                )
            raise first
        pending = []
        for part_handles, future in zip(handles, futures):
            for handle, state in zip(part_handles, future.result()):
                if state == _PROC:
                    pending.append(handle)
                elif state != _DONE:
                    raise kvwire.TransferError(f"NIXL write to {peer_agent} failed when posted ({state})", peer=session)
    except BaseException:
        release(nixl, made())
        raise
    return made(), pending


def post_side_by_side(
    nixl: NixlAgent, writes: Sequence[tuple[Sequence[Group], str, str]]
) -> list[tuple[list[Any], list[Any]] | BaseException]:
    """Post several writes at once, each whole on its own stream: per write ``(handles, in flight)`` or its error.

    For queued submissions: ``(groups, peer agent, session)`` each, at most one per stream. A write
    delayed by the caller's other work (planning the next request, on a 2-core machine) then holds up
    only itself, where one write cut across every stream would wait for its slowest chunk.
    """
    handles: list[list[Any]] = [[] for _ in writes]
    with nixl.lock:
        agent = nixl.raw()
        posts = [partial(_prepare_and_post, agent, nixl, g, p, s, h) for (g, p, s), h in zip(writes, handles)]
        futures = _run(nixl, posts)
    out: list[tuple[list[Any], list[Any]] | BaseException] = []
    for (_, peer, session), made, future in zip(writes, handles, futures):
        exc = future.exception()
        if exc is None:
            states = future.result()
            if all(state in (_DONE, _PROC) for state in states):
                out.append((made, [h for h, state in zip(made, states) if state == _PROC]))
                continue
            exc = kvwire.TransferError(f"NIXL write to {peer} failed when posted ({states})", peer=session)
        release(nixl, made)
        out.append(exc)
    return out


def poll(nixl: NixlAgent, pending: Sequence[Any], peer_agent: str, session: str) -> list[Any]:
    """One look at ``pending`` (which also progresses the worker); the handles still in flight."""
    with nixl.quiet, nixl.lock:
        agent = nixl.raw()
        try:
            states = [agent.check_xfer_state(h) for h in pending]
        except Exception as exc:
            raise translate(exc, "a NIXL write", session, posted=True) from exc.with_traceback(None)
    if any(s not in (_DONE, _PROC) for s in states):
        raise kvwire.TransferError(f"NIXL write to {peer_agent} failed ({states})", peer=session)
    return [h for h, s in zip(pending, states) if s == _PROC]


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
    """Release every handle; one NIXL refuses (still in flight) is kept and released at close."""
    with nixl.quiet, nixl.lock:
        for handle in handles:
            try:
                handle.release()
            except Exception:
                nixl.leak(handle)


def _raw_part(agent: Any, part: Sequence[Group], peer_agent: str) -> None:
    """The bare NIXL calls for one chunk: prepare, post, poll without pause, release."""
    handles = [_prepare(agent, g, peer_agent) for g in part]
    try:
        states = [agent.transfer(h) for h in handles]
        for i, handle in enumerate(handles):
            while states[i] == _PROC:
                states[i] = agent.check_xfer_state(handle)
        if any(s != _DONE for s in states):
            raise kvwire.TransferError(f"NIXL write to {peer_agent} failed ({states})")
    finally:
        for handle in handles:
            handle.release()


def raw_transfer(nixl: NixlAgent, groups: Sequence[Group], peer_agent: str) -> None:
    """The bare NIXL calls on the same chunks and stream threads as :func:`transfer`; no deadline.

    The lock is held throughout; each chunk is prepared, posted, polled without pause and released by
    its stream (by this thread with one stream).
    """
    with nixl.lock:
        agent = nixl.raw()
        futures = _run(nixl, [partial(_raw_part, agent, part, peer_agent) for part in chunks_of(groups, nixl.streams)])
    for future in futures:
        future.result()
