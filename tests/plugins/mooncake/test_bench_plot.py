"""``kvwire bench --plot``: a real run (mooncake, local decode child) writes the picture; stdout stays the JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_plot_of_kvwire_and_raw_is_written_and_progress_goes_to_stderr(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    proc = subprocess.run(
        [
            sys.executable, "-m", "kvwire", "bench", "--backend", "mooncake", "--preset", "qwen2.5-7b",
            "--requests", "2", "--tokens", "512", "--compare-raw", "--json", "--plot", str(path),
            "--option", "max_inflight_per_peer=2048",  # an int, as the backend checks it
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)  # nothing but the JSON on stdout
    assert (result["verified"], result["raw_verified"]) == (True, True)
    assert "_series" not in result
    steps = proc.stderr.splitlines()
    assert all(line.startswith("kvwire bench: [") for line in steps), proc.stderr
    for expected in ("starting the decode process", "allocating the prefill pool", "2/2 requests done (all verified)"):
        assert any(expected in line for line in steps), proc.stderr
    assert steps[-1].endswith(f"wrote the plot of kvwire, raw engine call per request to {path}")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
