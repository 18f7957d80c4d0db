"""The exceptions kvwire raises: one hierarchy, so callers catch ``KvwireError``.

Transport failures are always exceptions, never status codes: a backend maps
its engine's return codes onto :class:`TransferError` and its subclasses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvwire.registry.findings import Finding

__all__ = [
    "BackendDriftError",
    "BackendError",
    "BackendImportError",
    "BackendLoadError",
    "BackendUnavailableError",
    "ConfigError",
    "DuplicateBackendError",
    "InvalidTransferError",
    "KvwireError",
    "PeerUnreachableError",
    "TransferError",
    "TransferTimeoutError",
    "UnsupportedFeatureError",
]


class KvwireError(Exception):
    """Base class of every error kvwire raises on purpose."""


class ConfigError(KvwireError, ValueError):
    """A configuration value is invalid; the message names the argument."""


class InvalidTransferError(KvwireError, ValueError):
    """A transfer request is invalid; raised before any byte moves.

    The message names the argument and the first offending position and value.
    """


class UnsupportedFeatureError(KvwireError):
    """A feature was asked of a backend that does not implement it.

    Raised when a connection is made with required features the backend lacks,
    or when a call passes a non-None argument for such a feature (before the
    backend is called, so nothing moves).
    """


class BackendError(KvwireError):
    """A backend cannot be loaded or used."""


class BackendLoadError(BackendError, LookupError):
    """The requested backend cannot be loaded: not installed, not allowed, failed to import, or drifted."""


class BackendImportError(BackendLoadError):
    """Importing the backend's module failed (an exception, ``SystemExit`` included); the process goes on.

    The message names the backend, its distribution, version and entry point, what was raised, and the fix.
    """


class BackendUnavailableError(BackendError):
    """The backend loaded and validated, but its runtime (hardware, engine) is missing on this machine."""


class DuplicateBackendError(BackendError):
    """Two distributions (or a runtime registration) claim the same backend name."""


class BackendDriftError(BackendError):
    """One or more backends do not match the hook specification.

    ``findings`` holds every finding of every drifted backend, so one start-up
    reports all of them together.
    """

    def __init__(self, findings: Sequence[Finding]) -> None:
        self.findings: tuple[Finding, ...] = tuple(findings)
        backends = sorted({f.backend for f in self.findings})
        head = f"{len(self.findings)} hook-specification finding(s) in backend(s) {', '.join(backends)}:"
        super().__init__("\n\n".join([head, *(f.render() for f in self.findings)]))


class TransferError(KvwireError):
    """A transfer failed in the transport. ``code`` is the engine's own code, if any."""

    def __init__(self, message: str, *, code: int | None = None, peer: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.peer = peer


class PeerUnreachableError(TransferError):
    """The peer could not be reached (refused, dead, unknown session id)."""


class TransferTimeoutError(TransferError, TimeoutError):
    """The peer did not complete the transfer within the configured timeout."""
