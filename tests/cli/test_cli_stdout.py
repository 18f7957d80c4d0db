"""The ``kvwire`` command's stdout carries only its own output: what a library writes to fd 1 goes to stderr.

A backend's engine may write to file descriptor 1 directly while a command runs (UCX prints its errors there
under NIXL); ``kvwire.cli.console``, the process entry of ``kvwire`` and ``python -m kvwire``, keeps stdout
for the command (:mod:`kvwire.stdout`). Here the "library" writes to fd 1 in the middle of a real command.
"""

from __future__ import annotations

import json
import subprocess
import sys

NOISE = "[1796365956.045520] [vm:2620 :0]  sock.c:355  UCX  ERROR native noise"

NOISY_COMMAND = f"""
import importlib, os, sys

cli = importlib.import_module("kvwire.cli.main")  # the module (kvwire.cli.main the attribute is the function)

command = cli.main

def main_with_a_noisy_library(argv=None):
    os.write(1, {(NOISE + chr(10)).encode()!r})  # as native code does: straight to fd 1
    print("and a print to sys.__stdout__", file=sys.__stdout__, flush=True)
    return command(argv)

cli.main = main_with_a_noisy_library
sys.argv = ["kvwire", *sys.argv[1:]]
sys.exit(cli.console())
"""


def test_a_librarys_writes_to_fd_1_do_not_reach_a_json_document() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", NOISY_COMMAND, "check", "--json", "--backends", "local"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [b["name"] for b in json.loads(proc.stdout)] == ["local"]
    assert NOISE in proc.stderr and "and a print to sys.__stdout__" in proc.stderr


def test_the_commands_own_table_still_reaches_stdout() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvwire", "check", "--backends", "local"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == "1/1 allowed backend(s) pass"
