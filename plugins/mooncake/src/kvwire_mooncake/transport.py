"""``KVTransport``: the Mooncake-backed send path, shared by composition.

It owns one :class:`MooncakeEngine` and a :class:`kvwire.peers.LayoutBook`,
and turns a ``send_kvcache`` call into one core plan and chunked engine
writes. The ``mooncake`` and ``hisparse`` backends both delegate to it, so
neither carries its own copy of the send path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire import BackendConfig, KVLayout
from kvwire.peers import LayoutBook
from kvwire_mooncake.engine import MooncakeEngine

__all__ = ["KVTransport"]


class KVTransport:
    """Local buffers, peer layouts and the engine; ``send`` plans with the core and writes."""

    def __init__(self, config: BackendConfig, *, engine_factory: Callable[[], Any] | None = None) -> None:
        self.config = config
        self.engine = MooncakeEngine(config, engine_factory=engine_factory)
        self.layouts = LayoutBook()

    def register(self, layout: KVLayout) -> None:
        """Register every buffer of ``layout`` with the engine, replacing a previous layout.

        All or nothing: if one buffer cannot be registered, those registered so far are
        unregistered again and no layout is recorded (the previous one is already gone).
        """
        if self.layouts.local is not None:
            self.engine.unregister_all()
            self.layouts.register(None)
        done: list[int] = []
        try:
            for buf in layout.buffers:
                self.engine.register(buf.base, buf.nbytes)
                done.append(buf.base)
        except BaseException:
            for base in done:
                self.engine.unregister(base)
            raise
        self.layouts.register(layout)

    def add_peer(self, session_id: str, layout: KVLayout) -> None:
        self.layouts.add_peer(session_id, layout)

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
        plan = self.layouts.plan(
            session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices, dst_layer_ids, dst_device_kv_indices
        )
        if len(plan):
            self.engine.write(session_id, plan.src, plan.dst, plan.length)  # checks local sources first
        return plan.nbytes

    def close(self) -> None:
        self.engine.close()
        self.layouts.clear()
