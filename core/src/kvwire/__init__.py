"""kvwire: move KV-cache pages between prefill and decode through validated, pluggable backends.

Backend authors implement :class:`BackendSpec`'s hooks as methods marked
``@kvwire.hookimpl`` on a class taking one :class:`BackendConfig`, and register
it under the entry-point group ``kvwire.backends``. Users call
:func:`connect`. Every backend is validated against the spec when it loads.
"""

from kvwire.capabilities import FEATURES
from kvwire.config import BackendConfig
from kvwire.connection import Connection
from kvwire.errors import (
    BackendDriftError,
    BackendError,
    BackendNotAvailableError,
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
from kvwire.layout import KVBuffer, KVLayout, LayoutError
from kvwire.markers import ENTRY_POINT_GROUP, hookimpl, hookspec
from kvwire.planning import TransferPlan, plan_transfer
from kvwire.registry import BackendInfo, Registry, connect, default_registry, register_backend
from kvwire.spec import SPEC_HISTORY, SPEC_VERSION, BackendSpec, SpecVersion
from kvwire.validator import ValidationResult, validate_backend

__version__ = "0.1.0"

__all__ = [
    "ENTRY_POINT_GROUP",
    "FEATURES",
    "SPEC_HISTORY",
    "SPEC_VERSION",
    "BackendConfig",
    "BackendDriftError",
    "BackendError",
    "BackendInfo",
    "BackendNotAvailableError",
    "BackendSpec",
    "BackendUnavailableError",
    "ConfigError",
    "Connection",
    "DuplicateBackendError",
    "Finding",
    "InvalidTransferError",
    "KVBuffer",
    "KVLayout",
    "KvwireError",
    "LayoutError",
    "PeerUnreachableError",
    "Registry",
    "SpecVersion",
    "TransferError",
    "TransferPlan",
    "TransferTimeoutError",
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
