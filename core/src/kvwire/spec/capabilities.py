"""Feature names a backend may declare in ``capabilities``.

A feature is tied to a ``send_kvcache`` parameter (the backend honours that
argument), to an optional hook (the backend implements it), or to a layout or
transport property (attention kind, memory kind). Asking for a feature a
backend lacks is an error, never a silent no-op.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from kvwire.errors import UnsupportedFeatureError
from kvwire.layout.buffers import MemoryKind
from kvwire.spec.history import PARAMETER_FEATURES, SPEC_HISTORY

__all__ = [
    "CAPABILITY_REQUIREMENTS",
    "FEATURES",
    "FEATURE_DISTRIBUTIONS",
    "MEMORY_FEATURES",
    "PARAMETER_FEATURES",
    "RETIRED_FEATURES",
    "Requirement",
    "parameters_for",
    "refuse_lacking",
]

#: Features of the layout (attention kind, memory kind) and of the transport itself.
_OTHER_FEATURES: Mapping[str, str] = {
    "mha": "moves MHA layouts (K and V buffer per layer)",
    "mla": "moves MLA layouts (one latent-KV buffer per layer)",
    "host_memory": "sends from / receives into host DRAM buffers",
    "device_memory": "sends from / receives into accelerator memory buffers",
    "interprocess": "reaches peers in other processes and on other hosts",
    "head_slicing": "sends head slices per token: prefill and decode with different attention TP sizes",
}

#: Names that were features and are not any more: a backend may still declare them (nothing is checked or
#: promised); what each became.
RETIRED_FEATURES: Mapping[str, str] = MappingProxyType(
    {
        "raw_write": "a bench seam, not a capability: Connection.raw_write works for a kvwire.TransportBackend "
        "whose transport implements kvwire.RawWriter (raw_write(session_id, plan))",
    }
)


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


@dataclass(frozen=True)
class Requirement:
    """What declaring one feature obliges a backend to implement.

    ``hooks``: hooks of a backend written against the hook spec; ``transport``:
    methods of the :class:`kvwire.Transport` of a :class:`kvwire.TransportBackend`
    (whose hooks the base already implements).
    """

    hooks: tuple[str, ...] = ()
    transport: tuple[str, ...] = ()


def _requirements() -> dict[str, Requirement]:
    table: dict[str, Requirement] = {}
    for release in SPEC_HISTORY:
        for h in release.optional_hooks:
            known = table.get(h.feature, Requirement())
            table[h.feature] = Requirement((*known.hooks, h.name), (*known.transport, h.transport))
    return table


#: Feature -> what a backend declaring it must implement: the one table the validator reads.
CAPABILITY_REQUIREMENTS: Mapping[str, Requirement] = MappingProxyType(_requirements())


def parameters_for(features: Iterable[str]) -> list[str]:
    """The ``send_kvcache`` parameters that need ``features``, in spec order."""
    wanted = set(features)
    return [p for p, f in PARAMETER_FEATURES.items() if f in wanted]


def refuse_lacking(backend: str, declared: frozenset[str], used: Iterable[str], why: str | None = None) -> None:
    """The one capability gate: UnsupportedFeatureError when ``used`` holds a feature ``declared`` lacks.

    ``backend`` names the backend as the message shows it; ``why`` says what needed
    the features (default: the ``send_kvcache`` parameters that use them).
    """
    lacking = sorted(set(used) - declared)
    if not lacking:
        return
    needed_for = why if why is not None else ", ".join(parameters_for(lacking))
    providers = sorted({FEATURE_DISTRIBUTIONS[f] for f in lacking if f in FEATURE_DISTRIBUTIONS})
    hint = f". Use a backend that supports it (pip install {' '.join(providers)})" if providers else ""
    raise UnsupportedFeatureError(
        f"backend {backend} does not support {', '.join(map(repr, lacking))}, needed for {needed_for}; "
        f"nothing was sent{hint}"
    )
