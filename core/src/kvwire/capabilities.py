"""Feature names a backend may declare in ``capabilities``.

A feature is either tied to a ``send_kvcache`` parameter (the backend honours
that argument) or to a layout property (attention kind, memory kind). Asking
for a feature a backend lacks is an error, never a silent no-op.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

__all__ = ["FEATURES", "FEATURE_DISTRIBUTIONS", "PARAMETER_FEATURES"]

#: Every known feature name, with what it promises.
FEATURES: Mapping[str, str] = MappingProxyType(
    {
        "layer_ids": "honours dst_layer_ids (pipeline-parallel layer mapping)",
        "device_kv_indices": "honours dst_device_kv_indices (HiSparse split host/device destinations)",
        "mha": "moves MHA layouts (K and V buffer per layer)",
        "mla": "moves MLA layouts (one latent-KV buffer per layer)",
        "host_memory": "sends from / receives into host DRAM buffers",
        "device_memory": "sends from / receives into accelerator memory buffers",
    }
)

#: send_kvcache parameter -> the feature that makes a non-None value meaningful.
PARAMETER_FEATURES: Mapping[str, str] = MappingProxyType(
    {"dst_layer_ids": "layer_ids", "dst_device_kv_indices": "device_kv_indices"}
)

#: Features whose reference implementation ships as its own distribution (named in errors).
FEATURE_DISTRIBUTIONS: Mapping[str, str] = MappingProxyType({"device_kv_indices": "kvwire-hisparse"})
