"""``mooncake``: kvwire over Mooncake Transfer Engine (TCP by default, RDMA where NICs exist).

The engine is imported when the backend is created, never when this module is
imported, so ``kvwire check`` validates it on any machine. The spec hooks are
:class:`kvwire.TransportBackend`'s; this module only opens the transport.

Options (``BackendConfig.options``, see :class:`~kvwire_mooncake.options.MooncakeOptions`):
``max_descriptors_per_call``, ``max_inflight_per_peer``, and ``engine`` (a host's
own initialised ``TransferEngine``, used instead of creating one). Protocol,
device and metadata server are ``BackendConfig`` fields (``protocol="rdma"``,
``device="mlx5_0"``, ``metadata_server="http://host:8080/metadata"``).
"""

from __future__ import annotations

import importlib.util

from kvwire import BackendConfig, TransportBackend
from kvwire_mooncake.transport import MooncakeTransport

__all__ = ["MooncakeBackend", "engine_availability"]


def engine_availability() -> str | None:
    """Why the Mooncake engine cannot run here (found without importing it), or None."""
    if importlib.util.find_spec("mooncake") is None:
        return "no Mooncake engine wheel installed (pip install 'kvwire-mooncake[cpu]', or [cuda] / [cuda13])"
    return None


class MooncakeBackend(TransportBackend):
    """Moves KV pages with Mooncake's ``batch_transfer_sync_write``."""

    spec_version = "1.5"
    capabilities = TransportBackend.planned | {"submit", "notifications", "interprocess"}
    capabilities |= {"host_memory", "device_memory"}

    @classmethod
    def availability(cls) -> str | None:
        return engine_availability()

    def open_transport(self, config: BackendConfig) -> MooncakeTransport:
        return MooncakeTransport(config)
