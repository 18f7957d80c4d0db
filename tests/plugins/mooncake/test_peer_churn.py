"""What a dead peer costs, and ``forget_peer`` keeping it bounded (issue 11, item 7).

Mooncake 0.3.13 keeps up to ``MC_TCP_LANES_PER_PEER`` (default 4) pooled data
connections per peer it wrote to, and its segment descriptor, until the engine
is destroyed: once the peer dies they sit in CLOSE_WAIT, one file descriptor
each, and the binding has no call to drop them (no ``close_segment``,
``remove_segment`` or ``disconnect``). ``MooncakeEngine.forget_peer`` therefore
counts the forgotten peers the sending engine wrote to and, past
``RECYCLE_AFTER_FORGOTTEN``, replaces that engine by a fresh one (the receiving
engine and the endpoint stay), which closes them.

The first tests use the in-process engine double; the slow ones churn a few
hundred real peer processes (a raw Mooncake engine each, killed after one write)
and count this process's sockets in ``/proc``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest

from kvwire.config import BackendConfig
from kvwire_mooncake import engine_double
from kvwire_mooncake.engine import MooncakeEngine, listening, wrapper
from kvwire_mooncake.engine_double import HostMemoryEngine

HAVE_MOONCAKE = importlib.util.find_spec("mooncake") is not None
needs_engine = pytest.mark.skipif(not (HAVE_MOONCAKE and listening.supported()), reason="needs Mooncake and /proc")

LANES = 4  # MC_TCP_LANES_PER_PEER's default: the most pooled connections Mooncake keeps per peer
DESCRIPTORS = 8  # per write: enough to open every lane
PAGE = 4096

#: A peer process: a raw engine with one registered buffer; prints "<endpoint> <addr>", exits when stdin closes.
CHILD = """
import ctypes, os, sys
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
from mooncake.engine import TransferEngine
engine = TransferEngine()
assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
buf = ctypes.create_string_buffer(1 << 16)
assert engine.register_memory(ctypes.addressof(buf), 1 << 16) == 0
print(f"127.0.0.1:{engine.get_rpc_port()} {ctypes.addressof(buf)}", flush=True)
sys.stdin.readline()
os._exit(0)
"""


class Receivers:
    """Engine doubles standing for peers, each with one registered 64 KiB buffer."""

    def __init__(self) -> None:
        self.engines: list[HostMemoryEngine] = []
        self.buffers: list[np.ndarray] = []

    def start(self) -> tuple[str, int]:
        engine = HostMemoryEngine()
        engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        buf = np.zeros(1 << 16, dtype=np.uint8)
        engine.register_memory(int(buf.ctypes.data), buf.nbytes)
        self.engines.append(engine)
        self.buffers.append(buf)
        return f"127.0.0.1:{engine.port}", int(buf.ctypes.data)

    def close(self) -> None:
        for engine in self.engines:
            engine.close()


@pytest.fixture
def receivers() -> Iterator[Receivers]:
    made = Receivers()
    yield made
    made.close()


class Factory:
    """Makes engine doubles and keeps them, in order (the primary first)."""

    def __init__(self) -> None:
        self.made: list[HostMemoryEngine] = []

    def __call__(self) -> HostMemoryEngine:
        self.made.append(HostMemoryEngine())
        return self.made[-1]


@pytest.fixture
def factory(monkeypatch: pytest.MonkeyPatch) -> Factory:
    """An engine factory for the wrapper under test, with recycling after 3 forgotten peers."""
    monkeypatch.setattr(wrapper, "RECYCLE_AFTER_FORGOTTEN", 3)
    return Factory()


def _write(engine: MooncakeEngine, src: np.ndarray, session: str, addr: int, n: int = DESCRIPTORS) -> None:
    offsets = np.arange(n, dtype=np.int64) * PAGE
    engine.write(session, int(src.ctypes.data) + offsets, addr + offsets, np.full(n, PAGE, dtype=np.int64))


# ---------------------------------------------------------------------------- the recycling rule, with doubles


def test_forget_peer_recycles_the_sender_every_few_forgotten_peers(factory: Factory, receivers: Receivers) -> None:
    made = factory.made
    with MooncakeEngine(BackendConfig(), engine_factory=factory) as eng:
        src = np.ones(1 << 16, dtype=np.uint8)
        eng.register(int(src.ctypes.data), src.nbytes)
        endpoint = eng.endpoint
        eng.forget_peer("127.0.0.1:1")  # never written to: costs nothing, counts for nothing
        for expected in (1, 2):
            for _ in range(3):
                session, addr = receivers.start()
                _write(eng, src, session, addr)
                eng.forget_peer(session)
            assert eng.recycles == expected and len(made) == 1 + expected
        assert made[1]._closed and not made[0]._closed  # the old sender is destroyed, the primary stays
        assert eng.endpoint == endpoint and engine_double._engines[endpoint] is made[0]
        assert eng.renewals == 0
        session, addr = receivers.start()
        _write(eng, src, session, addr)  # the fresh sender writes, with all memory registered
        assert receivers.buffers[-1][: DESCRIPTORS * PAGE].all()


def test_a_forgotten_peer_written_to_again_no_longer_counts(factory: Factory, receivers: Receivers) -> None:
    with MooncakeEngine(BackendConfig(), engine_factory=factory) as eng:
        src = np.ones(1 << 16, dtype=np.uint8)
        eng.register(int(src.ctypes.data), src.nbytes)
        back, back_addr = receivers.start()
        for _ in range(2):
            session, addr = receivers.start()
            _write(eng, src, session, addr)
            eng.forget_peer(session)
        _write(eng, src, back, back_addr)
        eng.forget_peer(back)  # third forgotten: recycled
        assert eng.recycles == 1
        _write(eng, src, back, back_addr)  # back again, on the fresh sender
        eng.forget_peer(back)
        _write(eng, src, back, back_addr)  # ...and again: in use, so not counted as gone
        for _ in range(2):
            session, addr = receivers.start()
            _write(eng, src, session, addr)
            eng.forget_peer(session)
        assert eng.recycles == 1


def test_a_peer_found_dead_by_a_write_counts_as_forgotten_without_forget_peer(
    factory: Factory, receivers: Receivers
) -> None:
    """Issue 23 leftover: a sender's connections grew over killed receivers when remove_peer was never called."""
    from kvwire.errors import PeerUnreachableError

    with MooncakeEngine(BackendConfig(timeout_s=2.0), engine_factory=factory) as eng:
        src = np.ones(1 << 16, dtype=np.uint8)
        eng.register(int(src.ctypes.data), src.nbytes)
        for i in range(3):
            session, addr = receivers.start()
            _write(eng, src, session, addr)
            receivers.engines[-1].close()  # the receiver dies; nobody calls forget_peer / remove_peer
            with pytest.raises(PeerUnreachableError):
                _write(eng, src, session, addr)
            assert eng.recycles == (1 if i == 2 else 0)
        session, addr = receivers.start()
        _write(eng, src, session, addr)  # the fresh sender serves a live peer
        assert receivers.buffers[-1][: DESCRIPTORS * PAGE].all()


def test_a_host_engine_is_never_recycled(receivers: Receivers, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wrapper, "RECYCLE_AFTER_FORGOTTEN", 1)
    host = HostMemoryEngine()
    host.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    try:
        with MooncakeEngine(BackendConfig(options={"engine": host})) as eng:
            src = np.ones(1 << 16, dtype=np.uint8)
            eng.register(int(src.ctypes.data), src.nbytes)
            for _ in range(3):
                session, addr = receivers.start()
                _write(eng, src, session, addr)
                eng.forget_peer(session)
            assert eng.recycles == 0
    finally:
        host.close()


# ---------------------------------------------------------------------------- real peers, real sockets


class Children:
    """Peer processes started in batches; each is killed (stdin closed) after the test wrote to it."""

    def __init__(self) -> None:
        self.env = {**os.environ, "MC_LOG_LEVEL": "ERROR"}

    def batch(self, n: int) -> list[tuple[subprocess.Popen[str], str, int]]:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", CHILD],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env=self.env,
            )
            for _ in range(n)
        ]
        started = []
        for proc in procs:
            assert proc.stdout is not None
            line = proc.stdout.readline().split()
            assert len(line) == 2, f"peer exited with {proc.wait()}"
            started.append((proc, line[0], int(line[1])))
        return started

    @staticmethod
    def kill(batch: list[tuple[subprocess.Popen[str], str, int]]) -> None:
        for proc, _, _ in batch:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.close()
            proc.stdout.close()
            proc.wait(timeout=30)


def close_wait() -> int:
    return listening.socket_states().get("CLOSE_WAIT", 0)


@needs_engine
@pytest.mark.slow
def test_each_dead_peer_keeps_at_most_a_few_sockets_until_forgotten() -> None:
    """Measured: about 2.75 CLOSE_WAIT sockets per dead peer at 8 descriptors per write, 1 at 1 descriptor."""
    children = Children()
    with MooncakeEngine(BackendConfig(host="127.0.0.1")) as eng:
        src = np.ones(1 << 16, dtype=np.uint8)
        eng.register(int(src.ctypes.data), src.nbytes)
        before = close_wait()
        dead = 0
        for _ in range(3):
            batch = children.batch(8)
            for _, session, addr in batch:
                _write(eng, src, session, addr)
            children.kill(batch)
            dead += len(batch)
        kept = close_wait() - before
        assert kept <= LANES * dead
        assert eng.recycles == 0  # nothing forgotten: nothing recycled


@needs_engine
@pytest.mark.slow
def test_a_churn_of_hundreds_of_peers_with_forget_peer_keeps_sockets_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    threshold, per_batch, peers = 16, 8, 240
    monkeypatch.setattr(wrapper, "RECYCLE_AFTER_FORGOTTEN", threshold)
    # The primary keeps what it held at the first recycle, the sender at most one threshold's worth (and a batch).
    bound = 2 * (threshold + per_batch) * LANES
    children = Children()
    with MooncakeEngine(BackendConfig(host="127.0.0.1")) as eng:
        src = np.ones(1 << 16, dtype=np.uint8)
        eng.register(int(src.ctypes.data), src.nbytes)
        base_fds, base_sockets = len(os.listdir("/proc/self/fd")), close_wait()
        peak = 0
        for _ in range(peers // per_batch):
            batch = children.batch(per_batch)
            for _, session, addr in batch:
                _write(eng, src, session, addr)
            children.kill(batch)
            for _, session, _ in batch:
                eng.forget_peer(session)
            peak = max(peak, close_wait() - base_sockets)
        fds = len(os.listdir("/proc/self/fd")) - base_fds
        assert peak <= bound, (peak, bound)
        assert fds <= bound + 16, (fds, bound)  # + the fresh sender's own listeners, threads' pipes
        assert eng.recycles >= peers // threshold - 2
        endpoint = eng.endpoint
    assert endpoint.startswith("127.0.0.1:")


def test_peers_that_died_unannounced_are_swept_and_count_as_forgotten(
    factory: Factory, receivers: Receivers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 23 leftover: a receiver killed and never written to again kept its sockets until close()."""
    with MooncakeEngine(BackendConfig(), engine_factory=factory) as eng:
        src = np.ones(1 << 16, dtype=np.uint8)
        eng.register(int(src.ctypes.data), src.nbytes)
        alive, alive_addr = receivers.start()
        _write(eng, src, alive, alive_addr)
        dead = []
        for _ in range(2):
            session, addr = receivers.start()
            _write(eng, src, session, addr)
            receivers.engines[-1].close()  # dies; nobody tells the sender, nobody writes to it again
            dead.append(session)
        assert eng.sweep_dead_peers() == sorted(dead)  # the live one is left alone
        assert eng.sweep_dead_peers() == [] and eng.recycles == 0
        session, addr = receivers.start()
        _write(eng, src, session, addr)
        receivers.engines[-1].close()
        assert eng.sweep_dead_peers() == [session] and eng.recycles == 1  # the third forgotten: recycled
        _write(eng, src, alive, alive_addr)  # the live peer, through the fresh sender


def test_the_periodic_thread_calls_its_method_until_closed() -> None:
    import threading

    from kvwire_mooncake.engine.periodic import Periodic

    class Counting:
        def __init__(self) -> None:
            self.calls = 0
            self.swept = threading.Event()

        def sweep(self) -> None:
            self.calls += 1
            if self.calls == 3:
                self.swept.set()

    counting = Counting()
    sweeper = Periodic(counting.sweep, "test", 0.01)
    assert counting.swept.wait(10)
    sweeper.close()
    calls = counting.calls
    assert not sweeper._thread.is_alive() and counting.calls == calls


def test_the_periodic_thread_ends_when_its_method_says_false_or_its_owner_is_dropped() -> None:
    import gc

    from kvwire_mooncake.engine.periodic import Periodic

    class Once:
        def __init__(self) -> None:
            self.calls = 0

        def step(self) -> bool:
            self.calls += 1
            return False

    once = Once()
    stopping = Periodic(once.step, "test-false", 0.01)
    stopping._thread.join(10)
    assert not stopping._thread.is_alive() and once.calls == 1

    class Forever:
        def step(self) -> None:
            pass

    owner = Forever()
    orphan = Periodic(owner.step, "test-dropped", 0.01)
    del owner
    gc.collect()
    orphan._thread.join(10)
    assert not orphan._thread.is_alive()
