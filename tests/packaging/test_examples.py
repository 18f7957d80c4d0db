"""The examples run as their docstrings say (so they do not rot)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)


def test_middleware_example_logs_each_send() -> None:
    proc = _run(str(EXAMPLES / "middleware.py"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert re.fullmatch(r"send to local://\d+/\d+: 16 pages, 262144 bytes in [\d.]+ ms(; .*)?", lines[0]), lines
    assert re.fullmatch(r"send to local://\d+/\d+: 8 pages, 131072 bytes in [\d.]+ ms(; .*)?", lines[1]), lines
    assert lines[2].endswith("InvalidTransferError: prefill_kv_indices[0] = 64 is out of range: local buffer 0 "
                             "(layer 0, k) has 64 pages")  # fmt: skip
    assert len(lines) == 3


@pytest.mark.slow
def test_prefill_decode_pair_over_mooncake() -> None:
    if importlib.util.find_spec("mooncake") is None:
        pytest.skip("no Mooncake engine wheel installed")
    proc = _run(str(EXAMPLES / "prefill_decode" / "prefill.py"), "mooncake")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.fullmatch(r"prefill: sent 1048576 bytes to 127\.0\.0\.1:\d+", proc.stdout.strip())
    assert "decode: 64 pages x 8 buffers verified" in proc.stderr


def test_prefill_refuses_the_in_process_backend() -> None:
    proc = _run(str(EXAMPLES / "prefill_decode" / "prefill.py"), "local")
    assert proc.returncode == 1
    assert proc.stderr.startswith(
        "prefill: backend 'local' (kvwire, spec 1.5) does not support required feature(s) ['interprocess']"
    )
