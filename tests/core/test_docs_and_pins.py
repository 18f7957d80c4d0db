"""What the docs say about pins, distributions and the spec matches the pyproject files and the code."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import kvwire
from kvwire.spec.history import known_versions

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]
DEPENDENTS = [
    *sorted([*ROOT.glob("plugins/*/pyproject.toml"), *ROOT.glob("hosts/*/pyproject.toml")]),
    ROOT / "examples" / "backend-template" / "pyproject.toml",
]
DISTRIBUTIONS = [ROOT / "core" / "pyproject.toml", *DEPENDENTS[:-1]]


def _project(pyproject: Path) -> dict[str, object]:
    project: dict[str, object] = tomllib.loads(pyproject.read_text())["project"]
    return project


def _kvwire_pin(pyproject: Path) -> str:
    dependencies = _project(pyproject)["dependencies"]
    assert isinstance(dependencies, list)
    (pin,) = [d for d in dependencies if re.match(r"kvwire\s*[<>=!~]", d)]
    return "".join(pin.split())


def test_one_pin_for_every_backend_and_the_policy_states_it() -> None:
    pins = {p.relative_to(ROOT).as_posix(): _kvwire_pin(p) for p in DEPENDENTS}
    assert set(pins.values()) == {"kvwire>=0.1,<0.2"}, pins
    policy = (ROOT / "docs" / "spec-policy.md").read_text()
    assert "`kvwire>=0.1,<0.2`" in policy
    stated = set(re.findall(r"kvwire>=[0-9.]+,<[0-9.]+", policy))
    assert stated == {"kvwire>=0.1,<0.2"}, stated  # no second pin in the policy


@pytest.mark.parametrize("pyproject", DISTRIBUTIONS, ids=lambda p: p.parent.name)
def test_no_made_up_project_urls(pyproject: Path) -> None:
    assert "urls" not in _project(pyproject)


def test_the_core_readme_names_every_backend_and_the_spec() -> None:
    readme = (ROOT / "core" / "README.md").read_text()
    for pyproject in ROOT.glob("plugins/*/pyproject.toml"):
        assert f"`{_project(pyproject)['name']}`" in readme, pyproject
    versions = known_versions()
    adapted = f"{versions[0]} to {versions[-2]}"
    assert f"Backend spec {kvwire.SPEC_VERSION}; backends declaring {adapted} load adapted" in readme


def test_pip_install_at_the_root_says_what_to_install_instead(tmp_path: Path) -> None:
    pytest.importorskip("build")
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--sdist", "--outdir", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode != 0
    assert "the repository root is a workspace, not a distribution" in proc.stdout + proc.stderr
    assert "pip install ./core ./plugins/mooncake" in proc.stdout + proc.stderr
    assert not list(tmp_path.iterdir())
