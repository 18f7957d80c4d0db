"""``mooncake``: kvwire over Mooncake Transfer Engine (TCP by default, RDMA where NICs exist).

The engine is imported when the backend is created, never when this module is
imported, so ``kvwire check`` validates it on any machine. Address arithmetic
is the core's; chunking, the in-flight bound, timeouts and error mapping are
:class:`~kvwire_mooncake.engine.MooncakeEngine`'s.

Options (``BackendConfig.options``): none yet; protocol, device and metadata
server are ``BackendConfig`` fields (``protocol="rdma"``, ``device="mlx5_0"``,
``metadata_server="http://host:8080/metadata"``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from concurrent.futures import Executor

import numpy as np
from numpy.typing import NDArray

import kvwire
from kvwire import BackendConfig, KVLayout
from kvwire_mooncake.transport import KVTransport

__all__ = ["MooncakeBackend", "engine_availability"]


def engine_availability() -> str | None:
    """Why the Mooncake engine cannot run here (found without importing it), or None."""
    if importlib.util.find_spec("mooncake") is None:
        return "no Mooncake engine wheel installed (pip install 'kvwire-mooncake[cpu]', or [cuda] / [cuda13])"
    return None


class MooncakeBackend:
    """Moves KV pages with Mooncake's ``batch_transfer_sync_write``."""

    spec_version = "1.2"
    capabilities = frozenset({"layer_ids", "mha", "mla", "host_memory", "device_memory"})

    @classmethod
    def availability(cls) -> str | None:
        return engine_availability()

    def __init__(self, config: BackendConfig) -> None:
        self.transport = KVTransport(config)

    @kvwire.hookimpl
    def register_kv_buffers(self, layout: KVLayout) -> None:
        self.transport.register(layout)

    @kvwire.hookimpl
    def endpoint(self) -> str:
        return self.transport.engine.endpoint

    @kvwire.hookimpl
    def add_peer(self, session_id: str, layout: KVLayout) -> None:
        self.transport.add_peer(session_id, layout)

    @kvwire.hookimpl
    def send_kvcache(
        self,
        session_id: str,
        prefill_kv_indices: NDArray[np.int32],
        dst_kv_ptrs: Sequence[int],
        dst_kv_indices: NDArray[np.int32],
        executor: Executor | None,
        dst_layer_ids: Sequence[int] | None = None,
        dst_device_kv_indices: NDArray[np.int32] | None = None,
    ) -> int:
        return self.transport.send(
            session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices, dst_layer_ids, dst_device_kv_indices
        )

    @kvwire.hookimpl
    def close(self) -> None:
        self.transport.close()
