"""Freezing a peer process for fault tests: SIGSTOP, then wait until the kernel reports every thread stopped.

``os.kill`` returns once the signal is queued; on a loaded machine a thread of the
peer may still run for a while (finish a receive, send an acknowledgement), and a
test that writes at once can see its write succeed. Polling ``/proc`` for the stopped
state is bounded and observes the condition itself, instead of sleeping and hoping.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

__all__ = ["freeze"]


def _states(pid: int) -> list[str]:
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        states.append(stat.rsplit(")", 1)[1].split()[0])  # the field after "(comm)"
    return states


def freeze(pid: int, timeout_s: float = 10.0) -> None:
    """Stop ``pid`` with SIGSTOP and return once every one of its threads is stopped."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while not all(state in ("T", "t") for state in _states(pid)):
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} not stopped {timeout_s} s after SIGSTOP: {_states(pid)}")
        time.sleep(0.001)
