"""``override-missing-keyword``: keywords that calls ``self.<method>(...)`` in base classes pass to an override.

A call in a base-class method that the subclass overrides without calling
``super()`` never runs for the subclass and is left out.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from kvwire.lint.classes import ClassInfo
from kvwire.lint.findings import Caller, LintFinding
from kvwire.lint.pair import Pair
from kvwire.lint.signature import Function, decorator_names

__all__ = ["SelfCalls", "keyword_findings"]


def _live(mro: list[ClassInfo], index: int, name: str) -> bool:
    """Whether ``mro[index]``'s method ``name`` runs for ``mro[0]``: not overridden, or overridden calling super()."""
    for cls in mro[:index]:
        member = cls.member(name)
        if member is not None and (member.kind != "def" or "super(" not in member.text()):
            return False
    return True


class SelfCalls:
    """Calls ``self.<name>(...)`` in a function, by name: each function is walked once."""

    def __init__(self) -> None:
        self._index: dict[int, tuple[Function, dict[str, list[ast.Call]]]] = {}

    def __call__(self, function: Function, method: str) -> list[ast.Call]:
        entry = self._index.get(id(function))
        if entry is None:
            entry = (function, _index_calls(function))
            self._index[id(function)] = entry
        return entry[1].get(method, [])


def _index_calls(function: Function) -> dict[str, list[ast.Call]]:
    index: dict[str, list[ast.Call]] = {}
    args = [*function.args.posonlyargs, *function.args.args]
    if not args or "staticmethod" in decorator_names(function):
        return index
    me = args[0].arg
    todo: list[ast.AST] = [function]
    while todo:  # ast.walk, without its generators: this walk is most of the time spent on callers
        node = todo.pop()
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == me:
                index.setdefault(func.attr, []).append(node)
        for name in node._fields:
            value = getattr(node, name, None)
            if isinstance(value, list):
                todo.extend(v for v in value if isinstance(v, ast.AST))
            elif isinstance(value, ast.AST):
                todo.append(value)
    for calls in index.values():
        calls.sort(key=lambda call: (call.lineno, call.col_offset))
    return index


def keyword_findings(mro: list[ClassInfo], pair: Pair, self_calls: SelfCalls) -> Iterator[LintFinding]:
    """One finding per keyword the override does not accept, naming every live call that passes it."""
    method = pair.sig.name
    passed: dict[str, list[Caller]] = {}
    for index, ancestor in enumerate(mro[1:], start=1):
        for member in ancestor.callers(method):
            for function in member.functions():
                if not _live(mro, index, function.name):
                    continue
                for call in self_calls(function, method):
                    for passed_keyword in call.keywords:
                        name = passed_keyword.arg
                        if name is not None and not pair.sig.accepts_keyword(name):
                            line = call.lineno + member.offset
                            caller = Caller(f"{ancestor.name}.{function.name}", ancestor.module.display, line)
                            passed.setdefault(name, []).append(caller)
    for keyword, callers in passed.items():
        sites = [f"`{c.caller}` at {c.file}:{c.line}" for c in callers]
        who = sites[0] + " passes" if len(sites) == 1 else f"{', '.join(sites[:-1])} and {sites[-1]} pass"
        declared = pair.base_sig.named(keyword)
        own = pair.sig.named(keyword)
        if own is not None:
            fix = f"move `{keyword}` after the `/` in {pair.target}"
        elif declared is not None:
            fix = f"add `{declared.declaration()}` to {pair.target}"
        else:
            fix = f"add a `{keyword}` parameter to {pair.target}, or stop passing it"
        yield pair.finding(
            "override-missing-keyword",
            keyword,
            f"{who} `{keyword}=` to `self.{method}(...)`, which the override does not accept "
            "(a TypeError on every such call)",
            fix,
            tuple(callers),
        )
