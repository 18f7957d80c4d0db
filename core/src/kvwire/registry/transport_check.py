"""The short path validated at load: a :class:`kvwire.TransportBackend`'s transport class against
:class:`kvwire.Transport`, method by method, with the rules and the findings hooks get.

The transport class is read from ``open_transport``'s return annotation (or,
without one, from the class its ``return`` statements construct); nothing is
instantiated. Each method of :class:`kvwire.Transport` the declared spec version
has is compared like a hook: names, order, kinds, defaults, annotations,
``*args``/``**kwargs``. Abstract methods must be implemented; a method a
declared capability needs (:data:`kvwire.spec.capabilities.CAPABILITY_REQUIREMENTS`)
must be implemented, not inherited from :class:`kvwire.Transport`'s refusal;
the other optional methods are compared when overridden.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import re
import textwrap
import typing
from collections.abc import Callable, Mapping
from functools import cache
from types import MappingProxyType
from typing import Any

from kvwire.registry.annotations import UnresolvedAnnotation, resolve_annotation
from kvwire.registry.signatures import Issue, compare_hook, with_self
from kvwire.spec.capabilities import CAPABILITY_REQUIREMENTS
from kvwire.spec.history import SPEC_HISTORY, SpecVersion, transport_method_since
from kvwire.spec.hooks import SpecHook, SpecParam
from kvwire.transport import interface
from kvwire.transport.backend import TransportBackend
from kvwire.transport.interface import RawWriter, Transport

__all__ = ["check_transport", "transport_class", "transport_methods"]

_FIRST = SPEC_HISTORY[0].version
_EXTRA = re.compile(r"parameter `(\w+)` is not in spec ")


def _spec_of(name: str, func: Callable[..., Any]) -> SpecHook:
    hints = typing.get_type_hints(func, vars(interface))
    raw = func.__annotations__
    params = tuple(
        SpecParam(p.name, hints[p.name], str(raw[p.name]), p.default, _FIRST)
        for p in list(inspect.signature(func).parameters.values())[1:]
    )
    return SpecHook(name, params, hints["return"], str(raw["return"]))


@cache
def transport_methods() -> Mapping[str, tuple[SpecHook, SpecVersion]]:
    """Every method of the transport contract (``raw_write`` included): its signature and the version that
    added it. ``endpoint`` is a property; its signature is that of its getter."""
    methods: dict[str, tuple[SpecHook, SpecVersion]] = {}
    for name, member in [*vars(Transport).items(), ("raw_write", vars(RawWriter)["raw_write"])]:
        func = member.fget if isinstance(member, property) else member
        if name.startswith("_") or not callable(func):
            continue
        methods[name] = (_spec_of(name, func), transport_method_since(name) or _FIRST)
    return MappingProxyType(methods)


def _lookup_name(node: ast.expr, namespace: Mapping[str, Any]) -> object:
    """The object a dotted name (``X`` or ``mod.X``) refers to in ``namespace``; None for anything else."""
    if isinstance(node, ast.Name):
        return namespace.get(node.id)
    if isinstance(node, ast.Attribute):
        return getattr(_lookup_name(node.value, namespace), node.attr, None)
    return None


def _returned_classes(func: Callable[..., Any]) -> list[type]:
    """The classes ``func``'s ``return X(...)`` statements construct, looked up in its closure and module."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
        closure = inspect.getclosurevars(func)
    except (OSError, TypeError, SyntaxError, ValueError):
        return []
    namespace = {**vars(builtins), **closure.globals, **dict(getattr(func, "__globals__", {})), **closure.nonlocals}
    found: list[type] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Call):
            value = _lookup_name(node.value.func, namespace)
            if isinstance(value, type) and value not in found:
                found.append(value)
    return found


def transport_class(cls: type) -> tuple[type | None, list[Issue]]:
    """The :class:`kvwire.Transport` subclass ``cls.open_transport`` returns, or an issue saying why not known."""
    func = inspect.getattr_static(cls, "open_transport", None)
    func = func.__func__ if isinstance(func, (staticmethod, classmethod)) else func
    expected = "open_transport(self, config: BackendConfig) -> YourTransport"
    if not callable(func) or getattr(func, "__isabstractmethod__", False):
        return None, [
            Issue(
                "open_transport",
                "missing-method",
                "a TransportBackend must implement `open_transport`",
                f"define `{expected}` returning your kvwire.Transport subclass",
                expected,
                "<absent>",
            )
        ]
    annotation = inspect.signature(func).return_annotation
    try:
        returned = resolve_annotation(annotation, func)
    except UnresolvedAnnotation:
        returned = None
    candidates: list[type] = []
    if isinstance(returned, type) and returned not in (Transport, inspect.Signature.empty):
        candidates.append(returned)
    candidates = candidates or _returned_classes(func)
    concrete = [c for c in candidates if issubclass(c, Transport) and c is not Transport]
    if len(concrete) == 1 and len(candidates) == 1:
        return concrete[0], []
    found = ", ".join(getattr(c, "__qualname__", repr(c)) for c in candidates) or "no class"
    return None, [
        Issue(
            "open_transport",
            "transport-class",
            f"cannot tell which kvwire.Transport subclass `open_transport` returns (found: {found}), so its "
            "methods cannot be checked at load",
            f"annotate the return with the transport class: `{expected}`",
            expected,
            "open_transport -> "
            + ("(no annotation)" if annotation is inspect.Signature.empty else inspect.formatannotation(annotation)),
        )
    ]


def _owner(cls: type, name: str) -> type | None:
    return next((klass for klass in cls.__mro__ if name in vars(klass)), None)


def check_transport(cls: type, version: SpecVersion, capabilities: frozenset[str]) -> list[Issue]:
    """Every difference between the transport of backend ``cls`` and :class:`kvwire.Transport` at ``version``."""
    if not (isinstance(cls, type) and issubclass(cls, TransportBackend)):
        return []
    tcls, issues = transport_class(cls)
    if tcls is None:
        return issues
    needed = {m: f for f, req in CAPABILITY_REQUIREMENTS.items() if f in capabilities for m in req.transport}
    for name, (spec, since) in transport_methods().items():
        if since > version:
            continue
        label = f"{tcls.__name__}.{name}"
        owner = _owner(tcls, name)
        member = inspect.getattr_static(tcls, name, None)
        implemented = owner is not None and owner is not Transport
        if not implemented or getattr(member, "__isabstractmethod__", False):
            if name in needed:
                issues.append(
                    Issue(
                        label,
                        "missing-method",
                        f"declares {needed[name]!r} but its transport {tcls.__qualname__} does not implement `{name}`",
                        f"add `def {with_self(spec.signature_text())}` to {tcls.__qualname__}, "
                        f"or drop {needed[name]!r} from capabilities",
                        spec.signature_text(),
                        "<absent>",
                    )
                )
            elif getattr(vars(Transport).get(name), "__isabstractmethod__", False) or (
                name == "endpoint" and not implemented
            ):
                issues.append(
                    Issue(
                        label,
                        "missing-method",
                        f"required method `{name}` of kvwire.Transport is not implemented",
                        f"add `def {with_self(spec.signature_text())}` to {tcls.__qualname__}",
                        spec.signature_text(),
                        "<absent>",
                    )
                )
            continue
        where = None if owner is tcls else f"{owner.__module__}:{owner.__qualname__}"  # type: ignore[union-attr]
        if name == "endpoint":
            if not isinstance(member, property):
                issues.append(
                    Issue(
                        label,
                        "parameter-kind",
                        "`endpoint` must be a property, as in kvwire.Transport",
                        "decorate it with @property: `@property def endpoint(self) -> str`",
                        "@property endpoint(self) -> str",
                        f"endpoint = {type(member).__name__}",
                        where,
                    )
                )
                continue
            member = member.fget
        if isinstance(member, (staticmethod, classmethod)) or not callable(member):
            issues.append(
                Issue(
                    label,
                    "parameter-kind",
                    f"`{name}` must be a plain method, as in kvwire.Transport",
                    f"define `def {name}(self, ...)` as in kvwire.Transport",
                    spec.signature_text(),
                    f"{name} = {type(member).__name__}",
                    where,
                )
            )
            continue
        for issue in compare_hook(spec, member, True):
            message, fix = issue.message, issue.fix
            extra = _EXTRA.match(message)
            if issue.rule == "unknown-parameter" and extra:
                message = f"parameter `{extra[1]}` is not in kvwire.Transport.{name}"
                fix = f"remove `{extra[1]}`: kvwire.TransportBackend calls `{spec.signature_text()}`, never with it"
            issues.append(Issue(label, issue.rule, message, fix, issue.spec_signature, issue.impl_signature, where))
    return issues
