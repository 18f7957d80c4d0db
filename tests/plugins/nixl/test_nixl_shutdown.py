"""Processes that moved verified bytes through kvwire-nixl exit 0, again and again.

NIXL 1.5 crashes processes at exit in two ways: an agent still alive at
interpreter shutdown, and (where the system has rdma-core) UCX's EFA module
loading the system's libibverbs/libnl next to the wheel's copies. kvwire tears
its agents down before shutdown, and with ``process_settings`` sets
``UCX_MODULES=^efa``; a host that sets nothing is warned.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvwire_nixl.locate import efa_conflict, nixl_availability

if (_reason := nixl_availability()) is not None:
    pytest.skip(f"kvwire-nixl cannot run here: {_reason}", allow_module_level=True)

pytestmark = pytest.mark.slow

RUNS = 5

SENDER = """
import sys
import numpy as np
import kvwire
from kvwire.testing.harness import expected_buffers
from kvwire.testing.receiver import LayoutSpec, SubprocessReceiver, buffer_digests

config = kvwire.BackendConfig(process_settings=sys.argv[1] == "process_settings")
spec = LayoutSpec("mha", (0, 1), 64, 4096)
receiver = SubprocessReceiver("nixl", spec, 7, config)
memory = spec.allocate(3)
conn = kvwire.connect("nixl", config)  # never closed: the process just ends
conn.register_kv_buffers(memory.layout)
conn.add_peer(receiver.endpoint, receiver.layout)
src, dst = np.array([1, 2, 3, 9], np.int32), np.array([5, 6, 7, 40], np.int32)
conn.send_kvcache(receiver.endpoint, src, [b.base for b in receiver.layout.buffers], dst, None)
want = buffer_digests(expected_buffers(memory.views, memory.layout, spec.allocate(7).views, receiver.layout, src, dst))
ok = receiver.hashes() == want
receiver.close()
print("verified" if ok else "MISMATCH", receiver.child.proc.returncode)
"""


def _run(mode: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", SENDER, mode], capture_output=True, text=True, timeout=120, env=env)


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("UCX_", "NIXL_"))}


@pytest.mark.parametrize("run", range(RUNS))
def test_process_settings_make_a_clean_exit(run: int) -> None:
    """The CLI's mode: kvwire sets UCX_MODULES=^efa itself; sender and receiver exit 0."""
    proc = _run("process_settings", _clean_env())
    assert (proc.returncode, proc.stdout) == (0, "verified 0\n"), proc.stderr[-2000:]


@pytest.mark.parametrize("run", range(RUNS))
def test_a_host_that_sets_ucx_modules_exits_cleanly_without_closing(run: int) -> None:
    proc = _run("host", {**_clean_env(), "UCX_MODULES": "^efa"})
    assert (proc.returncode, proc.stdout) == (0, "verified 0\n"), proc.stderr[-2000:]


@pytest.mark.skipif(not efa_conflict(), reason="no system libefa.so.1 here: nothing to warn about")
def test_a_host_that_sets_nothing_is_warned_of_the_crash_at_exit() -> None:
    proc = _run("host", _clean_env())
    assert "RuntimeWarning: kvwire-nixl: this system's libefa.so.1" in proc.stderr
    assert "UCX_MODULES=^efa" in proc.stderr
    assert proc.stdout.startswith("verified")  # the bytes still arrive; only the exit is at risk
