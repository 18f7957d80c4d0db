"""examples/backend-template: built, installed, checked and run through the contract kit as its CI would."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TEMPLATE = Path(__file__).resolve().parents[2] / "examples" / "backend-template"
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]


def _run(
    *args: str | Path, cwd: Path, site: Path | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVWIRE_") and k != "PYTHONPATH"}
    if site is not None:
        env["PYTHONPATH"] = str(site)
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a clean copy of the template's source, the directory its wheel is installed into)."""
    work = tmp_path_factory.mktemp("template")
    src = work / "kvwire-template"
    shutil.copytree(TEMPLATE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    wheels, site = work / "wheels", work / "site"
    built = _run(*PIP, "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", wheels, src, cwd=work)
    assert built.returncode == 0, built.stderr
    (wheel,) = wheels.glob("kvwire_template-*.whl")
    done = _run(*PIP, "install", "--no-deps", "--target", site, wheel, cwd=work)
    assert done.returncode == 0, done.stderr
    return src, site


@pytest.mark.slow
def test_kvwire_check_strict_passes(installed: tuple[Path, Path]) -> None:
    src, site = installed
    proc = _run(
        sys.executable, "-m", "kvwire", "check", "--strict", "--json", "--backends", "template", cwd=src, site=site
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (entry,) = [e for e in json.loads(proc.stdout) if e["status"] != "blocked"]
    assert (entry["name"], entry["distribution"], entry["status"], entry["findings"]) == (
        "template",
        "kvwire-template",
        "ok",
        [],
    )
    assert entry["capabilities"] == ["host_memory", "layer_ids", "mha", "mla"]


@pytest.mark.slow
def test_contract_kit_passes(installed: tuple[Path, Path]) -> None:
    src, site = installed
    proc = _run(
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--kvwire-backend", "template", "tests",
        cwd=src, site=site,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    summary = proc.stdout.strip().splitlines()[-1]
    match = re.match(r"(\d+) passed(?:, (\d+) skipped)?", summary)
    assert match, summary
    assert int(match[1]) >= 20, summary  # the template's 2 tests + the contract suite


@pytest.mark.slow
def test_mypy_strict_passes_on_the_template(installed: tuple[Path, Path]) -> None:
    """The template's static check (``_static_check`` -> ``kvwire.BackendProtocol``) with its own mypy config."""
    pytest.importorskip("mypy", reason="mypy is a dev dependency (make setup)")
    src, _ = installed
    proc = _run(sys.executable, "-m", "mypy", "--cache-dir", src.parent / ".mypy", cwd=src)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "Success: no issues found in 2 source files"
