"""The hook specification of a kvwire transfer backend: :class:`BackendSpec` and its signatures per version.

The hookspecs below are the contract; :mod:`kvwire.spec.history` says which
version added what, and :func:`spec_hooks` gives the hooks of any version.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from functools import cache
from types import MappingProxyType
from typing import Any

from kvwire.spec.history import HOOK_FEATURES, PARAMETER_FEATURES, SPEC_HISTORY, SpecVersion, hook_since
from kvwire.spec.notifications import Notification
from kvwire.spec.pluggy_project import hookspec
from kvwire.spec.protocol import BackendProtocol
from kvwire.spec.request import TransferRequest

__all__ = ["BackendSpec", "SpecHook", "SpecParam", "features_at", "spec_hooks"]


def _required(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` (a required hook as :class:`BackendProtocol` declares it) marked as a firstresult hookspec."""
    marked: Callable[..., Any] = hookspec(firstresult=True)(hook)
    return marked


class BackendSpec:
    """The hooks every backend implements, as methods marked ``@kvwire.hookimpl``.

    A backend class is constructed with one :class:`kvwire.BackendConfig`.
    Calls reach it through pluggy, one backend per connection, so every hook
    is ``firstresult``; middleware may wrap them with ``wrapper=True``.
    """

    # The required hooks: declared once, in BackendProtocol (the static type), marked here.
    register_kv_buffers = _required(BackendProtocol.register_kv_buffers)
    endpoint = _required(BackendProtocol.endpoint)
    add_peer = _required(BackendProtocol.add_peer)
    remove_peer = _required(BackendProtocol.remove_peer)
    send_kvcache = _required(BackendProtocol.send_kvcache)

    # The optional hooks of spec 1.5 (a Protocol cannot make a member optional).
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

    close = _required(BackendProtocol.close)


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

    hooks: dict[str, SpecHook] = {}
    for name, func in vars(BackendSpec).items():
        if not callable(func) or name.startswith("_"):
            continue
        hints = typing.get_type_hints(func)  # in the module that declares it
        raw = func.__annotations__
        params = tuple(
            SpecParam(p.name, hints[p.name], str(raw[p.name]), p.default, _since(name, p.name))
            for p in list(inspect.signature(func).parameters.values())[1:]
        )
        hooks[name] = SpecHook(name, params, hints["return"], str(raw["return"]))
    return MappingProxyType(hooks)


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


def features_at(version: SpecVersion) -> frozenset[str]:
    """The parameter-bound and hook-bound features present in the spec at ``version``."""
    hooks = spec_hooks(version)
    present = {p.name for p in hooks["send_kvcache"].params}
    return frozenset(
        [feature for param, feature in PARAMETER_FEATURES.items() if param in present]
        + [feature for hook, feature in HOOK_FEATURES.items() if hook in hooks]
    )
