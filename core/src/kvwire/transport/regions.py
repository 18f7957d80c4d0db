"""``RegionSet``: registered memory ranges, and the vectorised check that ranges lie inside them.

A transport must never read or write outside registered memory, whatever a
plan says; engines do not all check (Mooncake's TCP transport reads an
unregistered local source without complaint). One implementation serves every
transport: ranges are kept sorted, and a whole plan is checked with one
``searchsorted``, in arithmetic that cannot overflow.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable

import numpy as np
from numpy.typing import NDArray

from kvwire.errors import InvalidTransferError

__all__ = ["RegionSet"]

_INT64_MAX = int(np.iinfo(np.int64).max)


class RegionSet:
    """Non-overlapping ``[base, base + nbytes)`` ranges; thread-safe.

    :meth:`check` reads the sorted index without the lock: it is replaced in one
    assignment, so a reader never sees a mixed pair.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sizes: dict[int, int] = {}
        empty = np.zeros(0, dtype=np.int64)
        self._index: tuple[NDArray[np.int64], NDArray[np.int64]] = (empty, empty)  # (starts, ends) by start

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, base: object) -> bool:
        return base in self._sizes

    def items(self) -> tuple[tuple[int, int], ...]:
        """``(base, nbytes)`` of every range, by base."""
        with self._lock:
            return tuple(sorted(self._sizes.items()))

    @staticmethod
    def checked_range(base: object, nbytes: object, names: tuple[str, str] = ("base", "nbytes")) -> tuple[int, int]:
        """``(base, nbytes)`` as ints; InvalidTransferError when they are not an address range below 2**63."""
        for name, value in zip(names, (base, nbytes)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise InvalidTransferError(f"{name} must be an int, got {type(value).__name__} {value!r:.100}")
        start, size = int(base), int(nbytes)  # type: ignore[call-overload]
        if not 0 < start <= _INT64_MAX:
            raise InvalidTransferError(f"{names[0]} must be a valid address > 0 and below 2**63, got {start:#x}")
        if not 0 < size <= _INT64_MAX - start:
            raise InvalidTransferError(f"{names[1]} must be > 0 and the range must end below 2**63, got {size}")
        return start, size

    def require_free(self, base: int, nbytes: int) -> None:
        """InvalidTransferError if ``[base, base + nbytes)`` overlaps a range already added."""
        with self._lock:
            self._require_free(base, nbytes)

    def _require_free(self, base: int, nbytes: int) -> None:
        for start, size in self._sizes.items():
            if base < start + size and start < base + nbytes:
                raise InvalidTransferError(
                    f"range [{base:#x}, {base + nbytes:#x}) overlaps the registered range "
                    f"[{start:#x}, {start + size:#x}); unregister it first"
                )

    def add(self, base: int, nbytes: int) -> None:
        """Add a range; InvalidTransferError for a non-address or a range overlapping one already added."""
        base, nbytes = self.checked_range(base, nbytes)
        with self._lock:
            self._require_free(base, nbytes)
            self._sizes[base] = nbytes
            self._reindex()

    def remove(self, base: int) -> None:
        """Remove the range starting at ``base``; InvalidTransferError if there is none."""
        with self._lock:
            if self._sizes.pop(int(base), None) is None:
                raise InvalidTransferError(f"{int(base):#x} is not the start of a registered range")
            self._reindex()

    def clear(self) -> None:
        with self._lock:
            self._sizes.clear()
            self._reindex()

    def _reindex(self) -> None:
        items = sorted(self._sizes.items())
        starts = np.array([a for a, _ in items], dtype=np.int64)
        ends = np.array([a + n for a, n in items], dtype=np.int64)
        self._index = (starts, ends)  # one assignment: readers never see a mixed pair

    @classmethod
    def of(cls, ranges: Iterable[tuple[int, int]]) -> RegionSet:
        """A set of many ``(base, nbytes)`` ranges at once: sorted once, InvalidTransferError on an overlap.

        For a peer's whole table of registered ranges, where adding one by one
        would check every pair.
        """
        regions = cls()
        checked = sorted(cls.checked_range(base, nbytes) for base, nbytes in ranges)
        for (start, size), (nxt, nxt_size) in itertools.pairwise(checked):
            if nxt < start + size:
                raise InvalidTransferError(
                    f"range [{nxt:#x}, {nxt + nxt_size:#x}) overlaps the registered range "
                    f"[{start:#x}, {start + size:#x})"
                )
        regions._sizes = dict(checked)
        regions._reindex()
        return regions

    def first_outside(self, addrs: NDArray[np.int64], lengths: NDArray[np.int64]) -> int | None:
        """The first ``i`` whose ``[addrs[i], addrs[i] + lengths[i])`` lies inside no one range, or None."""
        if addrs.size == 0:
            return None
        starts, ends = self._index
        if starts.size == 0:
            return 0
        idx = np.searchsorted(starts, addrs, side="right") - 1
        ok = (idx >= 0) & (lengths > 0) & (lengths <= ends[np.maximum(idx, 0)] - addrs)  # cannot overflow
        return None if ok.all() else int(np.argmin(ok))

    def check(
        self,
        addrs: NDArray[np.int64],
        lengths: NDArray[np.int64],
        *,
        names: tuple[str, str] = ("src", "length"),
        where: str = "local memory",
    ) -> None:
        """Raise InvalidTransferError unless each ``[addrs[i], addrs[i] + lengths[i])`` is inside one range."""
        i = self.first_outside(addrs, lengths)
        if i is None:
            return
        starts, ends = self._index
        a, n = names
        if starts.size == 0:
            raise InvalidTransferError(
                f"{a}[0] = {int(addrs[0]):#x} is not in registered {where}: nothing is registered"
            )
        j = int(np.searchsorted(starts, addrs[i], side="right")) - 1
        near = f"; nearest registered range [{int(starts[j]):#x}, {int(ends[j]):#x})" if j >= 0 else ""
        raise InvalidTransferError(
            f"{a}[{i}] = {int(addrs[i]):#x} with {n}[{i}] = {int(lengths[i])} is not inside registered {where}{near}"
        )
