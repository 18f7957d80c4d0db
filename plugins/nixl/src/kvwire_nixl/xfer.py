"""NIXL descriptor tables for a plan, and the transfer loop (deadline, backoff, release).

A :class:`kvwire.TransferPlan` becomes Nx3 ``int64`` tables ``(address,
length, device)``, handed to NIXL as arrays (it copies them in one
``memcpy``): one table pair per (local segment, remote segment) group, so a
plan over DRAM only, the usual case, is one NIXL transfer.

Waiting: the initiator's NIXL offers no completion wait, only
``check_xfer_state``, which also progresses the UCX worker (with no progress
thread, that *is* the transfer's engine). The loop polls without pause for
the first millisecond, then yields the CPU between polls (``sleep(0)``), and
after 10 ms sleeps up to 200 µs between polls, so a slow peer never costs a
spinning core; it ends at the deadline.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

import kvwire
from kvwire_nixl.agent import NixlAgent
from kvwire_nixl.endpoint import Region
from kvwire_nixl.errors import translate
from kvwire_nixl.memory import DRAM, VRAM, Segment

__all__ = ["Group", "RegionIndex", "groups_of", "raw_transfer", "transfer"]

_SPIN_S: Final = 100e-6
_YIELD_S: Final = 1e-3
_MAX_SLEEP_S: Final = 200e-6
_DONE, _PROC = "DONE", "PROC"


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


def _prepare(agent: Any, group: Group, peer: str) -> Any:
    local = agent.get_xfer_descs(group.local, group.local_segment)
    remote = agent.get_xfer_descs(group.remote, group.remote_segment)
    return agent.initialize_xfer("WRITE", local, remote, peer)


def _post(agent: Any, handle: Any) -> str:
    return str(agent.transfer(handle))


def transfer(nixl: NixlAgent, groups: Sequence[Group], peer_agent: str, session: str, deadline: float) -> None:
    """Write every group to ``peer_agent``; a kvwire error on failure, TransferTimeoutError at ``deadline``."""
    handles: list[Any] = []
    pending: list[Any] = []
    try:
        for group in groups:
            prepare = partial(_prepare, group=group, peer=peer_agent)
            handles.append(nixl.call("preparing a NIXL write", prepare, peer=session))
        for handle in handles:
            state: str = nixl.call("posting a NIXL write", partial(_post, handle=handle), peer=session, posted=True)
            if state == _PROC:
                pending.append(handle)
            elif state != _DONE:
                raise kvwire.TransferError(f"NIXL write to {peer_agent} failed when posted ({state})", peer=session)
        _wait(nixl, pending, peer_agent, session, deadline)
    finally:
        _release(nixl, handles)
        handles.clear()
        pending.clear()


def _wait(nixl: NixlAgent, pending: list[Any], peer_agent: str, session: str, deadline: float) -> None:
    start = time.monotonic()
    lock = nixl.lock
    while pending:
        with nixl.quiet, lock:
            agent = nixl.raw()
            try:
                states = [agent.check_xfer_state(h) for h in pending]
            except Exception as exc:
                raise translate(exc, "a NIXL write", session, posted=True) from exc.with_traceback(None)
        if any(s not in (_DONE, _PROC) for s in states):
            raise kvwire.TransferError(f"NIXL write to {peer_agent} failed ({states})", peer=session)
        pending[:] = [h for h, s in zip(pending, states) if s == _PROC]
        if not pending:
            return
        now = time.monotonic()
        if now >= deadline:
            raise kvwire.TransferTimeoutError(
                f"NIXL write to {peer_agent} did not complete within the timeout "
                f"({now - start:.2f} s waited); the destination may be partly written",
                peer=session,
            )
        waited = now - start
        if waited >= _YIELD_S:
            time.sleep(min(_MAX_SLEEP_S, waited / 20))
        elif waited >= _SPIN_S:
            time.sleep(0)


def _release(nixl: NixlAgent, handles: list[Any]) -> None:
    """Release every handle; one NIXL refuses (still in flight) is kept and released at close."""
    with nixl.quiet, nixl.lock:
        for handle in handles:
            try:
                handle.release()
            except Exception:
                nixl.leak(handle)


def raw_transfer(nixl: NixlAgent, groups: Sequence[Group], peer_agent: str) -> None:
    """The bare NIXL calls on the same tables: prepare, post, poll without pause, release; no deadline."""
    with nixl.lock:
        agent = nixl.raw()
        handles = [_prepare(agent, g, peer_agent) for g in groups]
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
            handles.clear()
