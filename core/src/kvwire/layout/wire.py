"""The JSON wire format of a layout, parsed strictly: a peer's layout comes from another process.

The wire format (``kvwire.layout`` version 1) carries the buffers and, each
only when recorded, ``attn_tp_size``, ``attn_tp_rank`` and ``heads`` (an object
of ``kv_heads``, ``total_kv_heads``, ``head_dim``, ``elem_bytes``,
``tokens_per_page``, and ``head_major: true`` for head-major pages, written
only then: a kvwire that predates it refuses such a description as an unknown
field instead of slicing it token by token). A description without the optional fields parses as
before (same-TP planning only); every field is parsed strictly since it comes
from another process.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvwire.layout.buffers import (
    _BUFFER_FIELDS,
    _HEAD_FIELDS,
    _LAYOUT_FIELDS,
    LAYOUT_FORMAT,
    LAYOUT_FORMAT_VERSION,
    HeadLayout,
    KVBuffer,
    LayoutError,
)

if TYPE_CHECKING:
    from kvwire.layout.kv_layout import KVLayout

__all__ = ["layout_fields_from_dict", "layout_to_dict"]


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
        if layout.heads.head_major:  # written only when set: a token-major description reads as before
            data["heads"]["head_major"] = True
    return data


def _fields(item: object, fields: tuple[str, ...], where: str, optional: tuple[str, ...] = ()) -> dict[str, Any]:
    if not isinstance(item, Mapping):
        raise LayoutError(f"layout description: {where} must be an object")
    missing = [f for f in fields if f not in item]
    extra = sorted(map(str, set(item) - set(fields) - set(optional)))
    if missing or extra:
        raise LayoutError(f"layout description: {where} has missing fields {missing} / unknown fields {extra}")
    return {f: item[f] for f in (*fields, *optional) if f in item}


def layout_fields_from_dict(data: Mapping[str, Any]) -> tuple[tuple[KVBuffer, ...], Any, Any, HeadLayout | None]:
    """Parse a layout description strictly: the buffers, ``attn_tp_size``, ``attn_tp_rank`` and ``heads``
    (the last three checked by the :class:`KVLayout` they build)."""
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
        fields = _fields(data["heads"], _HEAD_FIELDS, "heads", optional=("head_major",))
        try:
            heads = HeadLayout(**fields)
        except LayoutError as exc:
            raise LayoutError(f"layout description: heads: {exc}") from None
    return tuple(buffers), data.get("attn_tp_size"), data.get("attn_tp_rank"), heads
