"""The endpoint string: how an agent's NIXL metadata reaches its peers through kvwire's public API.

A sender needs the receiver's NIXL metadata (``get_agent_metadata()``: its UCX
worker address and the keys of its registered memory) before it can write.
kvwire moves exactly one string from a receiver to its senders, the endpoint
(``PeerDescription.endpoint``, the ``session_id`` of ``add_peer`` and
``send_kvcache``), so the endpoint carries the metadata::

    nixl:1:<agent>:<base64url(JSON)>
    JSON: {"agent", "metadata": base64, "sha256": hex, "regions": [[base, nbytes, segment, device], ...]}

Versioned, JSON and base64 (never pickle), parsed strictly with a size bound;
the metadata's SHA-256 catches an endpoint damaged in transit before NIXL
reads it (NIXL 1.5 cannot load an agent again after a half-failed load).
The metadata includes the registered memory, so read the endpoint after
``register_kv_buffers``; it changes when the layout is registered again.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import kvwire
from kvwire_nixl.memory import DRAM, VRAM, Segment

__all__ = [
    "MAX_ENDPOINT_CHARS",
    "PREFIX",
    "PeerInfo",
    "Region",
    "decode_endpoint",
    "encode_endpoint",
    "metadata_agent",
]

PREFIX: Final = "nixl:1:"
#: Longer endpoints are refused before decoding (a 64-buffer layout: 8.8 KB).
MAX_ENDPOINT_CHARS: Final = 4 << 20
_MAX_REGIONS: Final = 1 << 14
_NAME: Final = re.compile(r"[A-Za-z0-9._-]{1,200}")
_SEGMENTS: Final = (DRAM, VRAM)
_KEYS: Final = frozenset({"agent", "metadata", "sha256", "regions"})
_SERDES_AGENT: Final = b"nixlSerDes|Agent"
_ADDRESS_LIMIT: Final = 2**63


@dataclass(frozen=True)
class Region:
    """A registered range: ``nbytes`` at ``base`` in ``segment`` (device ``device`` for VRAM)."""

    base: int
    nbytes: int
    segment: Segment
    device: int


@dataclass(frozen=True)
class PeerInfo:
    """What an endpoint says: the agent's name, its NIXL metadata and its registered regions."""

    agent: str
    metadata: bytes
    regions: tuple[Region, ...]


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode("ascii").rstrip("=")


def _unb64(text: str, what: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError) as exc:
        raise _bad(f"{what} is not base64url ({exc})") from None


def _bad(why: str) -> kvwire.InvalidTransferError:
    return kvwire.InvalidTransferError(f"session_id is not a kvwire-nixl endpoint ({PREFIX}...): {why}")


def encode_endpoint(agent: str, metadata: bytes, regions: Sequence[Region]) -> str:
    """The endpoint string of ``agent`` with ``metadata`` and ``regions``."""
    payload = {
        "agent": agent,
        "metadata": _b64(metadata),
        "sha256": hashlib.sha256(metadata).hexdigest(),
        "regions": [[r.base, r.nbytes, r.segment, r.device] for r in regions],
    }
    return f"{PREFIX}{agent}:{_b64(json.dumps(payload, separators=(',', ':')).encode())}"


def _int(value: object, what: str, low: int, high: int) -> int:
    if type(value) is not int or not low <= value < high:
        raise _bad(f"{what} must be an int in [{low}, {high}), got {value!r:.40}")
    return value


def _region(i: int, item: object) -> Region:
    if not isinstance(item, list) or len(item) != 4:
        raise _bad(f"regions[{i}] must be [base, nbytes, segment, device], got {item!r:.80}")
    base = _int(item[0], f"regions[{i}] base", 1, _ADDRESS_LIMIT)
    nbytes = _int(item[1], f"regions[{i}] nbytes", 1, _ADDRESS_LIMIT - base)
    segment = item[2]
    if segment not in _SEGMENTS:
        raise _bad(f"regions[{i}] segment must be one of {_SEGMENTS}, got {segment!r:.40}")
    device = _int(item[3], f"regions[{i}] device", 0, 1 << 16)
    return Region(base, nbytes, DRAM if segment == DRAM else VRAM, device)


def metadata_agent(metadata: bytes) -> str | None:
    """The agent name NIXL 1.5's serialized metadata starts with, or None in another format.

    Read before NIXL loads the blob: a failed load of an agent already loaded
    drops that agent's session inside NIXL, so a blob must not claim another name.
    """
    if not metadata.startswith(_SERDES_AGENT) or len(metadata) < len(_SERDES_AGENT) + 8:
        return None
    start = len(_SERDES_AGENT) + 8
    size = int.from_bytes(metadata[len(_SERDES_AGENT) : start], "little")
    if size > 1024 or len(metadata) < start + size:
        return None
    return metadata[start : start + size].decode("utf-8", "replace")


def decode_endpoint(endpoint: object) -> PeerInfo:
    """Parse an endpoint string; InvalidTransferError naming what is wrong."""
    if not isinstance(endpoint, str):
        raise _bad(f"expected a str, got {type(endpoint).__name__}")
    if len(endpoint) > MAX_ENDPOINT_CHARS:
        raise _bad(f"{len(endpoint)} characters, over the limit of {MAX_ENDPOINT_CHARS}")
    if not endpoint.startswith(PREFIX):
        other = endpoint.split(":", 2)
        hint = f" (version {other[1]!r} is not supported: this kvwire-nixl reads 1)" if other[0] == "nixl" else ""
        raise _bad(f"it does not start with {PREFIX!r}{hint}: {endpoint[:60]!r}")
    name, sep, blob = endpoint[len(PREFIX) :].partition(":")
    if not sep or not _NAME.fullmatch(name):
        raise _bad(f"the agent name must match {_NAME.pattern} and be followed by ':'")
    try:
        payload = json.loads(_unb64(blob, "the payload"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise _bad(f"the payload is not JSON ({exc})") from None
    if not isinstance(payload, dict) or set(payload) != _KEYS:
        raise _bad(f"the payload must be an object with exactly the keys {sorted(_KEYS)}")
    if payload["agent"] != name:
        raise _bad(f"the payload names agent {payload['agent']!r:.80}, the endpoint {name!r}")
    metadata, regions = payload["metadata"], payload["regions"]
    if not isinstance(metadata, str) or not metadata:
        raise _bad("'metadata' must be a non-empty base64url string")
    if not isinstance(regions, list) or len(regions) > _MAX_REGIONS:
        raise _bad(f"'regions' must be a list of at most {_MAX_REGIONS} regions")
    raw = _unb64(metadata, "'metadata'")
    if payload["sha256"] != hashlib.sha256(raw).hexdigest():
        raise _bad("the metadata does not match its SHA-256 (the endpoint was damaged)")
    inside = metadata_agent(raw)
    if inside is not None and inside != name:
        raise _bad(f"its NIXL metadata is agent {inside[:80]!r}, not {name!r}")
    return PeerInfo(name, raw, tuple(_region(i, r) for i, r in enumerate(regions)))
