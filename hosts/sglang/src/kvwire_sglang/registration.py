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

Two forms. Over sglang's own Mooncake engine (kvwire-mooncake, kvwire-hisparse: the default) the
decode is reached at its sglang session id: :data:`FRAME_PREFIX` and the description of that
endpoint. When kvwire carries the KV on an engine of its own (``KVWIRE_SGLANG_BACKEND=nixl``, a third
party's backend), the decode is reached at that engine's endpoint: :data:`ENGINE_FRAME_PREFIX` and
``{"session": <sglang's session id>, "backend": <name>, "peer": <description of kvwire's endpoint>}``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from kvwire.layout.buffers import LayoutError
from kvwire.layout.kv_layout import KVLayout
from kvwire.layout.peer import PeerDescription

__all__ = [
    "ENGINE_FRAME_PREFIX",
    "FRAME_PREFIX",
    "MAX_FRAME_BYTES",
    "Published",
    "layout_frame",
    "layout_from_frames",
    "published_from_frames",
]

#: What starts kvwire's frame: a name no sglang frame (ASCII numbers, packed integers) begins with.
FRAME_PREFIX: Final = b"kvwire.peer:1:"
#: The frame of a decode whose kvwire runs an engine of its own (its endpoint is not sglang's session id).
ENGINE_FRAME_PREFIX: Final = b"kvwire.peer:2:"
#: Both prefixes are this long: a frame's first bytes say which form it is, and its JSON starts after them.
_PREFIX_BYTES: Final = len(FRAME_PREFIX)
assert len(ENGINE_FRAME_PREFIX) == _PREFIX_BYTES
#: The largest frame read (a layout of 1,000 buffers is about 90 KB).
MAX_FRAME_BYTES: Final = 4 << 20
#: The longest backend name read from a frame.
MAX_BACKEND_CHARS: Final = 200


@dataclass(frozen=True)
class Published:
    """What a decode rank published: its layout, where kvwire reaches it, and on which backend's engine."""

    layout: KVLayout
    endpoint: str
    backend: str | None  # None: sglang's own Mooncake engine (the endpoint is sglang's session id)


def layout_frame(session_id: str, layout: KVLayout, endpoint: str | None = None, backend: str | None = None) -> bytes:
    """The frame a decode rank appends to its registration: its layout, reached at sglang's session id, or
    (``endpoint`` and ``backend`` given) at the endpoint of kvwire's own engine of that backend."""
    if endpoint is None or backend is None:
        description = PeerDescription(session_id, layout).to_dict()
        return FRAME_PREFIX + json.dumps(description, separators=(",", ":")).encode()
    own = {"session": session_id, "backend": backend, "peer": PeerDescription(endpoint, layout).to_dict()}
    return ENGINE_FRAME_PREFIX + json.dumps(own, separators=(",", ":")).encode()


def layout_from_frames(frames: Sequence[bytes], session_id: str) -> KVLayout | None:
    """The layout in a registration's kvwire frame, or None when it has none (see :func:`published_from_frames`)."""
    published = published_from_frames(frames, session_id)
    return None if published is None else published.layout


def published_from_frames(frames: Sequence[bytes], session_id: str) -> Published | None:
    """What the registration's kvwire frame publishes, or None when it has none (a decode without kvwire).

    :class:`kvwire.LayoutError` naming the problem when the frame is malformed, too large,
    or describes another session than the one registering.
    """
    prefixes = (FRAME_PREFIX, ENGINE_FRAME_PREFIX)
    found = [bytes(f) for f in frames if bytes(f[:_PREFIX_BYTES]) in prefixes]
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
        data = json.loads(frame[_PREFIX_BYTES:])
    except (ValueError, RecursionError) as exc:
        raise LayoutError(f"registration of {session_id!r:.200}: kvwire layout frame is not JSON ({exc})") from None
    if frame.startswith(FRAME_PREFIX):
        described, backend = data, None
    else:
        described, backend = _engine_frame(data, session_id)
    description = PeerDescription.from_dict(described)
    if backend is None and description.endpoint != session_id:
        raise LayoutError(
            f"registration of {session_id!r:.200}: its kvwire layout frame describes session "
            f"{description.endpoint!r:.200}"
        )
    return Published(description.layout, description.endpoint, backend)


def _engine_frame(data: object, session_id: str) -> tuple[object, str]:
    """(the peer description, the backend name) of an :data:`ENGINE_FRAME_PREFIX` frame's JSON."""
    if not isinstance(data, Mapping) or set(data) != {"session", "backend", "peer"}:
        raise LayoutError(
            f"registration of {session_id!r:.200}: kvwire engine frame must be an object with keys "
            f"backend, peer and session, got {data!r:.200}"
        )
    if data["session"] != session_id:
        raise LayoutError(
            f"registration of {session_id!r:.200}: its kvwire layout frame describes session {data['session']!r:.200}"
        )
    backend = data["backend"]
    if not isinstance(backend, str) or not backend or len(backend) > MAX_BACKEND_CHARS:
        raise LayoutError(
            f"registration of {session_id!r:.200}: kvwire engine frame's backend must be a name of 1 to "
            f"{MAX_BACKEND_CHARS} characters, got {backend!r:.200}"
        )
    return data["peer"], backend
