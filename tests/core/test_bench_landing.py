"""``bench/landing_scatter.py``: the landing scatter timed next to a contiguous copy, every scatter verified."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "landing_scatter.py"


def test_the_scatter_is_verified_and_compared_with_a_contiguous_copy() -> None:
    command = [sys.executable, str(BENCH), "--preset", "qwen2.5-7b", "--prefill-tp", "4", "--tokens", "64"]
    proc = subprocess.run([*command, "--rounds", "1", "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    # qwen2.5-7b: 28 layers x K and V, 16 tokens per page; at prefill TP 4 a rank holds 1 of 4 heads (256 bytes)
    assert (r["verified"], r["slice_bytes"], r["bytes"]) == (True, 256, 4 * 4 * 16 * 256 * 56)
    assert [row["what"] for row in r["rows"]] == [
        "contiguous copy, 1 thread",
        "contiguous copy, 2 threads",
        "scatter, 1 thread",
        "scatter, 2 threads",
    ]
    assert all(row["GB/s"] > 0 and row["vs contiguous"] > 0 for row in r["rows"])
