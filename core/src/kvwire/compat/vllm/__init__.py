"""vLLM: ``KvwireConnector``, a ``KVConnectorBase_V1`` that moves KV blocks through any kvwire backend.

    --kv-transfer-config '{"kv_connector": "KvwireConnector", "kv_connector_module_path": "kvwire.compat.vllm",
                           "kv_role": "kv_producer", "kv_connector_extra_config": {"backend": "nixl"}}'

(docs/vllm.md has the recipe.) Only :mod:`~kvwire.compat.vllm.connector` and the
:mod:`~kvwire.compat.vllm.stats` it imports import vLLM, when ``KvwireConnector`` is first looked up, so
everything else here is checked without vLLM:

- :mod:`~kvwire.compat.vllm.layout`: vLLM's per-layer KV tensors as a :class:`~kvwire.KVLayout`;
- :mod:`~kvwire.compat.vllm.settings`: the keys of ``kv_connector_extra_config``;
- :mod:`~kvwire.compat.vllm.params`: the ``kv_transfer_params`` from the prefill to the decode;
- :mod:`~kvwire.compat.vllm.metadata`: what the scheduler side hands the workers each step;
- :mod:`~kvwire.compat.vllm.registration` and :mod:`~kvwire.compat.vllm.channel`: the decode's
  registration and the side channel it travels on;
- :mod:`~kvwire.compat.vllm.notices`: the prefill's notice that a write it had accepted failed;
- :mod:`~kvwire.compat.vllm.telemetry`: what the transfers did, for vLLM's metrics (``stats``, which imports
  vLLM, wraps it in vLLM's ``KVConnectorStats`` and ``vllm:kvwire_*`` Prometheus metrics);
- :mod:`~kvwire.compat.vllm.scheduler`, :mod:`~kvwire.compat.vllm.sending`,
  :mod:`~kvwire.compat.vllm.receiving`, :mod:`~kvwire.compat.vllm.worker`: the two sides' logic.
"""

from __future__ import annotations

from typing import Any

from kvwire.compat.vllm.layout import VllmLayout, layout_from_kv_caches
from kvwire.compat.vllm.params import RemotePrefill, parse_remote_prefill, prefill_params
from kvwire.compat.vllm.settings import ConnectorSettings

__all__ = [
    "ConnectorSettings",
    "KvwireConnector",
    "RemotePrefill",
    "VllmLayout",
    "layout_from_kv_caches",
    "parse_remote_prefill",
    "prefill_params",
]


def __getattr__(name: str) -> Any:
    """``KvwireConnector`` (and its metadata type) on first use: importing them imports vLLM."""
    if name in ("KvwireConnector", "KvwireConnectorMetadata"):
        try:
            from kvwire.compat.vllm import connector
        except ModuleNotFoundError as exc:
            if exc.name is None or not exc.name.startswith(("vllm", "torch")):
                raise
            missing = exc.name.split(".")[0]
            raise ModuleNotFoundError(
                f"kvwire.compat.vllm.{name} subclasses vLLM's KVConnectorBase_V1, and {missing!r} is not "
                "installed here: install vLLM in this environment (the rest of kvwire.compat.vllm works without it)",
                name=exc.name,
            ) from exc
        return getattr(connector, name)
    raise AttributeError(f"module 'kvwire.compat.vllm' has no attribute {name!r}")
