"""What is installed: the core's version, the spec, each backend's distribution, and engine-wheel clashes.

Every version comes from installed metadata (``importlib.metadata``): each
distribution's ``pyproject.toml`` ``version`` is its one source, and
``kvwire.__version__`` is read from it. Nothing here imports a backend.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from importlib import metadata
from typing import Any, Final, NoReturn

from kvwire.spec.history import SPEC_VERSION, known_versions
from kvwire.spec.pluggy_project import ENTRY_POINT_GROUP

__all__ = ["INSTALL_CHECK_GROUP", "VersionAction", "core_version", "install_problems", "version_text", "versions"]

CORE: Final = "kvwire"
#: Entry-point group of install checks: ``name = "module:function"``, a function returning a message or None.
INSTALL_CHECK_GROUP: Final = "kvwire.install_checks"


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def core_version() -> str:
    """The installed ``kvwire`` distribution's version (``"unknown"`` when run from an uninstalled tree)."""
    try:
        return metadata.version(CORE)
    except metadata.PackageNotFoundError:
        return "unknown"


def versions() -> dict[str, Any]:
    """``{"kvwire": ..., "spec": ..., "spec_known": [...], "backends": {name: {"distribution", "version"}}}``.

    Backends are the entry points of ``kvwire.backends``, read from metadata
    (none is imported); a name claimed twice lists the first distribution.
    """
    backends: dict[str, dict[str, str | None]] = {}
    for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        dist = ep.dist
        backends.setdefault(
            ep.name,
            {"distribution": dist.metadata["Name"] if dist else None, "version": dist.version if dist else None},
        )
    return {
        "kvwire": core_version(),
        "spec": SPEC_VERSION,
        "spec_known": [str(v) for v in known_versions()],
        "backends": backends,
    }


def version_text() -> str:
    """What ``kvwire --version`` prints: one line, the core and the spec (``kvwire check`` lists the backends)."""
    known = known_versions()
    return f"kvwire {core_version()} (backend spec {SPEC_VERSION}; loads backends of spec {known[0]} to {known[-1]})"


class VersionAction(argparse.Action):
    """``--version`` that reads metadata only when given (argparse's own formats a string at parser build)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        kwargs.setdefault("help", "print kvwire's version and the backend spec it implements, then exit")
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object, option: str | None = None
    ) -> NoReturn:
        print(version_text())
        parser.exit()


def install_problems() -> list[str]:
    """What installed plugins say is wrong with this installation (entry points of :data:`INSTALL_CHECK_GROUP`).

    Each entry point names a function taking no argument that returns a message, or None when all
    is well (kvwire-mooncake's says when two Mooncake engine wheels overwrite each other). A check
    that fails to load or raises is itself reported, never raised.
    """
    problems: list[str] = []
    for ep in sorted(metadata.entry_points(group=INSTALL_CHECK_GROUP), key=lambda e: e.name):
        try:
            found = ep.load()()
        except Exception as exc:  # a plugin's bug is reported, not raised
            problems.append(f"install check {ep.name} ({ep.value}) failed: {type(exc).__name__}: {exc}")
            continue
        if found:
            problems.append(str(found))
    return problems
