"""Installing one backend from the built wheels pulls the core and that backend, nothing else.

Every distribution (core/, plugins/*/) is built once per session from a clean
copy of its source; each case installs one requirement with ``--find-links``
into a fresh virtual environment (one per case; pip runs from this
interpreter with ``--python``, so the venv needs no pip of its own) and checks
``pip list`` and ``kvwire check --json``. numpy, pluggy and the engine wheel
come from the package index (or pip's cache): without it the tests skip.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path

import pytest
from offline import index_unreachable

ROOT = Path(__file__).resolve().parents[2]
DISTRIBUTIONS = [ROOT / "core", *sorted(p.parent for p in (ROOT / "plugins").glob("*/pyproject.toml"))]
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
FORBIDDEN = {"torch", "torch-npu", "nixl", "nixl-cu12", "nixl-cu13"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Case:
    requirement: str
    distributions: frozenset[str]  # every kvwire* distribution installed
    backends: frozenset[str]  # what `kvwire check` lists
    engines: frozenset[str] = frozenset()  # Mooncake engine wheels installed


CASES = {
    "mooncake": Case(
        "kvwire-mooncake[cpu]",
        frozenset({"kvwire", "kvwire-mooncake"}),
        frozenset({"local", "mooncake"}),
        frozenset({"mooncake-transfer-engine-non-cuda"}),
    ),
    # hisparse and ascend are built on kvwire-mooncake's transport, so its `mooncake` backend comes along
    "hisparse": Case(
        "kvwire-hisparse[cpu]",
        frozenset({"kvwire", "kvwire-mooncake", "kvwire-hisparse"}),
        frozenset({"local", "mooncake", "hisparse"}),
        frozenset({"mooncake-transfer-engine-non-cuda"}),
    ),
    "ascend": Case(
        "kvwire-ascend",
        frozenset({"kvwire", "kvwire-mooncake", "kvwire-ascend"}),
        frozenset({"local", "mooncake", "ascend"}),
    ),
    "nixl": Case("kvwire-nixl", frozenset({"kvwire", "kvwire-nixl"}), frozenset({"local", "nixl"})),
}
PRESENT = {"kvwire", *(f"kvwire-{p.name}" for p in DISTRIBUTIONS[1:])}


def _run(*args: str | Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVWIRE_") and k != "PYTHONPATH"}
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, env=env, timeout=timeout)


@pytest.fixture(scope="session")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Wheels of every distribution, built with one ``pip wheel --no-deps`` from clean copies of the sources."""
    work = tmp_path_factory.mktemp("dist")
    sources = []
    for dist in DISTRIBUTIONS:
        target = work / "src" / dist.name
        shutil.copytree(dist, target, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        sources.append(target)
    out = work / "wheels"
    proc = _run(*PIP, "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--wheel-dir", out, *sources)
    assert proc.returncode == 0, proc.stderr
    assert len(list(out.glob("*.whl"))) == len(DISTRIBUTIONS)
    return out


@pytest.fixture(scope="session")
def index_reachable(tmp_path_factory: pytest.TempPathFactory) -> None:
    proc = _run(*PIP, "download", "--quiet", "--no-deps", "--dest", tmp_path_factory.mktemp("probe"), "pluggy")
    if proc.returncode != 0:
        index_unreachable(f"pip download pluggy failed: {proc.stderr.strip()[-300:]}")


@pytest.mark.slow
@pytest.mark.parametrize("backend", list(CASES))
def test_install_one_backend(backend: str, wheels: Path, index_reachable: None, tmp_path: Path) -> None:
    case = CASES[backend]
    if not case.distributions <= PRESENT:
        pytest.skip(f"no {sorted(case.distributions - PRESENT)} source in this checkout")
    venv = tmp_path / "venv"
    assert _run(sys.executable, "-m", "venv", "--without-pip", venv).returncode == 0
    python = venv / "bin" / "python"
    install: list[str | Path] = ["install", "--quiet", "--no-compile", "--find-links", wheels, case.requirement]
    proc = _run(*PIP, "--python", python, *install, timeout=600)
    assert proc.returncode == 0, proc.stderr

    listed = _run(*PIP, "--python", python, "list", "--format", "json")
    assert listed.returncode == 0, listed.stderr
    installed = {_norm(d["name"]): d["version"] for d in json.loads(listed.stdout)}
    assert {n for n in installed if n.startswith("kvwire")} == case.distributions, installed
    assert {n for n in installed if n.startswith("mooncake-")} == case.engines, installed
    assert not FORBIDDEN & set(installed), installed
    built = {_norm(w.name.split("-")[0]): w.name.split("-")[1] for w in wheels.glob("*.whl")}
    assert {n: installed[n] for n in case.distributions} == {n: built[n] for n in case.distributions}

    check = _run(venv / "bin" / "kvwire", "check", "--json", timeout=180)
    assert check.returncode == 0, check.stdout + check.stderr
    entries = {e["name"]: e for e in json.loads(check.stdout)}
    assert set(entries) == case.backends
    assert {e["status"] for e in entries.values()} == {"ok"}, entries


def _metadata(wheel: Path) -> tuple[dict[str, list[str]], str, list[str]]:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        message = Parser().parsestr(zf.read(meta_name).decode())
    fields: dict[str, list[str]] = {}
    for key, value in message.items():
        fields.setdefault(key, []).append(value)
    return fields, str(message.get_payload()), names


@pytest.mark.slow
def test_every_wheel_carries_license_classifiers_and_a_readme_and_no_placeholder_url(wheels: Path) -> None:
    for wheel in sorted(wheels.glob("*.whl")):
        fields, readme, names = _metadata(wheel)
        assert fields["License-Expression"] == ["Apache-2.0"], wheel.name
        assert fields["License-File"] == ["LICENSE"], wheel.name
        assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), wheel.name
        assert "Project-URL" not in fields, wheel.name  # the project has no public home: no made-up address
        assert "Typing :: Typed" in fields["Classifier"], wheel.name
        assert fields["Description-Content-Type"] == ["text/markdown"], wheel.name
        assert len(readme) > 500 and "Install" in readme, f"{wheel.name}: README is not a long description"
