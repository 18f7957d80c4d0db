"""Backends named ``module.path:ClassName``: imported lazily, isolated, validated like entry points, allow-listed."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import kvwire
from kvwire.registry import manager
from kvwire.registry.findings import BackendOrigin

from plugin_wheels import VARIANTS

IDX = np.array([1, 2], np.int32)
GOOD = """\
from kvwire.backends.local import LocalBackend


class Good(LocalBackend):
    '''The local backend, from a file no distribution installed.'''
"""
_ids = itertools.count()
Write = Callable[[str], str]


@pytest.fixture
def write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Write]:
    """Write a module source to a fresh module on sys.path; its name is returned, and forgotten afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("KVWIRE_BACKENDS", raising=False)
    monkeypatch.delenv("KVWIRE_POLICY", raising=False)
    names: list[str] = []

    def _write(source: str) -> str:
        name = f"kvw_modpath_{os.getpid()}_{next(_ids)}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        names.append(name)
        return name

    yield _write
    for name in names:
        sys.modules.pop(name, None)


def test_a_good_module_path_backend_connects_and_moves_bytes(write: Write) -> None:
    path = f"{write(GOOD)}:Good"
    registry = kvwire.Registry(allow=["local", path], policy="strict")
    info = registry.get(path)
    assert (info.status, info.distribution, info.entry_point) == ("ok", "loaded by module path", path)
    src, dst = np.random.default_rng(0).integers(0, 256, (2, 8, 64), dtype=np.uint8)
    before = dst.copy()
    with registry.connect(path) as sender, registry.connect(path) as receiver:
        sender.register_kv_buffers(kvwire.KVLayout.mla([src]))
        receiver.register_kv_buffers(kvwire.KVLayout.mla([dst]))
        endpoint = receiver.endpoint()
        sender.add_peer(endpoint, kvwire.KVLayout.mla([dst]))
        assert sender.send_kvcache(endpoint, IDX, [int(dst.ctypes.data)], np.array([5, 6], np.int32), None) == 128
    assert (dst[5:7] == src[1:3]).all()
    assert (np.delete(dst, [5, 6], axis=0) == np.delete(before, [5, 6], axis=0)).all()


def test_kvwire_connect_takes_a_module_path(write: Write) -> None:
    path = f"{write(GOOD)}:Good"
    manager._default.reset()  # the process-wide registry, with the allow-list of this test's environment
    try:
        with kvwire.connect(path) as conn:
            assert conn.endpoint().startswith("local://")
    finally:
        manager._default.reset()


def test_the_module_is_imported_only_when_asked_for(write: Write) -> None:
    module = write(GOOD)
    registry = kvwire.Registry(allow=["local", f"{module}:Good"], policy="strict")
    assert registry.unknown_allowed() == []  # a module path is not "not installed"
    registry.entries()
    assert module not in sys.modules
    registry.get("local")
    assert module not in sys.modules
    registry.get(f"{module}:Good")
    assert module in sys.modules


def _installed(tmp_path: Path, group: str, name: str, value: str) -> None:
    """A real (if minimal) installed distribution declaring one entry point, found by importlib.metadata."""
    info = tmp_path / "kvw_modpath_dist-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvw-modpath-dist\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{group}]\n{name} = {value}\n")


def test_a_drifted_module_path_has_the_findings_it_has_when_installed(tmp_path: Path, write: Write) -> None:
    ep_name, source = VARIANTS["missing-parameter"]
    module = write(source)
    path = f"{module}:Backend"
    group = f"kvwire.test.modpath{os.getpid()}"
    _installed(tmp_path, group, ep_name, path)
    registry = kvwire.Registry(allow=[ep_name, path], policy="strict", group=group)
    with pytest.raises(kvwire.BackendDriftError) as by_path:
        registry.get(path)
    with pytest.raises(kvwire.BackendDriftError) as by_entry_point:
        registry.get(ep_name)
    runtime = kvwire.Registry(allow=[], policy="quarantine", group=group).register("rt", sys.modules[module].Backend)

    def comparable(findings: tuple[kvwire.Finding, ...]) -> list[tuple[object, ...]]:
        return [(f.hook, f.rule, f.message, f.spec_signature, f.impl_signature, f.fix, f.defined_in) for f in findings]

    assert {f.rule for f in by_path.value.findings} >= {"missing-parameter"}
    assert comparable(by_path.value.findings) == comparable(by_entry_point.value.findings)
    assert comparable(by_path.value.findings) == comparable(runtime.findings)
    # The rendered text differs only in where the backend came from.
    from_path = BackendOrigin(path, "loaded by module path", f"from {tmp_path / module}.py", path).describe()
    installed = BackendOrigin(ep_name, "kvw-modpath-dist", "1.0", path).describe()
    assert from_path in str(by_path.value)
    assert "(loaded by module path from " in from_path
    as_installed = str(by_path.value).replace(from_path, installed).replace(path, ep_name)
    assert as_installed == str(by_entry_point.value).replace(path, ep_name)


def test_quarantine_leaves_a_drifted_module_path_out(write: Write) -> None:
    path = f"{write(VARIANTS['missing-parameter'][1])}:Backend"
    registry = kvwire.Registry(allow=["local", path], policy="quarantine")
    assert {i.name: i.status for i in registry.load()}[path] == "drift"  # an allow-listed module path is scanned
    drift = r"is not available \(drift: \d+ finding\(s\) \(missing-parameter"
    with pytest.raises(kvwire.BackendLoadError, match=drift):
        registry.get(path)


def test_a_module_that_raises_at_import_is_a_backend_import_error(write: Write) -> None:
    module = write("raise RuntimeError('no engine here')\n")
    with pytest.raises(kvwire.BackendImportError) as exc:
        kvwire.Registry(allow=["local", f"{module}:Backend"]).get(f"{module}:Backend")
    assert str(exc.value) == (
        f"backend '{module}:Backend' (loaded by module path) cannot be loaded: importing module {module!r} raised "
        "RuntimeError: no engine here. Fix the module or the module path (is its directory on sys.path?); "
        "the other backends are unaffected"
    )


def test_a_module_that_exits_at_import_does_not_end_the_process(write: Write) -> None:
    module = write("raise SystemExit(3)\n")
    with pytest.raises(kvwire.BackendImportError, match=r"SystemExit\(3\) raised at import \(a backend must not exit"):
        kvwire.Registry(allow=None, policy="strict").get(f"{module}:Backend")


def test_a_module_that_is_not_there_is_named(write: Write) -> None:
    with pytest.raises(kvwire.BackendImportError, match=r"importing module 'kvw_no_such_mod' raised ModuleNotFound"):
        kvwire.Registry(allow=None).get("kvw_no_such_mod:Backend")


def test_a_missing_class_names_what_is_missing(write: Write) -> None:
    module = write(GOOD)
    with pytest.raises(kvwire.BackendImportError) as exc:
        kvwire.Registry(allow=None).get(f"{module}:Missing")
    assert f"module {module!r} imported, but {module!r} has no attribute 'Missing'" in str(exc.value)
    with pytest.raises(kvwire.BackendImportError, match=r"has no attribute 'Goodd' \(did you mean 'Good'\?\)"):
        kvwire.Registry(allow=None).get(f"{module}:Goodd")


@pytest.mark.parametrize("name", ["mod:", ":Cls", "a b:C", "mod:Cls:Other", "1mod:C"])
def test_a_malformed_module_path_says_how_to_write_one(name: str) -> None:
    with pytest.raises(kvwire.ConfigError, match=r"is not a valid module path: write module\.path:ClassName"):
        kvwire.Registry(allow=None).get(name)


def test_an_allow_list_must_name_the_exact_module_path(write: Write, monkeypatch: pytest.MonkeyPatch) -> None:
    module = write(GOOD)
    path = f"{module}:Good"
    for allow in (["local"], ["local", module], ["local", f"{module}:Other"]):
        with pytest.raises(kvwire.BackendLoadError) as exc:
            kvwire.Registry(allow=allow).get(path)
        assert f"add the exact string {path!r} to allow" in str(exc.value)
    assert module not in sys.modules  # refused before anything was imported
    monkeypatch.setenv("KVWIRE_BACKENDS", f"local,{path}")
    assert kvwire.Registry().get(path).usable
    monkeypatch.setenv("KVWIRE_BACKENDS", "local")
    with pytest.raises(kvwire.BackendLoadError, match=r"the allow-list \(\$KVWIRE_BACKENDS: local\) does not name"):
        kvwire.Registry().get(path)


def test_bench_resolves_a_module_path_backend(write: Write, tmp_path: Path) -> None:
    """``kvwire bench --backend mod:Class`` goes through the registry (the local copy cannot reach a child)."""
    path = f"{write(GOOD)}:Good"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVWIRE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    cli = Path(sys.executable).with_name("kvwire")
    done = subprocess.run([str(cli), "bench", "--backend", path], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done
    assert f"backend {path!r} only reaches endpoints of its own process" in done.stderr


def test_kvwire_check_checks_an_allow_listed_module_path_in_its_child(write: Write, tmp_path: Path) -> None:
    """`kvwire check --backends pkg.mod:Class`: the same isolated check as an installed backend, the same findings."""
    good = f"{write(GOOD)}:Good"
    _, source = VARIANTS["missing-parameter"]
    drifted = f"{write(source)}:Backend"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    env.pop("KVWIRE_BACKENDS", None)

    def check(*names: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "kvwire", "check", "--backends", ",".join(names)],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )

    ok = check(good)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert good in ok.stdout and "loaded by module path" in ok.stdout
    bad = check(good, drifted)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "[missing-parameter]" in bad.stdout + bad.stderr and drifted in bad.stdout + bad.stderr
