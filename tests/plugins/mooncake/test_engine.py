"""``MooncakeEngine``: real engine, real second process (``_engine_peer.py``), faults included.

The receiver is a separate process with a raw Mooncake engine (``_engine_peer.py``,
run by path; pytest puts this directory on ``sys.path`` for its helper); it reports
its endpoint and buffer address on stdout and the sha256 of its buffer on request,
so every transfer is checked byte for byte against a buffer computed here.
Nothing sleeps and hopes: the tests synchronise on the peer's stdout lines.
A few tests use small in-process engine doubles for paths a real engine cannot
produce on demand (a call that never returns, a missing wheel).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _engine_peer import initial_buffer
from freezing import freeze
from numpy.typing import NDArray

from kvwire.config import BackendConfig
from kvwire.errors import (
    BackendUnavailableError,
    InvalidTransferError,
    PeerUnreachableError,
    TransferError,
    TransferTimeoutError,
)
from kvwire_mooncake.engine import MooncakeEngine
from kvwire_mooncake.raw import raw_write

HERE = Path(__file__).parent

HAVE_MOONCAKE = importlib.util.find_spec("mooncake") is not None
needs_engine = pytest.mark.skipif(not HAVE_MOONCAKE, reason="mooncake-transfer-engine not installed")

MiB = 1 << 20
PEER_SIZE = 64 * MiB
TIMEOUT_S = 3.0
SLACK_S = 0.75
SRC_ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(
        [
            str(HERE.parents[2] / "core" / "src"),
            str(HERE.parents[2] / "plugins" / "mooncake" / "src"),
            os.environ.get("PYTHONPATH", ""),
        ]
    ),
}

I64 = NDArray[np.int64]


# ----------------------------------------------------------------------------- helpers


class Peer:
    """A receiver process: one registered buffer of random bytes, hashed on request."""

    def __init__(self, size: int = PEER_SIZE, seed: int = 1) -> None:
        self.size, self.seed = size, seed
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "_engine_peer.py"), "--size", str(size), "--seed", str(seed)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        info = self._read()
        assert "endpoint" in info, info
        self.endpoint: str = info["endpoint"]
        self.addr: int = info["addr"]
        self.pid: int = info["pid"]
        self.expected = np.frombuffer(bytearray(initial_buffer(size, seed)), dtype=np.uint8)

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"peer exited with {self.proc.poll()}"
        result: dict[str, Any] = json.loads(line)
        return result

    def sha256(self) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write("hash\n")
        self.proc.stdin.flush()
        digest: str = self._read()["sha256"]
        return digest

    def expected_sha256(self) -> str:
        return hashlib.sha256(self.expected.tobytes()).hexdigest()

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def peers() -> Iterator[Callable[..., Peer]]:
    """Factory of receiver processes, all killed afterwards (SIGCONT first, in case one is frozen)."""
    started: list[Peer] = []

    def start(size: int = PEER_SIZE, seed: int = 1) -> Peer:
        started.append(Peer(size, seed))
        return started[-1]

    yield start
    for p in started:
        if p.proc.poll() is None:
            p.signal(signal.SIGCONT)
        p.kill()


class Source:
    """A registered local buffer of random bytes."""

    def __init__(self, engine: MooncakeEngine, size: int = PEER_SIZE, seed: int = 7) -> None:
        self.data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
        self.addr = int(self.data.ctypes.data)
        engine.register(self.addr, size)


@pytest.fixture(scope="module")
def sender() -> Iterator[MooncakeEngine]:
    """One real engine shared by the real-engine tests (timeout 3 s), closed at the end."""
    if not HAVE_MOONCAKE:
        pytest.skip("mooncake-transfer-engine not installed")
    eng = MooncakeEngine(BackendConfig(timeout_s=TIMEOUT_S))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def source(sender: MooncakeEngine) -> Source:
    return Source(sender)


def fragmented(rng: np.random.Generator, n: int, size: int, max_len: int) -> tuple[I64, I64, I64]:
    """``n`` descriptors: random sources, disjoint destinations in random order, random lengths."""
    slot = size // n
    assert slot >= max_len
    dst = rng.permutation(n).astype(np.int64) * slot + rng.integers(0, slot - max_len + 1, n)
    length = rng.integers(1, max_len + 1, n).astype(np.int64)
    src = rng.integers(0, size - max_len, n).astype(np.int64)
    return src, dst, length


def apply(expected: NDArray[np.uint8], data: NDArray[np.uint8], src: I64, dst: I64, length: I64) -> None:
    for s, d, n in zip(src.tolist(), dst.tolist(), length.tolist()):
        expected[d : d + n] = data[s : s + n]


def raises_within(exc: type[BaseException], seconds: float, fn: Callable[[], object]) -> tuple[Any, float]:
    t0 = time.monotonic()
    with pytest.raises(exc) as info:
        fn()
    elapsed = time.monotonic() - t0
    assert elapsed < seconds, f"{exc.__name__} after {elapsed:.2f} s (limit {seconds} s)"
    return info.value, elapsed


class Recording:
    """Forwards to a real engine and records each write call's size and the peak in flight."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[int] = []
        self.inflight = 0
        self.peak = 0
        self.poisoned = False  # refuse every write, as an engine whose session to a peer broke for good
        self._lock = threading.Lock()

    def initialize(self, *args: str) -> int:
        return int(self.inner.initialize(*args))

    def get_rpc_port(self) -> int:
        return int(self.inner.get_rpc_port())

    def register_memory(self, ptr: int, size: int) -> int:
        return int(self.inner.register_memory(ptr, size))

    def unregister_memory(self, ptr: int) -> int:
        return int(self.inner.unregister_memory(ptr))

    def send_probe(self, session: str) -> int:
        return int(self.inner.send_probe(session))

    def batch_transfer_sync_write(self, session: str, src: list[int], dst: list[int], length: list[int]) -> int:
        if self.poisoned:
            return -1
        with self._lock:
            self.calls.append(len(src))
            self.inflight += len(src)
            self.peak = max(self.peak, self.inflight)
        try:
            return int(self.inner.batch_transfer_sync_write(session, src, dst, length))
        finally:
            with self._lock:
                self.inflight -= len(src)


def recording_factory(made: list[Recording]) -> Callable[[], Recording]:
    def make() -> Recording:
        # imported here, when MooncakeEngine needs it (and after it set MC_LOG_LEVEL, with process_settings)
        made.append(Recording(importlib.import_module("mooncake.engine").TransferEngine()))
        return made[-1]

    return make


# ----------------------------------------------------------------------------- import and logging


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in SRC_ENV.items() if not k.startswith("MC_")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)


def test_importing_the_module_does_not_load_the_engine() -> None:
    proc = run_python(
        "import sys, kvwire_mooncake, kvwire_mooncake.engine\n"
        "assert not [m for m in sys.modules if m.startswith('mooncake')], sorted(sys.modules)\n"
    )
    assert proc.returncode == 0, proc.stderr


def test_missing_wheel_names_the_extra_and_the_wheel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # import now raises ModuleNotFoundError
    with pytest.raises(BackendUnavailableError) as info:
        MooncakeEngine(BackendConfig())
    assert "pip install 'kvwire-mooncake[cpu]'" in str(info.value)
    assert "mooncake-transfer-engine-non-cuda" in str(info.value)


def test_missing_system_library_names_the_debian_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(name: str) -> object:
        raise ImportError("libibverbs.so.1: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(importlib, "import_module", fail)  # the engine module uses importlib
    with pytest.raises(BackendUnavailableError) as info:
        MooncakeEngine(BackendConfig())
    message = str(info.value)
    assert "libibverbs.so.1" in message
    assert "apt-get install -y libibverbs1 libnuma1 libcurl4" in message
    assert "Debian package libibverbs1" in message


@needs_engine
@pytest.mark.timeout(60)
def test_engine_creation_is_quiet_with_process_settings_unless_verbose() -> None:
    code = (
        "from kvwire.config import BackendConfig\n"
        "from kvwire_mooncake.engine import MooncakeEngine\n"
        "e = MooncakeEngine(BackendConfig(verbose={verbose}, process_settings=True))\n"
        "print(e.endpoint)\n"
        "import os; os._exit(0)\n"
    )
    quiet = run_python(code.format(verbose=False))
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout.startswith("127.0.0.1:")
    assert quiet.stderr == ""
    loud = run_python(code.format(verbose=True))
    assert loud.returncode == 0, loud.stderr
    assert "Transfer Engine" in loud.stderr  # the engine's INFO lines get through


# ----------------------------------------------------------------------------- registration and checks


@needs_engine
def test_registration_is_tracked_and_mapped_to_exceptions(sender: MooncakeEngine) -> None:
    buf = np.zeros(8192, dtype=np.uint8)
    ptr = int(buf.ctypes.data)
    before = sender.registered
    sender.register(ptr, 4096)
    assert (ptr, 4096) in sender.registered
    with pytest.raises(InvalidTransferError, match="overlaps"):
        sender.register(ptr + 100, 100)
    with pytest.raises(InvalidTransferError, match="ptr"):
        sender.register(0, 100)
    with pytest.raises(InvalidTransferError, match="nbytes"):
        sender.register(ptr + 4096, 0)
    with pytest.raises(InvalidTransferError, match="not the start"):
        sender.unregister(ptr + 1)
    sender.unregister(ptr)
    assert sender.registered == before
    sender.register(ptr, 8192)  # the range is free again, also for the engine
    sender.unregister(ptr)


@needs_engine
def test_check_local_names_the_first_offending_descriptor(sender: MooncakeEngine, source: Source) -> None:
    a, n = source.addr, source.data.size
    ok_src = np.array([a, a + 10, a + n - 8], dtype=np.int64)
    sender.check_local(ok_src, np.array([8, 100, 8], dtype=np.int64))
    cases = [
        (a - 1, 8),  # starts before
        (a + n - 8, 9),  # straddles the end
        (a + n, 1),  # just past the end
        (1, 1),  # far below everything
    ]
    for bad, length in cases:
        src = np.array([a, a + 64, bad, a], dtype=np.int64)
        lengths = np.array([8, 8, length, 8], dtype=np.int64)
        with pytest.raises(InvalidTransferError, match=rf"src_addrs\[2\] = {bad:#x} with lengths\[2\]"):
            sender.check_local(src, lengths)


# ----------------------------------------------------------------------------- transfers


@needs_engine
@pytest.mark.timeout(60)
def test_fragmented_random_write_is_byte_exact(
    sender: MooncakeEngine, source: Source, peers: Callable[..., Peer]
) -> None:
    peer = peers()
    rng = np.random.default_rng(11)
    src, dst, length = fragmented(rng, 700, PEER_SIZE, 64 * 1024)
    sender.write(peer.endpoint, src + source.addr, dst + peer.addr, length)
    apply(peer.expected, source.data, src, dst, length)
    assert peer.sha256() == peer.expected_sha256()


@needs_engine
@pytest.mark.timeout(60)
def test_writes_beyond_the_engine_queue_limit_are_chunked_and_bounded(peers: Callable[..., Peer]) -> None:
    made: list[Recording] = []
    config = BackendConfig(
        timeout_s=TIMEOUT_S, options={"max_descriptors_per_call": 512, "max_inflight_per_peer": 1024}
    )
    with MooncakeEngine(config, engine_factory=recording_factory(made)) as eng:
        source = Source(eng, 16 * MiB)
        peer = peers(16 * MiB, seed=2)
        rng = np.random.default_rng(12)
        # 4 threads x 2500 descriptors, disjoint quarters of the peer's buffer
        quarter = peer.size // 4
        plans = [fragmented(rng, 2500, quarter, 1024) for _ in range(4)]
        errors: list[BaseException] = []

        def send(k: int) -> None:
            src, dst, length = plans[k]
            try:
                eng.write(peer.endpoint, src + source.addr, dst + k * quarter + peer.addr, length)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=send, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for k, (src, dst, length) in enumerate(plans):
            apply(peer.expected, source.data, src, dst + k * quarter, length)
        assert peer.sha256() == peer.expected_sha256()
        (engine,) = made
        assert sum(engine.calls) == 10_000
        assert max(engine.calls) == 512
        assert engine.peak <= 1024


@needs_engine
def test_unregistered_local_source_is_rejected_before_the_engine(peers: Callable[..., Peer]) -> None:
    made: list[Recording] = []
    with MooncakeEngine(BackendConfig(), engine_factory=recording_factory(made)) as eng:
        source = Source(eng, MiB)
        stray = np.zeros(4096, dtype=np.uint8)
        src = np.array([source.addr, int(stray.ctypes.data)], dtype=np.int64)
        with pytest.raises(InvalidTransferError, match=rf"src\[1\] = {int(stray.ctypes.data):#x}"):
            eng.write("127.0.0.1:1", src, np.array([4096, 8192], dtype=np.int64), np.array([64, 64]))
        assert made[0].calls == []


@needs_engine
def test_bad_arguments_are_rejected_naming_them(sender: MooncakeEngine, source: Source) -> None:
    a = np.array([source.addr], dtype=np.int64)
    one = np.array([1], dtype=np.int64)
    with pytest.raises(InvalidTransferError, match="same length"):
        sender.write("x:1", a, np.array([1, 2], dtype=np.int64), one)
    with pytest.raises(InvalidTransferError, match=r"length\[0\] = 0"):
        sender.write("x:1", a, one, np.array([0], dtype=np.int64))
    with pytest.raises(InvalidTransferError, match=r"dst\[0\] = -5"):
        sender.write("x:1", a, np.array([-5], dtype=np.int64), one)
    with pytest.raises(InvalidTransferError, match="dst must have an integer dtype"):
        sender.write("x:1", a, np.array([1.5]), one)
    with pytest.raises(InvalidTransferError, match="src must be a 1-D array"):
        sender.write("x:1", a.reshape(1, 1), one, one)
    sender.write("x:1", a[:0], a[:0], a[:0])  # nothing to do


@needs_engine
@pytest.mark.timeout(60)
def test_raw_write_is_the_bare_chunked_engine_call(
    sender: MooncakeEngine, source: Source, peers: Callable[..., Peer]
) -> None:
    peer = peers(4 * MiB, seed=12)
    src, dst, length = fragmented(np.random.default_rng(13), 3000, 4 * MiB, 512)
    raw_write(sender, peer.endpoint, src + source.addr, dst + peer.addr, length)  # > 2060: chunked
    apply(peer.expected, source.data, src, dst, length)
    assert peer.sha256() == peer.expected_sha256()
    with pytest.raises(TransferError) as info:
        raw_write(sender, peer.endpoint, src[:1] + source.addr, np.array([peer.addr + 4 * MiB]), length[:1])
    assert info.value.code == -1


# ----------------------------------------------------------------------------- faults


@needs_engine
@pytest.mark.timeout(60)
def test_remote_range_outside_the_peer_is_a_transfer_error(
    sender: MooncakeEngine, source: Source, peers: Callable[..., Peer]
) -> None:
    peer = peers(MiB, seed=3)
    err, _ = raises_within(
        TransferError,
        1.0,
        lambda: sender.write(peer.endpoint, np.array([source.addr]), np.array([peer.addr + MiB - 8]), np.array([64])),
    )
    assert type(err) is TransferError
    assert err.code == -1 and err.peer == peer.endpoint
    assert "registered memory" in str(err)
    assert peer.sha256() == peer.expected_sha256()  # nothing written
    src, dst, length = fragmented(np.random.default_rng(4), 64, MiB, 4096)
    sender.write(peer.endpoint, src + source.addr, dst + peer.addr, length)  # still usable
    apply(peer.expected, source.data, src, dst, length)
    assert peer.sha256() == peer.expected_sha256()


@needs_engine
@pytest.mark.timeout(30)
def test_unreachable_session_is_peer_unreachable(sender: MooncakeEngine, source: Source) -> None:
    err, _ = raises_within(
        PeerUnreachableError,
        3.0,
        lambda: sender.write("127.0.0.1:1", np.array([source.addr]), np.array([4096]), np.array([64])),
    )
    assert err.code == -102 and err.peer == "127.0.0.1:1"


@needs_engine
@pytest.mark.timeout(60)
def test_peer_killed_mid_transfer_fails_fast_and_others_are_still_served(
    sender: MooncakeEngine, source: Source, peers: Callable[..., Peer]
) -> None:
    victim, other = peers(seed=4), peers(seed=5)
    n = 256
    src = np.arange(n, dtype=np.int64) * (256 * 1024)
    length = np.full(n, 256 * 1024, dtype=np.int64)
    first_done = threading.Event()
    failure: list[tuple[BaseException, float]] = []

    def stream() -> None:
        try:
            while True:  # 64 MiB per write, until the peer dies
                sender.write(victim.endpoint, src + source.addr, src + victim.addr, length)
                first_done.set()
        except BaseException as exc:
            failure.append((exc, time.monotonic()))
            first_done.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert first_done.wait(30)
    victim.signal(signal.SIGKILL)
    killed_at = time.monotonic()
    thread.join(10)
    assert not thread.is_alive()
    ((exc, failed_at),) = failure
    assert isinstance(exc, (PeerUnreachableError, TransferError))
    assert failed_at - killed_at < 2.0, failed_at - killed_at
    print(f"killed mid-transfer: {type(exc).__name__} {failed_at - killed_at:.3f} s after SIGKILL")
    # the same engine still serves a live peer
    sender.write(other.endpoint, src + source.addr, src + other.addr, length)
    apply(other.expected, source.data, src, src, length)
    assert other.sha256() == other.expected_sha256()


@pytest.fixture
def restore_environ() -> Iterator[None]:
    """Puts ``os.environ`` back afterwards (an engine created with ``process_settings`` sets MC_* variables)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@needs_engine
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("contacted", "process_settings"),
    [(True, False), (False, False), (True, True)],
    ids=["after-first-contact", "before-first-contact", "after-first-contact-process-settings"],
)
def test_frozen_peer_times_out_within_timeout_s_and_is_served_when_resumed(
    sender: MooncakeEngine,
    source: Source,
    peers: Callable[..., Peer],
    restore_environ: None,
    contacted: bool,
    process_settings: bool,
) -> None:
    """Frozen before the handshake, the handshake blocks 60 s in the engine and the Python deadline
    ends the write. Frozen after it, the same holds by default (the engine's own TCP deadlines are
    30 s); with ``process_settings`` they are set below ``timeout_s`` and the engine ends the write."""
    engine, own = sender, source
    if process_settings:
        for name in ("MC_TCP_STATUS_TIMEOUT_SEC", "MC_TCP_PROGRESS_TIMEOUT_SEC"):
            os.environ.pop(name, None)  # a value set by the user would be kept
        engine = MooncakeEngine(BackendConfig(timeout_s=TIMEOUT_S, process_settings=True))
        own = Source(engine)  # the same seed: the same bytes as source
        assert os.environ["MC_TCP_STATUS_TIMEOUT_SEC"] == os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"] == "2"
    src_base = own.addr
    peer = peers(seed=6)
    src, dst, length = fragmented(np.random.default_rng(6), 100, PEER_SIZE, 64 * 1024)
    try:
        if contacted:
            engine.write(peer.endpoint, src + src_base, dst + peer.addr, length)
        freeze(peer.pid)
        try:
            err, elapsed = raises_within(
                TransferTimeoutError,
                TIMEOUT_S + SLACK_S,
                lambda: engine.write(peer.endpoint, src + src_base, dst + peer.addr, length),
            )
            print(f"frozen peer ({'after' if contacted else 'before'} first contact): {elapsed:.3f} s")
            assert err.peer == peer.endpoint
            if process_settings:  # the engine's deadline: its code
                assert err.code == -1 and "within the engine's 2 s deadline" in str(err), err
            else:  # the Python deadline: no code, the call stays inside the engine
                assert err.code is None and "is still inside the engine" in str(err), err
        finally:
            peer.signal(signal.SIGCONT)
        # usable again (a call still stuck in the engine is waited for, not joined)
        engine.write(peer.endpoint, src + src_base, dst + peer.addr, length)
        apply(peer.expected, source.data, src, dst, length)
        assert peer.sha256() == peer.expected_sha256()
    finally:
        if engine is not sender:
            engine.close()


@needs_engine
@pytest.mark.timeout(60)
def test_restarted_peer_is_served_after_a_failure(
    sender: MooncakeEngine, source: Source, peers: Callable[..., Peer]
) -> None:
    first = peers(MiB, seed=8)
    src, dst, length = fragmented(np.random.default_rng(8), 32, MiB, 4096)
    sender.write(first.endpoint, src + source.addr, dst + first.addr, length)
    first.kill()
    with pytest.raises(PeerUnreachableError):
        sender.write(first.endpoint, src + source.addr, dst + first.addr, length)
    second = peers(MiB, seed=9)  # the restarted peer: a new process, a new endpoint
    sender.write(second.endpoint, src + source.addr, dst + second.addr, length)
    apply(second.expected, source.data, src, dst, length)
    assert second.sha256() == second.expected_sha256()


@needs_engine
@pytest.mark.timeout(60)
def test_broken_session_is_recovered_by_renewing_the_sending_engine(peers: Callable[..., Peer]) -> None:
    """A session the engine broke for good (queue overflow) works again; the endpoint stays."""
    made: list[Recording] = []
    with MooncakeEngine(BackendConfig(timeout_s=TIMEOUT_S), engine_factory=recording_factory(made)) as eng:
        endpoint = eng.endpoint
        source = Source(eng, 8 * MiB)
        peer = peers(8 * MiB, seed=10)
        n = 5000
        src = np.arange(n, dtype=np.int64) * 1024
        length = np.full(n, 1024, dtype=np.int64)
        eng.write(peer.endpoint, src[:10] + source.addr, src[:10] + peer.addr, length[:10])
        # Break the session behind the wrapper's back. A raw call of 5000 descriptors (queue overflow)
        # usually leaves the engine refusing that peer for good, but not on every run, so the broken
        # state is forced: the first engine refuses every write from now on, its peer still answers.
        raw = made[0].inner
        raw.batch_transfer_sync_write(
            peer.endpoint, (src + source.addr).tolist(), (src + peer.addr).tolist(), length.tolist()
        )
        made[0].poisoned = True
        # The same bytes again, through the wrapper (idempotent whatever the raw call wrote).
        eng.write(peer.endpoint, src + source.addr, src + peer.addr, length)
        assert eng.renewals == 1 and len(made) == 2
        assert eng.endpoint == endpoint
        apply(peer.expected, source.data, src, src, length)
        assert peer.sha256() == peer.expected_sha256()
        # The first engine still receives at the unchanged endpoint.
        target = np.zeros(4096, dtype=np.uint8)
        eng.register(int(target.ctypes.data), target.size)
        with MooncakeEngine(BackendConfig()) as other:
            payload = Source(other, 4096, seed=3)
            other.write(endpoint, np.array([payload.addr]), np.array([int(target.ctypes.data)]), np.array([4096]))
        assert np.array_equal(target, payload.data)


# ----------------------------------------------------------------------------- doubles: deadline, probe


class StuckEngine:
    """An engine double whose writes block until released (a peer that accepts and never answers)."""

    def __init__(self, probe: int | None = 0, rc: int = 0) -> None:
        self.release = threading.Event()
        self.block = True
        self.rc = rc
        self.calls = 0
        if probe is not None:
            self.send_probe = lambda session: probe

    def initialize(self, host: str, metadata: str, protocol: str, device: str) -> int:
        return 0

    def get_rpc_port(self) -> int:
        return 12345

    def register_memory(self, ptr: int, size: int) -> int:
        return 0

    def unregister_memory(self, ptr: int) -> int:
        return 0

    def batch_transfer_sync_write(self, session: str, src: list[int], dst: list[int], length: list[int]) -> int:
        self.calls += 1
        if self.block:
            self.release.wait(30)
        return self.rc


@pytest.mark.timeout(30)
def test_a_call_that_never_returns_ends_in_timeout_and_blocks_only_its_peer() -> None:
    double = StuckEngine()
    buf = np.zeros(4096, dtype=np.uint8)
    with MooncakeEngine(BackendConfig(timeout_s=0.5), engine_factory=lambda: double) as eng:
        assert eng.endpoint == "127.0.0.1:12345"
        eng.register(int(buf.ctypes.data), buf.size)
        args = (np.array([int(buf.ctypes.data)]), np.array([4096]), np.array([64]))
        err, _ = raises_within(TransferTimeoutError, 0.5 + SLACK_S, lambda: eng.write("peer:1", *args))
        assert "is still inside the engine" in str(err)
        # while that call is stuck, other peers are served and this one waits (then times out)
        double.block = False
        eng.write("peer:2", *args)
        err, _ = raises_within(TransferTimeoutError, 0.5 + SLACK_S, lambda: eng.write("peer:1", *args))
        assert "still inside the engine" in str(err)
        # once the stuck call returns, a waiting write goes through
        threading.Timer(0.1, double.release.set).start()
        eng.write("peer:1", *args)


@pytest.mark.parametrize(
    ("probe", "expected", "code"),
    [(-102, PeerUnreachableError, -102), (0, TransferError, -1), (None, TransferError, -1)],
)
def test_failures_are_classified_by_probe(probe: int | None, expected: type[TransferError], code: int) -> None:
    double = StuckEngine(probe=probe, rc=-1)
    double.block = False
    buf = np.zeros(4096, dtype=np.uint8)
    with MooncakeEngine(BackendConfig(), engine_factory=lambda: double) as eng:
        eng.register(int(buf.ctypes.data), buf.size)
        with pytest.raises(TransferError) as info:
            eng.write("peer:1", np.array([int(buf.ctypes.data)]), np.array([4096]), np.array([64]))
        assert type(info.value) is expected and info.value.code == code


def test_close_is_idempotent_and_unregisters_everything() -> None:
    class Counting(StuckEngine):
        def __init__(self) -> None:
            super().__init__()
            self.live: set[int] = set()

        def register_memory(self, ptr: int, size: int) -> int:
            self.live.add(ptr)
            return 0

        def unregister_memory(self, ptr: int) -> int:
            self.live.discard(ptr)
            return 0

    double = Counting()
    bufs = [np.zeros(4096, dtype=np.uint8) for _ in range(3)]
    eng = MooncakeEngine(BackendConfig(), engine_factory=lambda: double)
    for b in bufs:
        eng.register(int(b.ctypes.data), b.size)
    assert len(double.live) == 3
    eng.close()
    eng.close()
    assert double.live == set() and eng.registered == ()
    with pytest.raises(TransferError, match="closed"):
        eng.write("peer:1", np.array([int(bufs[0].ctypes.data)]), np.array([1]), np.array([1]))
    with pytest.raises(TransferError, match="closed"):
        raw_write(eng, "peer:1", np.array([int(bufs[0].ctypes.data)]), np.array([1]), np.array([1]))
