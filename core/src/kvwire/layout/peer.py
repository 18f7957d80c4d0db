"""``PeerDescription``: what an endpoint publishes so that peers can send to it.

Its endpoint id (the ``session_id`` a sender passes) and its KV layout, as a
versioned JSON object. It travels over whatever channel the host uses (the
bench and the contract kit use :mod:`kvwire.control`); the receiving side
parses it strictly, because it comes from another process.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from kvwire.layout.buffers import LayoutError
from kvwire.layout.kv_layout import KVLayout

__all__ = ["MAX_ENDPOINT_CHARS", "PEER_FORMAT", "PEER_VERSION", "PeerDescription"]

PEER_FORMAT: Final = "kvwire.peer"
PEER_VERSION: Final = 1
#: The longest endpoint (session id) kvwire accepts: NIXL's carry the agent's metadata (8.8 KB for 64 buffers).
MAX_ENDPOINT_CHARS: Final = 4 << 20


@dataclass(frozen=True)
class PeerDescription:
    """An endpoint id and the layout registered behind it."""

    endpoint: str
    layout: KVLayout

    def to_dict(self) -> dict[str, Any]:
        layout = self.layout.to_dict()
        return {"format": PEER_FORMAT, "version": PEER_VERSION, "endpoint": self.endpoint, "layout": layout}

    @classmethod
    def from_dict(cls, data: object) -> PeerDescription:
        """Parse a description; :class:`kvwire.LayoutError` naming the field when it is malformed."""
        if not isinstance(data, Mapping) or data.get("format") != PEER_FORMAT:
            raise LayoutError(f"peer description: expected an object with format {PEER_FORMAT!r}, got {data!r:.200}")
        version = data.get("version")
        if type(version) is not int or version != PEER_VERSION:  # not True, not 1.0
            raise LayoutError(
                f"peer description: version {version!r:.50} is not supported (this kvwire reads {PEER_VERSION})"
            )
        endpoint = data.get("endpoint")
        if not isinstance(endpoint, str) or not endpoint:
            raise LayoutError(f"peer description: 'endpoint' must be a non-empty string, got {endpoint!r:.200}")
        if len(endpoint) > MAX_ENDPOINT_CHARS:
            raise LayoutError(
                f"peer description: 'endpoint' is {len(endpoint)} characters, over the limit of {MAX_ENDPOINT_CHARS}"
            )
        return cls(endpoint, KVLayout.from_dict(data.get("layout")))  # type: ignore[arg-type]
