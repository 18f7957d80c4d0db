"""Signature comparison: one hook implementation against the spec, parameter by parameter.

Presence, name, order, kind, default and annotation of every parameter, plus
``*args``/``**kwargs`` and the return annotation; each difference is an
:class:`Issue` carrying both signatures and the fix. The validator
(:mod:`kvwire.registry.validator`) applies it to every hook of a backend class.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvwire.registry.annotations import UnresolvedAnnotation, annotation_key, format_annotation, resolve_annotation
from kvwire.registry.findings import Rule
from kvwire.spec.history import HOOK_FEATURES, PARAMETER_FEATURES, SpecVersion, known_versions
from kvwire.spec.hooks import SpecHook, features_at, spec_hooks

__all__ = [
    "EMPTY",
    "VAR_KINDS",
    "Issue",
    "compare_annotation",
    "compare_hook",
    "format_signature",
    "impl_parameters",
    "with_self",
]

EMPTY = inspect.Parameter.empty
VAR_KINDS = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
_STARS: dict[inspect._ParameterKind, str] = {
    inspect.Parameter.VAR_POSITIONAL: "*",
    inspect.Parameter.VAR_KEYWORD: "**",
}
#: Features tied to a parameter or an optional hook: a backend declaring an older spec must not claim them.
_BOUND_FEATURES = frozenset(PARAMETER_FEATURES.values()) | frozenset(HOOK_FEATURES.values())
_KIND_TEXT = {
    inspect.Parameter.POSITIONAL_ONLY: "positional-only",
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional-or-keyword",
    inspect.Parameter.KEYWORD_ONLY: "keyword-only",
    inspect.Parameter.VAR_POSITIONAL: "*args",
    inspect.Parameter.VAR_KEYWORD: "**kwargs",
}


@dataclass(frozen=True)
class Issue:
    hook: str
    rule: Rule
    message: str
    fix: str
    spec_signature: str = ""
    impl_signature: str = ""
    defined_in: str | None = None  # the parent class the hook is inherited from (None: this class)


def impl_parameters(func: Callable[..., Any], is_method: bool) -> tuple[list[inspect.Parameter], str]:
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
        if p.annotation is not EMPTY:
            text += f": {format_annotation(p.annotation)}"
        if p.default is not EMPTY:
            text += f" = {p.default!r}"
        parts.append(text)
        if p.kind is inspect.Parameter.POSITIONAL_ONLY and (
            i + 1 == len(params) or params[i + 1].kind is not inspect.Parameter.POSITIONAL_ONLY
        ):
            parts.append("/")
    tail = "" if returns is EMPTY else f" -> {format_annotation(returns)}"
    return f"({', '.join(parts)}){tail}"


def compare_annotation(spec_ann: object, spec_text: str, impl_ann: object, func: Callable[..., Any]) -> str | None:
    """None when equal, else the reason (for ``annotation-mismatch``)."""
    if impl_ann is EMPTY:
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
    if impl is EMPTY or spec is EMPTY:
        return False
    try:
        return bool(impl == spec)
    except Exception:  # arrays raise "truth value is ambiguous"; anything odd is a mismatch
        return False


def _default_text(value: object) -> str:
    return "no default" if value is EMPTY else f"default {value!r}"


def compare_hook(
    hook: SpecHook, func: Callable[..., Any], is_method: bool, capabilities: frozenset[str] = frozenset()
) -> list[Issue]:
    """Every difference between one hook of the spec and its implementation.

    ``capabilities`` are the backend's declared ones: a fix that declares an older spec version names
    only those of them that version lacks (a capability the backend never declared is not "dropped").
    """
    params, impl_text = impl_parameters(func, is_method)
    spec_text = hook.signature_text()
    impl_sig = f"{hook.name}{impl_text}"
    issues: list[Issue] = []

    def add(rule: Rule, message: str, fix: str) -> None:
        issues.append(Issue(hook.name, rule, message, fix, spec_text, impl_sig))

    for p in params:
        if p.kind in VAR_KINDS:
            star = "*" if p.kind is inspect.Parameter.VAR_POSITIONAL else "**"
            add(
                "var-args",
                f"`{star}{p.name}` would swallow arguments (pluggy passes it nothing, so values are lost)",
                f"replace `{star}{p.name}` with the spec's parameters: {', '.join(sp.name for sp in hook.params)}",
            )
    params = [p for p in params if p.kind not in VAR_KINDS]
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
    older = _older_version_matching(hook.name, [p.name for p in params]) if missing else None
    for sp in missing:
        if sp.name in renamed:
            continue
        index = hook.params.index(sp)
        where = f"after `{hook.params[index - 1].name}`" if index else "as the first parameter"
        added = f" added in spec {sp.since}" if sp.since > known_versions()[0] else ""
        adapt = ""
        if added and older is not None:  # the parameters are exactly an older version's: declaring it is a fix
            drop = sorted(capabilities & (_BOUND_FEATURES - features_at(older)))
            listed = " and ".join(f"{name!r}" for name in drop)
            dropping = f" and drop {listed} from capabilities" if drop else ""
            adapt = f", or declare spec_version = '{older}'{dropping} to load adapted with that feature off"
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
        reason = compare_annotation(sp.annotation, sp.annotation_text, p.annotation, func)
        if reason:
            add("annotation-mismatch", f"parameter `{sp.name}` {reason}", f"declare it as `{sp.declaration}`")
    returns = inspect.signature(func).return_annotation
    reason = compare_annotation(hook.returns, hook.returns_text, returns, func)
    if reason:
        add("annotation-mismatch", f"the return value {reason}", f"annotate the return as `-> {hook.returns_text}`")
    return issues


def _older_version_matching(name: str, impl_names: Sequence[str]) -> SpecVersion | None:
    """The newest spec version whose hook ``name`` has exactly the parameters ``impl_names``, in that order.

    Declaring it is a fix for a parameter missing from a later version; when no version matches
    (e.g. a later parameter is present but an earlier one is missing), it is not, and None is returned.
    """
    for version in reversed(known_versions()):
        hooks = spec_hooks(version)
        if name in hooks and [p.name for p in hooks[name].params] == list(impl_names):
            return version
    return None


def _version_of(hook: SpecHook) -> str:
    return str(max((p.since for p in hook.params), default=known_versions()[0]))


def with_self(signature: str) -> str:
    """``name(a, b) -> R`` as a method definition's text: ``name(self, a, b) -> R``."""
    name, rest = signature.split("(", 1)
    return f"{name}(self{'' if rest.startswith(')') else ', '}{rest}"
