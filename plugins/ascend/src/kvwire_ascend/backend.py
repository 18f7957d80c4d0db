"""``ascend``: KV transfers between Ascend NPUs over Mooncake's Ascend transport.

Validates on any machine: nothing heavy is imported until the backend is
created, and :meth:`AscendBackend.availability` explains what is missing
without importing torch_npu (which can break ``import torch`` off-NPU).

It does not support split host/device destinations (``dst_device_kv_indices``,
HiSparse) and declares so: a connection requiring them fails at start-up, and a
call passing them is refused before anything moves. Use ``kvwire-hisparse``.

Options (``BackendConfig.options``):
    ``engine``: ``"ascend"`` (default; torch_npu + Mooncake's Ascend transport) or
        ``"host-double"``, the test seam: an in-process engine double that copies
        host memory, so planning and error paths run on any CPU.
The engine protocol is Mooncake's ``"ascend"`` unless ``BackendConfig.protocol``
names another than the default ``"tcp"`` (so plain TCP cannot be chosen for this
backend: use ``mooncake`` for that). ``BackendConfig.device`` is passed to the
engine as its device name, and a value like ``"npu:3"`` also selects that NPU
for torch_npu. None of this NPU path runs on this repository's CI machines.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import replace
from typing import Any

import numpy as np
from numpy.typing import NDArray

import kvwire
from kvwire import BackendConfig, BackendUnavailableError, ConfigError, KVLayout, UnsupportedFeatureError
from kvwire_ascend.runtime import npu_unavailable_reason
from kvwire_mooncake.transport import KVTransport

__all__ = ["AscendBackend"]

ENGINES = ("ascend", "host-double")


def _engine_factory(config: BackendConfig) -> Callable[[], Any] | None:
    engine = config.option("engine", "ascend")
    if engine == "host-double":
        from kvwire_mooncake.engine_double import HostMemoryEngine

        return HostMemoryEngine
    if engine != "ascend":
        raise ConfigError(f"BackendConfig.options['engine'] must be one of {ENGINES}, got {engine!r}")
    reason = npu_unavailable_reason()
    if reason is not None:
        raise BackendUnavailableError(f"backend 'ascend' (kvwire-ascend) cannot run on this machine: {reason}")
    import torch_npu  # initialises the NPU runtime before the engine touches device memory

    if config.device.startswith("npu:"):  # BackendConfig.device names the NPU, e.g. "npu:3"
        torch_npu.npu.set_device(config.device)
    return None  # the real Mooncake engine, with the Ascend protocol


class AscendBackend:
    """Mooncake's Ascend transport for NPU-resident KV caches; no split destinations."""

    spec_version = "1.2"
    capabilities = frozenset({"layer_ids", "mha", "mla", "host_memory", "device_memory"})

    @classmethod
    def availability(cls) -> str | None:
        return npu_unavailable_reason()

    def __init__(self, config: BackendConfig) -> None:
        factory = _engine_factory(config)
        protocol = "ascend" if config.protocol == "tcp" else config.protocol
        self.transport = KVTransport(replace(config, protocol=protocol), engine_factory=factory)

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
        if dst_device_kv_indices is not None:  # also refused by kvwire.Connection; direct callers get it here
            raise UnsupportedFeatureError(
                "backend 'ascend' does not support split host/device destinations (dst_device_kv_indices); "
                "nothing was sent. Use the 'hisparse' backend (pip install kvwire-hisparse)"
            )
        return self.transport.send(
            session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices, dst_layer_ids, dst_device_kv_indices
        )

    @kvwire.hookimpl
    def close(self) -> None:
        self.transport.close()
