"""Landing-page credits: which landing pages are free, and which sender each reserved one is for.

The decode side owns its landing pages the way it owns its KV pages: it
reserves some for each sender of a request (before the request's page ids go
to the prefill side, where the KV pages are allocated too), and releases them
once it has scattered them. A sender can only write pages the decode side
reserved and told it about, so the bounded landing pool is never overrun.
Reservations are all or nothing: when too few pages are free for every
sender, :meth:`LandingCredits.reserve` reserves none and says so (None), and
the host sends that request straight into its KV pages (the head-slice path).
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Sequence
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from kvwire.errors import InvalidTransferError
from kvwire.layout.buffers import KVBuffer, LayoutError
from kvwire.layout.kv_layout import KVLayout
from kvwire.planning.checks import check_range, index_array, raise_repeat

__all__ = ["LandingCredits", "whole_number"]

_FREE: Final = -1
_MAX_SENDER: Final = (1 << 63) - 1  # a page's owner is an int64


def whole_number(name: str, value: object, minimum: int, error: type[Exception] = InvalidTransferError) -> int:
    """``value`` as an int (Python or numpy integer, not a bool) of at least ``minimum``; else ``error`` naming it."""
    if not isinstance(value, bool):
        try:
            number = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
        else:
            if number >= minimum:
                return number
    raise error(f"{name} must be an int >= {minimum}, got {value!r}")


class LandingCredits:
    """The reserved landing pages of one landing pool and the sender each is for; thread-safe."""

    def __init__(self, layout: KVLayout) -> None:
        self._layout = layout
        self.pages = layout.buffers[0].num_pages
        if self.pages < 1:
            raise LayoutError("a landing pool needs at least one page")
        self._owner = np.full(self.pages, _FREE, dtype=np.int64)  # the sender each page is reserved for
        self._held = np.zeros(self.pages, dtype=np.int64)  # scatters reading each page now
        self._lock = threading.Lock()

    @property
    def free(self) -> int:
        """Landing pages not reserved now."""
        with self._lock:
            return int(np.count_nonzero(self._owner == _FREE))

    def reserve(self, count: int, senders: Sequence[int]) -> dict[int, NDArray[np.int64]] | None:
        """``count`` pages for each of ``senders``, or None (nothing reserved) when too few are free now.

        Each sender gets the lowest free range of ``count`` pages when there is
        one, else the lowest free pages: a range keeps the sender's write one
        descriptor per run of its own pages, and the scatter's reads one slice.
        A request that can never fit (``count`` times the senders is more than
        the pool) is an InvalidTransferError, not a None to wait on.
        """
        n = whole_number("count", count, 1)
        owners = [whole_number(f"senders[{i}]", s, 0) for i, s in enumerate(senders)]
        first: dict[int, int] = {}
        for i, owner in enumerate(owners):  # all checked before anything is reserved
            if owner > _MAX_SENDER:
                raise InvalidTransferError(
                    f"senders[{i}] = {owner} is out of range: a sender is an int in 0..{_MAX_SENDER}; nothing was "
                    "reserved"
                )
            j = first.setdefault(owner, i)
            if j != i:
                raise InvalidTransferError(
                    f"senders[{i}] = {owner} repeats senders[{j}]: each sender gets pages of its own; nothing was "
                    "reserved"
                )
        if n * len(owners) > self.pages:
            raise InvalidTransferError(
                f"count = {n} pages for each of {len(owners)} senders is more than the landing pool's "
                f"{self.pages} pages: it can never be reserved; make the pool larger"
            )
        with self._lock:
            if n * len(owners) > int(np.count_nonzero(self._owner == _FREE)):
                return None
            out = {}
            for owner in owners:
                free = self._owner == _FREE
                start = _first_run(free, n)
                pages = np.arange(start, start + n, dtype=np.int64) if start is not None else np.flatnonzero(free)[:n]
                self._owner[pages] = owner
                out[owner] = pages
            return out

    def release(self, pages: NDArray[np.integer[Any]]) -> None:
        """Give back reserved ``pages``: all of them, or none (InvalidTransferError) when one is not reserved or a
        scatter reads it now (:meth:`reserve` could hand it out mid-copy)."""
        ids = self._ids("pages", pages)
        with self._lock:
            self._check_owner("pages", ids, None)
            busy = np.flatnonzero(self._held[ids])
            if busy.size:
                j = int(busy[0])
                raise InvalidTransferError(
                    f"pages[{j}] = {int(ids[j])} is being scattered: release it once scatter() returns; nothing was "
                    "released"
                )
            self._owner[ids] = _FREE

    def hold(self, name: str, pages: object, sender: int) -> NDArray[np.int64]:
        """:meth:`check`, and mark the pages read until :meth:`unhold` (a :meth:`release` meanwhile is refused)."""
        ids = self._ids(name, pages)
        with self._lock:
            self._check_owner(name, ids, sender)
            self._held[ids] += 1
        return ids

    def unhold(self, ids: NDArray[np.int64]) -> None:
        """The read of ``ids`` that :meth:`hold` marked is over."""
        with self._lock:
            self._held[ids] -= 1

    def check(self, name: str, pages: object, sender: int) -> NDArray[np.int64]:
        """``pages`` as int64: distinct landing pages reserved for ``sender`` (else InvalidTransferError)."""
        ids = self._ids(name, pages)
        with self._lock:
            self._check_owner(name, ids, sender)
        return ids

    def _ids(self, name: str, pages: object) -> NDArray[np.int64]:
        ids = index_array(name, pages).astype(np.int64, copy=False)
        if ids.shape[0]:
            check_range(name, ids, self.pages, layout=self._layout, ids=range(1), describe=_landing_name)
            if np.unique(ids).shape[0] != ids.shape[0]:
                raise_repeat(name, ids)
        return ids

    def _check_owner(self, name: str, ids: NDArray[np.int64], sender: int | None) -> None:
        owner = self._owner[ids]
        held = owner != _FREE if sender is None else owner == sender
        if held.all():
            return
        j = int(np.argmin(held))
        if owner[j] == _FREE:
            raise InvalidTransferError(
                f"{name}[{j}] = {int(ids[j])} is not a reserved landing page: reserve() hands pages out, "
                "and each is used until release()"
            )
        raise InvalidTransferError(
            f"{name}[{j}] = {int(ids[j])} is reserved for sender {int(owner[j])}, not sender {sender}: "
            "each sender's pages hold its own heads"
        )


def _landing_name(i: int, buf: KVBuffer) -> str:
    return "the landing pool"


def _first_run(free: NDArray[np.bool_], n: int) -> int | None:
    """Start of the lowest run of at least ``n`` free pages, or None."""
    edges = np.diff(np.concatenate(([0], free.view(np.int8), [0])))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    fits = np.flatnonzero(ends - starts >= n)
    return int(starts[fits[0]]) if fits.size else None
