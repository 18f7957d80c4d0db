"""KV memory for workloads: allocate buffers, fill them with random bytes, digest pages.

One allocator for the bench and the contract kit: numpy buffers, or torch
tensors when asked (torch CPU, or device memory for device buffers). Host
memory of either kind is an anonymous mapping advised to use transparent huge
pages, as serving engines' host KV pools should be: a cross-process copy
(UCX ``cma``, the kernel's ``process_vm_writev``) pins every destination page
it writes, and with 4 KiB pages that pinning cost kvwire-nixl about a quarter
of its throughput here (``bench/nixl_ceiling.py``; torch's own allocator gives
huge pages only under ``THP_MEM_ALLOC_ENABLE=1``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from kvwire.errors import ConfigError
from kvwire.layout.buffers import KVBuffer, MemoryKind, Role
from kvwire.layout.hugepages import hugepage_array
from kvwire.layout.kv_layout import KVLayout

__all__ = ["Backing", "BufferEntry", "KVMemory", "allocate", "digest"]

Backing = Literal["numpy", "torch", "auto"]
#: (layer, role, memory kind) of one buffer.
BufferEntry = tuple[int, Role, MemoryKind]


def _torch_or_none() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch


class KVMemory:
    """Allocated buffers and their layout; ``views`` are host-readable (pages x page_bytes) uint8 arrays.

    A buffer in accelerator memory has an empty view; :meth:`host_view` copies it out.
    """

    def __init__(self, layout: KVLayout, views: list[NDArray[np.uint8]], tensors: list[Any], backing: str) -> None:
        self.layout = layout
        self.views = views
        self.tensors = tensors
        self.backing = backing

    @property
    def num_pages(self) -> int:
        return self.layout.buffers[0].num_pages

    def host_view(self, i: int) -> NDArray[np.uint8]:
        view = self.views[i]
        return view if view.size or not self.tensors else self.tensors[i].cpu().numpy()

    def indices(self, kind: MemoryKind | None = None) -> list[int]:
        """Buffer indices of one memory kind (all when ``kind`` is None)."""
        return [i for i, b in enumerate(self.layout.buffers) if kind is None or b.memory == kind]

    def fill_random(self, seed: int) -> None:
        """Random bytes in every host buffer (never zeros: a transfer that did nothing must show)."""
        rng = np.random.default_rng(seed)
        for view in self.views:
            if view.size:
                view.reshape(-1)[:] = np.frombuffer(rng.bytes(view.size), np.uint8)

    def fill_pages(self, pages: NDArray[np.int64], value: int, kind: MemoryKind | None = None) -> None:
        """Set every byte of ``pages`` to ``value`` in the buffers of ``kind`` (memset speed)."""
        for i in self.indices(kind):
            if self.views[i].size:
                self.views[i][pages] = value
            else:  # device memory
                import torch

                idx = torch.from_numpy(pages).to(self.tensors[i].device)
                self.tensors[i][idx] = value

    def digest(self, pages: NDArray[np.int64] | None = None, kind: MemoryKind | None = None) -> str:
        """:func:`digest` of ``pages`` (all pages when None) of the buffers of ``kind``, in layout order."""
        return digest([self.host_view(i) for i in self.indices(kind)], pages)


def allocate(
    entries: Sequence[BufferEntry],
    num_pages: int,
    page_bytes: int,
    *,
    backing: Backing = "numpy",
    device: str = "cpu",
) -> KVMemory:
    """One buffer of ``num_pages`` x ``page_bytes`` per entry, and the :class:`KVLayout` describing them.

    ``backing="auto"`` uses torch when it is installed; ``device`` other than
    ``"cpu"`` puts the ``"device"`` buffers in that torch device's memory.
    """
    torch = _torch_or_none() if backing != "numpy" else None
    if backing == "torch" and torch is None:
        raise ConfigError("backing='torch' needs torch installed")
    if device != "cpu" and torch is None:
        raise ConfigError(f"device {device!r} needs torch; install torch or use device 'cpu'")
    views: list[NDArray[np.uint8]] = []
    tensors: list[Any] = []
    buffers = []
    for layer, role, kind in entries:
        on_device = kind == "device" and device != "cpu"
        if torch is not None and on_device:
            t = torch.empty((num_pages, page_bytes), dtype=torch.uint8, device=device)
            tensors.append(t)
            views.append(np.empty(0, np.uint8))
            ptr = int(t.data_ptr())
        else:  # host memory: a huge-page mapping, with a torch tensor over it when torch backs the pools
            a = hugepage_array(num_pages, page_bytes)
            if torch is not None:  # frombuffer keeps the mapping alive
                tensors.append(torch.frombuffer(a, dtype=torch.uint8).reshape(num_pages, page_bytes))
            views.append(a)
            ptr = int(a.ctypes.data)
        buffers.append(KVBuffer(ptr, page_bytes, num_pages, layer, role, kind))
    layout = KVLayout(tuple(buffers), keep=(*views, *tensors))  # registered, the memory lives as long as the layout
    return KVMemory(layout, views, tensors, "torch" if torch is not None else "numpy")


def digest(views: Sequence[NDArray[np.uint8]], pages: NDArray[np.int64] | None = None) -> str:
    """blake2b over ``pages`` (every page when None) of every view, in order."""
    h = hashlib.blake2b(digest_size=32)
    for view in views:
        h.update(np.ascontiguousarray(view if pages is None else view[pages]).data)
    return h.hexdigest()
