"""Validation of one request's arguments: page-id arrays, their ranges and repeats, and ``dst_kv_ptrs``.

Each check has a fast path for the common valid input (a few C-level calls,
no per-element Python) and falls back to a slow path only to find and name
the first offending position and value; no check is weaker for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from kvwire.errors import InvalidTransferError
from kvwire.layout.kv_layout import KVLayout
from kvwire.planning.pairing import Namer, Pairing, peer_name

__all__ = ["SMALL", "as_i64", "check_ptrs", "check_range", "index_array", "page_arrays", "raise_repeat"]

_I64 = np.int64
_max = np.maximum.reduce
_INDEX_DTYPES: Final = frozenset(
    np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32)
)
_INT64: Final = np.dtype(np.int64)
_INT32: Final = np.dtype(np.int32)
#: Up to this many ids, checks run on Python lists (cheaper than numpy's per-call cost).
SMALL: Final = 16


def index_array(name: str, value: object) -> NDArray[np.integer[Any]]:
    """``value``, checked to be a 1-D numpy integer array that int64 holds; InvalidTransferError naming ``name``."""
    if type(value) is np.ndarray and value.ndim == 1 and value.dtype in _INDEX_DTYPES:
        return value
    if not isinstance(value, np.ndarray):
        raise InvalidTransferError(f"{name} must be a 1-D numpy integer array, got {type(value).__name__}")
    if value.ndim != 1:
        raise InvalidTransferError(f"{name} must be a 1-D numpy integer array, got shape {value.shape}")
    if value.dtype.kind not in "iu" or not np.can_cast(value.dtype, _I64):
        raise InvalidTransferError(f"{name} must have an integer dtype (int32 or int64), got {value.dtype}")
    return np.asarray(value)  # a subclass (masked, memmap) as a plain array


def as_i64(a: NDArray[np.integer[Any]]) -> NDArray[np.int64]:
    """``a`` as int64 (itself when it is)."""
    return a if a.dtype == _INT64 else a.astype(_I64)  # type: ignore[return-value]


def page_arrays(*arrays: NDArray[np.integer[Any]] | None) -> list[Any]:
    """The page-id arrays of one request in one dtype that validation and runs can work in without copies.

    All int32 (sglang's) stay int32: every valid id is below 2**31, so their
    differences cannot overflow; anything else becomes int64. Run starts are
    widened to int64 before any address arithmetic.
    """
    if all(a is None or a.dtype is _INT32 or a.dtype == _INT32 for a in arrays):
        return list(arrays)
    return [None if a is None else as_i64(a) for a in arrays]


def check_range(
    name: str, idx: NDArray[np.integer[Any]], limit: int, *, layout: KVLayout, ids: Iterable[int], describe: Namer
) -> None:
    """Every id in [0, limit); on failure name the first offender and a buffer (of ``ids``) it overflows.

    ``idx`` is int64 or int32 (see :func:`page_arrays`).
    """
    if idx.shape[0] <= SMALL:
        values = idx.tolist()
        if min(values) >= 0 and max(values) < limit:
            return
    elif idx.dtype == _INT32:
        if _max(idx.view(np.uint32)) < min(limit, 1 << 31):  # negatives wrap to >= 2**31
            return
    elif _max(idx.view(np.uint64)) < limit:  # negatives wrap to >= 2**63
        return
    j = int(np.flatnonzero((idx < 0) | (idx >= limit))[0])
    v = int(idx[j])
    if v < 0:
        raise InvalidTransferError(f"{name}[{j}] = {v} is negative: page ids must be >= 0")
    i = next(i for i in ids if v >= layout.buffers[i].num_pages)
    buf = layout.buffers[i]
    raise InvalidTransferError(f"{name}[{j}] = {v} is out of range: {describe(i, buf)} has {buf.num_pages} pages")


def raise_repeat(name: str, pages: NDArray[np.integer[Any]]) -> None:
    """Raise for the first position of ``pages`` that repeats an earlier one (there must be one)."""
    order = np.argsort(pages, kind="stable")  # equal ids in position order
    ordered = pages[order]
    same = ordered[1:] == ordered[:-1]
    j = int(order[1:][same].min())  # the first position that repeats an earlier id
    v = int(pages[j])
    i = int(order[int(np.searchsorted(ordered, v))])  # its first occurrence
    raise InvalidTransferError(f"{name}[{j}] = {v} repeats {name}[{i}]: a destination page cannot be written twice")


def check_ptrs(pairing: Pairing, dst_kv_ptrs: Sequence[int]) -> None:
    """``dst_kv_ptrs`` are exactly the peer layout's buffer bases, as ints."""
    peer = pairing.peer
    try:
        count = len(dst_kv_ptrs)
    except TypeError:
        raise InvalidTransferError(
            f"dst_kv_ptrs must be a sequence of ints, got {type(dst_kv_ptrs).__name__}"
        ) from None
    if count != len(peer.buffers):
        raise InvalidTransferError(
            f"dst_kv_ptrs has {count} entries, expected {len(peer.buffers)} (one per peer buffer)"
        )
    ptrs = dst_kv_ptrs if type(dst_kv_ptrs) is list else list(dst_kv_ptrs)
    if ptrs == pairing.peer_bases and [*map(type, ptrs)] == pairing.int_types:  # plain ints, all equal
        return
    types = set(map(type, ptrs))
    if ptrs == pairing.peer_bases and all(t is int or issubclass(t, np.integer) for t in types):
        return
    for i, (p, base) in enumerate(zip(ptrs, pairing.peer_bases, strict=True)):
        if isinstance(p, (bool, np.bool_)) or not isinstance(p, (int, np.integer)):
            raise InvalidTransferError(f"dst_kv_ptrs[{i}] = {p!r} must be an int, got {type(p).__name__}")
        if int(p) != base:
            raise InvalidTransferError(
                f"dst_kv_ptrs[{i}] = {int(p)} does not match the peer layout: "
                f"{peer_name(i, peer.buffers[i])} has base {base}"
            )
