"""Backends in: discovery of entry points, loading, validation against the spec, isolation for ``kvwire check``.

Names re-exported for readers of ``kvwire.registry``; the core imports from the defining module.
"""

from kvwire.registry.findings import BackendOrigin, Finding
from kvwire.registry.manager import BackendInfo, Registry, connect, default_registry, register_backend
from kvwire.registry.validator import ValidationResult, validate_backend

__all__ = [
    "BackendInfo",
    "BackendOrigin",
    "Finding",
    "Registry",
    "ValidationResult",
    "connect",
    "default_registry",
    "register_backend",
    "validate_backend",
]
