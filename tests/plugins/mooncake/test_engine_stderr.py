"""``MooncakeEngine`` and file descriptor 2: captured around engine creation only with ``process_settings``.

Engine doubles that write to fd 2 while they initialise, as the real engine
does, created concurrently and in overlapping windows; one real-engine check,
skipped without the wheel.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from kvwire.config import BackendConfig
from kvwire.errors import BackendUnavailableError
from kvwire_mooncake.engine import MooncakeEngine
from kvwire_mooncake.engine_double import HostMemoryEngine

HAVE_MOONCAKE = importlib.util.find_spec("mooncake") is not None
THREADS = 8
#: Engines created by kvwire that may capture fd 2 (and set MC_* variables).
SETTINGS = BackendConfig(process_settings=True)


@pytest.fixture(autouse=True)
def restore_environ() -> Iterator[None]:
    """``process_settings`` sets MC_* variables: put ``os.environ`` back after each test."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


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


def spy_on_fd_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every ``os.dup`` / ``os.dup2`` call from now on (passed through) in the returned list."""
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
            lambda k: MooncakeEngine(SETTINGS, engine_factory=lambda: NoisyEngine(k)), THREADS
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
            MooncakeEngine(SETTINGS, engine_factory=factory).close()
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


class Failing(NoisyEngine):
    def initialize(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str) -> int:
        super().initialize(local_hostname, metadata_server, protocol, device_name)
        return -1


def test_creation_log_is_captured_into_the_error_message(capfd: pytest.CaptureFixture[str]) -> None:
    with _fd2_guard() as before, pytest.raises(BackendUnavailableError, match=r"engine 7 created"):
        MooncakeEngine(SETTINGS, engine_factory=lambda: Failing(7))
    assert _fd2() == before
    err = capfd.readouterr().err
    assert "not-a-log-line from engine 7" in err and "noisy.cpp" not in err


@pytest.mark.parametrize(
    ("config", "captured"),
    [
        (BackendConfig(), False),
        (BackendConfig(process_settings=True, verbose=True), False),
        (BackendConfig(process_settings=True), True),
    ],
    ids=["default", "process-settings-verbose", "process-settings"],
)
def test_fd2_is_captured_only_with_process_settings_and_not_verbose(
    config: BackendConfig, captured: bool, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = spy_on_fd_calls(monkeypatch)
    with pytest.raises(BackendUnavailableError) as info:
        MooncakeEngine(config, engine_factory=lambda: Failing(8))
    seen = list(calls)
    err = capfd.readouterr().err
    assert "not-a-log-line from engine 8" in err  # never swallowed
    if captured:
        assert "dup(2)" in seen and any(c.endswith(", 2)") for c in seen), seen
        assert "engine 8 created" in str(info.value) and "noisy.cpp" not in err
    else:
        assert seen == []
        assert "engine log" not in str(info.value)  # nothing captured to quote
        assert "noisy.cpp:1] engine 8 created" in err


@pytest.mark.skipif(not HAVE_MOONCAKE, reason="mooncake-transfer-engine not installed")
@pytest.mark.timeout(120)
def test_concurrent_real_engine_creation_restores_fd2(capfd: pytest.CaptureFixture[str]) -> None:
    with _fd2_guard() as before:
        errors = _create_concurrently(lambda k: MooncakeEngine(SETTINGS), 4)
        after = _fd2()
    assert not errors, errors
    assert after == before, f"fd 2 was {before}, is now {after}"
    assert "Transfer Engine" not in capfd.readouterr().err  # the engine's INFO lines stayed captured
