"""kvwire.registry.installed: versions from metadata (one source per distribution) and Mooncake engine-wheel clashes."""

from __future__ import annotations

import argparse
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest

import kvwire
from kvwire.registry import installed as about
from kvwire_mooncake import wheels

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]
PYPROJECTS = [ROOT / "core" / "pyproject.toml", *sorted((ROOT / "plugins").glob("*/pyproject.toml"))]


@pytest.mark.parametrize("pyproject", PYPROJECTS, ids=lambda p: p.parent.name)
def test_each_distribution_has_one_version_source(pyproject: Path) -> None:
    """The version is a literal in pyproject.toml; no module restates it (code reads it from metadata)."""
    project = tomllib.loads(pyproject.read_text())["project"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", project["version"]), project["version"]
    assert "version" not in project.get("dynamic", [])
    for module in (pyproject.parent / "src").rglob("*.py"):
        assert not re.search(r"^__version__\s*=\s*['\"]", module.read_text(), re.M), f"{module} restates a version"
    assert (pyproject.parent / "LICENSE").read_text() == (ROOT / "LICENSE").read_text()
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]


def test_versions_come_from_metadata_without_importing_backends() -> None:
    before = set(sys.modules)
    data = about.versions()
    assert not {m for m in set(sys.modules) - before if m.startswith("kvwire_")}
    assert data["kvwire"] == metadata.version("kvwire") == kvwire.__version__
    assert data["spec"] == kvwire.SPEC_VERSION and data["spec_known"][-1] == kvwire.SPEC_VERSION
    assert data["backends"]["local"] == {"distribution": "kvwire", "version": metadata.version("kvwire")}
    assert list(data["backends"]) == sorted(data["backends"])


def test_version_text_is_what_kvwire_version_prints(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="kvwire")
    parser.add_argument("--version", action=about.VersionAction)
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--version"])
    assert info.value.code == 0
    v = metadata.version("kvwire")
    expected = f"kvwire {v} (backend spec {kvwire.SPEC_VERSION}; loads backends of spec 1.0 to 1.5)\n"
    assert capsys.readouterr().out == expected


def test_one_engine_wheel_is_no_conflict() -> None:
    assert wheels.engine_conflict({}, "cpu") is None
    assert wheels.engine_conflict({"mooncake-transfer-engine-non-cuda": "0.3.13"}, "cuda") is None


def test_two_engine_wheels_name_the_one_to_keep_for_this_host() -> None:
    both = {"mooncake-transfer-engine-non-cuda": "0.3.13.post1", "mooncake-transfer-engine-npu": "0.3.13"}
    message = wheels.engine_conflict(both, "npu")
    assert message == (
        "2 Mooncake engine wheels are installed: mooncake-transfer-engine-non-cuda 0.3.13.post1 (hosts without CUDA: "
        "kvwire-mooncake[cpu]); mooncake-transfer-engine-npu 0.3.13 (Ascend hosts: kvwire-ascend[npu]). They ship "
        "the same `mooncake` package and overwrite each other's files, so which engine loads is an accident of "
        "install order. This is an Ascend host: keep mooncake-transfer-engine-npu, remove "
        "mooncake-transfer-engine-non-cuda: pip uninstall -y mooncake-transfer-engine-non-cuda "
        "mooncake-transfer-engine-npu && pip install mooncake-transfer-engine-npu==0.3.13 (uninstalling one deletes "
        "the files the other shares, so reinstall the one you keep)"
    )
    cpu = wheels.engine_conflict(both, "cpu")
    assert cpu is not None and "This is a host without CUDA or CANN: keep mooncake-transfer-engine-non-cuda" in cpu
    cuda = wheels.engine_conflict({"mooncake-transfer-engine": "0.3.13", **both}, "cuda")
    assert cuda is not None and cuda.startswith("3 Mooncake engine wheels are installed")
    keep = "keep mooncake-transfer-engine, remove mooncake-transfer-engine-non-cuda, mooncake-transfer-engine-npu"
    assert keep in cuda


def test_two_cuda_builds_cannot_be_told_apart() -> None:
    both = {"mooncake-transfer-engine": "0.3.13", "mooncake-transfer-engine-cuda13": "0.3.13"}
    message = wheels.engine_conflict(both, "cuda")
    assert message is not None and message.endswith(
        "Keep the one for this host and remove the others: pip uninstall -y mooncake-transfer-engine "
        "mooncake-transfer-engine-cuda13 && pip install <the one>"
    )


def test_this_environment_has_at_most_one_engine_wheel() -> None:
    assert wheels.engine_conflict() is None


def test_host_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASCEND_HOME_PATH", raising=False)
    assert wheels.host_kind(lambda name: None) == "cpu"
    assert wheels.host_kind(lambda name: "libcuda.so.1" if name == "cuda" else None) == "cuda"
    assert wheels.host_kind(lambda name: "libascendcl.so" if name == "ascendcl" else None) == "npu"
    monkeypatch.setenv("ASCEND_HOME_PATH", "/usr/local/Ascend")
    assert wheels.host_kind(lambda name: None) == "npu"


def test_kvwire_mooncake_registers_its_engine_wheel_check() -> None:
    from importlib import metadata

    (ep,) = [e for e in metadata.entry_points(group=about.INSTALL_CHECK_GROUP) if e.name == "mooncake-engine-wheels"]
    assert ep.value == "kvwire_mooncake.wheels:engine_conflict" and ep.load() is wheels.engine_conflict
    assert about.install_problems() == []  # this environment has one engine wheel


def test_an_install_check_that_raises_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib import metadata

    broken = metadata.EntryPoint("broken", "json:loads", about.INSTALL_CHECK_GROUP)  # loads() needs an argument
    checks = about.INSTALL_CHECK_GROUP
    monkeypatch.setattr(about.metadata, "entry_points", lambda group: [broken] if group == checks else [])
    (problem,) = about.install_problems()
    assert problem.startswith("install check broken (json:loads) failed: TypeError: ")
