"""Buffers described from what a host holds: numpy arrays and torch tensors (torch is never imported)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvwire.layout.buffers import LayoutError, MemoryKind

__all__ = ["describe_array", "memory_per_buffer"]


def memory_per_buffer(memory: MemoryKind | Sequence[MemoryKind], count: int) -> list[MemoryKind]:
    if isinstance(memory, str):
        return [memory] * count
    kinds = list(memory)
    if len(kinds) != count:
        raise LayoutError(f"memory: expected {count} memory kinds (one per buffer), got {len(kinds)}")
    return kinds


def describe_array(obj: Any, what: str) -> tuple[int, int, int, MemoryKind]:
    """(base, page_bytes, num_pages, memory) of a numpy array or torch tensor; first dim = pages."""
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise LayoutError(f"{what} must be C-contiguous")
        if obj.ndim < 1 or obj.shape[0] == 0:
            raise LayoutError(f"{what} must have at least one page (first dimension), got shape {obj.shape}")
        return int(obj.ctypes.data), obj.nbytes // obj.shape[0], int(obj.shape[0]), "host"
    data_ptr = getattr(obj, "data_ptr", None)
    if callable(data_ptr):  # a torch.Tensor, without importing torch
        if not obj.is_contiguous():
            raise LayoutError(f"{what} must be contiguous")
        if obj.dim() < 1 or obj.shape[0] == 0:
            raise LayoutError(f"{what} must have at least one page (first dimension), got shape {tuple(obj.shape)}")
        nbytes = int(obj.numel()) * int(obj.element_size())
        kind: MemoryKind = "host" if obj.device.type == "cpu" else "device"
        return int(data_ptr()), nbytes // int(obj.shape[0]), int(obj.shape[0]), kind
    raise LayoutError(f"{what} must be a numpy.ndarray or torch.Tensor, got {type(obj).__name__}")
