"""The contract kit run against the reference ``local`` backend, both ways a user would run it."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from kvwire.testing.contract import *  # noqa: F403 - the suite, imported as a backend author would


@pytest.fixture(scope="session")
def kvwire_backend_name() -> str:
    return "local"


def test_kit_runs_from_the_command_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--kvwire-backend",
            "local",
            "--rootdir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "34 passed, 1 skipped" in proc.stdout  # the refusal test is skipped: local carries notifications


def _pytest(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(cwd), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=cwd)


def test_a_failed_contract_test_is_printed_as_a_command_that_reruns_it_alone(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(
        "import pytest\n\n\n"
        "@pytest.fixture(autouse=True)\n"
        "def _break_one(request):\n"
        "    if request.node.name == 'test_contract_round_trip[seed1-mha-odd-page]':\n"
        "        pytest.fail('broken on purpose')\n"
    )
    run = _pytest(tmp_path, "--kvwire-backend", "local")
    command = (
        "pytest --kvwire-backend local --pyargs 'kvwire.testing.contract::test_contract_round_trip[seed1-mha-odd-page]'"
    )
    lines = run.stdout.splitlines()
    assert lines[lines.index(command) - 1].strip("= ") == "kvwire contract kit: rerun one failed test"
    rerun = _pytest(tmp_path, *shlex.split(command)[1:])  # the ids: random seed 1 on the SHAPES key mha-odd-page
    assert rerun.stdout.splitlines()[-1].startswith("1 error in"), rerun.stdout[-2000:]


def test_a_kit_fixture_overridden_function_scoped_is_one_line_saying_what_to_write(tmp_path: Path) -> None:
    (tmp_path / "test_mine.py").write_text(
        "import pytest\n"
        "from kvwire.testing.contract import *  # noqa: F403\n\n\n"
        "@pytest.fixture\n"
        "def kvwire_backend_name() -> str:\n"
        "    return 'local'\n"
    )
    proc = _pytest(tmp_path, "test_mine.py")
    assert proc.returncode == 4  # usage error
    assert proc.stderr.strip() == (
        "ERROR: kvwire contract kit: fixture kvwire_backend_name in test_mine.py is function-scoped, but the kit's "
        'harness lives per module: write @pytest.fixture(scope="module") (or "session")'
    )


def test_the_kit_takes_a_module_path_backend_as_kvwire_check_does(tmp_path: Path) -> None:
    """``--kvwire-backend package.module:Class`` runs the suite on a class that is not installed."""
    (tmp_path / "my_backend.py").write_text(
        "from kvwire.backends.local import LocalBackend\n\n\nclass Mine(LocalBackend):\n    pass\n"
    )
    run = _pytest(tmp_path, "--kvwire-backend", "my_backend:Mine")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "34 passed, 1 skipped" in run.stdout
    missing = _pytest(tmp_path, "--kvwire-backend", "no_such_module:Mine")
    assert missing.returncode == 4  # pytest's usage error
    assert "ERROR: --kvwire-backend no_such_module:Mine: backend 'no_such_module:Mine'" in missing.stderr
