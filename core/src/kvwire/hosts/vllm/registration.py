"""The registration a decode worker sends its prefill: "write your blocks of request X into these blocks of mine".

One JSON object (``format`` ``"kvwire.vllm.registration"``, ``version`` 1):
``prefill_request_id``, ``decode_request_id``, ``prefill_block_ids`` and
``decode_block_ids`` (equal lengths: block ``i`` of one lands on block ``i`` of
the other), ``layers`` (the decode's layer names, which must be the prefill's),
``tp_rank`` and ``tp_size``, ``valid_for_s`` (how much longer the decode waits: a
write that could not end by then is not started, since the decode frees its blocks
when it stops waiting), ``block_order`` (how the decode's blocks hold their bytes,
:data:`~kvwire.hosts.vllm.layout.BLOCK_ORDERS`; optional, ``"head-major"`` when
absent, the only order earlier decodes had: whole blocks move only between the
same order), and ``peer``: the decode's
:class:`kvwire.PeerDescription` (its backend endpoint and KV layout). It comes
from another process, so it is parsed strictly: :class:`Registration.from_dict`
raises :class:`kvwire.InvalidTransferError` or :class:`kvwire.LayoutError` naming
the field.
"""

from __future__ import annotations

import hmac
import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, cast

from kvwire.errors import InvalidTransferError
from kvwire.hosts.vllm.layout import BLOCK_ORDERS, BlockOrder
from kvwire.layout.peer import PeerDescription

__all__ = [
    "REGISTRATION_FORMAT",
    "REGISTRATION_VERSION",
    "Registration",
    "notification_for",
    "parse_notification",
    "new_token",
    "request_of_notification",
    "split_token",
    "token_matches",
    "with_token",
]

REGISTRATION_FORMAT: Final = "kvwire.vllm.registration"
REGISTRATION_VERSION: Final = 1
_FIELDS: Final = frozenset(
    {
        "cmd",
        "format",
        "version",
        "prefill_request_id",
        "decode_request_id",
        "prefill_block_ids",
        "decode_block_ids",
        "layers",
        "tp_rank",
        "tp_size",
        "valid_for_s",
        "block_order",
        "peer",
        "token",
    }
)
_NOTE_PREFIX: Final = b"kvwire.vllm:"
_RANKED_PREFIX: Final = b"kvwire.vllm.rank:"  # across TP sizes: b"kvwire.vllm.rank:<prefill rank>:<request id>"
_MAX_ID_CHARS: Final = 1024
_TAG_PREFIX: Final = b"kvwire.vllm.tag:"  # b"kvwire.vllm.tag:<the registration's token>:<notification or notice>"
_TOKEN_CHARS: Final = 32  # 16 random bytes, lowercase hex
_HEX: Final = frozenset("0123456789abcdef")


def new_token() -> str:
    """A registration's token: 16 random bytes as hex, new for each request."""
    return secrets.token_hex(_TOKEN_CHARS // 2)


def with_token(token: str | None, message: bytes) -> bytes:
    """``message`` (an arrival notification or a failure notice) tagged with the registration's ``token``
    (None: untagged, for a registration that carried none)."""
    return message if token is None else _TAG_PREFIX + token.encode() + b":" + message


def split_token(message: bytes) -> tuple[str | None, bytes]:
    """(the token ``message`` is tagged with, or None; the message inside). A malformed tag is no message
    (``b""``)."""
    if not message.startswith(_TAG_PREFIX):
        return None, message
    token, sep, inner = message[len(_TAG_PREFIX) :].partition(b":")
    text = token.decode("ascii", errors="replace")
    if not sep or len(text) != _TOKEN_CHARS or not set(text) <= _HEX:
        return None, b""
    return text, inner


def token_matches(expected: str | None, token: str | None) -> bool:
    """A message tagged ``token`` is from the sender a registration with token ``expected`` reached (None: the
    registration carried no token, so any message counts, as before tokens)."""
    return expected is None or (token is not None and hmac.compare_digest(expected, token))


def notification_for(decode_request_id: str, prefill_rank: int | None = None) -> bytes:
    """The arrival notification that tells the decode ``decode_request_id``'s blocks are written.

    ``prefill_rank`` (across TP sizes, where several prefill ranks write one decode rank's blocks) makes
    each sender's notification distinct; None (equal TP sizes) keeps the one-sender form.
    """
    if prefill_rank is None:
        return _NOTE_PREFIX + decode_request_id.encode()
    if isinstance(prefill_rank, bool) or not isinstance(prefill_rank, int) or prefill_rank < 0:
        raise ValueError(f"prefill_rank must be an int >= 0 or None, got {prefill_rank!r:.40}")
    return _RANKED_PREFIX + str(prefill_rank).encode() + b":" + decode_request_id.encode()


def parse_notification(message: bytes) -> tuple[str, int | None] | None:
    """(decode request id, prefill rank or None for the one-sender form), or None: not this connector's.

    Parsed strictly: a ranked notification whose rank is not a plain decimal int (``0``, ``12``; no sign, no
    leading zero) or whose request id is empty or not UTF-8 is not this connector's.
    """
    if message.startswith(_NOTE_PREFIX):
        return message[len(_NOTE_PREFIX) :].decode(errors="replace"), None
    if not message.startswith(_RANKED_PREFIX):
        return None
    rank, _, request = message[len(_RANKED_PREFIX) :].partition(b":")
    if not request or not rank.isdigit() or len(rank) > 9 or (len(rank) > 1 and rank.startswith(b"0")):
        return None
    try:
        return request.decode(), int(rank)
    except UnicodeDecodeError:
        return None


def request_of_notification(message: bytes) -> str | None:
    """The decode request id a one-sender notification names, or None for a message not of that form."""
    parsed = parse_notification(message)
    return parsed[0] if parsed is not None and parsed[1] is None else None


def _ids(data: Mapping[str, Any], name: str) -> tuple[int, ...]:
    raw = data.get(name)
    if not isinstance(raw, list) or not raw:
        raise InvalidTransferError(f"registration: {name!r} must be a non-empty list of block ids, got {raw!r:.80}")
    for i, b in enumerate(raw):
        if isinstance(b, bool) or not isinstance(b, int):
            raise InvalidTransferError(f"registration: {name}[{i}] = {b!r:.40} must be an int block id")
    return tuple(raw)


def _utf8(value: str, name: str) -> str:
    """``value``, or InvalidTransferError naming ``name`` when it is not UTF-8 text (a lone surrogate: ``"\\ud800"``
    is valid JSON, and would raise UnicodeEncodeError where the id is encoded, in vLLM's step)."""
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise InvalidTransferError(
            f"registration: {name} is not UTF-8 text ({exc.reason} at character {exc.start}): {value!r:.60}"
        ) from None
    return value


def _text(data: Mapping[str, Any], name: str) -> str:
    value = data.get(name)
    if not isinstance(value, str) or not value or len(value) > _MAX_ID_CHARS:
        raise InvalidTransferError(
            f"registration: {name!r} must be a non-empty string of at most {_MAX_ID_CHARS} characters, "
            f"got {value!r:.80}"
        )
    return _utf8(value, repr(name))


def _int(data: Mapping[str, Any], name: str, minimum: int) -> int:
    value = data.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidTransferError(f"registration: {name!r} must be an int >= {minimum}, got {value!r:.40}")
    return value


@dataclass(frozen=True)
class Registration:
    """A parsed registration (see the module docstring)."""

    prefill_request_id: str
    decode_request_id: str
    prefill_block_ids: tuple[int, ...]
    decode_block_ids: tuple[int, ...]
    layers: tuple[str, ...]
    tp_rank: int
    tp_size: int
    valid_for_s: float
    peer: PeerDescription
    block_order: BlockOrder = "head-major"
    token: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "cmd": "register",
            "format": REGISTRATION_FORMAT,
            "version": REGISTRATION_VERSION,
            "prefill_request_id": self.prefill_request_id,
            "decode_request_id": self.decode_request_id,
            "prefill_block_ids": list(self.prefill_block_ids),
            "decode_block_ids": list(self.decode_block_ids),
            "layers": list(self.layers),
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "valid_for_s": self.valid_for_s,
            "block_order": self.block_order,
            "peer": self.peer.to_dict(),
            **({} if self.token is None else {"token": self.token}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Registration:
        if data.get("format") != REGISTRATION_FORMAT:
            raise InvalidTransferError(
                f"registration: 'format' must be {REGISTRATION_FORMAT!r}, got {data.get('format')!r:.80}"
            )
        version = data.get("version")
        if type(version) is not int or version != REGISTRATION_VERSION:
            raise InvalidTransferError(
                f"registration: version {version!r:.40} is not supported (this kvwire reads {REGISTRATION_VERSION})"
            )
        unknown = sorted(map(str, set(data) - _FIELDS))
        if unknown:
            raise InvalidTransferError(f"registration: unknown fields {unknown}")
        prefill_ids, decode_ids = _ids(data, "prefill_block_ids"), _ids(data, "decode_block_ids")
        if len(prefill_ids) != len(decode_ids):
            raise InvalidTransferError(
                f"registration: {len(prefill_ids)} prefill_block_ids but {len(decode_ids)} decode_block_ids; "
                "block i of one lands on block i of the other"
            )
        valid = data.get("valid_for_s")
        if isinstance(valid, bool) or not isinstance(valid, (int, float)) or not (valid > 0 and math.isfinite(valid)):
            raise InvalidTransferError(
                f"registration: 'valid_for_s' must be a number of seconds > 0, got {valid!r:.40}"
            )
        order = data.get("block_order", "head-major")
        if not isinstance(order, str) or order not in BLOCK_ORDERS:
            raise InvalidTransferError(
                f"registration: 'block_order' must be one of {sorted(BLOCK_ORDERS)}, got {order!r:.40}"
            )
        layers = data.get("layers")
        if not isinstance(layers, list) or not all(isinstance(n, str) for n in layers):
            raise InvalidTransferError(f"registration: 'layers' must be a list of layer names, got {layers!r:.80}")
        for i, name in enumerate(layers):
            _utf8(name, f"layers[{i}]")
        prefill_request_id, decode_request_id = _text(data, "prefill_request_id"), _text(data, "decode_request_id")
        tp_rank, tp_size = _int(data, "tp_rank", 0), _int(data, "tp_size", 1)
        peer = PeerDescription.from_dict(data.get("peer"))
        _utf8(peer.endpoint, "the peer's endpoint")
        token = data.get("token")
        if token is not None and not (isinstance(token, str) and len(token) == _TOKEN_CHARS and set(token) <= _HEX):
            raise InvalidTransferError(
                f"registration: 'token' must be {_TOKEN_CHARS} lowercase hex digits, got {token!r:.60}"
            )
        return cls(
            prefill_request_id=prefill_request_id,
            decode_request_id=decode_request_id,
            prefill_block_ids=prefill_ids,
            decode_block_ids=decode_ids,
            layers=tuple(layers),
            tp_rank=tp_rank,
            tp_size=tp_size,
            valid_for_s=float(valid),
            peer=peer,
            block_order=cast(BlockOrder, order),
            token=token,
        )
