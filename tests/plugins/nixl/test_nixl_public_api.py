"""kvwire-nixl is written like a third party's plugin: kvwire's public API only, read from its source with ``ast``.

Allowed: ``import kvwire``, ``from kvwire import NAME`` and ``kvwire.NAME`` where
NAME is in ``kvwire.__all__``, and ``from kvwire.transport import NAME`` where NAME is in
``kvwire.transport.__all__`` (the helpers public for transport authors). Refused:
``kvwire._anything``, ``kvwire.<submodule>`` (imported or reached as an attribute), and any
other plugin (``kvwire_<other>``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvwire
import kvwire.transport

SOURCE = Path(__file__).parents[3] / "plugins" / "nixl" / "src" / "kvwire_nixl"
PUBLIC = frozenset(kvwire.__all__)
#: Submodules public for plugin authors, with the names each offers.
PUBLIC_MODULES = {"kvwire.transport": frozenset(kvwire.transport.__all__)}


def _findings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        where = f"{path.name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if alias.name.startswith("kvwire.") or (top.startswith("kvwire_") and top != "kvwire_nixl"):
                    found.append(f"{where}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            top = module.split(".")[0]
            other_plugin = top.startswith("kvwire_") and top != "kvwire_nixl"
            if module in PUBLIC_MODULES:
                offered = PUBLIC_MODULES[module]
                found += [f"{where}: from {module} import {a.name}" for a in node.names if a.name not in offered]
            elif node.level == 0 and (module.startswith("kvwire.") or other_plugin):
                found.append(f"{where}: from {module} import ...")
            if module == "kvwire":
                found += [f"{where}: from kvwire import {a.name}" for a in node.names if a.name not in PUBLIC]
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "kvwire"
            and node.attr not in PUBLIC
        ):
            found.append(f"{where}: kvwire.{node.attr}")
    return found


def test_the_plugin_uses_only_kvwires_public_api() -> None:
    files = sorted(SOURCE.rglob("*.py"))
    assert len(files) >= 5, f"plugin source not found under {SOURCE}"
    findings = [f for path in files for f in _findings(path)]
    assert findings == [], "non-public kvwire API or another plugin used:\n" + "\n".join(findings)


def test_the_checker_catches_what_it_must(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import kvwire\nimport kvwire.planning\nfrom kvwire.transport.backend import TransportBackend\n"
        "from kvwire import _internal\nfrom kvwire.transport import run_into, follow\n"
        "from kvwire_mooncake import MooncakeBackend\nx = kvwire.registry\ny = kvwire._private\nz = kvwire.Transport\n"
    )
    assert len(_findings(bad)) == 7  # follow is not among kvwire.transport's public names


def test_modules_stay_small() -> None:
    sizes = {p.name: len(p.read_text().splitlines()) for p in SOURCE.rglob("*.py")}
    assert max(sizes.values()) < 400, sizes
