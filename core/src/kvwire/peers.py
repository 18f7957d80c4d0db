"""``LayoutBook``: the local layout and the layouts peers published, and planning between them.

Every backend needs the same bookkeeping before it can move a byte: the layout
it registered, the layout each peer announced through ``add_peer``, and one
call to the core planner between the two. Keeping it here gives every backend
the same checks and the same error messages.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from kvwire.errors import InvalidTransferError
from kvwire.layout import KVLayout
from kvwire.planning import TransferPlan, plan_transfer

__all__ = ["LayoutBook"]


class LayoutBook:
    """The local layout (``local``) and each peer's layout, by session id."""

    def __init__(self) -> None:
        self.local: KVLayout | None = None
        self._peers: dict[str, KVLayout] = {}

    def register(self, layout: KVLayout | None) -> None:
        """Record the local layout (None: nothing registered)."""
        self.local = layout

    def add_peer(self, session_id: str, layout: KVLayout) -> None:
        self._peers[session_id] = layout

    def peer(self, session_id: str) -> KVLayout:
        """The layout ``session_id`` published; InvalidTransferError if it never did."""
        layout = self._peers.get(session_id)
        if layout is None:
            known = ", ".join(sorted(self._peers)) or "none"
            raise InvalidTransferError(
                f"session_id {session_id!r} is unknown: call add_peer(session_id, layout) first (known: {known})"
            )
        return layout

    def plan(
        self,
        session_id: str,
        prefill_kv_indices: NDArray[np.int32],
        dst_kv_ptrs: Sequence[int],
        dst_kv_indices: NDArray[np.int32],
        dst_layer_ids: Sequence[int] | None,
        dst_device_kv_indices: NDArray[np.int32] | None,
    ) -> TransferPlan:
        """Validate and plan one request between the local layout and the peer's (before anything moves)."""
        if self.local is None:
            raise InvalidTransferError("register_kv_buffers() must be called before send_kvcache()")
        return plan_transfer(
            self.local,
            self.peer(session_id),
            prefill_kv_indices,
            dst_kv_ptrs,
            dst_kv_indices,
            dst_layer_ids,
            dst_device_kv_indices,
        )

    def clear(self) -> None:
        self.local = None
        self._peers.clear()
