"""``KVTransport``: the Mooncake-backed send path, shared by composition.

It owns one :class:`MooncakeEngine`, the local layout and the peers' layouts,
and turns a ``send_kvcache`` call into one core plan and chunked engine
writes. The ``mooncake`` and ``hisparse`` backends both delegate to it, so
neither carries its own copy of the send path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire import BackendConfig, InvalidTransferError, KVLayout
from kvwire.planning import TransferPlan, plan_transfer
from kvwire_mooncake.engine import MooncakeEngine

__all__ = ["KVTransport"]


class KVTransport:
    """Local buffers, peer layouts and the engine; ``send`` plans with the core and writes."""

    def __init__(self, config: BackendConfig, *, engine_factory: Callable[[], Any] | None = None) -> None:
        self.config = config
        self.engine = MooncakeEngine(config, engine_factory=engine_factory)
        self.layout: KVLayout | None = None
        self.peers: dict[str, KVLayout] = {}

    def register(self, layout: KVLayout) -> None:
        """Register every buffer of ``layout`` with the engine, replacing a previous layout.

        All or nothing: if one buffer cannot be registered, those registered so far are
        unregistered again and no layout is recorded (the previous one is already gone).
        """
        if self.layout is not None:
            self.engine.unregister_all()
            self.layout = None
        done: list[int] = []
        try:
            for buf in layout.buffers:
                self.engine.register(buf.base, buf.nbytes)
                done.append(buf.base)
        except BaseException:
            for base in done:
                self.engine.unregister(base)
            raise
        self.layout = layout

    def add_peer(self, session_id: str, layout: KVLayout) -> None:
        self.peers[session_id] = layout

    def plan(
        self,
        session_id: str,
        prefill_kv_indices: NDArray[np.int32],
        dst_kv_ptrs: Sequence[int],
        dst_kv_indices: NDArray[np.int32],
        dst_layer_ids: Sequence[int] | None,
        dst_device_kv_indices: NDArray[np.int32] | None,
    ) -> TransferPlan:
        """Validate and plan one request (raises before anything moves)."""
        if self.layout is None:
            raise InvalidTransferError("register_kv_buffers() must be called before send_kvcache()")
        peer = self.peers.get(session_id)
        if peer is None:
            known = ", ".join(sorted(self.peers)) or "none"
            raise InvalidTransferError(
                f"session_id {session_id!r} is unknown: call add_peer(session_id, layout) first (known: {known})"
            )
        return plan_transfer(
            self.layout, peer, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices, dst_layer_ids, dst_device_kv_indices
        )

    def send(
        self,
        session_id: str,
        prefill_kv_indices: NDArray[np.int32],
        dst_kv_ptrs: Sequence[int],
        dst_kv_indices: NDArray[np.int32],
        dst_layer_ids: Sequence[int] | None,
        dst_device_kv_indices: NDArray[np.int32] | None,
    ) -> int:
        """Plan (validating both layouts), then write (checking local sources); returns the bytes moved."""
        plan = self.plan(
            session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices, dst_layer_ids, dst_device_kv_indices
        )
        if len(plan):
            self.engine.write(session_id, plan.src, plan.dst, plan.length)  # checks local sources first
        return plan.nbytes

    def close(self) -> None:
        self.engine.close()
        self.layout = None
        self.peers.clear()
