"""Landing-page credits: which landing pages are free, handed out per request and given back after the scatter.

The decode side owns its landing pages the way it owns its KV pages: it
reserves some for each sender of a request (before the request's page ids go
to the prefill side, where the KV pages are allocated too), and releases them
once it has scattered them. A sender can only write pages the decode side
reserved and told it about, so the bounded landing pool is never overrun;
when too few are free, :meth:`LandingCredits.reserve` says so (None) and the
host sends that request straight into its KV pages (the head-slice path).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire.errors import InvalidTransferError
from kvwire.layout.buffers import KVBuffer, LayoutError
from kvwire.layout.kv_layout import KVLayout
from kvwire.planning.checks import check_range, index_array, raise_repeat

__all__ = ["LandingCredits"]


class LandingCredits:
    """Free and reserved landing pages of one landing pool; thread-safe."""

    def __init__(self, layout: KVLayout) -> None:
        self._layout = layout
        self.pages = layout.buffers[0].num_pages
        if self.pages < 1:
            raise LayoutError("a landing pool needs at least one page")
        self._reserved = np.zeros(self.pages, dtype=np.bool_)
        self._lock = threading.Lock()

    @property
    def free(self) -> int:
        """Landing pages not reserved now."""
        with self._lock:
            return self.pages - int(np.count_nonzero(self._reserved))

    def reserve(self, count: int) -> NDArray[np.int64] | None:
        """``count`` free pages, now reserved: the lowest contiguous range that fits, else the lowest free pages.

        None when fewer than ``count`` are free (nothing is reserved then). A
        contiguous range keeps the sender's write one descriptor per run of
        its own pages and the scatter's reads one slice.
        """
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1:
            raise InvalidTransferError(f"count must be a positive int (landing pages to reserve), got {count!r}")
        n = int(count)
        with self._lock:
            free = ~self._reserved
            if n > int(np.count_nonzero(free)):
                return None
            start = _first_run(free, n)
            pages = np.arange(start, start + n, dtype=np.int64) if start is not None else np.flatnonzero(free)[:n]
            self._reserved[pages] = True
            return pages

    def release(self, pages: NDArray[np.integer[Any]]) -> None:
        """Give back reserved ``pages`` (all of them, or none when one is not reserved: InvalidTransferError)."""
        ids = self.check_reserved("pages", pages)
        with self._lock:
            if not self._reserved[ids].all():  # released by another thread meanwhile
                raise InvalidTransferError(f"pages[{int(np.argmin(self._reserved[ids]))}] is not reserved")
            self._reserved[ids] = False

    def check_reserved(self, name: str, pages: object) -> NDArray[np.int64]:
        """``pages`` as int64: a 1-D integer array of distinct, reserved landing pages (else InvalidTransferError)."""
        ids = index_array(name, pages).astype(np.int64, copy=False)
        if ids.shape[0] == 0:
            return ids
        check_range(name, ids, self.pages, layout=self._layout, ids=range(1), describe=_landing_name)
        if np.unique(ids).shape[0] != ids.shape[0]:
            raise_repeat(name, ids)
        with self._lock:
            held = self._reserved[ids]
        if not held.all():
            j = int(np.argmin(held))
            raise InvalidTransferError(
                f"{name}[{j}] = {int(ids[j])} is not a reserved landing page: reserve() hands pages out, "
                "and each is used until release()"
            )
        return ids


def _landing_name(i: int, buf: KVBuffer) -> str:
    return "the landing pool"


def _first_run(free: NDArray[np.bool_], n: int) -> int | None:
    """Start of the lowest run of at least ``n`` free pages, or None."""
    edges = np.diff(np.concatenate(([0], free.view(np.int8), [0])))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    fits = np.flatnonzero(ends - starts >= n)
    return int(starts[fits[0]]) if fits.size else None
