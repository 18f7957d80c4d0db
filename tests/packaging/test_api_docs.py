"""`make docs`: the API reference builds from the docstrings with every warning an error."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_api_reference_builds_without_a_warning(tmp_path: Path) -> None:
    makefile = (ROOT / "Makefile").read_text()
    found = re.search(r"^DOC_MODULES := (.*?)(?<!\\)$", makefile, re.M | re.S)
    assert found, "the Makefile lists DOC_MODULES"
    modules = found.group(1).replace("\\\n", " ").split()
    proc = subprocess.run(
        [sys.executable, "-W", "error", "-m", "pdoc", "--docformat", "restructuredtext", *modules, "-o", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "kvwire.html").stat().st_size > 10_000
    for module in modules:
        assert (tmp_path / (module.replace(".", "/") + ".html")).is_file(), module
