"""Annotation resolution and normalisation for signature comparison.

Two annotations are equal when they denote the same type after normalising:
``Optional[X]`` == ``X | None`` == ``Union[X, None]`` (unions are unordered),
``typing.Sequence`` == ``collections.abc.Sequence``, ``typing.List`` ==
``list``, and string annotations (``from __future__ import annotations``) are
resolved in the defining module first.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["UnresolvedAnnotation", "annotation_key", "format_annotation", "resolve_annotation"]


class UnresolvedAnnotation(Exception):
    """A string annotation could not be evaluated in its module."""


def resolve_annotation(annotation: object, func: Callable[..., Any]) -> object:
    """Evaluate a string annotation in ``func``'s module; other values pass through."""
    globalns = dict(getattr(inspect.unwrap(func), "__globals__", {}))
    for _ in range(3):  # a quoted annotation under `from __future__ import annotations` is a str twice
        if not isinstance(annotation, str):
            return annotation
        text = annotation
        try:
            annotation = eval(text, globalns)  # noqa: S307 - annotations are code by definition
        except Exception as exc:  # NameError, AttributeError, TypeError from `X | Y` on old types...
            raise UnresolvedAnnotation(f"cannot resolve annotation {text!r}: {type(exc).__name__}: {exc}") from None
    return annotation


def annotation_key(annotation: object) -> Hashable:
    """A hashable normal form of a resolved annotation (see the module docstring)."""
    if annotation is None or annotation is type(None):
        return "None"
    if annotation is typing.Any:
        return "Any"
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        return ("Union", frozenset(annotation_key(a) for a in typing.get_args(annotation)))
    if origin is not None:
        args = typing.get_args(annotation)
        base = annotation_key(origin)
        return (base, tuple(annotation_key(a) for a in args)) if args else base
    if isinstance(annotation, typing.TypeVar):
        return ("TypeVar", annotation.__name__)
    if isinstance(annotation, type):
        return f"{annotation.__module__}.{annotation.__qualname__}"
    if isinstance(annotation, (list, tuple)):  # Callable[[a, b], c] argument lists
        return tuple(annotation_key(a) for a in annotation)
    return repr(annotation)


def format_annotation(annotation: object) -> str:
    """Readable text of an annotation as written (strings stay as written)."""
    if annotation is inspect.Parameter.empty:
        return "<none>"
    if isinstance(annotation, str):
        return annotation
    return inspect.formatannotation(annotation)
