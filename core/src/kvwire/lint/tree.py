"""A source tree's modules, read with ``ast`` (never imported), and names resolved through their imports.

Module names come from the path below the given root, prefixed with the
packages above it (``sglang/srt/...`` linted from ``sglang/srt`` is still
``sglang.srt...``, though ``srt`` is a namespace package), so absolute imports,
relative imports and ``module.Class`` attribute bases all resolve within the
tree; an absolute import that matches no module exactly falls back to the one
module whose name ends with it (a ``src/`` layout linted from the repository
root). A name is looked up among the
bindings made before the line that uses it (so ``class Foo(Foo)`` sees the
imported ``Foo``): imports, ``from`` imports (re-exports followed), ``*``
imports, ``Alias = Name`` assignments, class statements, submodules.
"""

from __future__ import annotations

import ast
import importlib.util
import keyword
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvwire.files import UnreadableFile, read_regular_file
from kvwire.lint.source import Piece, parse_at, parse_piece, split

__all__ = ["Binding", "Module", "SourceTree"]

_SKIP_DIRS = frozenset({"__pycache__", "node_modules", "site-packages"})
#: The largest source file read (sglang's largest is about 300 KB); a larger one is reported and skipped.
MAX_SOURCE_BYTES = 16 << 20
_NESTED_CLASS = re.compile(r"\n[ \t]+class[ \t]+\w")
_HEAD_WORD = re.compile(r"\w+")
_BINDING_STATEMENTS = frozenset({"import", "from", "if", "try", "with", "for", "while", "async"})


@dataclass(frozen=True)
class Binding:
    """A module-level name: a module (``import``), a name of a module (``from``), an expression, or a class."""

    line: int
    module: str | None = None
    attribute: str | None = None
    expression: ast.expr | None = None
    classdef: ast.ClassDef | None = None
    piece: Piece | None = None


class SourceTree:
    """Every ``.py`` file under a directory (or one file), by dotted module name."""

    def __init__(self, path: Path, display: str, warn: Callable[[str], None]) -> None:
        self.warn = warn
        self.modules: dict[str, Module] = {}
        self._suffixes: dict[str, list[str]] | None = None
        root = path if path.is_dir() else path.parent
        prefix = _package_prefix(root)
        for file in [path] if path.is_file() else sorted(_walk(path)):
            parts = list(file.relative_to(root).with_suffix("").parts)
            package = parts[-1] == "__init__"
            name = ".".join(prefix + (parts[:-1] if package else parts))
            shown = display if path.is_file() else os.path.join(display, *file.relative_to(root).parts)
            if name:
                self.modules.setdefault(name, Module(self, name, file, shown, package))

    def module(self, name: str) -> Module | None:
        """The module of this dotted name: exact, else the only one whose name ends with it."""
        found = self.modules.get(name)
        if found is not None or not name:
            return found
        if self._suffixes is None:
            self._suffixes = {}
            for full in self.modules:
                parts = full.split(".")
                for i in range(1, len(parts)):
                    self._suffixes.setdefault(".".join(parts[i:]), []).append(full)
        matches = [self.modules[m] for m in self._suffixes.get(name, [])]
        if len(matches) == 1 and ("." in name or matches[0].is_package):
            return matches[0]
        return None


def _package_prefix(root: Path) -> list[str]:
    """The dotted package path of ``root``: up to its highest enclosing package, across namespace directories.

    ``sglang/srt`` has no ``__init__.py`` but ``sglang`` has, so a tree rooted at
    ``sglang/srt/disaggregation`` holds ``sglang.srt.disaggregation.*``. The walk
    up stops after three directories in a row without ``__init__.py``.
    """
    best: list[str] = []
    pending: list[str] = []
    directory, gap = root.resolve(), 0
    while directory != directory.parent and gap < 3:
        pending.insert(0, directory.name)
        if (directory / "__init__.py").is_file():
            best, gap = list(pending), 0
        else:
            gap += 1
        directory = directory.parent
    return best


def _walk(root: Path) -> Iterator[Path]:
    for directory, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in _SKIP_DIRS]
        for file in files:
            if file.endswith(".py"):
                yield Path(directory, file)


class Module:
    """One file: its top-level pieces, parsed on demand, and its module-level names."""

    def __init__(self, tree: SourceTree, name: str, path: Path, display: str, is_package: bool) -> None:
        self.tree, self.name, self.path, self.display, self.is_package = tree, name, path, display, is_package
        self.broken = False
        self._text: str | None = None
        self._pieces: list[Piece] | None = None
        self._parsed: dict[int, list[ast.stmt]] = {}
        self._shallow: dict[int, tuple[list[ast.stmt], int]] = {}
        self._full: list[ast.stmt] | None = None
        self._bindings: dict[str, list[Binding]] = {}
        self._stars: list[str] | None = None
        self._line_starts: list[int] | None = None

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = ""
            try:
                self._text = importlib.util.decode_source(read_regular_file(self.path, MAX_SOURCE_BYTES))
            except UnreadableFile as exc:
                self._fail(str(exc))
            except (OSError, SyntaxError, UnicodeDecodeError) as exc:
                self._fail(f"cannot read ({type(exc).__name__}: {exc})")
        return self._text

    @property
    def pieces(self) -> list[Piece]:
        if self._pieces is None:
            self._pieces = split(self.text, 0, len(self.text), 1, "") if self.text else []
        return self._pieces

    def _fail(self, reason: str) -> None:
        if not self.broken:
            self.broken = True
            self.tree.warn(f"{self.display}: {reason}; skipped")

    def statements(self, piece: Piece) -> list[ast.stmt]:
        """The parsed statements of a piece; from the whole file's tree when the piece alone does not parse."""
        cached = self._parsed.get(piece.start)
        if cached is None:
            try:
                cached = parse_piece(self.text, piece)
            except (SyntaxError, ValueError, MemoryError, RecursionError):
                cached = _within(self.full_tree(), piece.first_line, piece.last_line)
            self._parsed[piece.start] = cached
        return cached

    def shallow_statements(self, piece: Piece) -> tuple[list[ast.stmt], int]:
        """The statements of a piece with their own line numbers the file's, and the offset of the nested ones'.

        Moving every nested node's line number costs as much as parsing; callers
        that need one line inside a function add the offset instead.
        """
        cached = self._shallow.get(piece.start)
        if cached is None:
            try:
                nodes = parse_at(self.text[piece.start : piece.end], piece.first_line, piece.indent, shallow=True)
                cached = (nodes, piece.first_line - (2 if piece.indent else 1))
            except (SyntaxError, ValueError, MemoryError, RecursionError):
                cached = (_within(self.full_tree(), piece.first_line, piece.last_line), 0)
            self._shallow[piece.start] = cached
        return cached

    def full_tree(self) -> list[ast.stmt]:
        if self._full is None:
            self._full = []
            try:
                self._full = ast.parse(self.text, str(self.path)).body
            except SyntaxError as exc:
                self._fail(f"line {exc.lineno}: cannot parse ({exc.msg})")
            except ValueError as exc:
                self._fail(f"cannot parse ({exc})")
            except (MemoryError, RecursionError) as exc:  # nesting the parser cannot hold
                self._fail(f"cannot parse ({type(exc).__name__}: nested too deeply)")
        return self._full

    def offset(self, line: int) -> int:
        """The offset of the start of a 1-based line."""
        if self._line_starts is None:
            self._line_starts = [0] + [m.end() for m in re.finditer("\n", self.text)]
        return self._line_starts[line - 1] if line <= len(self._line_starts) else len(self.text)

    def nested_classes(self) -> Iterator[ast.ClassDef]:
        """Classes defined inside module-level ``if``/``try``/``with`` blocks, and inside class bodies."""
        for piece in self.pieces:
            if piece.kind == "other" and _NESTED_CLASS.search(self.text, piece.start, piece.end):
                for node in _walk_block(self.statements(piece)):
                    if isinstance(node, ast.ClassDef):
                        yield node
                        yield from _inner_classes(node)
            elif piece.kind == "class" and _NESTED_CLASS.search(self.text, piece.start, piece.end):
                for node in self.statements(piece):
                    if isinstance(node, ast.ClassDef):
                        yield from _inner_classes(node)

    def absolute(self, module: str | None, level: int) -> str:
        """The absolute name of a (possibly relative) ``from`` import's module."""
        if not level:
            return module or ""
        parts = self.name.split(".")
        base = parts if self.is_package else parts[:-1]
        base = base[: len(base) - (level - 1)] if level > 1 else base
        return ".".join([*base, module] if module else base)

    def bindings(self, name: str) -> list[Binding]:
        """Every module-level binding of ``name``, in source order."""
        found = self._bindings.get(name)
        if found is not None:
            return found
        found = []
        text = self.text
        for piece in self.pieces:
            if piece.kind == "class" and piece.name == name:
                found.append(Binding(piece.first_line, piece=piece))
                continue
            if piece.kind != "other":
                continue
            head = _HEAD_WORD.match(text, piece.start)
            word = head.group(0) if head else ""
            if word in _BINDING_STATEMENTS:
                reach = piece.end
            elif piece.name and not keyword.iskeyword(piece.name):  # an assignment: only its targets bind
                equals = text.find("=", piece.start, piece.end)
                reach = piece.end if equals == -1 else equals
            else:
                continue
            if name in text[piece.start : reach]:
                found.extend(self._collect(piece, name))
        self._bindings[name] = found
        return found

    def stars(self) -> list[str]:
        """The modules this module ``*``-imports."""
        if self._stars is None:
            self._stars = []
            for piece in self.pieces:
                if piece.kind == "other" and "*" in self.text[piece.start : piece.end]:
                    for node in _walk_block(self.statements(piece)):
                        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
                            self._stars.append(self.absolute(node.module, node.level))
        return self._stars

    def _collect(self, piece: Piece, name: str) -> list[Binding]:
        out: list[Binding] = []
        for node in _walk_block(self.statements(piece)):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname == name:
                        out.append(Binding(node.lineno, module=alias.name))
                    elif alias.asname is None and alias.name.split(".")[0] == name:
                        out.append(Binding(node.lineno, module=name))
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name and alias.name != "*":
                        target = self.absolute(node.module, node.level)
                        out.append(Binding(node.lineno, module=target, attribute=alias.name))
            elif isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    out.append(Binding(node.lineno, expression=node.value))
            elif isinstance(node, ast.ClassDef) and node.name == name:
                out.append(Binding(node.lineno, classdef=node))
        return out


def _inner_classes(cls: ast.ClassDef, enclosing: frozenset[str] = frozenset()) -> Iterator[ast.ClassDef]:
    """The classes defined in ``cls``'s body, at any depth of class nesting, whose bases resolve at module level.

    A class whose base is a name bound in an enclosing class body (``class Outer: class Base: ...;
    class Impl(Base)``) is left out: lint resolves names at module level and would pick the wrong class.
    """
    bound = enclosing | _bound_in(cls.body)
    for node in _walk_block(cls.body):
        if isinstance(node, ast.ClassDef):
            roots = {_root_name(base) for base in node.bases}
            if roots & bound:
                continue
            yield node
            yield from _inner_classes(node, bound)


def _bound_in(body: list[ast.stmt]) -> frozenset[str]:
    """The names a class body binds: its classes, functions and assignment targets."""
    names: set[str] = set()
    for node in _walk_block(body):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return frozenset(names)


def _root_name(expr: ast.expr) -> str | None:
    """``a`` of ``a``, ``a.b.c`` or ``a[...]``; None for anything else."""
    while isinstance(expr, (ast.Attribute, ast.Subscript)):
        expr = expr.value
    return expr.id if isinstance(expr, ast.Name) else None


def _walk_block(statements: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Module-level statements, into ``if``/``try``/``with``/loop blocks but not into functions or classes."""
    for node in statements:
        yield node
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        for field in ("body", "orelse", "finalbody"):
            yield from _walk_block(getattr(node, field, []))
        for handler in getattr(node, "handlers", []):
            yield from _walk_block(handler.body)


def _within(statements: list[ast.stmt], first: int, last: int) -> list[ast.stmt]:
    """The outermost statements of a tree that start within lines ``first..last``."""
    out: list[ast.stmt] = []
    for node in statements:
        start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
        end = node.end_lineno or node.lineno
        if first <= start <= last:
            out.append(node)
        elif start < first and end >= first:
            nested = [*getattr(node, "body", []), *getattr(node, "orelse", []), *getattr(node, "finalbody", [])]
            for handler in getattr(node, "handlers", []):
                nested.extend(handler.body)
            out.extend(_within(nested, first, last))
    return out
