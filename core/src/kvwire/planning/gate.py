"""``Gate``: the one capability check of a backend, for every kind of feature a call can need.

A layout needs its attention kind and its buffers' memory kinds, a pair of
layouts of different attention-TP sizes needs ``head_slicing``, a send needs the
features of its non-None arguments, a submission ``submit`` and a notification
``notifications``. The Connection and :class:`kvwire.TransportBackend` each hold
one Gate (the Connection over the capabilities the registry resolved, the base
over the class's declaration), so a direct caller of a backend gets the refusal
a Connection gives, in the same words.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvwire.layout.kv_layout import KVLayout
from kvwire.planning.head_slicing import needs_head_slicing
from kvwire.spec.capabilities import MEMORY_FEATURES, refuse_lacking

__all__ = ["Gate"]


class Gate:
    """Refuses, with :class:`kvwire.UnsupportedFeatureError`, what needs a feature ``declared`` lacks."""

    def __init__(self, backend: str, declared: frozenset[str]) -> None:
        self.backend = backend  # as messages show it, e.g. "'mooncake' (spec 1.5)"
        self.declared = declared

    def require(self, features: Iterable[str], why: str | None = None) -> None:
        """Refuse ``features`` the backend lacks; ``why`` says what needed them (default: the parameters)."""
        if not self.declared.issuperset(features):
            refuse_lacking(self.backend, self.declared, features, why)

    def layout(self, layout: KVLayout, what: str) -> None:
        """A layout needs its attention kind and the memory kind of each of its buffers."""
        self.require({layout.attention}, f"{what} ({layout.attention.upper()} buffers)")
        for kind in sorted({b.memory for b in layout.buffers}):
            self.require({MEMORY_FEATURES[kind]}, f"{what} ({kind} buffers)")

    def pair(self, local: KVLayout, peer: KVLayout, session_id: str) -> None:
        """Different attention-TP sizes on the two sides need head slicing (checked before the first send)."""
        if needs_head_slicing(local, peer):
            self.require(
                {"head_slicing"},
                f"peer {session_id!r}: attention TP size {local.attn_tp_size} here, {peer.attn_tp_size} there",
            )
