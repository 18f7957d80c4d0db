"""Bounded JSON lines: UTF-8, a nesting depth and an object checked without trusting the sender.

:func:`parse_object` is the one parser of both ends of :mod:`kvwire.control`.
The nesting depth is measured by a flat scan before :func:`json.loads` sees the
text, so ``[[[[...`` a hundred thousand levels deep is refused cheaply instead
of recursing.
"""

from __future__ import annotations

import json
import operator
import re
from itertools import accumulate
from typing import Any

__all__ = [
    "DEFAULT_MAX_BUFFERED",
    "DEFAULT_MAX_DEPTH",
    "DEFAULT_MAX_LINE",
    "LineError",
    "nesting_depth",
    "parse_object",
    "preview",
]

#: Longest line (without its newline) either end accepts: 1 MiB.
DEFAULT_MAX_LINE = 1 << 20
#: Most bytes of unread lines (and the partial line) the parent holds: 8 MiB.
DEFAULT_MAX_BUFFERED = 8 << 20
#: Deepest nesting of arrays and objects in one message.
DEFAULT_MAX_DEPTH = 32

_ESCAPE = re.compile(r"\\.", re.DOTALL)
_BRACKETS = b"[]{}"
_STEP = bytes(2 if b in b"[{" else 0 for b in range(256))  # an opening bracket counts 2, a closing one 0
_NOT_BRACKET = bytes(b for b in range(256) if b not in _BRACKETS)


class LineError(ValueError):
    """A line that is not a bounded JSON object; the message says what it is instead."""


def preview(data: bytes, limit: int = 60) -> str:
    """A short escaped prefix of ``data``, with its length when cut."""
    shown = repr(bytes(data[:limit]))
    return shown if len(data) <= limit else f"{shown}... ({len(data)} bytes)"


def nesting_depth(text: str) -> int:
    """The deepest nesting of ``[`` and ``{`` outside strings, in linear time and no recursion."""
    if "[" not in text and "{" not in text:
        return 0
    # Drop escapes (\" among them), then every other '"'-separated part is outside a string.
    outside = "".join(_ESCAPE.sub("", text).split('"')[::2]).encode("utf-8", "surrogatepass")
    steps = outside.translate(_STEP, _NOT_BRACKET)
    # after k brackets the depth is opens - closes = (sum of steps) - k
    return max(0, max(map(operator.sub, accumulate(steps), range(1, len(steps) + 1)), default=0))


def _kind(value: object) -> str:
    if isinstance(value, list):
        return "a JSON array"
    if isinstance(value, str):
        return "a JSON string"
    if value is None or isinstance(value, bool):
        return f"JSON {json.dumps(value)}"
    return "a JSON number"


def parse_object(line: bytes, max_depth: int = DEFAULT_MAX_DEPTH) -> dict[str, Any]:
    """One line (without its newline) as a JSON object; :class:`LineError` saying why not."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LineError(
            f"a line that is not UTF-8 (byte 0x{line[exc.start]:02x} at offset {exc.start}): {preview(line)}"
        ) from None
    # Cheap bound first: a line with few brackets cannot nest deeply.
    if text.count("[") + text.count("{") > max_depth and nesting_depth(text) > max_depth:
        raise LineError(f"JSON nested deeper than {max_depth} levels: {preview(line)}")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LineError(f"a line that is not JSON ({exc.msg} at column {exc.colno}): {preview(line)}") from None
    except (ValueError, RecursionError) as exc:  # e.g. an integer over Python's digit limit
        raise LineError(f"a line that is not JSON kvwire reads ({exc}): {preview(line)}") from None
    if not isinstance(value, dict):
        raise LineError(f"{_kind(value)}, not a JSON object: {preview(line)}")
    return value
