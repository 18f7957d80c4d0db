"""Import-only sgl_kernel stand-in (see pyproject.toml): any name imports; calling it raises NotImplementedError."""

from __future__ import annotations

from typing import Any, NoReturn

__version__ = "0.0.0+kvwire.stub"


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)

    def not_available(*args: object, **kwargs: object) -> NoReturn:
        raise NotImplementedError(f"sgl_kernel.{name} called: this is kvwire's import-only stand-in (CPU test venv)")

    not_available.__name__ = name
    return not_available
