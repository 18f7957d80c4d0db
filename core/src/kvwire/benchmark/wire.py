"""What the bench's two processes exchange: the peer description, and page digests.

The decode side's first message on the control channel (:mod:`kvwire.control`)
is its peer description: endpoint id and layout, versioned, validated by the
prefill side before use.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire.layout import KVLayout, LayoutError

__all__ = ["PEER_FORMAT", "digest", "is_split", "parse_peer_description", "peer_description"]

PEER_FORMAT = "kvwire.peer"
PEER_VERSION = 1


def peer_description(endpoint: str, layout: KVLayout) -> dict[str, Any]:
    return {"format": PEER_FORMAT, "version": PEER_VERSION, "endpoint": endpoint, "layout": layout.to_dict()}


def parse_peer_description(data: Any) -> tuple[str, KVLayout]:
    """(endpoint, layout) from a peer description; :class:`LayoutError` when malformed."""
    if not isinstance(data, dict) or data.get("format") != PEER_FORMAT:
        raise LayoutError(f"peer description: expected an object with format {PEER_FORMAT!r}, got {data!r:.200}")
    if data.get("version") != PEER_VERSION:
        raise LayoutError(f"peer description: version {data.get('version')!r} is not supported ({PEER_VERSION})")
    endpoint = data.get("endpoint")
    if not isinstance(endpoint, str) or not endpoint:
        raise LayoutError(f"peer description: 'endpoint' must be a non-empty string, got {endpoint!r}")
    return endpoint, KVLayout.from_dict(data.get("layout"))  # type: ignore[arg-type]


def is_split(layout: KVLayout) -> bool:
    """A layout with both host and device buffers is a split destination (HiSparse): two page-id spaces."""
    return layout.has_memory("host") and layout.has_memory("device")


def digest(views: Sequence[NDArray[np.uint8]], pages: NDArray[np.int64]) -> str:
    """blake2b over the given pages of every view, in order."""
    h = hashlib.blake2b(digest_size=32)
    for view in views:
        h.update(np.ascontiguousarray(view[pages]).data)
    return h.hexdigest()
