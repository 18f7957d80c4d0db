"""vLLM: ``KvwireConnector``, a ``KVConnectorBase_V1`` that moves KV blocks through any kvwire backend.

    --kv-transfer-config '{"kv_connector": "KvwireConnector", "kv_connector_module_path": "kvwire.hosts.vllm",
                           "kv_role": "kv_producer", "kv_connector_extra_config": {"backend": "nixl"}}'

(docs/vllm.md has the recipe.) Only :mod:`~kvwire.hosts.vllm.connector` and the
:mod:`~kvwire.hosts.vllm.stats` it imports import vLLM, when ``KvwireConnector`` is first looked up, so
everything else here is checked without vLLM:

- :mod:`~kvwire.hosts.vllm.layout`: vLLM's per-layer KV tensors as a :class:`~kvwire.KVLayout`;
- :mod:`~kvwire.hosts.vllm.settings`: the keys of ``kv_connector_extra_config``;
- :mod:`~kvwire.hosts.vllm.params`: the ``kv_transfer_params`` from the prefill to the decode;
- :mod:`~kvwire.hosts.vllm.metadata`: what the scheduler side hands the workers each step;
- :mod:`~kvwire.hosts.vllm.registration` and :mod:`~kvwire.hosts.vllm.channel`: the decode's
  registration and the side channel it travels on;
- :mod:`~kvwire.hosts.vllm.notices`: the prefill's notice that a write it had accepted failed;
- :mod:`~kvwire.hosts.vllm.telemetry`: what the transfers did, for vLLM's metrics (``stats``, which imports
  vLLM, wraps it in vLLM's ``KVConnectorStats`` and ``vllm:kvwire_*`` Prometheus metrics);
- :mod:`~kvwire.hosts.vllm.scheduler`, :mod:`~kvwire.hosts.vllm.sending`,
  :mod:`~kvwire.hosts.vllm.receiving`, :mod:`~kvwire.hosts.vllm.worker`: the two sides' logic.
"""

from __future__ import annotations

from typing import Any

from kvwire.hosts.vllm.layout import VllmLayout, layout_from_kv_caches
from kvwire.hosts.vllm.params import RemotePrefill, parse_remote_prefill, prefill_params
from kvwire.hosts.vllm.settings import ConnectorSettings

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
            from kvwire.hosts.vllm import connector
        except ModuleNotFoundError as exc:
            if exc.name is None or not exc.name.startswith(("vllm", "torch")):
                raise
            missing = exc.name.split(".")[0]
            raise ModuleNotFoundError(
                f"kvwire.hosts.vllm.{name} subclasses vLLM's KVConnectorBase_V1, and {missing!r} is not "
                "installed here: install vLLM in this environment (the rest of kvwire.hosts.vllm works without it)",
                name=exc.name,
            ) from exc
        return getattr(connector, name)
    raise AttributeError(f"module 'kvwire.hosts.vllm' has no attribute {name!r}")
