"""``kvwire lint`` as the kvwire command runs it, on sglang's released source."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _lint(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvwire", "lint", "sglang", *args],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_kvwire_lint_reports_the_seed_drift_in_0_5_17_only(sglang_source: Callable[[str], Path]) -> None:
    drifted = _lint(sglang_source("0.5.17"), "--select", "send_kvcache", "--json")
    assert drifted.returncode == 1, drifted.stderr
    findings = json.loads(drifted.stdout)
    assert [(f["rule"], f["subclass"], f["method"], f["base_class"], f["parameter"]) for f in findings] == [
        ("override-missing-parameter", "AscendKVManager", "send_kvcache", "MooncakeKVManager", "dst_device_kv_indices"),
        ("override-missing-keyword", "AscendKVManager", "send_kvcache", "MooncakeKVManager", "dst_device_kv_indices"),
    ]
    for version in ("0.5.16", "0.5.18"):
        clean = _lint(sglang_source(version), "--select", "send_kvcache")
        assert (clean.returncode, clean.stdout.strip()) == (0, "no override drift found"), version
