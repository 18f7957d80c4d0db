"""Feature names a backend may declare in ``capabilities``.

A feature is tied to a ``send_kvcache`` parameter (the backend honours that
argument), to an optional hook (the backend implements it), or to a layout or
transport property (attention kind, memory kind). Asking for a feature a
backend lacks is an error, never a silent no-op.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from kvwire.layout import MemoryKind
from kvwire.spec import PARAMETER_FEATURES, SPEC_HISTORY

__all__ = ["FEATURES", "FEATURE_DISTRIBUTIONS", "MEMORY_FEATURES", "PARAMETER_FEATURES"]

#: Features of the layout (attention kind, memory kind) and of the transport itself.
_OTHER_FEATURES: Mapping[str, str] = {
    "mha": "moves MHA layouts (K and V buffer per layer)",
    "mla": "moves MLA layouts (one latent-KV buffer per layer)",
    "host_memory": "sends from / receives into host DRAM buffers",
    "device_memory": "sends from / receives into accelerator memory buffers",
    "interprocess": "reaches peers in other processes and on other hosts",
    "head_slicing": "sends head slices per token: prefill and decode with different attention TP sizes",
    "raw_write": "offers Connection.raw_write: the bare engine call on a plan (benchmarks compare against it)",
}

def _hook_features() -> dict[str, str]:
    hooks: dict[str, list[str]] = {}
    for release in SPEC_HISTORY:
        for h in release.optional_hooks:
            hooks.setdefault(h.feature, []).append(f"{h.name} ({h.purpose})")
    return {feature: "implements " + "; ".join(names) for feature, names in hooks.items()}


#: Every known feature name, with what it promises (parameter features come from the spec history).
FEATURES: Mapping[str, str] = MappingProxyType(
    {
        **{
            p.feature: f"honours {p.name} ({p.purpose})"
            for release in SPEC_HISTORY
            for p in release.added
            if p.feature is not None
        },
        **_hook_features(),
        **_OTHER_FEATURES,
    }
)

#: The feature a backend needs to register or address buffers of each memory kind.
MEMORY_FEATURES: Mapping[MemoryKind, str] = MappingProxyType({"host": "host_memory", "device": "device_memory"})

#: Features whose reference implementation ships as its own distribution (named in errors).
FEATURE_DISTRIBUTIONS: Mapping[str, str] = MappingProxyType({"device_kv_indices": "kvwire-hisparse"})
