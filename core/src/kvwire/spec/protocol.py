"""``BackendProtocol``: the current backend spec as a typed ``Protocol``, for static drift checks.

A backend author checks a class with mypy in their own repository, before
anything is installed or imported::

    import kvwire

    def _check(backend: MyBackend) -> kvwire.BackendProtocol:
        return backend  # mypy --strict prints both signatures of a hook that drifted

(or ``_check: type[kvwire.BackendProtocol] = MyBackend``, which reports the
same drift in one line without the signatures). mypy then reports a missing
hook, a missing parameter, an extra required one, parameters out of order, a
renamed parameter and a wrong annotation. It does not compare default values
(only that a default exists): ``dst_layer_ids = ()`` instead of ``None`` passes
mypy and is reported by the load-time validator (``kvwire check``); so is an
extra optional parameter at the end, which a static type cannot refuse.

Each hook with parameters is declared twice (overloads): positionally, which
checks the order, and keyword-only, which checks the names (mypy ignores the
names of positional parameters when it matches a protocol, and pluggy passes
hook arguments by name). The implementation after the overloads is the one
declaration of each required hook: :class:`kvwire.spec.hooks.BackendSpec` marks
these very functions as hookspecs, so the static type and pluggy's spec cannot
differ.

The protocol is the current spec's required hooks only: a backend declaring
an older version loads adapted on purpose and is not meant to satisfy it, and
the optional hooks of spec 1.5 (``submit_kvcache``, ``send_notification``,
``poll_notifications``) cannot be expressed as optional members of a
``Protocol``; the load-time validator checks them when a backend has them.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Protocol, overload

import numpy as np
from numpy.typing import NDArray

from kvwire.layout.kv_layout import KVLayout

__all__ = ["BackendProtocol"]


class BackendProtocol(Protocol):
    """The required hooks of spec 1.5: names, order, annotations and the presence of defaults."""

    @overload
    def register_kv_buffers(self, layout: KVLayout) -> None: ...
    @overload
    def register_kv_buffers(self, *, layout: KVLayout) -> None: ...
    def register_kv_buffers(self, layout: KVLayout) -> None:
        """Register the local KV memory this endpoint sends from or receives into."""

    def endpoint(self) -> str:
        """The id peers pass as ``session_id`` to reach this endpoint."""
        raise NotImplementedError

    @overload
    def add_peer(self, session_id: str, layout: KVLayout) -> None: ...
    @overload
    def add_peer(self, *, session_id: str, layout: KVLayout) -> None: ...
    def add_peer(self, session_id: str, layout: KVLayout) -> None:
        """Learn a peer's KV layout (published by the peer) before sending to it."""

    @overload
    def remove_peer(self, session_id: str) -> None: ...
    @overload
    def remove_peer(self, *, session_id: str) -> None: ...
    def remove_peer(self, session_id: str) -> None:
        """Forget a peer: its layout and the engine's per-peer resources (spec 1.4); unknown ids are a no-op."""

    @overload
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
    ) -> int: ...
    @overload
    def send_kvcache(
        self,
        *,
        session_id: str,
        prefill_kv_indices: NDArray[np.int32],
        dst_kv_ptrs: Sequence[int],
        dst_kv_indices: NDArray[np.int32],
        executor: Executor | None,
        dst_layer_ids: Sequence[int] | None = None,
        dst_device_kv_indices: NDArray[np.int32] | None = None,
        dst_kv_item_len: int | None = None,
        dst_attn_tp_size: int | None = None,
    ) -> int: ...
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
        """Write the pages ``prefill_kv_indices`` into the peer; return the bytes moved.

        The parameters follow sglang's ``MooncakeKVManager.send_kvcache`` (0.5.18+),
        with ``session_id`` for its ``mooncake_session_id``. Failures raise
        :class:`kvwire.TransferError` (or a subclass), never a status code.
        """
        raise NotImplementedError

    def close(self) -> None:
        """Release engine resources and unregister memory; idempotent."""
