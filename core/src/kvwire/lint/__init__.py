"""``kvwire lint``: signature drift between methods and their overrides, found in source before anything runs.

For hosts that have not adopted kvwire: it reads a source tree with ``ast``
(nothing is imported or executed), resolves base classes through the tree's
imports, and reports every override that would fail a caller of the method it
overrides, the failure sglang 0.5.17 shipped (``AscendKVManager.send_kvcache``
lacked the ``dst_device_kv_indices`` that ``MooncakeKVManager.transfer_worker``
passes on every call). Rules are described in :mod:`kvwire.lint.overrides`.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from kvwire.errors import ConfigError
from kvwire.lint.findings import RULES, Caller, LintFinding, LintRule
from kvwire.lint.hierarchy import Classes
from kvwire.lint.overrides import check_overrides
from kvwire.lint.tree import SourceTree

__all__ = ["RULES", "Caller", "LintFinding", "LintRule", "lint_tree"]

_log = logging.getLogger("kvwire.lint")


def lint_tree(
    path: str | os.PathLike[str],
    select: Iterable[str] | None = None,
    *,
    warn: Callable[[str], None] | None = None,
) -> list[LintFinding]:
    """Every finding in the ``.py`` files under ``path`` (a directory or one file), for methods in ``select``.

    A file is parsed as far as the checks need it (whole-file parsing would take
    ~10 s on sglang's 3,000 modules): a file whose needed part does not parse is
    reported to ``warn`` (default: the ``kvwire.lint`` logger) and skipped, and a
    syntax error where no check reads goes unnoticed (this is no syntax checker).
    Raises ConfigError when ``path`` is not a directory or a ``.py`` file.
    """
    if isinstance(select, str):
        select = [select]
    root = Path(path)
    if not root.exists():
        raise ConfigError(f"{os.fspath(path)}: no such file or directory")
    if not (root.is_dir() or (root.is_file() and root.suffix == ".py")):
        raise ConfigError(f"{os.fspath(path)}: not a directory or a .py file")
    collecting = gc.isenabled()
    gc.disable()  # collections amid ~10^6 new AST nodes add ~50% to a large tree's time; cycles go at the next one
    try:
        tree = SourceTree(root, os.fspath(path), warn or _log.warning)
        return check_overrides(Classes(tree), frozenset(select) if select is not None else None)
    finally:
        if collecting:
            gc.enable()
