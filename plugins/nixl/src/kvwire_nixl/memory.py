"""Which NIXL memory segment an address belongs to: ``VRAM`` for CUDA device memory, else ``DRAM``.

NIXL must be told the kind of every registered range and of every descriptor.
kvwire decides it from the memory itself (the CUDA driver's
``cuPointerGetAttribute``), not from the layout's ``memory`` label: a layout
marks buffers ``"device"`` to say which page ids address them (HiSparse), and
the contract kit marks host memory that way. Without a CUDA driver, or
without a CUDA context in the process, nothing is device memory.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Final, Literal

__all__ = ["DRAM", "VRAM", "Segment", "cuda_pointer_query", "segment_of"]

Segment = Literal["DRAM", "VRAM"]
DRAM: Final = "DRAM"
VRAM: Final = "VRAM"

#: ``query(attribute, address) -> value or None`` (None: the driver does not know the address).
PointerQuery = Callable[[int, int], "int | None"]

_CU_POINTER_ATTRIBUTE_MEMORY_TYPE: Final = 2
_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: Final = 9
_CU_MEMORYTYPE_DEVICE: Final = 2


@functools.lru_cache(maxsize=1)
def cuda_pointer_query() -> PointerQuery | None:
    """``cuPointerGetAttribute`` of the CUDA driver, or None where there is no driver (loaded lazily, once)."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        get = driver.cuPointerGetAttribute
    except (OSError, AttributeError):
        return None
    get.restype = ctypes.c_int
    get.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_ulonglong]

    def query(attribute: int, address: int) -> int | None:
        value = ctypes.c_int(0)
        rc = get(ctypes.byref(value), attribute, address)
        return int(value.value) if rc == 0 else None

    return query


def segment_of(address: int, query: PointerQuery | None = None) -> tuple[Segment, int]:
    """``(segment, device id)`` of ``address``: ``("VRAM", ordinal)`` for CUDA device memory, else ``("DRAM", 0)``."""
    query = query or cuda_pointer_query()
    if query is None or query(_CU_POINTER_ATTRIBUTE_MEMORY_TYPE, address) != _CU_MEMORYTYPE_DEVICE:
        return DRAM, 0
    return VRAM, query(_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, address) or 0
