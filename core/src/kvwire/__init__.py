"""kvwire: move KV-cache pages between prefill and decode through validated, pluggable backends.

Backend authors subclass :class:`TransportBackend` and supply a
:class:`Transport` (the short path), or implement :class:`BackendSpec`'s hooks
as methods marked ``@kvwire.hookimpl`` on a class taking one
:class:`BackendConfig` (the long one), and register it under the entry-point
group ``kvwire.backends``. Users call :func:`connect`. Every backend is
validated against the spec when it loads.
"""

from kvwire.about import core_version
from kvwire.base import RawWriter, Transport, TransportBackend
from kvwire.capabilities import FEATURES
from kvwire.config import BackendConfig
from kvwire.connection import Connection
from kvwire.errors import (
    BackendDriftError,
    BackendError,
    BackendImportError,
    BackendLoadError,
    BackendUnavailableError,
    ConfigError,
    DuplicateBackendError,
    InvalidTransferError,
    KvwireError,
    PeerUnreachableError,
    TransferError,
    TransferTimeoutError,
    UnsupportedFeatureError,
)
from kvwire.findings import Finding
from kvwire.futures import TransferFuture
from kvwire.layout import HeadLayout, KVBuffer, KVLayout, LayoutError
from kvwire.markers import ENTRY_POINT_GROUP, hookimpl, hookspec
from kvwire.notifications import MAX_NOTIFICATION_BYTES, Notification
from kvwire.peer import PeerDescription
from kvwire.planning import TransferPlan, TransferRequest, plan_transfer
from kvwire.protocol import BackendProtocol
from kvwire.regions import RegionSet
from kvwire.registry import BackendInfo, Registry, connect, default_registry, register_backend
from kvwire.spec import SPEC_HISTORY, SPEC_VERSION, BackendSpec, SpecVersion
from kvwire.validator import ValidationResult, validate_backend
from kvwire.watcher import Arrival, NotificationWatcher

__version__ = core_version()  # from the installed metadata: pyproject.toml is the one source

__all__ = [
    "ENTRY_POINT_GROUP",
    "FEATURES",
    "MAX_NOTIFICATION_BYTES",
    "SPEC_HISTORY",
    "SPEC_VERSION",
    "Arrival",
    "BackendConfig",
    "BackendDriftError",
    "BackendError",
    "BackendImportError",
    "BackendInfo",
    "BackendProtocol",
    "BackendLoadError",
    "BackendSpec",
    "BackendUnavailableError",
    "ConfigError",
    "Connection",
    "DuplicateBackendError",
    "Finding",
    "HeadLayout",
    "InvalidTransferError",
    "KVBuffer",
    "KVLayout",
    "KvwireError",
    "LayoutError",
    "Notification",
    "NotificationWatcher",
    "PeerDescription",
    "PeerUnreachableError",
    "RawWriter",
    "RegionSet",
    "Registry",
    "SpecVersion",
    "TransferError",
    "TransferFuture",
    "TransferPlan",
    "TransferRequest",
    "TransferTimeoutError",
    "Transport",
    "TransportBackend",
    "UnsupportedFeatureError",
    "ValidationResult",
    "__version__",
    "connect",
    "default_registry",
    "hookimpl",
    "hookspec",
    "plan_transfer",
    "register_backend",
    "validate_backend",
]
