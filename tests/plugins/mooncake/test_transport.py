"""MooncakeTransport under the backend base, on the host-memory engine double: registration is all or nothing."""

from __future__ import annotations

import numpy as np
import pytest

from kvwire import BackendConfig, InvalidTransferError, KVBuffer, KVLayout
from kvwire_mooncake.backend import MooncakeBackend
from kvwire_mooncake.engine_double import HostMemoryEngine
from kvwire_mooncake.transport import MooncakeTransport


class DoubleBacked(MooncakeBackend):
    def open_transport(self, config: BackendConfig) -> MooncakeTransport:
        return MooncakeTransport(config, engine_factory=HostMemoryEngine)


def test_failed_registration_rolls_back() -> None:
    backend = DoubleBacked(BackendConfig())
    assert isinstance(backend.transport, MooncakeTransport)
    engine = backend.transport.engine
    a, b = np.zeros((4, 64), np.uint8), np.zeros((4, 64), np.uint8)
    backend.register_kv_buffers(KVLayout.mha([a], [b]))
    assert set(engine.registered) == {(int(a.ctypes.data), a.nbytes), (int(b.ctypes.data), b.nbytes)}
    # Host and device address spaces are separate to the layout, but here they are the same memory:
    # the engine wrapper refuses the second (overlapping) registration, after the first succeeded.
    base = int(a.ctypes.data)
    broken = KVLayout((KVBuffer(base, 64, 4, 0, "k"), KVBuffer(base + 64, 64, 2, 0, "k", "device")))
    with pytest.raises(InvalidTransferError, match="overlaps the registered range"):
        backend.register_kv_buffers(broken)
    assert engine.registered == ()  # the first buffer's registration was rolled back
    with pytest.raises(InvalidTransferError, match=r"register_kv_buffers\(\) must be called"):
        backend.send_kvcache("p", np.array([1], np.int32), [base], np.array([1], np.int32), None)
    backend.close()
