"""``MooncakeEngine`` over the in-process ``HostMemoryEngine``: stderr capture, renewal failure, teardown, probe.

Also one real-engine check (concurrent creation leaves fd 2 alone), skipped
without the wheel.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from kvwire.config import BackendConfig
from kvwire.errors import BackendUnavailableError, PeerUnreachableError, TransferError
from kvwire_mooncake import engine_double
from kvwire_mooncake.engine import MooncakeEngine
from kvwire_mooncake.engine_double import HostMemoryEngine

HAVE_MOONCAKE = importlib.util.find_spec("mooncake") is not None
THREADS = 8


def _fd2() -> tuple[str, int, int]:
    st = os.fstat(2)
    return os.readlink("/proc/self/fd/2"), st.st_dev, st.st_ino


@contextmanager
def _fd2_guard() -> Iterator[tuple[str, int, int]]:
    """Yields what fd 2 is now; afterwards puts it back whatever happened (a failure must not blind later tests)."""
    saved = os.dup(2)
    before = _fd2()
    try:
        yield before
    finally:
        if _fd2() != before:
            os.dup2(saved, 2)
        os.close(saved)


def _create_concurrently(make: Callable[[int], MooncakeEngine], n: int) -> list[BaseException]:
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            barrier.wait(10)
            make(k).close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return errors


# ----------------------------------------------------------------------------- 1. fd 2 capture under concurrency


class NoisyEngine(HostMemoryEngine):
    """Writes to fd 2 while it initialises, as the real engine does: one glog line, one other line."""

    def __init__(self, tag: int) -> None:
        super().__init__()
        self.tag = tag

    def initialize(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str) -> int:
        os.write(2, f"I0101 00:00:00.000001 {self.tag} noisy.cpp:1] engine {self.tag} created\n".encode())
        time.sleep(0.02)  # keep the windows of concurrent creations overlapping
        os.write(2, f"not-a-log-line from engine {self.tag}\n".encode())
        time.sleep(0.02)
        return super().initialize(local_hostname, metadata_server, protocol, device_name)


def test_concurrent_creation_restores_fd2_and_passes_other_output_through(capfd: pytest.CaptureFixture[str]) -> None:
    with _fd2_guard() as before:
        errors = _create_concurrently(
            lambda k: MooncakeEngine(BackendConfig(), engine_factory=lambda: NoisyEngine(k)), THREADS
        )
        after = _fd2()
    assert not errors, errors
    assert after == before, f"fd 2 was {before}, is now {after}"
    err = capfd.readouterr().err
    for k in range(THREADS):
        assert err.count(f"not-a-log-line from engine {k}\n") == 1, err  # passed through, once
    assert "noisy.cpp" not in err  # the engine's log lines are captured


def test_overlapping_creations_restore_fd2() -> None:
    """Engine A's window opens, B's opens inside it, A's closes first, B's last: the order that broke fd 2.

    Without serialisation B saved A's temp file as "the" fd 2 and restored it
    last. With it, B waits for A's window to close; A's wait for B times out.
    """
    a_started, b_started, a_returned = threading.Event(), threading.Event(), threading.Event()

    class A(HostMemoryEngine):
        def initialize(self, *args: str) -> int:
            a_started.set()
            b_started.wait(0.3)
            a_returned.set()
            return super().initialize(*args)

    class B(HostMemoryEngine):
        def initialize(self, *args: str) -> int:
            b_started.set()
            a_returned.wait(5)
            time.sleep(0.05)  # A restores fd 2 meanwhile
            return super().initialize(*args)

    errors: list[BaseException] = []

    def create(factory: Callable[[], HostMemoryEngine]) -> None:
        try:
            MooncakeEngine(BackendConfig(), engine_factory=factory).close()
        except BaseException as exc:
            errors.append(exc)

    with _fd2_guard() as before:
        first = threading.Thread(target=create, args=(A,))
        first.start()
        assert a_started.wait(5)
        second = threading.Thread(target=create, args=(B,))
        second.start()
        first.join(10)
        second.join(10)
        after = _fd2()
    assert not errors, errors
    assert after == before, f"fd 2 was {before}, is now {after}"


def test_creation_log_is_captured_into_the_error_message(capfd: pytest.CaptureFixture[str]) -> None:
    class Failing(NoisyEngine):
        def initialize(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str) -> int:
            super().initialize(local_hostname, metadata_server, protocol, device_name)
            return -1

    with _fd2_guard() as before, pytest.raises(BackendUnavailableError, match=r"engine 7 created"):
        MooncakeEngine(BackendConfig(), engine_factory=lambda: Failing(7))
    assert _fd2() == before
    err = capfd.readouterr().err
    assert "not-a-log-line from engine 7" in err and "noisy.cpp" not in err


@pytest.mark.skipif(not HAVE_MOONCAKE, reason="mooncake-transfer-engine not installed")
@pytest.mark.timeout(120)
def test_concurrent_real_engine_creation_restores_fd2(capfd: pytest.CaptureFixture[str]) -> None:
    with _fd2_guard() as before:
        errors = _create_concurrently(lambda k: MooncakeEngine(BackendConfig()), 4)
        after = _fd2()
    assert not errors, errors
    assert after == before, f"fd 2 was {before}, is now {after}"
    assert "Transfer Engine" not in capfd.readouterr().err  # the engine's INFO lines stayed captured


# ----------------------------------------------------------------------------- HostMemoryEngine pairs


class Buffers:
    """A sender and a receiving ``HostMemoryEngine`` peer, each with one registered buffer."""

    def __init__(self, eng: MooncakeEngine, size: int = 4096) -> None:
        self.src = np.arange(size, dtype=np.uint8)
        self.dst = np.zeros(size, dtype=np.uint8)
        self.size = size
        self.src_addr = int(self.src.ctypes.data)
        self.dst_addr = int(self.dst.ctypes.data)
        eng.register(self.src_addr, size)
        self.peer = HostMemoryEngine()
        assert self.peer.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert self.peer.register_memory(self.dst_addr, size) == 0
        self.session = f"127.0.0.1:{self.peer.get_rpc_port()}"

    def args(self, offset: int = 0, n: int = 64) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return np.array([self.src_addr]), np.array([self.dst_addr + offset]), np.array([n])

    def close(self) -> None:
        self.peer.close()


# ----------------------------------------------------------------------------- 2. failed renewal


class SecondCreationFails:
    """Factory of ``HostMemoryEngine``s whose second engine cannot be created (``how``)."""

    def __init__(self, how: str) -> None:
        self.how = how
        self.made: list[HostMemoryEngine] = []

    def __call__(self) -> HostMemoryEngine:
        if self.made and self.how == "factory-raises":
            raise BackendUnavailableError("no engine for you")
        engine = HostMemoryEngine()
        if self.made:
            engine.initialize = lambda *args: -1  # type: ignore[method-assign]
        self.made.append(engine)
        return engine


@pytest.mark.parametrize("how", ["initialize-fails", "factory-raises"])
def test_failed_renewal_is_a_transfer_error(how: str) -> None:
    factory = SecondCreationFails(how)
    with MooncakeEngine(BackendConfig(), engine_factory=factory) as eng:
        bufs = Buffers(eng)
        try:
            eng.write(bufs.session, *bufs.args())  # a session that worked: a later failure renews
            assert bufs.dst[:64].tolist() == bufs.src[:64].tolist()
            with pytest.raises(TransferError) as info:
                eng.write(bufs.session, *bufs.args(offset=bufs.size - 8))  # past the peer's memory
            err = info.value
            assert type(err) is TransferError
            assert err.peer == bufs.session and err.code == -1
            assert "renewing the sending engine" in str(err) and "failed" in str(err)
            assert isinstance(err.__cause__, BackendUnavailableError)
            assert str(err.__cause__) in str(err)
            assert eng.renewals == 0
            eng.write(bufs.session, *bufs.args(offset=128))  # the old engine still sends
            assert bufs.dst[128:192].tolist() == bufs.src[:64].tolist()
        finally:
            bufs.close()


# ----------------------------------------------------------------------------- 3. teardown closes the engine


def test_close_closes_every_host_memory_engine() -> None:
    made: list[HostMemoryEngine] = []

    def factory() -> HostMemoryEngine:
        made.append(HostMemoryEngine())
        return made[-1]

    eng = MooncakeEngine(BackendConfig(), engine_factory=factory)
    bufs = Buffers(eng)
    try:
        assert engine_double._engines.get(eng.endpoint) is made[0]
        eng.write(bufs.session, *bufs.args())
        with pytest.raises(TransferError):  # renews the sender, then fails again
            eng.write(bufs.session, *bufs.args(offset=bufs.size - 8))
        assert eng.renewals == 1 and len(made) == 2
        assert all(e in engine_double._engines.values() for e in made)
        eng.close()
        eng.close()
        assert not [e for e in engine_double._engines.values() if e in made]
    finally:
        bufs.close()


def test_host_memory_engine_close_is_idempotent() -> None:
    a, b = HostMemoryEngine(), HostMemoryEngine()
    a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    key = f"127.0.0.1:{a.get_rpc_port()}"
    a.close()
    a.close()
    assert key not in engine_double._engines
    assert b.send_probe(key) == -102
    b.close()
    HostMemoryEngine().close()  # never initialised: nothing to remove


# ----------------------------------------------------------------------------- 4. send_probe classification


def test_unknown_session_is_peer_unreachable_with_the_double() -> None:
    with MooncakeEngine(BackendConfig(), engine_factory=HostMemoryEngine) as eng:
        bufs = Buffers(eng)
        try:
            bufs.close()  # the peer is gone
            with pytest.raises(PeerUnreachableError) as info:
                eng.write(bufs.session, *bufs.args())
            assert info.value.code == -102 and info.value.peer == bufs.session
            with pytest.raises(PeerUnreachableError):
                eng.write("127.0.0.1:1", *bufs.args())
        finally:
            bufs.close()


def test_range_outside_the_peer_is_a_plain_transfer_error_with_the_double() -> None:
    with MooncakeEngine(BackendConfig(), engine_factory=HostMemoryEngine) as eng:
        bufs = Buffers(eng)
        try:
            assert eng._sender.engine is not None and eng._sender.engine.send_probe(bufs.session) == 0  # type: ignore[attr-defined]
            with pytest.raises(TransferError) as info:
                eng.write(bufs.session, *bufs.args(offset=bufs.size - 8))
            assert type(info.value) is TransferError
            assert info.value.code == -1 and "registered memory" in str(info.value)
            assert not bufs.dst.any()  # nothing written
        finally:
            bufs.close()
