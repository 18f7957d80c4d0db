"""The spec's version history, as data: what each ``major.minor`` release added.

Each minor version may add optional ``send_kvcache`` parameters (default None
= feature unused), required hooks, optional hooks (implemented by a backend
that declares their feature) and methods of :class:`kvwire.Transport`. The
signature of an older version is the current one minus what came later, so the
validator compares a backend with the version it declares and an old backend
keeps working in an adapted mode instead of crashing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import total_ordering
from types import MappingProxyType

__all__ = [
    "CURRENT",
    "HOOK_FEATURES",
    "PARAMETER_FEATURES",
    "SPEC_HISTORY",
    "SPEC_VERSION",
    "AddedParameter",
    "OptionalHook",
    "SpecRelease",
    "SpecVersion",
    "hook_since",
    "known_versions",
    "transport_method_since",
]

SPEC_VERSION = "1.5"


@total_ordering
@dataclass(frozen=True)
class SpecVersion:
    """A ``major.minor`` spec version."""

    major: int
    minor: int

    @classmethod
    def parse(cls, text: object) -> SpecVersion:
        """Parse ``"1.2"``; ValueError on anything else."""
        if not isinstance(text, str):
            raise ValueError(f"spec version must be a string like '1.2', got {type(text).__name__} {text!r}")
        parts = text.split(".")
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            raise ValueError(f"spec version must look like '1.2', got {text!r}")
        return cls(int(parts[0]), int(parts[1]))

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, SpecVersion):
            return NotImplemented
        return (self.major, self.minor) < (other.major, other.minor)

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}"


@dataclass(frozen=True)
class AddedParameter:
    """An optional ``send_kvcache`` parameter added by a minor version (None = unused).

    ``feature`` is the capability a backend declares to honour a non-None value,
    or None for a guard that the core checks itself for every backend (so an
    older backend, which never receives it, is still protected by it);
    ``purpose`` says what the parameter is for.
    """

    hook: str
    name: str
    feature: str | None
    purpose: str


@dataclass(frozen=True)
class OptionalHook:
    """A hook added by a minor version that a backend implements only if it declares ``feature``.

    A backend without the feature may leave it out (the core then provides the
    behaviour, or refuses the call); one that has it is validated like any hook.
    """

    name: str
    feature: str
    purpose: str
    transport: str  # the kvwire.Transport method that serves it for a TransportBackend


@dataclass(frozen=True)
class SpecRelease:
    """One spec version: what it added to the hooks, and to :class:`kvwire.Transport`.

    ``added``: optional ``send_kvcache`` parameters; ``added_hooks``: required
    hooks; ``optional_hooks``: hooks bound to a feature; ``transport_methods``:
    required methods of the transport (a transport's optional methods come with
    the optional hook they serve).
    """

    version: SpecVersion
    added: tuple[AddedParameter, ...] = ()
    added_hooks: tuple[str, ...] = ()
    optional_hooks: tuple[OptionalHook, ...] = ()
    transport_methods: tuple[str, ...] = ()


SPEC_HISTORY: tuple[SpecRelease, ...] = (
    SpecRelease(
        SpecVersion(1, 0),
        transport_methods=("endpoint", "register_memory", "unregister_memory", "write", "add_peer", "close"),
    ),
    SpecRelease(
        SpecVersion(1, 1),
        (AddedParameter("send_kvcache", "dst_layer_ids", "layer_ids", "pipeline-parallel layer mapping"),),
    ),
    SpecRelease(
        SpecVersion(1, 2),
        (
            AddedParameter(
                "send_kvcache",
                "dst_device_kv_indices",
                "device_kv_indices",
                "HiSparse split host/device destinations",
            ),
        ),
    ),
    SpecRelease(
        SpecVersion(1, 3),
        (
            AddedParameter(
                "send_kvcache",
                "dst_kv_item_len",
                None,
                "the peer's bytes per page as the caller knows it; checked against the peer's layout",
            ),
            AddedParameter(
                "send_kvcache",
                "dst_attn_tp_size",
                None,
                "the peer's attention tensor-parallel size as the caller knows it; checked against the peer's layout",
            ),
        ),
    ),
    SpecRelease(SpecVersion(1, 4), added_hooks=("remove_peer",), transport_methods=("forget_peer",)),
    SpecRelease(
        SpecVersion(1, 5),
        optional_hooks=(
            OptionalHook(
                "submit_kvcache",
                "submit",
                "native non-blocking sends; without it the core runs send_kvcache on a worker pool",
                "submit",
            ),
            OptionalHook("send_notification", "notifications", "short messages delivered after the data", "notify"),
            OptionalHook(
                "poll_notifications",
                "notifications",
                "the messages that arrived at this endpoint",
                "poll_notifications",
            ),
        ),
    ),
)

#: ``send_kvcache`` parameter -> the feature that makes a non-None value meaningful (from the history).
PARAMETER_FEATURES: Mapping[str, str] = MappingProxyType(
    {p.name: p.feature for release in SPEC_HISTORY for p in release.added if p.feature is not None}
)


#: Optional hook -> the feature that obliges a backend to implement it (from the history).
HOOK_FEATURES: Mapping[str, str] = MappingProxyType(
    {h.name: h.feature for release in SPEC_HISTORY for h in release.optional_hooks}
)


def hook_since(name: str) -> SpecVersion:
    """The spec version that added hook ``name``."""
    for release in SPEC_HISTORY:
        if name in release.added_hooks or any(h.name == name for h in release.optional_hooks):
            return release.version
    return SPEC_HISTORY[0].version


def transport_method_since(name: str) -> SpecVersion | None:
    """The spec version that added method ``name`` of :class:`kvwire.Transport`; None for one it never had."""
    for release in SPEC_HISTORY:
        if name in release.transport_methods or any(h.transport == name for h in release.optional_hooks):
            return release.version
    return None


def known_versions() -> tuple[SpecVersion, ...]:
    """Every spec version this core implements, oldest first."""
    return tuple(r.version for r in SPEC_HISTORY)


CURRENT = SpecVersion.parse(SPEC_VERSION)
assert SPEC_HISTORY[-1].version == CURRENT, "SPEC_VERSION must be the newest release in SPEC_HISTORY"
