"""``hisparse``: split host/device destinations on the Mooncake transport.

HiSparse decode keeps a request's full KV in host DRAM and a hot subset on the
device; the two kinds of buffer have independent page ids. The decode side's
layout says which buffer is which (``KVBuffer.memory``); the core's planner
sends host buffers to ``dst_kv_indices`` and device buffers to
``dst_device_kv_indices``. This backend composes :class:`KVTransport` from
kvwire-mooncake (no subclassing, so no inherited signature to drift from).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor

import numpy as np
from numpy.typing import NDArray

import kvwire
from kvwire import BackendConfig, KVLayout
from kvwire_mooncake.backend import engine_availability
from kvwire_mooncake.transport import KVTransport

__all__ = ["HiSparseBackend"]


class HiSparseBackend:
    """Mooncake transport with split host/device destinations."""

    spec_version = "1.2"
    capabilities = frozenset({"layer_ids", "device_kv_indices", "mha", "mla", "host_memory", "device_memory"})

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
