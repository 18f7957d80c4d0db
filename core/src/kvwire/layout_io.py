"""Layouts in and out: buffers described from arrays/tensors, and the JSON wire format.

The wire format (``kvwire.layout`` version 1) carries the buffers and, each
only when recorded, ``attn_tp_size``, ``attn_tp_rank`` and ``heads`` (an object
of ``kv_heads``, ``total_kv_heads``, ``head_dim``, ``elem_bytes``,
``tokens_per_page``). A description without the optional fields parses as
before (same-TP planning only); every field is parsed strictly since it comes
from another process.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvwire.layout import (
    _BUFFER_FIELDS,
    _HEAD_FIELDS,
    _LAYOUT_FIELDS,
    LAYOUT_FORMAT,
    LAYOUT_FORMAT_VERSION,
    HeadLayout,
    KVBuffer,
    KVLayout,
    LayoutError,
    MemoryKind,
)

__all__ = ["describe_array", "layout_from_dict", "layout_to_dict", "memory_per_buffer"]


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


def layout_to_dict(layout: KVLayout) -> dict[str, Any]:
    data: dict[str, Any] = {
        "format": LAYOUT_FORMAT,
        "version": LAYOUT_FORMAT_VERSION,
        "buffers": [{f: getattr(b, f) for f in _BUFFER_FIELDS} for b in layout.buffers],
    }
    if layout.attn_tp_size is not None:
        data["attn_tp_size"] = layout.attn_tp_size
    if layout.attn_tp_rank is not None:
        data["attn_tp_rank"] = layout.attn_tp_rank
    if layout.heads is not None:
        data["heads"] = {f: getattr(layout.heads, f) for f in _HEAD_FIELDS}
    return data


def _fields(item: object, fields: tuple[str, ...], where: str) -> dict[str, Any]:
    if not isinstance(item, Mapping):
        raise LayoutError(f"layout description: {where} must be an object")
    missing = [f for f in fields if f not in item]
    extra = sorted(map(str, set(item) - set(fields)))
    if missing or extra:
        raise LayoutError(f"layout description: {where} has missing fields {missing} / unknown fields {extra}")
    return {f: item[f] for f in fields}


def layout_from_dict(data: Mapping[str, Any]) -> KVLayout:
    """Parse a layout description strictly (it may come from another process)."""
    if not isinstance(data, Mapping):
        raise LayoutError(f"layout description must be a JSON object, got {type(data).__name__}")
    if data.get("format") != LAYOUT_FORMAT:
        raise LayoutError(f"layout description: 'format' must be {LAYOUT_FORMAT!r}, got {data.get('format')!r}")
    version = data.get("version")
    if type(version) is not int or version != LAYOUT_FORMAT_VERSION:  # not True, not 1.0
        raise LayoutError(
            f"layout description: 'version' {version!r} is not supported "
            f"(this kvwire reads version {LAYOUT_FORMAT_VERSION})"
        )
    raw = data.get("buffers")
    if not isinstance(raw, list):
        raise LayoutError("layout description: 'buffers' must be a list")
    buffers = []
    for i, item in enumerate(raw):
        fields = _fields(item, _BUFFER_FIELDS, f"buffers[{i}]")
        try:
            buffers.append(KVBuffer(**fields))
        except LayoutError as exc:
            raise LayoutError(f"layout description: buffers[{i}]: {exc}") from None
    extra = sorted(map(str, set(data) - _LAYOUT_FIELDS))
    if extra:
        raise LayoutError(f"layout description: unknown fields {extra}")
    heads = None
    if data.get("heads") is not None:
        fields = _fields(data["heads"], _HEAD_FIELDS, "heads")
        try:
            heads = HeadLayout(**fields)
        except LayoutError as exc:
            raise LayoutError(f"layout description: heads: {exc}") from None
    try:
        return KVLayout(tuple(buffers), data.get("attn_tp_size"), data.get("attn_tp_rank"), heads)
    except LayoutError as exc:
        raise LayoutError(f"layout description: {exc}") from None
