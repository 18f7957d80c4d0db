"""KVTransport on the host-memory engine double: registration is all or nothing."""

from __future__ import annotations

import numpy as np
import pytest

from kvwire import BackendConfig, InvalidTransferError, KVBuffer, KVLayout
from kvwire_mooncake.engine_double import HostMemoryEngine
from kvwire_mooncake.transport import KVTransport


def test_failed_registration_rolls_back() -> None:
    transport = KVTransport(BackendConfig(), engine_factory=HostMemoryEngine)
    a, b = np.zeros((4, 64), np.uint8), np.zeros((4, 64), np.uint8)
    first = KVLayout.mha([a], [b])
    transport.register(first)
    assert set(transport.engine.registered) == {(int(a.ctypes.data), a.nbytes), (int(b.ctypes.data), b.nbytes)}
    # Host and device address spaces are separate to the layout, but here they are the same memory:
    # the engine refuses the second (overlapping) registration, after the first succeeded.
    base = int(a.ctypes.data)
    broken = KVLayout((KVBuffer(base, 64, 4, 0, "k"), KVBuffer(base + 64, 64, 2, 0, "k", "device")))
    with pytest.raises(InvalidTransferError, match="overlaps the registered range"):
        transport.register(broken)
    assert transport.layouts.local is None
    assert transport.engine.registered == ()  # the first buffer's registration was rolled back
    transport.close()
