"""``local``: the reference backend, moving bytes between buffers of one process.

It supports every capability and does exactly what the spec says with the
core's planning and nothing else, so it is the yardstick the contract test kit
is run against. Its endpoints live in one process-wide directory; a peer's
published layout must equal the layout that endpoint actually registered.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import Executor

import numpy as np
from numpy.typing import NDArray

from kvwire.config import BackendConfig
from kvwire.errors import InvalidTransferError, PeerUnreachableError
from kvwire.layout import KVLayout
from kvwire.markers import hookimpl
from kvwire.peers import LayoutBook
from kvwire.planning import TransferPlan

__all__ = ["LocalBackend"]

_directory: weakref.WeakValueDictionary[str, LocalBackend] = weakref.WeakValueDictionary()
_counter = itertools.count(1)
_lock = threading.Lock()


def apply_plan(plan: TransferPlan) -> None:
    """Copy every descriptor of ``plan`` with memmove (addresses were bounds-checked by planning)."""
    for src, dst, length in zip(plan.src.tolist(), plan.dst.tolist(), plan.length.tolist()):
        ctypes.memmove(dst, src, length)


class LocalBackend:
    """In-process transfers; every feature supported."""

    spec_version = "1.2"
    capabilities = frozenset({"layer_ids", "device_kv_indices", "mha", "mla", "host_memory", "device_memory"})

    def __init__(self, config: BackendConfig) -> None:
        self.config = config
        self._layouts = LayoutBook()
        with _lock:
            self._endpoint = f"local://{os.getpid()}/{next(_counter)}"
            _directory[self._endpoint] = self

    @hookimpl
    def register_kv_buffers(self, layout: KVLayout) -> None:
        self._layouts.register(layout)

    @hookimpl
    def endpoint(self) -> str:
        return self._endpoint

    @hookimpl
    def add_peer(self, session_id: str, layout: KVLayout) -> None:
        self._layouts.add_peer(session_id, layout)

    @hookimpl
    def send_kvcache(
        self,
        session_id: str,
        prefill_kv_indices: NDArray[np.int32],
        dst_kv_ptrs: Sequence[int],
        dst_kv_indices: NDArray[np.int32],
        executor: Executor | None,
        dst_layer_ids: Sequence[int] | None = None,
        dst_device_kv_indices: NDArray[np.int32] | None = None,
    ) -> int:
        plan = self._layouts.plan(
            session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices, dst_layer_ids, dst_device_kv_indices
        )
        peer = _directory.get(session_id)
        if peer is None:
            raise PeerUnreachableError(
                f"local endpoint {session_id!r} is not in this process or was closed (the local backend only "
                "reaches endpoints of its own process)",
                peer=session_id,
            )
        if peer._layouts.local != self._layouts.peer(session_id):
            raise InvalidTransferError(
                f"session_id {session_id!r}: the layout given to add_peer differs from the one the peer registered"
            )
        apply_plan(plan)
        return plan.nbytes

    @hookimpl
    def close(self) -> None:
        with _lock:
            if _directory.get(self._endpoint) is self:
                del _directory[self._endpoint]
        self._layouts.clear()
