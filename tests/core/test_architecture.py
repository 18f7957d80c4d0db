"""The core's layout: the public names, no import cycles, small modules, and the layers pointing one way."""

from __future__ import annotations

import ast
from pathlib import Path

import kvwire

SOURCE = Path(kvwire.__file__).parent
PUBLIC = [
    "CALL_GRACE_S", "ENTRY_POINT_GROUP", "FEATURES", "MAX_NOTIFICATION_BYTES", "SPEC_HISTORY", "SPEC_VERSION",
    "Arrival", "BackendConfig", "BackendOrigin", "BackendDriftError", "BackendError", "BackendImportError",
    "BackendInfo",
    "BackendLoadError", "BackendProtocol", "BackendSpec", "BackendUnavailableError", "ConfigError", "Connection",
    "DuplicateBackendError", "Finding", "HeadLayout", "InvalidTransferError", "KVBuffer", "KVLayout", "KvwireError",
    "Landing", "LandingCredits",
    "LayoutError", "Notification", "NotificationWatcher", "PeerDescription", "PeerUnreachableError", "RawWriter",
    "RegionSet", "Registry", "ResolvedConfig", "SpecVersion", "StuckCall", "TransferError", "TransferFuture",
    "TransferPlan", "TransferRequest",
    "TransferTimeoutError", "Transport", "TransportBackend", "TransportTuning", "UnsupportedFeatureError",
    "ValidationResult",
    "__version__", "connect", "default_registry", "hookimpl", "hookspec", "plan_transfer", "register_backend",
    "resolve_config", "validate_backend",
]  # fmt: skip


def _modules() -> dict[str, Path]:
    found = {}
    for path in SOURCE.rglob("*.py"):
        parts = ["kvwire", *path.relative_to(SOURCE).with_suffix("").parts]
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The kvwire modules ``path`` imports (lazy ones included, ``if TYPE_CHECKING:`` blocks left out)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _type_checking_only(node):
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def test_the_public_names_stay_the_same() -> None:
    assert sorted(kvwire.__all__) == sorted(PUBLIC)
    assert all(hasattr(kvwire, name) for name in PUBLIC)


def test_there_is_no_import_cycle() -> None:
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def walk(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                walk(nxt, [*stack, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name, [name])
    assert cycles == []


def test_the_cycle_check_finds_a_cycle(tmp_path: Path) -> None:
    """The check above can fail: two modules importing each other are found."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from kvwire.b import x\n")
    b.write_text("def f():\n    from kvwire.a import y\n")
    modules = {"kvwire.a": a, "kvwire.b": b}
    assert _imports(a, modules) == {"kvwire.b"} and _imports(b, modules) == {"kvwire.a"}


def test_no_module_is_over_450_lines() -> None:
    sizes = {str(p.relative_to(SOURCE)): len(p.read_text().splitlines()) for p in SOURCE.rglob("*.py")}
    assert {name: n for name, n in sizes.items() if n > 450} == {}


def test_no_plugin_or_host_module_is_over_450_lines() -> None:
    """The backends' and hosts' distributions are held to the core's size limit too."""
    root = Path(__file__).resolve().parents[2]
    files = [p for d in ("plugins", "hosts") for p in (root / d).glob("*/src/**/*.py")]
    assert len(files) > 40  # the trees were found
    sizes = {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in files}
    assert {name: n for name, n in sizes.items() if n > 450} == {}


def test_the_top_level_holds_only_the_bottom_layer_and_entry_modules() -> None:
    top = sorted(p.name for p in SOURCE.glob("*.py"))
    bottom = ["config.py", "errors.py", "files.py", "metrics.py", "process_wide.py", "records.py", "stdout.py"]
    assert top == ["__init__.py", "__main__.py", *bottom]


def test_the_spec_never_imports_planning_or_anything_above_it() -> None:
    modules = _modules()
    above = ("kvwire.planning", "kvwire.transport", "kvwire.connection", "kvwire.registry", "kvwire.cli")
    for name, path in modules.items():
        if name.startswith(("kvwire.spec", "kvwire.layout")):
            assert not [m for m in _imports(path, modules) if m.startswith(above)], name
