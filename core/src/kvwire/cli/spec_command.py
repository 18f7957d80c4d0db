"""``kvwire spec``: the backend spec of any known version, and what changed between two.

Everything printed is read from :mod:`kvwire.spec.hooks` (the hookspecs and
``SPEC_HISTORY``) and :data:`kvwire.spec.capabilities.FEATURES`, so it cannot
disagree with what the validator enforces.
"""

from __future__ import annotations

import argparse
import inspect
import json
from collections.abc import Mapping
from typing import Any

from kvwire.errors import ConfigError
from kvwire.spec.capabilities import FEATURES
from kvwire.spec.history import (
    CURRENT,
    HOOK_FEATURES,
    PARAMETER_FEATURES,
    SPEC_HISTORY,
    AddedParameter,
    SpecVersion,
    hook_since,
    known_versions,
)
from kvwire.spec.hooks import BackendSpec, SpecHook, SpecParam, features_at, spec_hooks

__all__ = ["add_arguments", "diff_data", "render_diff", "render_spec", "run", "spec_data"]

_ONE_LINE = 100  # a signature longer than this prints one parameter per line
_BOUND_FEATURES = frozenset(PARAMETER_FEATURES.values()) | frozenset(HOOK_FEATURES.values())
_ADDED: dict[tuple[str, str], AddedParameter] = {(p.hook, p.name): p for r in SPEC_HISTORY for p in r.added}


def _versions() -> list[str]:
    return [str(v) for v in known_versions()]


def _version(text: str) -> SpecVersion:
    """A known spec version, or ConfigError (one line: the CLI prints it and exits 2)."""
    if text not in _versions():
        raise ConfigError(f"unknown spec version {text!r}; known: {', '.join(_versions())}")
    return SpecVersion.parse(text)


def _doc(hook: str) -> str:
    """The first line of the hookspec's docstring, without reST markup."""
    doc = inspect.getdoc(getattr(BackendSpec, hook)) or ""
    return doc.splitlines()[0].replace("``", "`") if doc else ""


def _note(hook: str, param: SpecParam) -> str:
    """Where a parameter came from: its version and the capability it needs (or that it is a guard)."""
    added = _ADDED.get((hook, param.name))
    if added is None:
        return ""
    return f"since {param.since}, {_need(added)}"


def _need(added: AddedParameter | None) -> str:
    """The capability a parameter needs, or that it is a guard (checked by the core for every backend)."""
    if added is None:
        return ""
    return f"capability {added.feature}" if added.feature else "guard, no capability"


def _capabilities(version: SpecVersion) -> dict[str, str]:
    present = features_at(version)
    return {name: text for name, text in FEATURES.items() if name not in _BOUND_FEATURES or name in present}


def _hook_lines(hook: SpecHook) -> list[str]:
    since = hook_since(hook.name)
    tag = f"  # since {since}" if since > SPEC_HISTORY[0].version else ""
    if hook.name in HOOK_FEATURES:
        tag += f", optional: with capability {HOOK_FEATURES[hook.name]}"
    if len(hook.signature_text()) <= _ONE_LINE:
        head = [f"  {hook.signature_text()}{tag}"]
    else:
        head = [f"  {hook.name}({tag}"]
        for param in hook.params:
            note = _note(hook.name, param)
            head.append(f"      {param.declaration}," + (f"  # {note}" if note else ""))
        head.append(f"  ) -> {hook.returns_text}")
    return [*head, f"      {_doc(hook.name)}"]


def _release_lines(upto: SpecVersion) -> list[str]:
    lines: list[str] = []
    for release in SPEC_HISTORY:
        if release.version > upto:
            break
        label = f"  {release.version}  "
        if release.version == SPEC_HISTORY[0].version:
            hooks = spec_hooks(release.version).values()
            items = [f"{h.name}({', '.join(p.name for p in h.params)})" for h in hooks]
        else:
            items = [f"{p.hook}: {p.name} ({p.purpose})" for p in release.added]
            items += [f"hook {h}: {_doc(h)}" for h in release.added_hooks]
            items += [f"optional hook {h.name} (capability {h.feature}): {h.purpose}" for h in release.optional_hooks]
        lines.extend((label if i == 0 else " " * len(label)) + item for i, item in enumerate(items))
    return lines


def render_spec(version: SpecVersion) -> str:
    """The spec at ``version`` as text: hooks, capabilities, history up to it."""
    state = "current" if version == CURRENT else f"current is {CURRENT}"
    lines = [f"kvwire backend spec {version} ({state}; known: {', '.join(_versions())})", ""]
    lines.append("Hooks (methods marked @kvwire.hookimpl on a class constructed with one kvwire.BackendConfig):")
    for hook in spec_hooks(version).values():
        lines.extend(_hook_lines(hook))
    lines += ["", "Capabilities (a backend's `capabilities`):"]
    caps = _capabilities(version)
    width = max(map(len, caps))
    lines.extend(f"  {name.ljust(width)}  {text}" for name, text in caps.items())
    lines += ["", "History:", *_release_lines(version)]
    return "\n".join(lines)


def _param_data(hook: str, param: SpecParam) -> dict[str, Any]:
    added = _ADDED.get((hook, param.name))
    required = param.default is inspect.Parameter.empty
    return {
        "name": param.name,
        "annotation": param.annotation_text,
        "required": required,
        "default": None if required else repr(param.default),
        "since": str(param.since),
        "feature": added.feature if added else None,
        "purpose": added.purpose if added else None,
    }


def spec_data(version: SpecVersion) -> dict[str, Any]:
    """The spec at ``version`` as JSON data."""
    return {
        "version": str(version),
        "current": version == CURRENT,
        "known": _versions(),
        "hooks": [
            {
                "name": hook.name,
                "since": str(hook_since(hook.name)),
                "optional_with": HOOK_FEATURES.get(hook.name),
                "signature": hook.signature_text(),
                "returns": hook.returns_text,
                "doc": _doc(hook.name),
                "parameters": [_param_data(hook.name, p) for p in hook.params],
            }
            for hook in spec_hooks(version).values()
        ],
        "capabilities": _capabilities(version),
        "history": [
            {
                "version": str(r.version),
                "added_hooks": list(r.added_hooks),
                "optional_hooks": [
                    {"name": h.name, "feature": h.feature, "purpose": h.purpose} for h in r.optional_hooks
                ],
                "added_parameters": [
                    {"hook": p.hook, "name": p.name, "feature": p.feature, "purpose": p.purpose} for p in r.added
                ],
            }
            for r in SPEC_HISTORY
            if r.version <= version
        ],
    }


def diff_data(old: SpecVersion, new: SpecVersion) -> dict[str, Any]:
    """What a backend written for ``old`` meets in ``new``: hooks, parameters and capabilities added or removed."""
    a, b = spec_hooks(old), spec_hooks(new)

    def params(left: Mapping[str, SpecHook], right: Mapping[str, SpecHook]) -> list[dict[str, Any]]:
        return [
            {**_param_data(name, p), "hook": name, "declaration": p.declaration}
            for name, hook in right.items()
            if name in left
            for p in hook.params
            if p.name not in {q.name for q in left[name].params}
        ]

    caps_a, caps_b = set(_capabilities(old)), set(_capabilities(new))
    return {
        "from": str(old),
        "to": str(new),
        "added_hooks": [b[h].signature_text() for h in b if h not in a],
        "removed_hooks": [a[h].signature_text() for h in a if h not in b],
        "added_parameters": params(a, b),
        "removed_parameters": params(b, a),
        "added_capabilities": sorted(caps_b - caps_a),
        "removed_capabilities": sorted(caps_a - caps_b),
    }


def _optional(signature: str) -> str:
    feature = HOOK_FEATURES.get(signature.split("(", 1)[0])
    return f"  (optional: with capability {feature})" if feature else ""


def render_diff(old: SpecVersion, new: SpecVersion) -> str:
    """:func:`diff_data` as text, one change per line."""
    data = diff_data(old, new)
    lines = [f"spec {old} -> {new}"]
    lines += [f"  + hook {sig}{_optional(sig)}" for sig in data["added_hooks"]]
    lines += [f"  - hook {sig}" for sig in data["removed_hooks"]]
    for sign, key in (("+", "added_parameters"), ("-", "removed_parameters")):
        for p in data[key]:
            need = _need(_ADDED.get((p["hook"], p["name"])))
            lines.append(f"  {sign} {p['hook']}: {p['declaration']}  ({p['purpose']}; {need})")
    lines += [f"  + capability {c}: {FEATURES[c]}" for c in data["added_capabilities"]]
    lines += [f"  - capability {c}: {FEATURES[c]}" for c in data["removed_capabilities"]]
    if len(lines) == 1:
        lines.append("  no changes")
    elif old < new and old.major == new.major:
        lines.append(
            f"A backend declaring {old} loads adapted: a feature {new} added is refused before anything is sent, "
            "a guard is checked by the core, a hook it lacks is not called."
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``kvwire spec``."""
    versions = "{" + ",".join(_versions()) + "}"
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--at",
        dest="version",
        default=str(CURRENT),
        metavar=versions,
        help=f"the spec at this version (default: {CURRENT})",
    )
    # the former name: --version means "kvwire's version" everywhere else, so it is kept working but not shown
    which.add_argument("--version", dest="version", help=argparse.SUPPRESS)
    which.add_argument("--diff", nargs=2, metavar=("OLD", "NEW"), help=f"what changed from OLD to NEW, each {versions}")
    parser.add_argument("--json", action="store_true", help="print JSON for tools")


def run(args: argparse.Namespace) -> int:
    """Print the spec (or a diff); an unknown version raises :class:`kvwire.ConfigError` (one line, exit 2)."""
    if args.diff:
        old, new = (_version(v) for v in args.diff)
        print(json.dumps(diff_data(old, new), indent=2) if args.json else render_diff(old, new))
    else:
        version = _version(args.version)
        print(json.dumps(spec_data(version), indent=2) if args.json else render_spec(version))
    return 0
