"""``PeerTable``: the layouts peers published, by session id, and the one check of a session id.

The Connection and :class:`kvwire.TransportBackend` each keep one; both say
"unknown peer" and "bad session id" the same way, with the same error type.
"""

from __future__ import annotations

import threading

from kvwire.errors import InvalidTransferError
from kvwire.layout.kv_layout import KVLayout
from kvwire.layout.peer import MAX_ENDPOINT_CHARS

__all__ = ["PeerTable", "check_session_id", "short_session_id"]


def short_session_id(session_id: str, *, quote: bool = True, limit: int = 80) -> str:
    """A session id for an error message: whole, or its start and its length (some transports' ids are KBs)."""
    text = repr(session_id) if quote else session_id
    return text if len(text) <= limit else f"{text[: limit - 20]}... ({len(session_id)} chars)"


def check_session_id(session_id: object) -> str:
    """``session_id`` when it is a non-empty str of at most :data:`MAX_ENDPOINT_CHARS`; else InvalidTransferError."""
    if not isinstance(session_id, str) or not session_id:
        shown = repr(session_id) if isinstance(session_id, str) else type(session_id).__name__
        raise InvalidTransferError(f"session_id must be a non-empty str, got {shown}")
    if len(session_id) > MAX_ENDPOINT_CHARS:
        raise InvalidTransferError(
            f"session_id is {len(session_id)} characters, over the limit of {MAX_ENDPOINT_CHARS}"
        )
    return session_id


class PeerTable:
    """Session id -> the layout that peer published; safe to use from several threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._layouts: dict[str, KVLayout] = {}

    def add(self, session_id: str, layout: KVLayout) -> None:
        with self._lock:
            self._layouts[session_id] = layout

    def remove(self, session_id: str) -> None:
        """Forget ``session_id``; an unknown one is a no-op."""
        with self._lock:
            self._layouts.pop(session_id, None)

    def clear(self) -> None:
        with self._lock:
            self._layouts.clear()

    def get(self, session_id: str) -> KVLayout | None:
        with self._lock:
            return self._layouts.get(session_id)

    def items(self) -> list[tuple[str, KVLayout]]:
        with self._lock:
            return list(self._layouts.items())

    def known(self, session_id: str) -> KVLayout:
        """The layout of ``session_id``; InvalidTransferError naming up to eight known ids when there is none."""
        with self._lock:
            layout = self._layouts.get(session_id)
            if layout is not None:
                return layout
            known = sorted(self._layouts)
        listed = ", ".join(short_session_id(k, quote=False) for k in known[:8])
        listed += f" and {len(known) - 8} more" if len(known) > 8 else ""
        raise InvalidTransferError(
            f"session_id {short_session_id(session_id)} is unknown: call add_peer(session_id, layout) first "
            f"(known: {listed or 'none'})"
        )

    def __len__(self) -> int:
        with self._lock:
            return len(self._layouts)
