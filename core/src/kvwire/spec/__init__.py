"""The contract: the hook spec, its version history, capabilities, the request, and the typed Protocol.

Data and signatures only: nothing here plans or moves bytes. The names are
re-exported here for readers of ``kvwire.spec``; modules of the core import
from the defining module.
"""

from kvwire.spec.capabilities import CAPABILITY_REQUIREMENTS, FEATURES, Requirement
from kvwire.spec.history import (
    CURRENT,
    HOOK_FEATURES,
    PARAMETER_FEATURES,
    SPEC_HISTORY,
    SPEC_VERSION,
    AddedParameter,
    OptionalHook,
    SpecRelease,
    SpecVersion,
    hook_since,
    known_versions,
    transport_method_since,
)
from kvwire.spec.hooks import BackendSpec, SpecHook, SpecParam, features_at, spec_hooks
from kvwire.spec.request import TransferRequest

__all__ = [
    "CAPABILITY_REQUIREMENTS",
    "CURRENT",
    "FEATURES",
    "HOOK_FEATURES",
    "PARAMETER_FEATURES",
    "SPEC_HISTORY",
    "SPEC_VERSION",
    "AddedParameter",
    "BackendSpec",
    "OptionalHook",
    "Requirement",
    "SpecHook",
    "SpecParam",
    "SpecRelease",
    "SpecVersion",
    "TransferRequest",
    "features_at",
    "hook_since",
    "known_versions",
    "spec_hooks",
    "transport_method_since",
]
