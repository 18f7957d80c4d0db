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

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from kvwire import BackendConfig, BackendUnavailableError, ConfigError, TransportBackend
from kvwire_ascend.runtime import npu_unavailable_reason
from kvwire_mooncake.transport import MooncakeTransport

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


class AscendBackend(TransportBackend):
    """Mooncake's Ascend transport for NPU-resident KV caches; no split destinations."""

    spec_version = "1.5"
    capabilities = TransportBackend.planned | {"submit", "interprocess", "host_memory", "device_memory"}

    @classmethod
    def availability(cls) -> str | None:
        return npu_unavailable_reason()

    def open_transport(self, config: BackendConfig) -> MooncakeTransport:
        factory = _engine_factory(config)
        protocol = "ascend" if config.protocol == "tcp" else config.protocol
        options = {k: v for k, v in config.options.items() if k != "engine"}  # ours, not the Mooncake engine's
        return MooncakeTransport(replace(config, protocol=protocol, options=options), engine_factory=factory)
