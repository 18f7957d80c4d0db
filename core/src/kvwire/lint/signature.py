"""Signatures read from ``ast``: parameters as written (annotations and defaults unparsed), and how a call binds.

``staticmethod``s have no implicit first parameter and ``classmethod``s bind
``cls`` like methods bind ``self``, so an override is compared with its base on
the parameters a caller passes, whatever the decorators. Properties (and
``cached_property``, setters) and ``@overload`` stubs are not methods here.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cached_property
from typing import Literal, Union

__all__ = ["Param", "Signature", "decorator_names", "signature_of"]

Kind = Literal["positional-only", "positional-or-keyword", "keyword-only", "*args", "**kwargs"]
Function = Union[ast.FunctionDef, ast.AsyncFunctionDef]  # noqa: UP007 (runtime alias, py3.10 target)

_NOT_METHODS = frozenset({"property", "cached_property", "abstractproperty", "setter", "getter", "deleter", "overload"})
_POSITIONAL = ("positional-only", "positional-or-keyword")


@dataclass(frozen=True)
class Param:
    """One parameter, with its annotation and default as written (unparsed only when shown)."""

    name: str
    kind: Kind
    annotation: ast.expr | None
    default: ast.expr | None

    @property
    def has_default(self) -> bool:
        return self.default is not None

    @property
    def positional(self) -> bool:
        return self.kind in _POSITIONAL

    @property
    def by_keyword(self) -> bool:
        return self.kind in ("positional-or-keyword", "keyword-only")

    def declaration(self) -> str:
        """``name: X = d`` (``name=d`` without an annotation), as PEP 8 writes it."""
        text = {"*args": "*", "**kwargs": "**"}.get(self.kind, "") + self.name
        if self.annotation is not None:
            text += f": {ast.unparse(self.annotation)}"
        if self.default is not None:
            text += (
                f" = {ast.unparse(self.default)}" if self.annotation is not None else f"={ast.unparse(self.default)}"
            )
        return text


@dataclass(frozen=True)
class Signature:
    """A method's parameters; ``implicit`` of them (``self``/``cls``) are bound, not passed."""

    name: str
    params: tuple[Param, ...]
    implicit: int
    returns: ast.expr | None

    @property
    def explicit(self) -> tuple[Param, ...]:
        return self.params[self.implicit :]

    @property
    def positional(self) -> list[Param]:
        return [p for p in self.explicit if p.positional]

    def named(self, name: str) -> Param | None:
        return next((p for p in self.explicit if p.name == name and p.kind not in ("*args", "**kwargs")), None)

    def has(self, kind: Kind) -> bool:
        return any(p.kind == kind for p in self.params)

    def accepts_keyword(self, name: str) -> bool:
        param = self.named(name)
        return param.by_keyword if param is not None else self.has("**kwargs")

    @cached_property
    def text(self) -> str:
        """``name(self, a: int, /, b=1, *args, c: X | None = None, **kwargs) -> R``, as written."""
        parts: list[str] = []
        star = False
        for i, param in enumerate(self.params):
            if param.kind == "keyword-only" and not star:
                parts.append("*")
            star = star or param.kind in ("keyword-only", "*args")
            parts.append(param.declaration())
            following = self.params[i + 1].kind if i + 1 < len(self.params) else None
            if param.kind == "positional-only" and following != "positional-only":
                parts.append("/")
        tail = f" -> {ast.unparse(self.returns)}" if self.returns is not None else ""
        return f"{self.name}({', '.join(parts)}){tail}"


def decorator_names(node: Function) -> list[str]:
    """The last dotted component of each decorator (``functools.cached_property`` -> ``cached_property``)."""
    names: list[str] = []
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if isinstance(target, ast.Attribute):
            names.append(target.attr)
        elif isinstance(target, ast.Name):
            names.append(target.id)
    return names


def signature_of(node: Function) -> Signature | None:
    """The signature of a method, or None for a property or an ``@overload`` stub."""
    decorators = decorator_names(node)
    if _NOT_METHODS.intersection(decorators):
        return None
    args = node.args
    positional = [*args.posonlyargs, *args.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    params = [
        Param(a.arg, "positional-only" if i < len(args.posonlyargs) else "positional-or-keyword", a.annotation, d)
        for i, (a, d) in enumerate(zip(positional, defaults))
    ]
    if args.vararg is not None:
        params.append(Param(args.vararg.arg, "*args", args.vararg.annotation, None))
    params.extend(Param(a.arg, "keyword-only", a.annotation, d) for a, d in zip(args.kwonlyargs, args.kw_defaults))
    if args.kwarg is not None:
        params.append(Param(args.kwarg.arg, "**kwargs", args.kwarg.annotation, None))
    implicit = 0 if "staticmethod" in decorators or not positional else 1
    return Signature(node.name, tuple(params), implicit, node.returns)
