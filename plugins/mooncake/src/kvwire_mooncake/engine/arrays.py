"""Validation of the address arrays a write is given (the registered ranges are a ``kvwire.RegionSet``).

Over TCP Mooncake reads a local source that was never registered without
complaint, so the wrapper checks every source against its ``RegionSet``; the
arrays themselves are checked here first: 1-D, integer, int64-sized, positive.
"""

from __future__ import annotations

from typing import Final

import numpy as np
from numpy.typing import NDArray

from kvwire.errors import InvalidTransferError

__all__ = ["INT64_MAX", "as_addresses", "require_positive", "write_arrays"]

INT64_MAX: Final = int(np.iinfo(np.int64).max)


def as_addresses(value: object, name: str) -> NDArray[np.int64]:
    """``value`` as a 1-D int64 array, or InvalidTransferError naming ``name``."""
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise InvalidTransferError(f"{name} must be a 1-D array, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise InvalidTransferError(f"{name} must have an integer dtype (int64), got {arr.dtype}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > INT64_MAX:
        i = int(np.argmax(arr > INT64_MAX))
        raise InvalidTransferError(f"{name}[{i}] = {int(arr[i])} does not fit in int64")
    return arr.astype(np.int64, copy=False)


def require_positive(arr: NDArray[np.int64], name: str) -> None:
    """InvalidTransferError naming the first element of ``arr`` that is <= 0."""
    bad = arr <= 0
    if bad.any():
        i = int(np.argmax(bad))
        raise InvalidTransferError(f"{name}[{i}] = {int(arr[i])} must be > 0")


def write_arrays(
    src: object, dst: object, length: object
) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
    """``src``, ``dst`` and ``length`` of one write: 1-D int64 arrays of one size, every value > 0 (when
    not empty), no ``dst + length`` past int64; InvalidTransferError naming the argument otherwise."""
    s, d, n = as_addresses(src, "src"), as_addresses(dst, "dst"), as_addresses(length, "length")
    if not s.shape == d.shape == n.shape:
        raise InvalidTransferError(
            f"src, dst and length must have the same length, got {s.size}, {d.size} and {n.size}"
        )
    if s.size:
        require_positive(s, "src")
        require_positive(d, "dst")
        require_positive(n, "length")
        too_far = n > INT64_MAX - d
        if too_far.any():
            i = int(np.argmax(too_far))
            raise InvalidTransferError(f"dst[{i}] + length[{i}] overflows int64")
    return s, d, n
