"""``kvwire bench`` across two separately started processes over TCP (two machines, here over loopback)."""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path

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
        assert decode.stderr is not None
        assert "kvwire bench: warning: the control channel on 127.0.0.1 is unauthenticated" in decode.stderr.read()
    finally:
        if decode.poll() is None:
            decode.kill()
        decode.wait()


def test_two_hosts_with_a_control_key_and_a_wrong_one(tmp_path: Path) -> None:
    """The key in the env on one side, in a file on the other; a wrong or missing key is refused, the right one not."""
    (tmp_path / "right").write_text("s3cret-control-key\n")
    (tmp_path / "wrong").write_text("not-the-control-key\n")
    env = {**os.environ, "KVWIRE_CONTROL_KEY": "s3cret-control-key"}
    decode = subprocess.Popen(
        [sys.executable, "-m", "kvwire", "bench", "--role", "decode", "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    clean = {k: v for k, v in os.environ.items() if k != "KVWIRE_CONTROL_KEY"}
    try:
        port = _announced_port(decode)
        base = [
            sys.executable, "-m", "kvwire", "bench", "--backend", "mooncake", "--peer", f"127.0.0.1:{port}",
            "--preset", "qwen2.5-7b", "--requests", "1", "--tokens", "256", "--json",
        ]
        for extra, pattern in (
            (["--control-key-file", str(tmp_path / "wrong")], "refused the control key: authentication failed"),
            ([], "requires a control key: set KVWIRE_CONTROL_KEY or pass --control-key-file"),
        ):
            refused = subprocess.run(
                [*base, *extra], capture_output=True, text=True, timeout=120, check=False, env=clean
            )
            assert refused.returncode == 2, refused.stderr
            assert refused.stderr.splitlines()[-1].startswith(
                f"kvwire bench: error: decode side at 127.0.0.1:{port} "
            ), refused.stderr
            assert pattern in refused.stderr
        prefill = subprocess.run(
            [*base, "--control-key-file", str(tmp_path / "right")],
            capture_output=True, text=True, timeout=300, check=False, env=clean,
        )
        assert prefill.returncode == 0, prefill.stderr[-3000:]
        assert json.loads(prefill.stdout)["verified"] is True
        assert decode.wait(timeout=60) == 0
        assert decode.stderr is not None
        log = decode.stderr.read()
        assert log.count("kvwire bench: refused a connection: prefill side at 127.0.0.1:") == 2, log
        assert "answered the control-key challenge with a wrong key" in log
        assert "unauthenticated" not in log
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
    *steps, error = proc.stderr.splitlines()
    assert error.startswith("kvwire bench: error: decode side at 127.0.0.1:1 could not be reached: ")
    assert [re.sub(r"\[ *[\d.]+ s\] ", "", line) for line in steps] == [
        "kvwire bench: connecting to the decode side at 127.0.0.1:1 (no control key)"
    ]
