"""``nixl``: kvwire over NIXL (UCX: shared memory on one host, RDMA and GPU memory across hosts).

NIXL is imported when the backend is created, never when this module is
imported, so ``kvwire check`` validates it on any machine. The spec hooks are
:class:`kvwire.TransportBackend`'s; this module only opens the transport.
Options: see :mod:`kvwire_nixl.options`.
"""

from __future__ import annotations

import kvwire
from kvwire_nixl.locate import nixl_availability
from kvwire_nixl.transport import NixlTransport

__all__ = ["NixlBackend"]


class NixlBackend(kvwire.TransportBackend):
    """Moves KV pages with NIXL WRITE transfers (one agent per instance, descriptor tables as arrays)."""

    spec_version = "1.5"
    capabilities = kvwire.TransportBackend.planned | {"submit", "notifications", "interprocess"}
    capabilities |= {"host_memory", "device_memory", "device_kv_indices"}  # and split (HiSparse) destinations

    @classmethod
    def availability(cls) -> str | None:
        """Why NIXL cannot run here (found without importing it), or None."""
        return nixl_availability()

    def open_transport(self, config: kvwire.BackendConfig) -> NixlTransport:
        return NixlTransport(config)
