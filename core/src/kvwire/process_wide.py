"""``ProcessWide``: a value created once per process, on first use, under a lock (the default registry, metrics)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["ProcessWide"]

T = TypeVar("T")


class ProcessWide(Generic[T]):
    """``get()`` returns the one value ``factory`` made; concurrent first calls still make exactly one."""

    def __init__(self, factory: Callable[[], T]) -> None:
        self._factory = factory
        self._lock = threading.Lock()
        self._value: T | None = None

    def get(self) -> T:
        with self._lock:
            if self._value is None:
                self._value = self._factory()
            return self._value

    def reset(self) -> None:
        """Forget the value (tests); the next ``get()`` makes a new one."""
        with self._lock:
            self._value = None
