"""Old import paths, kept working: they are names users' configurations hold.

- ``kvwire.compat.vllm`` is :mod:`kvwire.hosts.vllm` (``kv_connector_module_path`` in vLLM's
  ``--kv-transfer-config``), submodules included;
- ``kvwire.compat.sglang`` is :mod:`kvwire_sglang` (the ``kvwire-sglang`` distribution);
- ``kvwire.compat.activation`` and ``kvwire.compat.host_range`` are :mod:`kvwire.hosts.activation` and
  :mod:`kvwire.hosts.host_range`.

Importing an old name gives the very module object of the new one (no copy: classes and state are shared),
through a finder on ``sys.meta_path`` that answers only for names under ``kvwire.compat.``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Final

__all__ = ["ALIASES"]

#: Old name -> the module it stands for now.
ALIASES: Final = {
    "vllm": "kvwire.hosts.vllm",
    "sglang": "kvwire_sglang",
    "activation": "kvwire.hosts.activation",
    "host_range": "kvwire.hosts.host_range",
}
_PREFIX: Final = __name__ + "."


def _target(name: str) -> str | None:
    head, _, rest = name[len(_PREFIX) :].partition(".")
    new = ALIASES.get(head)
    return None if new is None else f"{new}.{rest}" if rest else new


class _Aliases(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``kvwire.compat.<old>[.sub]`` as the module it now is."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(_PREFIX) or _target(fullname) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = _target(spec.name)
        assert new is not None  # find_spec answered only for aliased names
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module was imported under its own name."""


if not any(isinstance(finder, _Aliases) for finder in sys.meta_path):
    sys.meta_path.insert(0, _Aliases())
