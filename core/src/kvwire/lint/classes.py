"""Classes of a source tree, read from their source: the bases as written, and the members.

A top-level class is read lazily: its header alone is parsed for the bases, and
its body is cut into members (see ``source``) of which only the ones a check
reads are parsed. A class inside a module-level ``if``/``try`` block, or one whose
pieces do not parse on their own, is read from its ``ast.ClassDef``. Members
defined inside ``if`` blocks of a class body, and nested classes, are not
looked at.
"""

from __future__ import annotations

import ast
import keyword
import re
from dataclasses import dataclass, field

from kvwire.lint.signature import Function
from kvwire.lint.source import Piece, header_end, parse_at, split
from kvwire.lint.tree import Module

__all__ = ["CLASS", "ClassInfo", "Function", "Member"]


#: A ``class`` statement (at a line's start: not a word in a decorator's string).
CLASS = re.compile(r"^[ \t]*class[ \t]+(\w+)", re.MULTILINE)
_DEF = re.compile(r"^[ \t]*(?:async[ \t]+)?def[ \t]+\w+", re.MULTILINE)
_CALLED = re.compile(r"\.[ \t]*(\w+)[ \t]*\(")


@dataclass
class Member:
    """One name a class body binds: a function (``def``), a nested class, or an assignment."""

    owner: ClassInfo
    name: str
    kind: str
    piece: Piece | None = None
    node: ast.stmt | None = None
    offset: int = 0
    _header: tuple[Function | None] | None = field(default=None, repr=False)

    def text(self) -> str:
        module = self.owner.module
        if self.piece is not None:
            return module.text[self.piece.start : self.piece.end]
        assert self.node is not None
        first = min([self.node.lineno, *(d.lineno for d in getattr(self.node, "decorator_list", []))])
        return module.text[module.offset(first) : module.offset((self.node.end_lineno or first) + 1)]

    def functions(self) -> list[Function]:
        """Every function this member's statements define (one, unless pieces were joined).

        Nodes inside them are ``offset`` lines off (see ``Module.shallow_statements``).
        """
        nodes: list[ast.stmt | None] = [self.node]
        if self.piece is not None:
            parsed, self.offset = self.owner.module.shallow_statements(self.piece)
            nodes = list(parsed)
        return [n for n in nodes if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]

    def function(self) -> Function | None:
        found = [f for f in self.functions() if f.name == self.name]
        return found[-1] if found else None

    def header(self) -> Function | None:
        """The function with its decorators and parameters but no body: parsing the header alone is cheap."""
        if self._header is None:
            self._header = (self._parse_header(),)
        return self._header[0]

    def _parse_header(self) -> Function | None:
        piece = self.piece
        if piece is None or len(piece.names) != 1:
            return self.function()
        text = self.owner.module.text
        match = _DEF.search(text, piece.start, piece.end)
        colon = header_end(text, match.end(), piece.end) if match else None
        if colon is not None:
            try:
                nodes = parse_at(text[piece.start : colon + 1] + " pass", piece.first_line, piece.indent, shallow=True)
            except (SyntaxError, ValueError):
                nodes = []
            found = [n for n in nodes if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == self.name]
            if found:
                return found[-1]
        return self.function()


@dataclass(eq=False)
class ClassInfo:
    """A class statement of the tree."""

    module: Module
    name: str
    line: int
    piece: Piece | None = None
    node: ast.ClassDef | None = None
    _bases: list[ast.expr] | None = None
    _members: dict[str, list[Member]] | None = None
    _body: tuple[int, int] | None = None
    _called: dict[str, list[Member]] | None = field(default=None, repr=False)

    def base_expressions(self) -> list[ast.expr]:
        if self._bases is None:
            self._bases = self._read_header()
        return self._bases

    def _read_header(self) -> list[ast.expr]:
        """The bases, from the header alone when it parses alone; notes where the body starts for ``members``."""
        if self.node is not None or self.piece is None:
            return list(self.node.bases) if self.node is not None else []
        text, piece = self.module.text, self.piece
        match = CLASS.search(text, piece.start, piece.end)
        colon = header_end(text, match.end(), piece.end) if match else None
        newline = text.find("\n", colon, piece.end) if colon is not None else -1
        rest = text[colon + 1 : newline].strip() if colon is not None and newline != -1 else "-"
        if match is None or colon is None or (rest and not rest.startswith("#")):  # no header, or a one-line body
            return self._from_node()
        self._body = (newline + 1, self.line + text.count("\n", match.start(), newline) + 1)
        if "(" not in text[match.end() : colon]:
            return []
        try:
            header = parse_at(text[match.start() : colon + 1] + " pass", self.line, "", shallow=True)[0]
        except (SyntaxError, ValueError, IndexError):
            return self._from_node()
        return list(header.bases) if isinstance(header, ast.ClassDef) else []

    def _split_body(self) -> dict[str, list[Member]]:
        assert self.piece is not None and self._body is not None
        text, end = self.module.text, self.piece.end
        members: dict[str, list[Member]] = {}
        position, line = self._body
        while position < end:
            stop = text.find("\n", position, end)
            stop = end if stop == -1 else stop
            stripped = text[position:stop].lstrip(" \t")
            if stripped.strip() and not stripped.startswith("#"):
                for piece in split(text, position, end, line, text[position : stop - len(stripped)]):
                    for name in piece.names or ((piece.name,) if piece.name else ()):
                        kind = piece.kind if name in piece.names else "other"
                        if kind != "other" or not keyword.iskeyword(name):
                            members.setdefault(name, []).append(Member(self, name, kind, piece=piece))
                break
            position, line = stop + 1, line + 1
        return members

    def _from_node(self) -> list[ast.expr]:
        assert self.piece is not None
        found = [n for n in self.module.statements(self.piece) if isinstance(n, ast.ClassDef)]
        self.node = found[0] if found else None
        return list(self.node.bases) if self.node is not None else []

    def members(self) -> dict[str, list[Member]]:
        if self._members is None:
            self.base_expressions()
            if self.node is None and self._body is not None:
                self._members = self._split_body()
            else:
                self._members = {}
                for stmt in self.node.body if self.node is not None else []:
                    for name, kind in _bound_names(stmt):
                        self._members.setdefault(name, []).append(Member(self, name, kind, node=stmt))
        return self._members

    def member(self, name: str) -> Member | None:
        """The binding of ``name`` that wins (the last one), or None."""
        found = self.members().get(name)
        return found[-1] if found else None

    def callers(self, name: str) -> list[Member]:
        """The function members whose text has a call ``<something>.name(...)``."""
        if self._called is None:
            self._called = {}
            seen: set[int] = set()
            for members in self.members().values():
                for member in members:
                    if member.kind == "def" and id(member.piece or member.node) not in seen:
                        seen.add(id(member.piece or member.node))
                        for called in set(_CALLED.findall(member.text())):
                            self._called.setdefault(called, []).append(member)
        return self._called.get(name, [])


def _bound_names(stmt: ast.stmt) -> list[tuple[str, str]]:
    if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
        return [(stmt.name, "def")]
    if isinstance(stmt, ast.ClassDef):
        return [(stmt.name, "class")]
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
    return [(t.id, "other") for t in targets if isinstance(t, ast.Name)]
