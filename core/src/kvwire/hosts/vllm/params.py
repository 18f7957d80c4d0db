"""The ``kv_transfer_params`` a prefill returns from ``request_finished`` and a decode request carries.

They follow vLLM's NIXL connectors, so vLLM's disaggregation proxies forward them
unchanged: the prefill's request carries ``{"do_remote_decode": true}``; its
``request_finished`` returns :func:`prefill_params` (``do_remote_prefill``,
``remote_block_ids``, ``remote_engine_id``, ``remote_request_id``,
``remote_host``, ``remote_port``, ``tp_size``, ``remote_num_tokens``), which the
proxy hands to the decode request. ``transfer_mode`` is ``"push"`` and
``kvwire`` the version of this format. They cross a proxy, so the decode parses
them strictly (:func:`parse_remote_prefill`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from kvwire.errors import InvalidTransferError

__all__ = ["MAX_TEXT_CHARS", "MAX_TP_SIZE", "PARAMS_VERSION", "RemotePrefill", "parse_remote_prefill", "prefill_params"]

#: The version of the ``kv_transfer_params`` this connector writes and reads (key ``"kvwire"``).
PARAMS_VERSION: Final = 1
#: Longest string field (request and engine ids, host): the registration's limit on its ids.
MAX_TEXT_CHARS: Final = 1024
#: Largest prefill ``tp_size`` a decode takes: each of its ranks registers with up to this many prefill ranks.
MAX_TP_SIZE: Final = 256


@dataclass(frozen=True)
class RemotePrefill:
    """Where a decode request's KV is: the prefill's request, its engine, blocks and side channel."""

    request_id: str
    engine_id: str
    host: str
    port: int
    block_ids: tuple[int, ...]
    tp_size: int
    num_tokens: int


def prefill_params(
    request_id: str, engine_id: str, host: str, port: int, block_ids: Sequence[int], tp_size: int, num_tokens: int
) -> dict[str, Any]:
    """What the prefill's ``request_finished`` returns for the decode request (see the module docstring)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [int(b) for b in block_ids],
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": tp_size,
        "remote_num_tokens": num_tokens,
        "transfer_mode": "push",
        "kvwire": PARAMS_VERSION,
    }


def _shown(value: object, limit: int = 40) -> str:
    """``value``'s repr cut to ``limit`` characters; an int of thousands of digits by its size (no repr of it)."""
    if isinstance(value, int) and value.bit_length() > 256:
        return f"an int of {value.bit_length()} bits"
    return f"{value!r:.{limit}}"


def _field(params: Mapping[str, Any], name: str, kind: type, minimum: int | None = None) -> Any:
    value: Any = params.get(name)
    if isinstance(value, bool) or not isinstance(value, kind) or (kind is str and not value):
        raise InvalidTransferError(
            f"kv_transfer_params[{name!r}] must be a{'n int' if kind is int else ' non-empty string'}, "
            f"got {_shown(value, 80)}: the prefill's request_finished sets it"
        )
    if minimum is not None and isinstance(value, int) and value < minimum:
        raise InvalidTransferError(f"kv_transfer_params[{name!r}] must be >= {minimum}, got {value}")
    if isinstance(value, str):
        if len(value) > MAX_TEXT_CHARS:
            raise InvalidTransferError(
                f"kv_transfer_params[{name!r}] is {len(value)} characters, over the limit of {MAX_TEXT_CHARS}: "
                f"{value!r:.60}"
            )
        try:
            value.encode()
        except UnicodeEncodeError as exc:
            raise InvalidTransferError(
                f"kv_transfer_params[{name!r}] is not UTF-8 text ({exc.reason} at character {exc.start}): {value!r:.60}"
            ) from None
    return value


def _block_ids(raw: object) -> tuple[int, ...]:
    # NIXL's form is one list per KV-cache group; this connector writes one flat list (one group)
    if isinstance(raw, (list, tuple)) and len(raw) == 1 and isinstance(raw[0], (list, tuple)):
        raw = raw[0]
    if not isinstance(raw, (list, tuple)) or not raw:
        raise InvalidTransferError(
            f"kv_transfer_params['remote_block_ids'] must be a non-empty list of block ids, got {raw!r:.80}"
        )
    for i, b in enumerate(raw):
        if isinstance(b, bool) or not isinstance(b, int) or b < 0:
            raise InvalidTransferError(f"kv_transfer_params['remote_block_ids'][{i}] = {b!r:.40} is not a block id")
    return tuple(raw)


def parse_remote_prefill(params: Mapping[str, Any]) -> RemotePrefill:
    """The decode side's view of ``params``; :class:`kvwire.InvalidTransferError` naming the key otherwise.

    Bounded as the registration is: strings at most :data:`MAX_TEXT_CHARS` characters of UTF-8 text, ``tp_size``
    at most :data:`MAX_TP_SIZE`, ``remote_port`` a TCP port for every prefill rank (``remote_port + rank``), and the
    version the int ``1`` as written (``1.0`` or ``true`` are not).
    """
    version = params.get("kvwire")
    if type(version) is not int or version != PARAMS_VERSION:
        raise InvalidTransferError(
            f"kv_transfer_params['kvwire'] = {_shown(version)}: not written by this connector's prefill "
            f"(this kvwire reads version {PARAMS_VERSION}); run kvwire's KvwireConnector on both sides"
        )
    tp_size = _field(params, "tp_size", int, 1)
    if tp_size > MAX_TP_SIZE:
        raise InvalidTransferError(
            f"kv_transfer_params['tp_size'] = {_shown(tp_size)} is over the largest prefill TP size this connector "
            f"takes ({MAX_TP_SIZE})"
        )
    port = _field(params, "remote_port", int, 1)
    if port > 65535:
        raise InvalidTransferError(f"kv_transfer_params['remote_port'] must be a TCP port 1..65535, got {_shown(port)}")
    if port + tp_size - 1 > 65535:
        raise InvalidTransferError(
            f"kv_transfer_params['remote_port'] = {_shown(port)} is not a TCP port for each of the prefill's "
            f"{tp_size} ranks (ports remote_port .. remote_port + {tp_size - 1} must be at most 65535)"
        )
    return RemotePrefill(
        request_id=_field(params, "remote_request_id", str),
        engine_id=_field(params, "remote_engine_id", str),
        host=_field(params, "remote_host", str),
        port=port,
        block_ids=_block_ids(params.get("remote_block_ids")),
        tp_size=tp_size,
        num_tokens=_field(params, "remote_num_tokens", int, 0),
    )
