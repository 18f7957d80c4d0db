"""Python source cut into statements by line, without parsing; each piece is parsed only when read.

Parsing every function body of sglang's ~3,000 modules takes ~10 s, and the
checks read a few thousand functions, so a module (or a class body) is cut at
its indentation and ``ast`` sees only the pieces a check reads. No cut is made
inside a triple-quoted string (triple quotes inside a quoted string or a comment
open none); a decorator, or a line ending in a backslash, is joined to the next
statement, and ``else``/``elif``/``except``/``finally`` to the one before. A
piece that still does not parse (a cut inside brackets) is read from the whole
file's tree instead (see ``Module.statements``).
"""

from __future__ import annotations

import ast
import bisect
import re
from functools import lru_cache
from typing import NamedTuple

__all__ = ["Piece", "header_end", "parse_at", "parse_piece", "split"]

# a decorator | def/class NAME | a clause continuing the statement before | NAME = / NAME: (an assignment)
_HEAD = re.compile(r"(@)|(?:async[ \t]+)?(def|class)[ \t]+(\w+)|(else|elif|except|finally)\b|(\w+)[ \t]*(?::|=(?!=))")
_LEXEMES = re.compile(r"\\.|\"\"\"|'''|\"|'|#")
_HEADER_STOPS = re.compile(r"[()\[\]{}\"'#:]")


@lru_cache(maxsize=64)
def _starts(indent: str) -> re.Pattern[str]:
    """A line at exactly ``indent`` that begins a statement (not a comment, not a closing bracket)."""
    return re.compile("\n" + re.escape(indent) + r"(?=[^ \t\r\n\f#)\]}])")


class Piece(NamedTuple):
    """One statement (or a few joined ones) of a module or class body: where it is, and what it names."""

    start: int
    end: int
    first_line: int
    last_line: int
    indent: str
    kind: str  # "def", "class" or "other"
    name: str  # the def/class name, or the assigned name of an "other" piece ("" if none)
    names: tuple[str, ...]  # every def/class name among the joined statements


def _find(text: str, what: str, start: int, end: int) -> int:
    found = text.find(what, start, end)
    return end if found == -1 else found


def _quoted_or_commented(text: str, start: int, end: int) -> bool:
    """Whether ``end`` falls inside a string or a comment of the code ``text[start:end]`` (one line's start)."""
    quote = ""
    for match in _LEXEMES.finditer(text, start, end):
        lexeme = match.group()
        if not quote:
            if lexeme == "#":
                return True
            if lexeme[0] in "\"'":
                quote = lexeme
        elif lexeme == quote:
            quote = ""
    return bool(quote)


def _strings(text: str, start: int, end: int) -> list[int]:
    """Start and end offsets of the triple-quoted strings in a region, flattened: [s0, e0, s1, e1, ...]."""
    bounds: list[int] = []
    after_string = position = start  # code is read from the end of the last string; quotes are looked for from position
    double, single = _find(text, '"""', start, end), _find(text, "'''", start, end)
    while (opening := min(double, single)) < end:
        quote = '"""' if opening == double else "'''"
        if _quoted_or_commented(text, max(text.rfind("\n", start, opening) + 1, after_string), opening):
            position = opening + 3  # inside '...' or a comment: not a string's start
        else:
            close = text.find(quote, opening + 3, end)
            while close != -1 and text[close - 1] == "\\":
                close = text.find(quote, close + 1, end)
            after_string = position = end if close == -1 else close + 3
            bounds += [opening, position]
        if double < position:
            double = _find(text, '"""', position, end)
        if single < position:
            single = _find(text, "'''", position, end)
    return bounds


def split(text: str, start: int, end: int, first_line: int, indent: str) -> list[Piece]:
    """The statements of ``text[start:end]`` (which starts at a statement line) at ``indent``."""
    strings = _strings(text, start, end)
    offsets = [start]
    for found in _starts(indent).finditer(text, start, end):
        offset = found.start() + 1
        if not bisect.bisect(strings, offset) % 2:  # even: outside every triple-quoted string
            offsets.append(offset)
    offsets.append(end)
    head, skip, count = _HEAD.match, len(indent), text.count
    pieces: list[Piece] = []
    names: list[str] = []
    group_start, group_line, kind, name, headed, joining = -1, 0, "other", "", False, False
    line = first_line
    for i in range(len(offsets) - 1):
        offset = offsets[i]
        if i:
            line += count("\n", offsets[i - 1], offset)
        match = head(text, offset + skip)
        decorator = match is not None and match.group(1) is not None
        if group_start < 0 or not (joining or (match is not None and match.group(4) is not None)):
            if group_start >= 0:
                pieces.append(Piece(group_start, offset, group_line, line - 1, indent, kind, name, tuple(names)))
            group_start, group_line, kind, name, names, headed = offset, line, "other", "", [], False
        if match is not None and match.group(2) is not None:
            names.append(match.group(3))
        if not headed and not decorator:
            headed = True
            if match is not None and match.group(2) is not None:
                kind, name = match.group(2), match.group(3)
            elif match is not None and match.group(5) is not None:
                name = match.group(5)
        stop = offsets[i + 1]
        joining = decorator or (stop - 2 >= offset and text[stop - 2] == "\\")  # a backslash ends the line
    last_line = line + count("\n", offsets[-2], max(end - 1, offsets[-2]))  # not the newline ending the last line
    pieces.append(Piece(group_start, end, group_line, last_line, indent, kind, name, tuple(names)))
    return pieces


def parse_piece(text: str, piece: Piece) -> list[ast.stmt]:
    """The statements of one piece, with the line numbers of the file. Raises SyntaxError/ValueError."""
    return parse_at(text[piece.start : piece.end], piece.first_line, piece.indent)


def parse_at(source: str, first_line: int, indent: str, *, shallow: bool = False) -> list[ast.stmt]:
    """The statements of ``source``, found at line ``first_line`` and ``indent`` of a file.

    Line numbers are the file's: of every node, or with ``shallow`` of the statements
    and their decorators only (cheaper, for headers parsed to read a signature).
    """
    if indent:
        body = _parse("if 1:\n" + source)
        statements = body[0].body if body and isinstance(body[0], ast.If) else []
        offset = first_line - 2
    else:
        statements = _parse(source)
        offset = first_line - 1
    for node in statements:
        if not shallow:
            ast.increment_lineno(node, offset)
            continue
        for part in [node, *getattr(node, "decorator_list", [])]:
            part.lineno += offset
            part.end_lineno = part.lineno if part.end_lineno is None else part.end_lineno + offset
    return statements


def header_end(text: str, start: int, end: int) -> int | None:
    """The offset of the ``:`` ending the ``class``/``def`` header at ``start``, skipping brackets and strings."""
    depth = 0
    position = start
    while True:
        match = _HEADER_STOPS.search(text, position, end)
        if match is None:
            return None
        i, c = match.start(), match.group()
        position = i + 1
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c in "\"'":
            close = text.find(c, i + 1, end)
            while close != -1 and text[close - 1] == "\\":
                close = text.find(c, close + 1, end)
            if close == -1:
                return None
            position = close + 1
        elif c == "#":
            newline = text.find("\n", i, end)
            if newline == -1:
                return None
            position = newline
        elif depth == 0:
            return i


def _parse(source: str) -> list[ast.stmt]:
    """``ast.parse``; nesting deeper than the parser holds (MemoryError, RecursionError) is a SyntaxError here."""
    try:
        return ast.parse(source).body
    except (MemoryError, RecursionError) as exc:
        raise SyntaxError(f"nested too deeply for the parser ({type(exc).__name__})") from None
