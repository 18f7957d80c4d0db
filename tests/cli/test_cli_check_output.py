"""`kvwire check`'s report: only the backends asked for, a true/false "available", a table 100 columns wide."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

KVWIRE = [sys.executable, "-m", "kvwire", "check"]
UNAVAILABLE = """\
from kvwire.backends.local import LocalBackend


class NoDevice(LocalBackend):
    '''The local backend, saying it cannot transfer here.'''

    @classmethod
    def availability(cls) -> str | None:
        return "no device on this host"
"""


def _check(*argv: str, pythonpath: Path | None = None, backends: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KVWIRE_BACKENDS", "KVWIRE_POLICY")}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")])
    if backends is not None:
        env["KVWIRE_BACKENDS"] = backends
    return subprocess.run([*KVWIRE, *argv], env=env, capture_output=True, text=True, timeout=300)


def test_backends_flag_reports_only_the_backends_it_names() -> None:
    proc = _check("--backends", "local")
    assert proc.returncode == 0, proc.stderr
    rows = proc.stdout.splitlines()[2:]
    assert rows[0].split()[:5] == ["local", "kvwire", rows[0].split()[2], "1.5", "ok"], proc.stdout
    assert "blocked" not in proc.stdout and rows[1:] == ["", "1/1 allowed backend(s) pass"], proc.stdout
    assert [b["name"] for b in json.loads(_check("--backends", "local", "--json").stdout)] == ["local"]


def test_json_says_available_true_false_or_null(tmp_path: Path) -> None:
    (tmp_path / "kvw_nodevice.py").write_text(UNAVAILABLE)
    proc = _check("--json", pythonpath=tmp_path, backends="local,kvw_nodevice:NoDevice")
    by_name = {b["name"]: b for b in json.loads(proc.stdout)}
    assert by_name["local"]["available"] is True
    assert by_name["kvw_nodevice:NoDevice"]["available"] is False
    assert by_name["kvw_nodevice:NoDevice"]["runtime"] == "unavailable: no device on this host"
    blocked = [b for b in by_name.values() if b["status"] == "blocked"]  # allowed by $KVWIRE_BACKENDS: still listed
    assert blocked and all(b["available"] is None for b in blocked)


def test_the_table_fits_100_columns_for_any_backend_name(tmp_path: Path) -> None:
    module = "kvw_" + "a_very_long_module_path_segment_" * 4  # a module:Class name of 140 characters
    (tmp_path / f"{module}.py").write_text(UNAVAILABLE)
    name = f"{module}:NoDevice"
    proc = _check("--backends", name, pythonpath=tmp_path)
    lines = proc.stdout.splitlines()
    assert max(map(len, lines)) <= 100, "\n".join(lines)
    assert lines[2].startswith(name[:21] + "\u2026"), lines  # the cell, cut
    below = "".join(line.strip() for line in lines[3:6])
    assert f"backend: {name}" in below, lines  # and in full, below the row
