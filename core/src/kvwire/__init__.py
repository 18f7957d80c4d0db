"""kvwire: move KV-cache pages between prefill and decode through validated, pluggable backends.

Backend authors subclass :class:`TransportBackend` and supply a
:class:`Transport` (the short path), or implement :class:`BackendSpec`'s hooks
as methods marked ``@kvwire.hookimpl`` on a class taking one
:class:`BackendConfig` (the long one), and register it under the entry-point
group ``kvwire.backends``. Users call :func:`connect`. Every backend is
validated against the spec when it loads.
"""

from kvwire.config import BackendConfig, ResolvedConfig, resolve_config
from kvwire.connection.connection import Connection
from kvwire.connection.deadline import CALL_GRACE_S, StuckCall
from kvwire.connection.watcher import Arrival, NotificationWatcher
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
from kvwire.landing import Landing, LandingCredits
from kvwire.layout.buffers import HeadLayout, KVBuffer, LayoutError
from kvwire.layout.kv_layout import KVLayout
from kvwire.layout.peer import PeerDescription
from kvwire.planning.plan import TransferPlan
from kvwire.planning.planner import plan_transfer
from kvwire.registry.findings import BackendOrigin, Finding
from kvwire.registry.installed import core_version
from kvwire.registry.loading import BackendInfo
from kvwire.registry.manager import Registry, connect, default_registry, register_backend
from kvwire.registry.validator import ValidationResult, validate_backend
from kvwire.spec.capabilities import FEATURES
from kvwire.spec.history import SPEC_HISTORY, SPEC_VERSION, SpecVersion
from kvwire.spec.hooks import BackendSpec
from kvwire.spec.notifications import MAX_NOTIFICATION_BYTES, Notification
from kvwire.spec.pluggy_project import ENTRY_POINT_GROUP, hookimpl, hookspec
from kvwire.spec.protocol import BackendProtocol
from kvwire.spec.request import TransferRequest
from kvwire.transport.backend import TransportBackend
from kvwire.transport.futures import TransferFuture
from kvwire.transport.interface import RawWriter, Transport, TransportTuning
from kvwire.transport.regions import RegionSet

__version__ = core_version()  # from the installed metadata: pyproject.toml is the one source

__all__ = [
    "CALL_GRACE_S",
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
    "BackendOrigin",
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
    "Landing",
    "LandingCredits",
    "LayoutError",
    "Notification",
    "NotificationWatcher",
    "PeerDescription",
    "PeerUnreachableError",
    "RawWriter",
    "RegionSet",
    "Registry",
    "ResolvedConfig",
    "SpecVersion",
    "StuckCall",
    "TransferError",
    "TransferFuture",
    "TransferPlan",
    "TransferRequest",
    "TransferTimeoutError",
    "Transport",
    "TransportBackend",
    "TransportTuning",
    "UnsupportedFeatureError",
    "ValidationResult",
    "__version__",
    "connect",
    "default_registry",
    "hookimpl",
    "hookspec",
    "plan_transfer",
    "register_backend",
    "resolve_config",
    "validate_backend",
]
