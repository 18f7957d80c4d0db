"""``hisparse``: split host/device destinations on the Mooncake transport.

HiSparse decode keeps a request's full KV in host DRAM and a hot subset on the
device; the two kinds of buffer have independent page ids. The decode side's
layout says which buffer is which (``KVBuffer.memory``, ``KVLayout.is_split``);
the core's planner sends host buffers to ``dst_kv_indices`` and device buffers
to ``dst_device_kv_indices``. The transport is kvwire-mooncake's; what this
distribution adds is the declared capability, validated as its own class.
"""

from __future__ import annotations

from kvwire import BackendConfig, TransportBackend
from kvwire_mooncake.backend import MooncakeBackend, engine_availability
from kvwire_mooncake.transport import MooncakeTransport

__all__ = ["HiSparseBackend"]


class HiSparseBackend(TransportBackend):
    """Mooncake transport with split host/device destinations."""

    spec_version = "1.5"
    capabilities = MooncakeBackend.capabilities | {"device_kv_indices"}  # the same transport, split destinations

    @classmethod
    def availability(cls) -> str | None:
        return engine_availability()

    def open_transport(self, config: BackendConfig) -> MooncakeTransport:
        return MooncakeTransport(config)
