"""The load-time validator: compare a backend class with the hook spec.

It checks, without instantiating the class: the declared spec version, the
constructor, the capabilities, that every spec hook is implemented and marked,
that no marked hook is unknown, and for every hook every parameter's presence,
name, order, kind, default and annotation, plus ``*args``/``**kwargs``.
A backend that declares no version gets the newest version it matches exactly.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from kvwire.annotations import UnresolvedAnnotation, annotation_key, format_annotation, resolve_annotation
from kvwire.capabilities import FEATURES
from kvwire.config import BackendConfig
from kvwire.findings import Finding, PluginOrigin, Rule
from kvwire.markers import IMPL_ATTR
from kvwire.spec import CURRENT, PARAMETER_FEATURES, SpecHook, SpecVersion, features_at, known_versions, spec_hooks

__all__ = ["Status", "ValidationResult", "validate_backend"]

Status = Literal["ok", "adapted", "drift", "import-error", "duplicate", "blocked"]

_EMPTY = inspect.Parameter.empty
_VAR_KINDS = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
_STARS: dict[inspect._ParameterKind, str] = {
    inspect.Parameter.VAR_POSITIONAL: "*",
    inspect.Parameter.VAR_KEYWORD: "**",
}
_KIND_TEXT = {
    inspect.Parameter.POSITIONAL_ONLY: "positional-only",
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional-or-keyword",
    inspect.Parameter.KEYWORD_ONLY: "keyword-only",
    inspect.Parameter.VAR_POSITIONAL: "*args",
    inspect.Parameter.VAR_KEYWORD: "**kwargs",
}


@dataclass(frozen=True)
class ValidationResult:
    """The verdict on one backend class."""

    status: Status
    spec_version: str | None
    declared_spec_version: str | None
    capabilities: frozenset[str]
    findings: tuple[Finding, ...]


@dataclass(frozen=True)
class _Issue:
    hook: str
    rule: Rule
    message: str
    fix: str
    spec_signature: str = ""
    impl_signature: str = ""
    defined_in: str | None = None  # the parent class the hook is inherited from (None: this class)


def _impl_parameters(func: Callable[..., Any], is_method: bool) -> tuple[list[inspect.Parameter], str]:
    sig = inspect.signature(func)
    params = list(sig.parameters.values())
    if is_method and params:
        params = params[1:]
    return params, format_signature(params, sig.return_annotation)


def format_signature(params: Sequence[inspect.Parameter], returns: object) -> str:
    """``(a: int, /, b: str = 'x', *, c: X | None = None) -> int`` with annotations as written."""
    parts: list[str] = []
    seen_kw_marker = False
    for i, p in enumerate(params):
        if p.kind is inspect.Parameter.KEYWORD_ONLY and not seen_kw_marker:
            parts.append("*")
            seen_kw_marker = True
        prefix = _STARS.get(p.kind, "")
        seen_kw_marker = seen_kw_marker or p.kind is inspect.Parameter.VAR_POSITIONAL
        text = prefix + p.name
        if p.annotation is not _EMPTY:
            text += f": {format_annotation(p.annotation)}"
        if p.default is not _EMPTY:
            text += f" = {p.default!r}"
        parts.append(text)
        if p.kind is inspect.Parameter.POSITIONAL_ONLY and (
            i + 1 == len(params) or params[i + 1].kind is not inspect.Parameter.POSITIONAL_ONLY
        ):
            parts.append("/")
    tail = "" if returns is _EMPTY else f" -> {format_annotation(returns)}"
    return f"({', '.join(parts)}){tail}"


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


def _compare_annotation(spec_ann: object, spec_text: str, impl_ann: object, func: Callable[..., Any]) -> str | None:
    """None when equal, else the reason (for ``annotation-mismatch``)."""
    if impl_ann is _EMPTY:
        return f"has no annotation (spec: `{spec_text}`)"
    try:
        resolved = resolve_annotation(impl_ann, func)
    except UnresolvedAnnotation as exc:
        return f"{exc} (spec: `{spec_text}`)"
    if annotation_key(resolved) != annotation_key(spec_ann):
        return f"is annotated `{format_annotation(impl_ann)}`, spec says `{spec_text}`"
    return None


def _same_default(impl: object, spec: object) -> bool:
    """Identity, else equality; an object whose ``==`` is not a bool (a numpy array) is different."""
    if impl is spec:
        return True
    if impl is _EMPTY or spec is _EMPTY:
        return False
    try:
        return bool(impl == spec)
    except Exception:  # arrays raise "truth value is ambiguous"; anything odd is a mismatch
        return False


def _default_text(value: object) -> str:
    return "no default" if value is _EMPTY else f"default {value!r}"


def _compare_hook(hook: SpecHook, func: Callable[..., Any], is_method: bool) -> list[_Issue]:
    """Every difference between one hook of the spec and its implementation."""
    params, impl_text = _impl_parameters(func, is_method)
    spec_text = hook.signature_text()
    impl_sig = f"{hook.name}{impl_text}"
    issues: list[_Issue] = []

    def add(rule: Rule, message: str, fix: str) -> None:
        issues.append(_Issue(hook.name, rule, message, fix, spec_text, impl_sig))

    for p in params:
        if p.kind in _VAR_KINDS:
            star = "*" if p.kind is inspect.Parameter.VAR_POSITIONAL else "**"
            add(
                "var-args",
                f"`{star}{p.name}` would swallow arguments (pluggy passes it nothing, so values are lost)",
                f"replace `{star}{p.name}` with the spec's parameters: {', '.join(sp.name for sp in hook.params)}",
            )
    params = [p for p in params if p.kind not in _VAR_KINDS]
    by_name = {p.name: p for p in params}
    spec_by_name = {sp.name: sp for sp in hook.params}
    missing = [sp for sp in hook.params if sp.name not in by_name]
    unknown = [p for p in params if p.name not in spec_by_name]

    renamed: set[str] = set()
    for p in unknown:
        close = difflib.get_close_matches(p.name, [sp.name for sp in missing], n=1, cutoff=0.6)
        if close:
            renamed.add(close[0])
            add(
                "unknown-parameter",
                f"parameter `{p.name}` is not in the spec; did you mean `{close[0]}`?",
                f"rename `{p.name}` to `{close[0]}`: `{spec_by_name[close[0]].declaration}`",
            )
        else:
            add(
                "unknown-parameter",
                f"parameter `{p.name}` is not in spec {_version_of(hook)}",
                f"remove `{p.name}`: a hook receives exactly the spec's arguments; a per-call value the host "
                "passes needs a spec version that has the parameter (upgrade kvwire and declare it)",
            )
    for sp in missing:
        if sp.name in renamed:
            continue
        index = hook.params.index(sp)
        where = f"after `{hook.params[index - 1].name}`" if index else "as the first parameter"
        added = f" added in spec {sp.since}" if sp.since > known_versions()[0] else ""
        adapt = ""
        if added:
            older = max(v for v in known_versions() if v < sp.since)
            feature = PARAMETER_FEATURES.get(sp.name)
            drop = f" and drop {feature!r} from capabilities" if feature else ""
            adapt = f", or declare spec_version = '{older}'{drop} to load adapted with that feature off"
        add(
            "missing-parameter",
            f"parameter `{sp.name}`{added} is missing (the caller's value would be dropped)",
            f"add `{sp.declaration}` {where}{adapt}",
        )

    spec_order = [sp.name for sp in hook.params if sp.name in by_name]
    impl_order = [p.name for p in params if p.name in spec_by_name]
    if spec_order != impl_order:
        add(
            "parameter-order",
            f"parameters are in the order ({', '.join(impl_order)}), the spec's is ({', '.join(spec_order)}); "
            "a positional caller would pass values to the wrong parameters",
            f"reorder the parameters to ({', '.join(spec_order)})",
        )
    for sp in hook.params:
        if sp.name not in by_name:
            continue
        p = by_name[sp.name]
        if p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
            add(
                "parameter-kind",
                f"parameter `{sp.name}` is {_KIND_TEXT[p.kind]}, the spec's is positional-or-keyword",
                f"make `{sp.name}` a plain parameter (move it out of the `/` or `*` section)",
            )
        if not _same_default(p.default, sp.default):
            add(
                "default-mismatch",
                f"parameter `{sp.name}` has {_default_text(p.default)}, the spec's has {_default_text(sp.default)}",
                f"declare it as `{sp.declaration}`",
            )
        reason = _compare_annotation(sp.annotation, sp.annotation_text, p.annotation, func)
        if reason:
            add("annotation-mismatch", f"parameter `{sp.name}` {reason}", f"declare it as `{sp.declaration}`")
    returns = inspect.signature(func).return_annotation
    reason = _compare_annotation(hook.returns, hook.returns_text, returns, func)
    if reason:
        add("annotation-mismatch", f"the return value {reason}", f"annotate the return as `-> {hook.returns_text}`")
    return issues


def _version_of(hook: SpecHook) -> str:
    return str(max((p.since for p in hook.params), default=known_versions()[0]))


def _check_constructor(cls: type) -> list[_Issue]:
    expected = "__init__(self, config: BackendConfig)"
    init = inspect.getattr_static(cls, "__init__")
    if init is object.__init__:
        return [
            _Issue(
                "__init__",
                "constructor",
                "the class defines no constructor taking the config",
                f"define `{expected}`",
                expected,
                "__init__(self)",
            )
        ]
    params, text = _impl_parameters(init, True)
    impl = f"__init__(self{', ' if params else ''}{text[1:]}"
    bad = len(params) != 1 or params[0].name != "config" or params[0].kind in _VAR_KINDS
    if not bad and params[0].kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
        bad = True
    if not bad and params[0].default is not _EMPTY:
        bad = True
    if bad:
        return [
            _Issue(
                "__init__",
                "constructor",
                "the constructor must take exactly one parameter, `config: kvwire.BackendConfig`",
                f"define `{expected}`; backend settings go in BackendConfig.options",
                expected,
                impl,
            )
        ]
    reason = _compare_annotation(BackendConfig, "BackendConfig", params[0].annotation, init)
    if reason:
        return [
            _Issue("__init__", "constructor", f"parameter `config` {reason}", f"define `{expected}`", expected, impl)
        ]
    return []


def _with_self(signature: str) -> str:
    name, rest = signature.split("(", 1)
    return f"{name}(self{'' if rest.startswith(')') else ', '}{rest}"


def _owner(cls: type, name: str) -> str | None:
    """``module:Qualname`` of the parent class ``cls`` inherits ``name`` from; None when ``cls`` defines it."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return None if klass is cls else f"{klass.__module__}:{klass.__qualname__}"
    return None


def _check_hooks(cls: type, version: SpecVersion) -> list[_Issue]:
    return [replace(i, defined_in=_owner(cls, i.hook)) for i in _hook_issues(cls, version)]


def _hook_issues(cls: type, version: SpecVersion) -> list[_Issue]:
    hooks = spec_hooks(version)
    issues: list[_Issue] = []
    for name in sorted(dir(cls)):
        func, _ = _lookup(cls, name)
        if func is not None and _is_marked(func) and name not in hooks:
            close = difflib.get_close_matches(name, list(hooks), n=1, cutoff=0.6)
            hint = f"; did you mean `{close[0]}`?" if close else ""
            issues.append(
                _Issue(
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
        if func is None:
            issues.append(
                _Issue(
                    name,
                    "missing-hook",
                    f"required hook `{name}` is not implemented",
                    f"add `@kvwire.hookimpl def {_with_self(hook.signature_text())}`",
                    hook.signature_text(),
                    "<absent>",
                )
            )
            continue
        if not _is_marked(func):
            issues.append(
                _Issue(
                    name,
                    "missing-hook",
                    f"`{name}` is defined but not marked, so pluggy would never call it",
                    f"decorate `{name}` with @kvwire.hookimpl",
                    hook.signature_text(),
                    name,
                )
            )
        issues.extend(_compare_hook(hook, func, is_method))
    return issues


def _declared_capabilities(cls: type, version: SpecVersion) -> tuple[frozenset[str], list[_Issue]]:
    raw: object = getattr(cls, "capabilities", frozenset())
    if (
        isinstance(raw, str)
        or not isinstance(raw, (set, frozenset, list, tuple))
        or not all(isinstance(c, str) for c in raw)
    ):
        return frozenset(), [
            _Issue(
                "capabilities",
                "capabilities",
                f"`capabilities` must be a set of feature names, got {raw!r}",
                f"declare e.g. `capabilities = frozenset({{'layer_ids', 'mha'}})`; known: {', '.join(FEATURES)}",
                "capabilities: frozenset[str]",
                f"capabilities = {raw!r}",
            )
        ]
    declared = frozenset(raw)
    issues: list[_Issue] = []
    spec_side = f"capabilities <= {{{', '.join(sorted(FEATURES))}}}"
    impl_side = f"capabilities = {{{', '.join(sorted(declared))}}}"
    for name in sorted(declared - set(FEATURES)):
        close = difflib.get_close_matches(name, list(FEATURES), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        issues.append(
            _Issue(
                "capabilities",
                "capabilities",
                f"unknown feature {name!r}{hint}",
                f"use known feature names: {', '.join(FEATURES)}",
                spec_side,
                impl_side,
            )
        )
    later = set(PARAMETER_FEATURES.values()) - features_at(version)
    for name in sorted(declared & later):
        issues.append(
            _Issue(
                "capabilities",
                "capabilities",
                f"declares {name!r}, but spec {version} has no parameter for it",
                f"declare spec_version {CURRENT} and implement its parameters, or drop {name!r}",
                f"spec {version}: send_kvcache parameters honour {sorted(features_at(version))}",
                impl_side,
            )
        )
    if "raw_write" in declared and not callable(getattr(cls, "raw_write", None)):
        issues.append(
            _Issue(
                "capabilities",
                "capabilities",
                "declares 'raw_write' but has no `raw_write(session_id, plan)` method",
                "subclass kvwire.TransportBackend with a transport that implements kvwire.RawWriter, "
                "or drop 'raw_write'",
                "raw_write(self, session_id: str, plan: TransferPlan) -> None",
                "<absent>",
            )
        )
    return declared & set(FEATURES), issues


def _declared_version(cls: type) -> tuple[str | None, SpecVersion | None, list[_Issue]]:
    """(declared text, parsed version if acceptable, issues)."""
    raw = getattr(cls, "spec_version", None)
    if raw is None:
        return None, None, []
    known = ", ".join(str(v) for v in known_versions())
    try:
        version = SpecVersion.parse(raw)
    except ValueError as exc:
        issue = _Issue(
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
        [_Issue("spec_version", "spec-version", message, fix, f"spec_version in ({known})", str(raw))],
    )


def validate_backend(cls: object, origin: PluginOrigin) -> ValidationResult:
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
    findings = tuple(_to_finding(i, origin) for i in issues)
    if findings:
        status: Status = "drift"
    elif version < CURRENT:
        status = "adapted"
    else:
        status = "ok"
    return ValidationResult(status, str(version), declared_text, capabilities, findings)


def _to_finding(issue: _Issue, origin: PluginOrigin) -> Finding:
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
