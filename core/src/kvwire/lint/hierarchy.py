"""Base classes resolved to classes of the tree, through each module's imports, and C3 MROs."""

from __future__ import annotations

import ast
from collections.abc import Callable
from typing import Union

from kvwire.lint.classes import CLASS, ClassInfo
from kvwire.lint.source import Piece
from kvwire.lint.tree import Binding, Module, SourceTree

__all__ = ["Classes", "Target"]

Target = Union[Module, ClassInfo, str]  # noqa: UP007 (runtime alias, py3.10 target; str: a module outside the tree)


class Classes:
    """Every class of a tree, base names resolved to classes of the tree, and C3 MROs."""

    def __init__(self, tree: SourceTree) -> None:
        self.tree = tree
        self._by_piece: dict[tuple[str, int], ClassInfo] = {}
        self._by_node: dict[int, ClassInfo] = {}
        self._mro: dict[int, list[ClassInfo]] = {}
        self._active: set[tuple[str, str, int | None]] = set()

    def all(self, where: Callable[[Module], bool] | None = None) -> list[ClassInfo]:
        """Every class of the tree (of the modules ``where`` accepts), module by module."""
        out: list[ClassInfo] = []
        for name in sorted(self.tree.modules):
            module = self.tree.modules[name]
            if where is not None and not where(module):
                continue
            out.extend(self._of_piece(module, p) for p in module.pieces if p.kind == "class")
            out.extend(self._of_node(module, node) for node in module.nested_classes())
        return out

    def _of_piece(self, module: Module, piece: Piece) -> ClassInfo:
        key = (module.name, piece.start)
        if key not in self._by_piece:
            match = CLASS.search(module.text, piece.start, piece.end)
            line = piece.first_line + (module.text.count("\n", piece.start, match.start()) if match else 0)
            self._by_piece[key] = ClassInfo(module, piece.name, line, piece=piece)
        return self._by_piece[key]

    def _of_node(self, module: Module, node: ast.ClassDef) -> ClassInfo:
        if id(node) not in self._by_node:
            self._by_node[id(node)] = ClassInfo(module, node.name, node.lineno, node=node)
        return self._by_node[id(node)]

    def resolve(self, module: Module, name: str, line: int | None) -> Target | None:
        """What ``name`` means in ``module`` just before ``line`` (None: at the end of the module)."""
        key = (module.name, name, line)
        if key in self._active:
            return None
        self._active.add(key)
        try:
            bindings = module.bindings(name)
            before = [b for b in reversed(bindings) if line is None or b.line < line]
            for binding in before + [b for b in bindings if line is not None and b.line >= line]:
                target = self._follow(module, binding)
                if target is not None:
                    return target
            for star in module.stars():
                starred = self.tree.module(star)
                found = self.resolve(starred, name, None) if starred is not None else None
                if found is not None:
                    return found
            return self.tree.modules.get(f"{module.name}.{name}") if module.is_package else None
        finally:
            self._active.discard(key)

    def _follow(self, module: Module, binding: Binding) -> Target | None:
        if binding.piece is not None:
            return self._of_piece(module, binding.piece)
        if binding.classdef is not None:
            return self._of_node(module, binding.classdef)
        if binding.expression is not None:
            return self.resolve_expression(module, binding.expression, binding.line)
        if binding.module is None:
            return None
        target = self.tree.module(binding.module)
        if binding.attribute is None:
            return target if target is not None else binding.module
        if target is None:
            return None
        return self.resolve(target, binding.attribute, None)

    def resolve_expression(self, module: Module, expr: ast.expr, line: int | None) -> Target | None:
        if isinstance(expr, ast.Name):
            return self.resolve(module, expr.id, line)
        if isinstance(expr, ast.Subscript):
            return self.resolve_expression(module, expr.value, line)
        if not isinstance(expr, ast.Attribute):
            return None
        owner = self.resolve_expression(module, expr.value, line)
        if isinstance(owner, Module):
            return self.resolve(owner, expr.attr, None)
        if isinstance(owner, str):
            dotted = f"{owner}.{expr.attr}"
            return self.tree.modules.get(dotted, dotted)
        return None

    def bases(self, cls: ClassInfo) -> list[ClassInfo]:
        """The bases that are classes of the tree, in order."""
        out: list[ClassInfo] = []
        for expr in cls.base_expressions():
            target = self.resolve_expression(cls.module, expr, cls.line)
            if isinstance(target, ClassInfo) and target is not cls and target not in out:
                out.append(target)
        return out

    def mro(self, cls: ClassInfo) -> list[ClassInfo]:
        """C3 linearisation over the bases in the tree (depth-first where C3 fails)."""
        cached = self._mro.get(id(cls))
        if cached is not None:
            return cached
        self._mro[id(cls)] = [cls]  # a cycle of bases stops here
        bases = self.bases(cls)
        sequences = [list(self.mro(b)) for b in bases] + [list(bases)]
        merged: list[ClassInfo] = []
        while any(sequences):
            head = next((s[0] for s in sequences if s and not any(s[0] in t[1:] for t in sequences)), None)
            if head is None:
                merged = list(dict.fromkeys(c for s in [self.mro(b) for b in bases] for c in s))
                break
            merged.append(head)
            sequences = [s[1:] if s and s[0] is head else s for s in sequences]
        result = [cls, *[c for c in merged if c is not cls]]
        self._mro[id(cls)] = result
        return result
