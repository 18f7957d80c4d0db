"""Host memory for KV pages: huge-page mappings, and arrays over host memory known by address.

A cross-process copy (UCX ``cma``, the kernel's ``process_vm_writev``) pins
every destination page it writes; with 4 KiB pages that pinning cost
kvwire-nixl about a quarter of its throughput (``bench/nixl_ceiling.py``).
The bench's pools (:mod:`kvwire.workload.memory`) and the decode side's
landing pages (:mod:`kvwire.landing`) are allocated here.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = ["host_bytes", "hugepage_array"]


def hugepage_array(num_pages: int, page_bytes: int) -> NDArray[np.uint8]:
    """A ``(num_pages, page_bytes)`` uint8 array over a private anonymous mapping advised MADV_HUGEPAGE.

    Private: a shared anonymous mapping is shmem, which gets huge pages only
    where ``shmem_enabled`` allows (not by default). The array keeps the
    mapping alive.
    """
    region = mmap.mmap(-1, num_pages * page_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # no madvise / THP: plain pages are fine
        region.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(region, np.uint8).reshape(num_pages, page_bytes)


def host_bytes(base: int, count: int, item: int, dtype: Any = np.uint8) -> NDArray[Any]:
    """The host memory ``base .. base + count * item`` as ``count`` rows of ``item`` bytes, no copy.

    ``dtype``: ``np.uint8`` gives a (count, item) byte array; a ``item``-byte
    dtype (``np.dtype((np.void, item))``) gives ``count`` items. The memory
    must be this process's and outlive the array: nothing here can check that.
    """
    memory = memoryview((ctypes.c_char * (count * item)).from_address(base)).cast("B")
    array = np.frombuffer(memory, dtype=dtype)
    return array.reshape(count, item) if array.dtype.itemsize == 1 else array
