"""``MooncakeEngine`` over the in-process ``HostMemoryEngine``: failure classification, renewal, teardown.

A session that broke for good on the sending engine is recovered by renewing
that engine (never a host's own engine); a renewal that fails is a
TransferError; ``forget_peer`` drops a gone peer's bookkeeping; ``close`` and
``borrow`` never destroy an engine under a caller, and never one the host owns.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import pytest

from kvwire.config import BackendConfig
from kvwire.errors import BackendUnavailableError, PeerUnreachableError, TransferError
from kvwire_mooncake import engine_double
from kvwire_mooncake.engine import MooncakeEngine
from kvwire_mooncake.engine_double import HostMemoryEngine

I64 = np.ndarray


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

    def args(self, offset: int = 0, n: int = 64) -> tuple[I64, I64, I64]:
        return np.array([self.src_addr]), np.array([self.dst_addr + offset]), np.array([n])

    def close(self) -> None:
        self.peer.close()


class Refusing(HostMemoryEngine):
    """A ``HostMemoryEngine`` whose sessions to the peers in ``refused`` are broken for good (-1, peer answers)."""

    def __init__(self) -> None:
        super().__init__()
        self.refused: set[str] = set()

    def batch_transfer_sync_write(
        self, target: str, src: Sequence[int], dst: Sequence[int], length: Sequence[int]
    ) -> int:
        return -1 if target in self.refused else super().batch_transfer_sync_write(target, src, dst, length)


class Factory:
    """Makes ``Refusing`` engines and keeps them (``made``)."""

    def __init__(self) -> None:
        self.made: list[Refusing] = []

    def __call__(self) -> Refusing:
        self.made.append(Refusing())
        return self.made[-1]


def never_called() -> HostMemoryEngine:
    raise AssertionError("the engine factory must not be called")


@pytest.fixture
def host() -> Iterator[Refusing]:
    """An engine the host created and initialised itself, closed by the host (the test) afterwards."""
    engine = Refusing()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    yield engine
    engine.close()


# ----------------------------------------------------------------------------- classification by probe


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
    factory = Factory()
    with MooncakeEngine(BackendConfig(), engine_factory=factory) as eng:
        bufs = Buffers(eng)
        try:
            assert factory.made[0].send_probe(bufs.session) == 0
            with pytest.raises(TransferError) as info:
                eng.write(bufs.session, *bufs.args(offset=bufs.size - 8))
            assert type(info.value) is TransferError
            assert info.value.code == -1 and "registered memory" in str(info.value)
            assert not bufs.dst.any()  # nothing written
            assert eng.renewals == 0 and len(factory.made) == 1  # never worked: not a broken session
        finally:
            bufs.close()


# ----------------------------------------------------------------------------- renewal


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


def test_forget_peer_drops_its_bookkeeping_and_keeps_it_recoverable() -> None:
    """A peer gone and back at the same endpoint (here: the engine refuses it) is recovered by renewal,
    at most once per interval per peer; forgetting the peer resets that interval."""
    factory = Factory()
    with MooncakeEngine(BackendConfig(), engine_factory=factory) as eng:
        bufs = Buffers(eng)
        try:
            eng.forget_peer(bufs.session)  # unknown: nothing to drop
            eng.write(bufs.session, *bufs.args())
            factory.made[0].refused.add(bufs.session)
            eng.write(bufs.session, *bufs.args(offset=64))  # renewed, retried
            assert eng.renewals == 1 and len(factory.made) == 2
            factory.made[1].refused.add(bufs.session)
            with pytest.raises(TransferError, match="although the peer answers"):
                eng.write(bufs.session, *bufs.args(offset=128))  # no second renewal within the interval
            assert eng.renewals == 1
            eng.forget_peer(bufs.session)
            eng.forget_peer(bufs.session)  # idempotent
            eng.write(bufs.session, *bufs.args(offset=128))  # a fresh peer entry: renewed again
            assert eng.renewals == 2 and len(factory.made) == 3
            assert bufs.dst[:192].tolist() == bufs.src[:64].tolist() * 3
            assert engine_double._engines.get(eng.endpoint) is factory.made[0]  # the endpoint never moved
        finally:
            bufs.close()


# ----------------------------------------------------------------------------- a host's engine


def test_host_engine_is_never_renewed_and_the_error_says_so(host: Refusing) -> None:
    config = BackendConfig(options={"engine": host})
    with MooncakeEngine(config, engine_factory=never_called) as eng:
        assert eng.endpoint == f"127.0.0.1:{host.get_rpc_port()}"
        bufs = Buffers(eng)
        try:
            eng.write(bufs.session, *bufs.args())
            assert bufs.dst[:64].tolist() == bufs.src[:64].tolist()
            host.refused.add(bufs.session)
            with pytest.raises(TransferError) as info:
                eng.write(bufs.session, *bufs.args(offset=64))
            assert type(info.value) is TransferError and info.value.code == -1
            assert str(info.value).endswith(
                "writes to it worked before through this engine, so the session may be broken: kvwire does not "
                "renew an engine the host supplied (BackendConfig.options['engine']); recreate it in the host, "
                "or let kvwire create its own"
            )
            assert eng.renewals == 0
        finally:
            bufs.close()


def test_close_unregisters_only_what_kvwire_registered_and_leaves_the_host_engine_open(host: Refusing) -> None:
    own = np.zeros(4096, dtype=np.uint8)
    assert host.register_memory(int(own.ctypes.data), own.size) == 0  # the host's own registration
    eng = MooncakeEngine(BackendConfig(options={"engine": host}), engine_factory=never_called)
    bufs = Buffers(eng)
    try:
        assert set(host.regions) == {int(own.ctypes.data), bufs.src_addr}
        eng.close()
        eng.close()
        assert host.regions == {int(own.ctypes.data): own.size}
        assert engine_double._engines.get(f"127.0.0.1:{host.get_rpc_port()}") is host  # not closed
        assert host.register_memory(bufs.src_addr, bufs.size) == 0  # still usable
        assert host.batch_transfer_sync_write(bufs.session, *(a.tolist() for a in bufs.args())) == 0
        assert bufs.dst[:64].tolist() == bufs.src[:64].tolist()
    finally:
        bufs.close()


# ----------------------------------------------------------------------------- teardown


def test_close_closes_every_host_memory_engine() -> None:
    factory = Factory()
    eng = MooncakeEngine(BackendConfig(), engine_factory=factory)
    bufs = Buffers(eng)
    try:
        assert engine_double._engines.get(eng.endpoint) is factory.made[0]
        eng.write(bufs.session, *bufs.args())
        with pytest.raises(TransferError):  # renews the sender, then fails again
            eng.write(bufs.session, *bufs.args(offset=bufs.size - 8))
        assert eng.renewals == 1 and len(factory.made) == 2
        assert all(e in engine_double._engines.values() for e in factory.made)
        eng.close()
        eng.close()
        assert not [e for e in engine_double._engines.values() if e in factory.made]
    finally:
        bufs.close()


def test_borrow_pins_the_sending_engine_until_the_block_ends() -> None:
    factory = Factory()
    eng = MooncakeEngine(BackendConfig(), engine_factory=factory)
    with eng.borrow() as raw:
        assert raw is factory.made[0]
        eng.close()  # retires the engine; destroying it waits for the borrower
        assert engine_double._engines.get(eng.endpoint) is raw
    assert eng.endpoint not in engine_double._engines
    with pytest.raises(TransferError, match="MooncakeEngine is closed"), eng.borrow():
        pass


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
