"""Every override of the tree against the method it overrides: an override must accept what its base accepts.

``override-missing-parameter``: a parameter of the overridden method that the
override does not accept the same way (by name, and by position where the base
takes it by position; ``*args``/``**kwargs`` accept any positional/keyword).
``override-required-parameter``: a parameter with a default in the base but none
in the override, or a required parameter the base does not have.
``override-missing-keyword``: a keyword that a call ``self.<method>(...)`` in a
base class passes, which the override does not accept.
The overridden method is the nearest definition in the subclass's MRO.
Dunder methods (``__init__`` included: constructors legitimately differ) and
name-mangled ``__private`` methods are not checked.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from kvwire.lint.classes import ClassInfo
from kvwire.lint.findings import RULES, LintFinding
from kvwire.lint.hierarchy import Classes
from kvwire.lint.keywords import SelfCalls, keyword_findings
from kvwire.lint.pair import Pair
from kvwire.lint.parameters import signature_findings
from kvwire.lint.signature import signature_of
from kvwire.lint.tree import Module

__all__ = ["check_overrides"]


def _checked(name: str, select: frozenset[str] | None) -> bool:
    if name.startswith("__"):  # dunders (constructors included) and name-mangled privates
        return False
    return select is None or name in select


def check_overrides(classes: Classes, select: frozenset[str] | None = None) -> list[LintFinding]:
    """Every finding of every override in the tree, by file, line and rule (parameters in the base's order)."""
    findings: list[LintFinding] = []
    self_calls = SelfCalls()
    where = None if select is None else _defining(select)
    for cls in classes.all(where):
        try:
            findings.extend(_class_findings(classes, cls, select, self_calls))
        except RecursionError:  # a chain of re-exports deeper than Python's stack: this class only
            classes.tree.warn(
                f"{cls.module.display}: class {cls.name}: its bases lead through re-exports nested too deeply; skipped"
            )
    broken = {m.display for m in classes.tree.modules.values() if m.broken}
    findings = [f for f in findings if f.file not in broken and f.base_file not in broken]
    return sorted(findings, key=lambda f: (f.file, f.line, RULES.index(f.rule)))


def _class_findings(
    classes: Classes, cls: ClassInfo, select: frozenset[str] | None, self_calls: SelfCalls
) -> list[LintFinding]:
    findings: list[LintFinding] = []
    mro = classes.mro(cls)
    if len(mro) < 2 or (select is not None and not select.intersection(cls.members())):
        return findings
    for name, members in cls.members().items():
        if not _checked(name, select) or members[-1].kind != "def":
            continue
        base = next((k for k in mro[1:] if name in k.members()), None)
        pair = _pair(cls, base, name) if base is not None else None
        if pair is not None:
            findings.extend(signature_findings(pair))
            findings.extend(keyword_findings(mro, pair, self_calls))
    return findings


def _defining(methods: frozenset[str]) -> Callable[[Module], bool]:
    """Whether a module defines one of ``methods``: only such a module can hold an override of one."""
    pattern = re.compile(rf"def[ \t]+(?:{'|'.join(map(re.escape, sorted(methods)))})\b")
    return lambda module: pattern.search(module.text) is not None


def _pair(cls: ClassInfo, base: ClassInfo, name: str) -> Pair | None:
    own, inherited = cls.member(name), base.member(name)
    function = own.header() if own is not None else None
    base_function = inherited.header() if inherited is not None and inherited.kind == "def" else None
    if function is None or base_function is None:
        return None
    sig, base_sig = signature_of(function), signature_of(base_function)
    if sig is None or base_sig is None:
        return None
    return Pair(cls, base, function, base_function, sig, base_sig)
