"""In-process backend classes for runtime-registration and connection tests."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Any, Optional

import numpy as np
from numpy.typing import NDArray

import kvwire
from kvwire import BackendConfig, KVLayout


class Recorder:
    """Records every hook call with every argument it received."""

    spec_version = "1.5"
    capabilities = frozenset({"layer_ids", "device_kv_indices", "mha", "mla", "host_memory"})

    def __init__(self, config: BackendConfig) -> None:
        self.config = config
        self.calls: list[tuple[str, dict[str, Any]]] = []

    @kvwire.hookimpl
    def register_kv_buffers(self, layout: KVLayout) -> None:
        self.calls.append(("register_kv_buffers", {"layout": layout}))

    @kvwire.hookimpl
    def endpoint(self) -> str:
        return "recorder://1"

    @kvwire.hookimpl
    def add_peer(self, session_id: str, layout: KVLayout) -> None:
        self.calls.append(("add_peer", {"session_id": session_id, "layout": layout}))

    @kvwire.hookimpl
    def remove_peer(self, session_id: str) -> None:
        self.calls.append(("remove_peer", {"session_id": session_id}))

    @kvwire.hookimpl
    def send_kvcache(
        self,
        session_id: str,
        prefill_kv_indices: NDArray[np.int32],
        dst_kv_ptrs: Sequence[int],
        dst_kv_indices: NDArray[np.int32],
        executor: Optional[Executor],  # noqa: UP045 - the validator must accept Optional[X]
        dst_layer_ids: Sequence[int] | None = None,
        dst_device_kv_indices: NDArray[np.int32] | None = None,
        dst_kv_item_len: int | None = None,
        dst_attn_tp_size: int | None = None,
    ) -> int:
        self.calls.append(("send_kvcache", dict(locals())))
        return 4096

    @kvwire.hookimpl
    def close(self) -> None:
        self.calls.append(("close", {}))


class Recorder11:
    """A spec-1.1 backend: no dst_device_kv_indices."""

    spec_version = "1.1"
    capabilities = frozenset({"layer_ids", "mha", "host_memory"})
    __init__ = Recorder.__init__
    register_kv_buffers = Recorder.register_kv_buffers
    endpoint = Recorder.endpoint
    add_peer = Recorder.add_peer
    close = Recorder.close

    @kvwire.hookimpl
    def send_kvcache(
        self,
        session_id: str,
        prefill_kv_indices: NDArray[np.int32],
        dst_kv_ptrs: Sequence[int],
        dst_kv_indices: NDArray[np.int32],
        executor: Executor | None,
        dst_layer_ids: Sequence[int] | None = None,
    ) -> int:
        self.calls.append(("send_kvcache", dict(locals())))
        return 0


class ReturnsStatus(Recorder):
    """Returns ``returns`` (a status code, a flag) instead of the bytes moved: the bug the spec forbids."""

    returns: object = None

    @kvwire.hookimpl
    def send_kvcache(
        self,
        session_id: str,
        prefill_kv_indices: NDArray[np.int32],
        dst_kv_ptrs: Sequence[int],
        dst_kv_indices: NDArray[np.int32],
        executor: Executor | None,
        dst_layer_ids: Sequence[int] | None = None,
        dst_device_kv_indices: NDArray[np.int32] | None = None,
        dst_kv_item_len: int | None = None,
        dst_attn_tp_size: int | None = None,
    ) -> int:
        return type(self).returns  # type: ignore[return-value]
