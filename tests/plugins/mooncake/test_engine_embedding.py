"""Embedding kvwire in a host process: nothing process-wide changes unless asked, and the host's engine is used.

* ``options={"engine": eng}``: kvwire registers and writes through the host's
  own, already initialised Mooncake engine; it never creates, renews or
  destroys one, and leaves ``os.environ`` and fd 2 as they were (even with
  ``process_settings``). Checked with two real engines in this process (Mooncake
  supports several per process: the host's and a receiver), bytes compared by hash.
* A kvwire-created engine touches ``os.environ`` and fd 2 only with
  ``process_settings=True`` (checked in child processes, whose environment is theirs).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

import kvwire
from kvwire.config import BackendConfig
from kvwire_mooncake.engine import MooncakeEngine
from kvwire_mooncake.engine_double import HostMemoryEngine

HERE = Path(__file__).parent
HAVE_MOONCAKE = importlib.util.find_spec("mooncake") is not None
needs_engine = pytest.mark.skipif(not HAVE_MOONCAKE, reason="mooncake-transfer-engine not installed")
MiB = 1 << 20


def fd2_identity() -> tuple[int, int]:
    st = os.fstat(2)
    return st.st_dev, st.st_ino


@pytest.fixture
def fd_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every ``os.dup`` / ``os.dup2`` call during the test (passed through)."""
    calls: list[str] = []
    real_dup, real_dup2 = os.dup, os.dup2

    def dup(fd: int) -> int:
        calls.append(f"dup({fd})")
        return real_dup(fd)

    def dup2(fd: int, fd2: int, inheritable: bool = True) -> int:
        calls.append(f"dup2({fd}, {fd2})")
        return real_dup2(fd, fd2, inheritable)

    monkeypatch.setattr(os, "dup", dup)
    monkeypatch.setattr(os, "dup2", dup2)
    return calls


class Untouched:
    """The process-wide state kvwire must leave alone, taken now, compared by :meth:`check`."""

    def __init__(self, fd_calls: list[str]) -> None:
        self.env = dict(os.environ)
        self.fd2 = fd2_identity()
        self.fd_calls = fd_calls
        fd_calls.clear()

    def check(self) -> None:
        assert dict(os.environ) == self.env
        assert fd2_identity() == self.fd2
        assert self.fd_calls == []  # no dup / dup2: fd 2 was never redirected


def sha256(buf: NDArray[np.uint8]) -> str:
    return hashlib.sha256(buf.tobytes()).hexdigest()


def plan(rng: np.random.Generator, n: int, size: int, max_len: int) -> tuple[NDArray[np.int64], ...]:
    """``n`` descriptors: random sources, disjoint destinations in random order, random lengths."""
    slot = size // n
    dst = rng.permutation(n).astype(np.int64) * slot + rng.integers(0, slot - max_len + 1, n)
    length = rng.integers(1, max_len + 1, n).astype(np.int64)
    src = rng.integers(0, size - max_len, n).astype(np.int64)
    return src, dst, length


# ----------------------------------------------------------------------------- the host's real engine


@pytest.fixture
def real_engines() -> Iterator[list[Any]]:
    """Two initialised Mooncake engines of this process: the host's, and a receiver."""
    if not HAVE_MOONCAKE:
        pytest.skip("mooncake-transfer-engine not installed")
    from mooncake.engine import TransferEngine

    made = []
    for _ in range(2):
        engine = TransferEngine()
        assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        made.append(engine)
    yield made
    made.clear()  # destroyed now, while pytest still captures their shutdown log


@needs_engine
@pytest.mark.timeout(60)
@pytest.mark.parametrize("process_settings", [False, True], ids=["default", "process-settings"])
def test_host_engine_moves_bytes_and_the_process_is_left_as_it_was(
    real_engines: list[Any], fd_calls: list[str], process_settings: bool
) -> None:
    host, receiver = real_engines
    size = 8 * MiB
    rng = np.random.default_rng(21)
    data = rng.integers(0, 256, size, dtype=np.uint8)
    target = np.zeros(size, dtype=np.uint8)
    data_addr, target_addr = int(data.ctypes.data), int(target.ctypes.data)
    assert receiver.register_memory(target_addr, size) == 0
    session = f"127.0.0.1:{receiver.get_rpc_port()}"
    src, dst, length = plan(rng, 3000, size, 2048)  # > max_descriptors_per_call: several concurrent calls
    factory_calls: list[int] = []

    untouched = Untouched(fd_calls)
    config = BackendConfig(timeout_s=5, process_settings=process_settings, options={"engine": host})
    eng = MooncakeEngine(config, engine_factory=lambda: factory_calls.append(1))
    assert eng.endpoint == f"127.0.0.1:{host.get_rpc_port()}"
    eng.register(data_addr, size)
    eng.write(session, src + data_addr, dst + target_addr, length)
    eng.close()
    untouched.check()
    assert factory_calls == []

    expected = np.zeros(size, dtype=np.uint8)
    for s, d, n in zip(src.tolist(), dst.tolist(), length.tolist()):
        expected[d : d + n] = data[s : s + n]
    assert sha256(target) == sha256(expected)
    # The host's engine is still alive and kvwire's registration is gone (else -7, overlapping).
    assert host.register_memory(data_addr, size) == 0
    assert host.batch_transfer_sync_write(session, [data_addr], [target_addr], [size]) == 0
    assert sha256(target) == sha256(data)
    assert host.unregister_memory(data_addr) == 0
    assert receiver.unregister_memory(target_addr) == 0


@needs_engine
@pytest.mark.timeout(60)
def test_kvwire_created_engine_leaves_the_process_as_it_was_by_default(
    real_engines: list[Any], fd_calls: list[str]
) -> None:
    _, receiver = real_engines
    data = np.random.default_rng(22).integers(0, 256, MiB, dtype=np.uint8)
    target = np.zeros(MiB, dtype=np.uint8)
    assert receiver.register_memory(int(target.ctypes.data), MiB) == 0
    untouched = Untouched(fd_calls)
    with MooncakeEngine(BackendConfig(timeout_s=5)) as eng:
        eng.register(int(data.ctypes.data), MiB)
        session = f"127.0.0.1:{receiver.get_rpc_port()}"
        eng.write(session, np.array([int(data.ctypes.data)]), np.array([int(target.ctypes.data)]), np.array([MiB]))
    untouched.check()
    assert sha256(target) == sha256(data)
    assert receiver.unregister_memory(int(target.ctypes.data)) == 0


# ----------------------------------------------------------------------------- a host engine double


def test_host_engine_is_used_without_importing_mooncake(monkeypatch: pytest.MonkeyPatch, fd_calls: list[str]) -> None:
    """Even with ``process_settings``: the host's engine needs neither the import nor any process setting."""
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # importing it would now fail
    host = HostMemoryEngine()
    assert host.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    untouched = Untouched(fd_calls)
    config = BackendConfig(process_settings=True, metadata_server="http://meta:8080/metadata", options={"engine": host})
    with MooncakeEngine(config) as eng:
        assert eng.endpoint == "127.0.0.1"  # with a metadata server: the host name, as for kvwire's own engine
    untouched.check()
    host.close()


# ----------------------------------------------------------------------------- process settings, in child processes

CHILD = """
import json, os, sys
import kvwire
from kvwire.config import BackendConfig
from kvwire_mooncake.engine import MooncakeEngine
before = dict(os.environ)
engine = MooncakeEngine(BackendConfig(timeout_s=10, process_settings={process_settings}))
after = dict(os.environ)
changed = {{k: v for k, v in after.items() if before.get(k) != v}}
print(json.dumps({{"changed": changed, "removed": sorted(set(before) - set(after))}}), flush=True)
os._exit(0)
"""


def run_child(process_settings: bool, **env: str) -> tuple[dict[str, Any], str]:
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("MC_")}
    child_env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE.parents[2] / "core" / "src"), str(HERE.parents[2] / "plugins" / "mooncake" / "src")]
    )
    child_env.update(env)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD.format(process_settings=process_settings)],
        capture_output=True,
        text=True,
        env=child_env,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout)
    return result, proc.stderr


@needs_engine
@pytest.mark.timeout(120)
def test_process_settings_set_the_engine_environment_and_silence_fd2() -> None:
    result, stderr = run_child(True)
    assert result == {
        "changed": {
            "MC_LOG_LEVEL": "ERROR",
            "MC_HANDSHAKE_CONNECT_TIMEOUT": "8",
            "MC_TCP_STATUS_TIMEOUT_SEC": "8",
            "MC_TCP_PROGRESS_TIMEOUT_SEC": "8",
            "MC_TRANSFER_TIMEOUT": "10",
        },
        "removed": [],
    }
    assert stderr == ""
    # a value the user set is kept
    result, _ = run_child(True, MC_TCP_STATUS_TIMEOUT_SEC="20", MC_LOG_LEVEL="WARNING")
    assert "MC_TCP_STATUS_TIMEOUT_SEC" not in result["changed"] and "MC_LOG_LEVEL" not in result["changed"]
    assert result["changed"]["MC_TCP_PROGRESS_TIMEOUT_SEC"] == "8"


@needs_engine
@pytest.mark.timeout(120)
def test_without_process_settings_the_environment_and_fd2_are_the_hosts() -> None:
    result, stderr = run_child(False)
    assert result == {"changed": {}, "removed": []}
    assert "Transfer Engine" in stderr  # the engine's own log reached the untouched fd 2


@needs_engine
@pytest.mark.timeout(60)
def test_memory_the_host_registered_is_used_not_registered_again(real_engines: list[Any]) -> None:
    """sglang registers its KV pools with its engine itself: with host_registered kvwire never re-registers."""
    host, receiver = real_engines
    size = 1 * MiB
    data = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
    target = np.zeros(size, dtype=np.uint8)
    data_addr, target_addr = int(data.ctypes.data), int(target.ctypes.data)
    assert host.register_memory(data_addr, size) == 0  # the host's own registration
    assert receiver.register_memory(target_addr, size) == 0
    session = f"127.0.0.1:{receiver.get_rpc_port()}"
    config = BackendConfig(timeout_s=5, options={"engine": host, "host_registered": True})
    eng = MooncakeEngine(config)
    eng.register(data_addr, size)  # without host_registered this would be Mooncake's -7 (overlapping)
    with pytest.raises(kvwire.InvalidTransferError, match=r"src\[0\] = .* is not inside registered local memory"):
        eng.write(session, np.array([data_addr + size]), np.array([target_addr]), np.array([8]))
    eng.write(session, np.array([data_addr]), np.array([target_addr]), np.array([size]))
    eng.close()
    assert sha256(target) == sha256(data)
    assert host.unregister_memory(data_addr) == 0  # still the host's: kvwire did not unregister it
    assert receiver.unregister_memory(target_addr) == 0


def test_host_registered_needs_the_hosts_engine() -> None:
    with pytest.raises(kvwire.ConfigError, match=r"options\['host_registered'\] applies to a host's own engine"):
        MooncakeEngine(BackendConfig(options={"host_registered": True}), engine_factory=HostMemoryEngine)
