"""NIXL's exceptions mapped onto kvwire's, by class name (NIXL's classes live in its private bindings).

NIXL raises one class per status (``nixlNotFoundError`` for ``NIXL_ERR_NOT_FOUND``
...). Which kvwire error a status means depends on when it is raised: while a
transfer is prepared (nothing has moved yet) or after it was posted.
"""

from __future__ import annotations

from typing import Final

import kvwire

__all__ = ["nixl_error_name", "translate"]

#: Raised while preparing: the request (descriptors, registrations, peer metadata) is wrong.
_INVALID: Final = frozenset(
    {
        "nixlNotFoundError",
        "nixlInvalidParamError",
        "nixlMismatchError",
        "nixlNotAllowedError",
        "nixlNotSupportedError",
    }
)
_PEER_GONE: Final = frozenset({"nixlRemoteDisconnectError"})


def nixl_error_name(exc: BaseException) -> str | None:
    """The NIXL exception class ``exc`` is (or derives from), else None."""
    return next((c.__name__ for c in type(exc).__mro__ if c.__name__.startswith("nixl")), None)


def translate(exc: BaseException, what: str, peer: str | None, *, posted: bool) -> kvwire.KvwireError:
    """The kvwire error for ``exc`` raised by NIXL during ``what`` (``posted``: bytes may have moved)."""
    if isinstance(exc, kvwire.KvwireError):
        return exc
    name = nixl_error_name(exc)
    detail = f"{name or type(exc).__name__}: {exc}"
    if name in _PEER_GONE:
        return kvwire.PeerUnreachableError(f"{what}: the peer disconnected ({detail})", peer=peer)
    if name in _INVALID and not posted:
        return kvwire.InvalidTransferError(f"{what} refused by NIXL before anything was sent ({detail})")
    moved = "the destination may be partly written" if posted else "nothing was sent"
    return kvwire.TransferError(f"{what} failed in NIXL ({detail}); {moved}", peer=peer)
