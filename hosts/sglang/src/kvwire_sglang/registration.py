"""The kvwire layout a decode rank adds to sglang's registration message, and its strict reading.

sglang's decode registers with each prefill rank through one ZMQ multipart
message (``MooncakeKVManager.build_receiver_registration_message``, 20 frames in
0.5.23) that carries its KV pointers, item lengths and layer ids, but no buffer
lengths or page counts: not enough for a :class:`~kvwire.KVLayout`, whose page
bounds kvwire checks before any byte moves. kvwire's decode manager appends one
frame: :data:`FRAME_PREFIX` followed by the :class:`~kvwire.PeerDescription`
JSON of its layout. sglang's own parser reads frames by index and ignores the
extra one; kvwire's prefill manager finds it by its prefix, wherever it lands,
and parses it as input from another process (size limit, strict JSON).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Final

from kvwire.layout.buffers import LayoutError
from kvwire.layout.kv_layout import KVLayout
from kvwire.layout.peer import PeerDescription

__all__ = ["FRAME_PREFIX", "MAX_FRAME_BYTES", "layout_frame", "layout_from_frames"]

#: What starts kvwire's frame: a name no sglang frame (ASCII numbers, packed integers) begins with.
FRAME_PREFIX: Final = b"kvwire.peer:1:"
#: The largest frame read (a layout of 1,000 buffers is about 90 KB).
MAX_FRAME_BYTES: Final = 4 << 20


def layout_frame(session_id: str, layout: KVLayout) -> bytes:
    """The frame a decode rank appends to its registration: its session id and layout."""
    return FRAME_PREFIX + json.dumps(PeerDescription(session_id, layout).to_dict(), separators=(",", ":")).encode()


def layout_from_frames(frames: Sequence[bytes], session_id: str) -> KVLayout | None:
    """The layout in a registration's kvwire frame, or None when it has none (a decode without kvwire).

    :class:`kvwire.LayoutError` naming the problem when the frame is malformed, too large,
    or describes another session than the one registering.
    """
    found = [bytes(f) for f in frames if bytes(f[: len(FRAME_PREFIX)]) == FRAME_PREFIX]
    if not found:
        return None
    if len(found) > 1:
        raise LayoutError(f"registration of {session_id!r:.200}: {len(found)} kvwire layout frames, expected one")
    frame = found[0]
    if len(frame) > MAX_FRAME_BYTES:
        raise LayoutError(
            f"registration of {session_id!r:.200}: kvwire layout frame of {len(frame)} bytes, over {MAX_FRAME_BYTES}"
        )
    try:
        data = json.loads(frame[len(FRAME_PREFIX) :])
    except (ValueError, RecursionError) as exc:
        raise LayoutError(f"registration of {session_id!r:.200}: kvwire layout frame is not JSON ({exc})") from None
    description = PeerDescription.from_dict(data)
    if description.endpoint != session_id:
        raise LayoutError(
            f"registration of {session_id!r:.200}: its kvwire layout frame describes session "
            f"{description.endpoint!r:.200}"
        )
    return description.layout
