"""``TransferPlan``: the flat descriptors one request turns into (what a transport writes).

Planning writes a plan's three arrays into one ``(3, capacity)`` int64 slab
taken from a small per-thread pool (:func:`output_slab`), so that a steady
stream of requests does not page-fault fresh memory for every plan. Ownership
is Python's: a plan's arrays are read-only views that keep their slab alive,
and a slab is written again only once nothing but the pool refers to it (no
plan, chunk or other view of it is left), exactly when a freed array's memory
could be reused by the allocator. Code that hands a plan's raw addresses to an
engine must keep the plan alive until the engine is done, as with any array.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

import numpy as np
from numpy.typing import NDArray

from kvwire.errors import InvalidTransferError

__all__ = ["TransferPlan", "constant_lengths", "frozen", "output_slab", "readonly_const", "trusted_plan"]

_EMPTY_I64: Final[NDArray[np.int64]] = np.zeros(0, dtype=np.int64)
_EMPTY_I64.setflags(write=False)


def frozen(a: NDArray[np.int64]) -> NDArray[np.int64]:
    """``a``, made read-only."""
    a.setflags(write=False)
    return a


def readonly_const(values: NDArray[np.int64]) -> NDArray[np.int64]:
    """A copy of ``values`` on immutable memory (no one can make it writeable again): safe to share."""
    return np.frombuffer(np.ascontiguousarray(values, dtype=np.int64).tobytes(), dtype=np.int64)


#: Slabs kept per thread, and the largest pooled plan (descriptors; about 6 MiB a slab): bigger plans
#: get their own arrays, so a pool holds at most ~25 MiB per planning thread.
POOL_SLABS: Final = 4
POOL_MAX_DESCRIPTORS: Final = 1 << 18
_MIN_CAPACITY: Final = 256


class _Pool(threading.local):
    def __init__(self) -> None:
        self.slabs: list[NDArray[np.int64]] = []


_pool = _Pool()


def _unshared_refcount() -> int:
    """What ``sys.getrefcount`` says, in :func:`output_slab`'s loop, of an array only the pool refers to.

    Measured in this interpreter rather than assumed (it may differ between
    Python versions); 0 disables pooling where counts are not reliable (a
    free-threaded build).
    """
    if not getattr(sys, "_is_gil_enabled", lambda: True)():
        return 0
    probe = [np.empty(1)]
    for a in probe:
        return sys.getrefcount(a)
    return 0


_UNSHARED: Final = _unshared_refcount()


def output_slab(count: int) -> NDArray[np.int64]:
    """A writable ``(3, >= count)`` int64 slab that nothing else refers to.

    A pooled slab is reused only when its reference count shows the pool as its
    only holder (a live plan's views hold it). The pool is thread-local: a slab
    is only ever handed out by the thread whose pool holds it.
    """
    slabs = _pool.slabs
    for slab in slabs:  # the same loop as _unshared_refcount's (no enumerate: its result tuple holds a reference)
        if slab.shape[1] >= count and sys.getrefcount(slab) == _UNSHARED:
            return slab
    if count > POOL_MAX_DESCRIPTORS or not _UNSHARED:
        return np.empty((3, count), dtype=np.int64)
    slab = np.empty((3, max(_MIN_CAPACITY, 1 << (count - 1).bit_length())), dtype=np.int64)
    if len(slabs) >= POOL_SLABS:  # forget the oldest: a plan still using it keeps it alive
        del slabs[0]
    slabs.append(slab)
    return slab


_constants: dict[int, NDArray[np.int64]] = {}
_CONSTANT_VALUES: Final = 8
_constants_lock = threading.Lock()


def constant_lengths(value: int, count: int) -> NDArray[np.int64]:
    """``count`` copies of ``value``, read-only, on immutable memory shared between plans.

    For plans whose descriptors all have one length (head slices; runs of one
    page): no per-plan writes. A few values are kept, each grown to the largest
    count asked (up to the pool's limit; larger counts get their own array).
    """
    shared = _constants.get(value)
    if shared is not None and shared.shape[0] >= count:
        return shared[:count]
    if count > POOL_MAX_DESCRIPTORS:
        return readonly_const(np.full(count, value, dtype=np.int64))
    shared = readonly_const(np.full(max(_MIN_CAPACITY, 1 << (count - 1).bit_length()), value, dtype=np.int64))
    with _constants_lock:  # a racing thread may have stored its own: either array is right
        if value not in _constants and len(_constants) >= _CONSTANT_VALUES:
            del _constants[next(iter(_constants))]
        _constants[value] = shared
    return shared[:count]


def trusted_plan(
    src: NDArray[np.int64], dst: NDArray[np.int64], length: NDArray[np.int64], descriptors_before: int
) -> TransferPlan:
    """A :class:`TransferPlan` of arrays planning built (1-D, equal length, int64, read-only): no re-checks."""
    plan = object.__new__(TransferPlan)
    fields = plan.__dict__  # a frozen dataclass: its fields live in the instance dict
    fields["src"] = src
    fields["dst"] = dst
    fields["length"] = length
    fields["descriptors_before"] = descriptors_before
    return plan


@dataclass(frozen=True, eq=False)
class TransferPlan:
    """Flat descriptors: copy ``length[i]`` bytes from address ``src[i]`` to address ``dst[i]``.

    The arrays are int64 and read-only. ``descriptors_before`` is how many
    descriptors there would be if every page of every buffer pair were its own
    (for a head-sliced plan, every token's head slice of every pair; the
    coalescing ratio is ``descriptors_before / len(plan)``). Equality is
    identity (the fields are arrays).
    """

    src: NDArray[np.int64]
    dst: NDArray[np.int64]
    length: NDArray[np.int64]
    descriptors_before: int

    def __post_init__(self) -> None:
        n = self.src.shape
        if self.src.ndim != 1 or self.dst.shape != n or self.length.shape != n:
            raise InvalidTransferError(
                f"TransferPlan: src, dst and length must be 1-D of equal length, got shapes "
                f"{self.src.shape}, {self.dst.shape}, {self.length.shape}"
            )

    def __len__(self) -> int:
        """Number of descriptors."""
        return int(self.src.shape[0])

    @property
    def nbytes(self) -> int:
        """Total bytes the plan moves."""
        return int(self.length.sum())

    def chunks(self, max_descriptors: int) -> Iterator[TransferPlan]:
        """Consecutive slices of at most ``max_descriptors`` descriptors (views, no copies).

        For engines that cap the batch size. An empty plan yields no chunk.
        Each chunk keeps the whole plan's ``descriptors_before``. A bad
        ``max_descriptors`` raises here, not when the first chunk is taken.
        """
        if isinstance(max_descriptors, bool) or not isinstance(max_descriptors, (int, np.integer)):
            raise InvalidTransferError(
                f"max_descriptors must be an int, got {type(max_descriptors).__name__} {max_descriptors!r}"
            )
        if max_descriptors < 1:
            raise InvalidTransferError(f"max_descriptors must be >= 1, got {max_descriptors}")
        step = int(max_descriptors)
        return (  # checked above, now, not on the first next()
            TransferPlan(
                self.src[i : i + step], self.dst[i : i + step], self.length[i : i + step], self.descriptors_before
            )
            for i in range(0, len(self), step)
        )

    @classmethod
    def empty(cls) -> TransferPlan:
        """A plan with no descriptors (an empty request is valid)."""
        return cls(_EMPTY_I64, _EMPTY_I64, _EMPTY_I64, 0)
