"""Host memory for KV pages: private anonymous mappings advised to use transparent huge pages.

A cross-process copy (UCX ``cma``, the kernel's ``process_vm_writev``) pins
every destination page it writes; with 4 KiB pages that pinning cost
kvwire-nixl about a quarter of its throughput (``bench/nixl_ceiling.py``).
The bench's pools (:mod:`kvwire.workload.memory`) and the decode side's
landing pages (:mod:`kvwire.landing`) are allocated here.
"""

from __future__ import annotations

import contextlib
import mmap

import numpy as np
from numpy.typing import NDArray

__all__ = ["hugepage_array"]


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
