"""KV pools for the bench: torch CPU tensors when torch is installed, numpy otherwise."""

from __future__ import annotations

import contextlib
import mmap
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire.benchmark.presets import Preset
from kvwire.errors import ConfigError
from kvwire.layout import KVBuffer, KVLayout, MemoryKind, Role

__all__ = ["Pool"]


def _torch_or_none() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch


def _hugepage_array(num_pages: int, page_bytes: int) -> NDArray[np.uint8]:
    """An anonymous mapping advised to use transparent huge pages (as serving engines' KV pools do)."""
    region = mmap.mmap(-1, num_pages * page_bytes)
    with contextlib.suppress(AttributeError, OSError):  # no madvise / THP: plain pages are fine
        region.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(region, np.uint8).reshape(num_pages, page_bytes)


class Pool:
    """One side's KV memory: ``views`` are numpy uint8 (pages x page_bytes) views of every buffer."""

    def __init__(self, preset: Preset, num_pages: int, *, decode_side: bool, device: str = "cpu") -> None:
        roles: tuple[Role, ...] = ("k", "v") if preset.attention == "mha" else ("kv",)
        kinds: tuple[MemoryKind, ...] = ("host",)
        if decode_side and preset.split_device:
            kinds = ("host", "device")
        elif decode_side and device != "cpu":
            kinds = ("device",)
        torch = _torch_or_none()
        if device != "cpu" and torch is None:
            raise ConfigError(f"--device {device!r} needs torch; install torch or use --device cpu")
        self.backing = "torch" if torch is not None else "numpy"
        self.tensors: list[Any] = []
        self.views: list[NDArray[np.uint8]] = []
        entries: list[tuple[int, Role, MemoryKind]] = [
            (layer, role, kind) for kind in kinds for role in roles for layer in range(preset.num_layers)
        ]
        buffers = []
        for layer, role, kind in entries:
            on_device = kind == "device" and device != "cpu"
            if torch is not None:
                t = torch.empty(
                    (num_pages, preset.page_bytes), dtype=torch.uint8, device=device if on_device else "cpu"
                )
                self.tensors.append(t)
                ptr = int(t.data_ptr())
                self.views.append(t.numpy() if not on_device else np.empty(0, np.uint8))
            else:
                a = _hugepage_array(num_pages, preset.page_bytes)
                self.views.append(a)
                ptr = int(a.ctypes.data)
            buffers.append(KVBuffer(ptr, preset.page_bytes, num_pages, layer, role, kind))
        self.layout = KVLayout(tuple(buffers))
        self.num_pages = num_pages

    def fill_random(self, seed: int) -> None:
        """Random bytes in every host buffer (never zeros)."""
        rng = np.random.default_rng(seed)
        for view in self.views:
            if view.size:
                view.reshape(-1)[:] = np.frombuffer(rng.bytes(view.size), np.uint8)
