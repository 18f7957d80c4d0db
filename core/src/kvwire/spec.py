"""The hook specification of a kvwire transfer backend, and its version history.

The hookspecs below are the contract. Their history is data
(:data:`SPEC_HISTORY`): each minor version may add optional ``send_kvcache``
parameters (default None = feature unused), required hooks, or optional hooks
(implemented by a backend that declares their feature), and the signature of
an older version is the current one minus what came later. The validator
compares a backend with the version it declares, so an old backend keeps
working in an adapted mode instead of crashing.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from functools import cache, total_ordering
from types import MappingProxyType
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from kvwire.layout import KVLayout
from kvwire.markers import hookspec
from kvwire.notifications import Notification

if TYPE_CHECKING:
    from kvwire.planning import TransferRequest

__all__ = [
    "PARAMETER_FEATURES",
    "SPEC_HISTORY",
    "SPEC_VERSION",
    "HOOK_FEATURES",
    "AddedParameter",
    "BackendSpec",
    "OptionalHook",
    "SpecHook",
    "SpecParam",
    "SpecRelease",
    "SpecVersion",
    "spec_hooks",
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


@dataclass(frozen=True)
class SpecRelease:
    """One spec version: the optional parameters, the required hooks and the optional hooks it added."""

    version: SpecVersion
    added: tuple[AddedParameter, ...] = ()
    added_hooks: tuple[str, ...] = ()
    optional_hooks: tuple[OptionalHook, ...] = ()


SPEC_HISTORY: tuple[SpecRelease, ...] = (
    SpecRelease(SpecVersion(1, 0)),
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
    SpecRelease(SpecVersion(1, 4), added_hooks=("remove_peer",)),
    SpecRelease(
        SpecVersion(1, 5),
        optional_hooks=(
            OptionalHook(
                "submit_kvcache",
                "submit",
                "native non-blocking sends; without it the core runs send_kvcache on a worker pool",
            ),
            OptionalHook("send_notification", "notifications", "short messages delivered after the data"),
            OptionalHook("poll_notifications", "notifications", "the messages that arrived at this endpoint"),
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


class BackendSpec:
    """The hooks every backend implements, as methods marked ``@kvwire.hookimpl``.

    A backend class is constructed with one :class:`kvwire.BackendConfig`.
    Calls reach it through pluggy, one backend per connection, so every hook
    is ``firstresult``; middleware may wrap them with ``wrapper=True``.
    """

    @hookspec(firstresult=True)
    def register_kv_buffers(self, layout: KVLayout) -> None:
        """Register the local KV memory this endpoint sends from or receives into."""

    @hookspec(firstresult=True)
    def endpoint(self) -> str:
        """The id peers pass as ``session_id`` to reach this endpoint."""
        raise NotImplementedError

    @hookspec(firstresult=True)
    def add_peer(self, session_id: str, layout: KVLayout) -> None:
        """Learn a peer's KV layout (published by the peer) before sending to it."""

    @hookspec(firstresult=True)
    def remove_peer(self, session_id: str) -> None:
        """Forget a peer: its layout and the engine's per-peer resources (spec 1.4); unknown ids are a no-op."""

    @hookspec(firstresult=True)
    def send_kvcache(
        self,
        session_id: str,
        prefill_kv_indices: NDArray[np.int32],
        dst_kv_ptrs: Sequence[int],
        dst_kv_indices: NDArray[np.int32],
        executor: Executor | None,
        dst_layer_ids: Sequence[int] | None = None,
        dst_device_kv_indices: NDArray[np.int32] | None = None,
        dst_kv_item_len: int | None = None,
        dst_attn_tp_size: int | None = None,
    ) -> int:
        """Write the pages ``prefill_kv_indices`` into the peer; return the bytes moved.

        The parameters follow sglang's ``MooncakeKVManager.send_kvcache`` (0.5.18+),
        with ``session_id`` for its ``mooncake_session_id``. Failures raise
        :class:`kvwire.TransferError` (or a subclass), never a status code.
        """
        raise NotImplementedError

    @hookspec(firstresult=True)
    def submit_kvcache(
        self, session_id: str, request: TransferRequest, notification: bytes | None = None
    ) -> Future[int]:
        """Start the send of a checked ``request`` and return at once (optional, feature ``submit``; spec 1.5).

        Input errors are raised here, synchronously, before anything is queued;
        the future then holds the bytes moved or the :class:`kvwire.TransferError`.
        ``notification`` (at most :data:`kvwire.MAX_NOTIFICATION_BYTES`) reaches the
        peer after this transfer's bytes, like :meth:`send_notification`.
        """
        raise NotImplementedError

    @hookspec(firstresult=True)
    def send_notification(self, session_id: str, message: bytes) -> None:
        """Deliver ``message`` to the peer after the bytes of every send to it that has completed
        (optional, feature ``notifications``; spec 1.5)."""

    @hookspec(firstresult=True)
    def poll_notifications(self) -> list[Notification]:
        """The notifications that arrived at this endpoint since the last call, each once, in arrival order
        for each sender (optional, feature ``notifications``; spec 1.5)."""
        raise NotImplementedError

    @hookspec(firstresult=True)
    def close(self) -> None:
        """Release engine resources and unregister memory; idempotent."""


@dataclass(frozen=True)
class SpecParam:
    """One spec parameter: resolved annotation, source text, default, and version."""

    name: str
    annotation: object
    annotation_text: str
    default: object
    since: SpecVersion

    @property
    def declaration(self) -> str:
        """The parameter as it should be written in an implementation."""
        text = f"{self.name}: {self.annotation_text}"
        return text if self.default is inspect.Parameter.empty else f"{text} = {self.default!r}"


@dataclass(frozen=True)
class SpecHook:
    """One hook of the spec at one version."""

    name: str
    params: tuple[SpecParam, ...]
    returns: object
    returns_text: str

    def signature_text(self) -> str:
        return f"{self.name}({', '.join(p.declaration for p in self.params)}) -> {self.returns_text}"


def _since(hook: str, param: str) -> SpecVersion:
    for release in SPEC_HISTORY:
        if any((p.hook, p.name) == (hook, param) for p in release.added):
            return release.version
    return SPEC_HISTORY[0].version


@cache
def _all_hooks() -> Mapping[str, SpecHook]:
    import typing

    from kvwire.planning import TransferRequest  # planning imports this module

    hooks: dict[str, SpecHook] = {}
    for name, func in vars(BackendSpec).items():
        if not callable(func) or name.startswith("_"):
            continue
        hints = typing.get_type_hints(func, {**globals(), "TransferRequest": TransferRequest})
        raw = func.__annotations__
        params = tuple(
            SpecParam(p.name, hints[p.name], str(raw[p.name]), p.default, _since(name, p.name))
            for p in list(inspect.signature(func).parameters.values())[1:]
        )
        hooks[name] = SpecHook(name, params, hints["return"], str(raw["return"]))
    return MappingProxyType(hooks)


def hook_since(name: str) -> SpecVersion:
    """The spec version that added hook ``name``."""
    for release in SPEC_HISTORY:
        if name in release.added_hooks or any(h.name == name for h in release.optional_hooks):
            return release.version
    return SPEC_HISTORY[0].version


@cache
def spec_hooks(version: SpecVersion) -> Mapping[str, SpecHook]:
    """The hooks of the spec at ``version``: hooks and parameters added later are left out."""
    return MappingProxyType(
        {
            name: SpecHook(
                hook.name, tuple(p for p in hook.params if p.since <= version), hook.returns, hook.returns_text
            )
            for name, hook in _all_hooks().items()
            if hook_since(name) <= version
        }
    )


def known_versions() -> tuple[SpecVersion, ...]:
    """Every spec version this core implements, oldest first."""
    return tuple(r.version for r in SPEC_HISTORY)


def features_at(version: SpecVersion) -> frozenset[str]:
    """The parameter-bound and hook-bound features present in the spec at ``version``."""
    hooks = spec_hooks(version)
    present = {p.name for p in hooks["send_kvcache"].params}
    return frozenset(
        [feature for param, feature in PARAMETER_FEATURES.items() if param in present]
        + [feature for hook, feature in HOOK_FEATURES.items() if hook in hooks]
    )


CURRENT = SpecVersion.parse(SPEC_VERSION)
assert SPEC_HISTORY[-1].version == CURRENT, "SPEC_VERSION must be the newest release in SPEC_HISTORY"
