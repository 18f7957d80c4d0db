"""The contract kit run against the reference ``local`` backend, both ways a user would run it."""

from __future__ import annotations

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
    assert "30 passed, 1 skipped" in proc.stdout  # the refusal test is skipped: local carries notifications
