"""``kvwire bench`` across two separately started processes over TCP (two machines, here over loopback)."""

from __future__ import annotations

import json
import re
import select
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow


def _announced_port(proc: subprocess.Popen[str], timeout_s: float = 60.0) -> int:
    assert proc.stderr is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stderr], [], [], 0.5)
        if ready:
            line = proc.stderr.readline()
            match = re.fullmatch(r"kvwire bench: decode side listening on 127\.0\.0\.1:(\d+)\n", line)
            if match:
                return int(match.group(1))
        assert proc.poll() is None, f"decode side exited with {proc.returncode}"
    raise AssertionError("the decode side did not announce its port")


def test_bench_between_two_separately_started_processes() -> None:
    decode = subprocess.Popen(
        [sys.executable, "-m", "kvwire", "bench", "--role", "decode", "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        port = _announced_port(decode)
        prefill = subprocess.run(
            [
                sys.executable, "-m", "kvwire", "bench", "--backend", "mooncake", "--peer", f"127.0.0.1:{port}",
                "--preset", "qwen2.5-7b", "--requests", "2", "--tokens", "512", "--json", "--compare-raw",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert prefill.returncode == 0, prefill.stderr[-3000:]
        result = json.loads(prefill.stdout)
        assert (result["verified"], result["guards_unchanged"]) == (True, True)
        assert result["decode"] == f"127.0.0.1:{port}"
        assert result["bytes"] == 2 * 32 * 16384 * 28 * 2
        assert decode.wait(timeout=60) == 0  # one session, then it exits
    finally:
        if decode.poll() is None:
            decode.kill()
        decode.wait()


def test_decode_role_needs_listen_and_prefill_refuses_it() -> None:
    for args, message in (
        (["--role", "decode"], "kvwire bench: error: --role decode needs --listen HOST:PORT\n"),
        (["--listen", "127.0.0.1:1"], "kvwire bench: error: --listen is for --role decode; the prefill side connects "
         "with --peer HOST:PORT\n"),
        (["--role", "decode", "--listen", "nohost"], "kvwire bench: error: --listen must be HOST:PORT, got 'nohost'\n"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "kvwire", "bench", *args], capture_output=True, text=True, timeout=60, check=False
        )
        assert (proc.returncode, proc.stderr) == (2, message)


def test_unreachable_decode_side_is_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvwire", "bench", "--backend", "mooncake", "--peer", "127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("kvwire bench: error: decode side at 127.0.0.1:1 could not be reached: ")
    assert proc.stderr.count("\n") == 1
