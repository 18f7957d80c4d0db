"""The load-time validator: compare a backend class with the hook spec.

It checks, without instantiating the class: the declared spec version, the
constructor, the capabilities, that every required spec hook (and every
optional hook whose feature the backend declares) is implemented and marked,
that no marked hook is unknown, and for every hook every parameter's presence,
name, order, kind, default and annotation, plus ``*args``/``**kwargs``.
A backend that declares no version gets the newest version it matches exactly.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from kvwire.config import BackendConfig
from kvwire.registry.findings import BackendOrigin, Finding
from kvwire.registry.signatures import (
    EMPTY,
    VAR_KINDS,
    Issue,
    compare_annotation,
    compare_hook,
    impl_parameters,
    with_self,
)
from kvwire.registry.transport_check import check_transport
from kvwire.spec.capabilities import CAPABILITY_REQUIREMENTS, FEATURES, RETIRED_FEATURES
from kvwire.spec.history import CURRENT, HOOK_FEATURES, PARAMETER_FEATURES, SpecVersion, known_versions
from kvwire.spec.hooks import SpecHook, features_at, spec_hooks
from kvwire.spec.pluggy_project import IMPL_ATTR

__all__ = ["Status", "ValidationResult", "validate_backend"]

Status = Literal["ok", "adapted", "drift", "import-error", "duplicate", "blocked", "timeout"]


@dataclass(frozen=True)
class ValidationResult:
    """The verdict on one backend class."""

    status: Status
    spec_version: str | None
    declared_spec_version: str | None
    capabilities: frozenset[str]
    findings: tuple[Finding, ...]


def _lookup(cls: type, name: str) -> tuple[Callable[..., Any] | None, bool]:
    """The hook function ``name`` of ``cls`` and whether it takes ``self``."""
    static = inspect.getattr_static(cls, name, None)
    if static is None:
        return None, False
    if isinstance(static, staticmethod):
        return static.__func__, False
    if isinstance(static, classmethod):
        return static.__func__, True
    return (static, True) if callable(static) else (None, False)


def _is_marked(func: object) -> bool:
    return getattr(func, IMPL_ATTR, None) is not None


def _check_constructor(cls: type) -> list[Issue]:
    expected = "__init__(self, config: BackendConfig)"
    init = inspect.getattr_static(cls, "__init__")
    if init is object.__init__:
        return [
            Issue(
                "__init__",
                "constructor",
                "the class defines no constructor taking the config",
                f"define `{expected}`",
                expected,
                "__init__(self)",
            )
        ]
    params, text = impl_parameters(init, True)
    impl = f"__init__(self{', ' if params else ''}{text[1:]}"
    bad = len(params) != 1 or params[0].name != "config" or params[0].kind in VAR_KINDS
    if not bad and params[0].kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
        bad = True
    if not bad and params[0].default is not EMPTY:
        bad = True
    if bad:
        return [
            Issue(
                "__init__",
                "constructor",
                "the constructor must take exactly one parameter, `config: kvwire.BackendConfig`",
                f"define `{expected}`; backend settings go in BackendConfig.options",
                expected,
                impl,
            )
        ]
    reason = compare_annotation(BackendConfig, "BackendConfig", params[0].annotation, init)
    if reason:
        return [
            Issue("__init__", "constructor", f"parameter `config` {reason}", f"define `{expected}`", expected, impl)
        ]
    return []


def _owner(cls: type, name: str) -> str | None:
    """``module:Qualname`` of the parent class ``cls`` inherits ``name`` from; None when ``cls`` defines it."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return None if klass is cls else f"{klass.__module__}:{klass.__qualname__}"
    return None


def _check_hooks(cls: type, version: SpecVersion) -> list[Issue]:
    return [replace(i, defined_in=_owner(cls, i.hook)) for i in _hook_issues(cls, version)]


def _forward_compatible(name: str, func: Callable[..., Any], is_method: bool, version: SpecVersion) -> SpecHook:
    """The spec hook to compare ``func`` with: that of ``version``, or of a later known version whose
    parameters ``func`` has exactly.

    A backend declaring an older version may already accept the optional parameters a later
    version added (a shared base class written for the current spec does): that is not drift.
    It still honours only its declared version: the Connection refuses later features for it.
    """
    declared = spec_hooks(version)[name]
    names = [p.name for p in impl_parameters(func, is_method)[0]]
    for later in known_versions():
        if later > version and name in spec_hooks(later):
            hook = spec_hooks(later)[name]
            if [p.name for p in hook.params] == names:
                return hook
    return declared


def _claimed_capabilities(cls: type) -> frozenset[str]:
    """The capabilities ``cls`` declares, for fix texts only (a malformed declaration is its own finding)."""
    raw: object = getattr(cls, "capabilities", frozenset())
    if isinstance(raw, (set, frozenset, list, tuple)) and all(isinstance(c, str) for c in raw):
        return frozenset(raw)
    return frozenset()


def _hook_issues(cls: type, version: SpecVersion) -> list[Issue]:
    hooks = spec_hooks(version)
    declared = _claimed_capabilities(cls)
    newest = spec_hooks(CURRENT)
    issues: list[Issue] = []
    for name in sorted(dir(cls)):
        func, _ = _lookup(cls, name)
        if func is not None and _is_marked(func) and name not in hooks and name not in newest:
            close = difflib.get_close_matches(name, list(hooks), n=1, cutoff=0.6)
            hint = f"; did you mean `{close[0]}`?" if close else ""
            issues.append(
                Issue(
                    name,
                    "unknown-hook",
                    f"`{name}` is marked @kvwire.hookimpl but the spec has no such hook{hint}",
                    f"rename it to `{close[0]}`" if close else f"remove the @kvwire.hookimpl marker from `{name}`",
                    f"hooks: {', '.join(hooks)}",
                    name,
                )
            )
    for name, hook in hooks.items():
        func, is_method = _lookup(cls, name)
        if func is None and name in HOOK_FEATURES:
            continue  # optional: required only with its feature (checked with the capabilities)
        if func is None:
            issues.append(
                Issue(
                    name,
                    "missing-hook",
                    f"required hook `{name}` is not implemented",
                    f"add `@kvwire.hookimpl def {with_self(hook.signature_text())}`",
                    hook.signature_text(),
                    "<absent>",
                )
            )
            continue
        if not _is_marked(func):
            issues.append(
                Issue(
                    name,
                    "missing-hook",
                    f"`{name}` is defined but not marked, so pluggy would never call it",
                    f"decorate `{name}` with @kvwire.hookimpl",
                    hook.signature_text(),
                    name,
                )
            )
        compared = _forward_compatible(name, func, is_method, version)
        issues.extend(compare_hook(compared, func, is_method, declared))
    return issues


def _declared_capabilities(cls: type, version: SpecVersion) -> tuple[frozenset[str], list[Issue]]:
    raw: object = getattr(cls, "capabilities", frozenset())
    if (
        isinstance(raw, str)
        or not isinstance(raw, (set, frozenset, list, tuple))
        or not all(isinstance(c, str) for c in raw)
    ):
        return frozenset(), [
            Issue(
                "capabilities",
                "capabilities",
                f"`capabilities` must be a set of feature names, got {raw!r}",
                f"declare e.g. `capabilities = frozenset({{'layer_ids', 'mha'}})`; known: {', '.join(FEATURES)}",
                "capabilities: frozenset[str]",
                f"capabilities = {raw!r}",
            )
        ]
    declared = frozenset(raw)
    issues: list[Issue] = []
    spec_side = f"capabilities <= {{{', '.join(sorted(FEATURES))}}}"
    impl_side = f"capabilities = {{{', '.join(sorted(declared))}}}"
    for name in sorted(declared - set(FEATURES) - set(RETIRED_FEATURES)):
        close = difflib.get_close_matches(name, list(FEATURES), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        issues.append(
            Issue(
                "capabilities",
                "capabilities",
                f"unknown feature {name!r}{hint}",
                f"use known feature names: {', '.join(FEATURES)}",
                spec_side,
                impl_side,
            )
        )
    present = features_at(version)
    for name in sorted(declared & set(CAPABILITY_REQUIREMENTS)):
        requirement = CAPABILITY_REQUIREMENTS[name]
        for hook in requirement.hooks if name in present else ():
            func, _ = _lookup(cls, hook)
            if func is None:
                signature = spec_hooks(version)[hook].signature_text()
                issues.append(
                    Issue(
                        hook,
                        "missing-hook",
                        f"declares {name!r} but does not implement its hook `{hook}`",
                        f"add `@kvwire.hookimpl def {with_self(signature)}`, or drop {name!r}",
                        signature,
                        "<absent>",
                    )
                )
    later = (set(PARAMETER_FEATURES.values()) | set(HOOK_FEATURES.values())) - features_at(version)
    for name in sorted(declared & later):
        issues.append(
            Issue(
                "capabilities",
                "capabilities",
                f"declares {name!r}, but spec {version} has no parameter or hook for it",
                f"declare spec_version {CURRENT} and implement its parameters, or drop {name!r}",
                f"spec {version}: send_kvcache parameters honour {sorted(features_at(version))}",
                impl_side,
            )
        )
    return declared & set(FEATURES), issues


def _declared_version(cls: type) -> tuple[str | None, SpecVersion | None, list[Issue]]:
    """(declared text, parsed version if acceptable, issues)."""
    raw = getattr(cls, "spec_version", None)
    if raw is None:
        return None, None, []
    known = ", ".join(str(v) for v in known_versions())
    try:
        version = SpecVersion.parse(raw)
    except ValueError as exc:
        issue = Issue(
            "spec_version",
            "spec-version",
            str(exc),
            f"declare one of: {known}",
            f"spec_version in ({known})",
            repr(raw),
        )
        return str(raw), None, [issue]
    if version.major != CURRENT.major:
        message = f"spec_version {version} is of major version {version.major}; this kvwire implements {CURRENT}"
        fix = f"install a kvwire whose spec major is {version.major}, or port the backend to spec {CURRENT}"
    elif version > CURRENT:
        message = f"spec_version {version} is newer than this kvwire's spec {CURRENT}"
        fix = f"upgrade kvwire (pip install -U kvwire), or declare one of: {known}"
    elif version not in known_versions():
        message = f"spec_version {version} is unknown"
        fix = f"declare one of: {known}"
    else:
        return str(raw), version, []
    return (
        str(raw),
        None,
        [Issue("spec_version", "spec-version", message, fix, f"spec_version in ({known})", str(raw))],
    )


def validate_backend(cls: object, origin: BackendOrigin) -> ValidationResult:
    """Validate one backend class against the spec; never raises for a bad backend."""
    if not isinstance(cls, type):
        finding = Finding(
            origin.name,
            origin.distribution,
            origin.version,
            origin.entry_point,
            "__init__",
            "constructor",
            f"the entry point names a {type(cls).__name__}, not a class",
            "class Backend: __init__(self, config: BackendConfig)",
            repr(cls),
            "point the entry point at the backend class (`module:Class`)",
        )
        return ValidationResult("drift", None, None, frozenset(), (finding,))
    declared_text, declared, issues = _declared_version(cls)
    if declared is not None:
        version = declared
        issues += _check_hooks(cls, version)
    elif declared_text is not None:
        version = CURRENT
        issues += _check_hooks(cls, version)
    else:  # infer: the newest version of the current major matched exactly
        version, hook_issues = CURRENT, _check_hooks(cls, CURRENT)
        for candidate in reversed(known_versions()[:-1]):
            if not hook_issues:
                break
            found = _check_hooks(cls, candidate)
            if not found:
                version, hook_issues = candidate, found
        issues += hook_issues
    issues += _check_constructor(cls)
    capabilities, cap_issues = _declared_capabilities(cls, version)
    issues += cap_issues
    issues += check_transport(cls, version, capabilities)
    findings = tuple(_to_finding(i, origin) for i in issues)
    if findings:
        status: Status = "drift"
    elif version < CURRENT:
        status = "adapted"
    else:
        status = "ok"
    return ValidationResult(status, str(version), declared_text, capabilities, findings)


def _to_finding(issue: Issue, origin: BackendOrigin) -> Finding:
    return Finding(
        origin.name,
        origin.distribution,
        origin.version,
        origin.entry_point,
        issue.hook,
        issue.rule,
        issue.message,
        issue.spec_signature,
        issue.impl_signature,
        issue.fix,
        issue.defined_in,
    )
