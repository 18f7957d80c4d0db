"""``bench/nixl_ceiling.py --with-cma``: process_vm_writev of the plans, checked by the child's own digest."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "nixl_ceiling.py"

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process_vm_writev is Linux's"),
    pytest.mark.slow,  # three pools of 192 MiB and a child process: seconds
]


def test_the_cma_row_writes_the_plans_into_a_child_whose_own_digest_of_the_target_pages_matches() -> None:
    command = [sys.executable, str(SCRIPT), "--with-cma", "--requests", "2", "--tokens", "256", "--repeat", "1"]
    done = subprocess.run([*command, "--json"], capture_output=True, text=True, timeout=240, check=False)
    if done.returncode != 0 and re.search(r"process_vm_writev wrote -1 of \d+ bytes \(errno (1|38)\)", done.stderr):
        pytest.skip(f"this sandbox refuses process_vm_writev: {done.stderr.strip()[-200:]}")  # EPERM, ENOSYS
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["cma_verified"] is True
    assert result["cma_threads_gbps"] > 0
    assert result["descriptors_per_request"] > 1  # fragmented runs: many iovecs, in batches
