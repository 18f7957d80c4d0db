"""sglang: ``MooncakeKVManager.send_kvcache`` through a kvwire :class:`~kvwire.Connection`.

:class:`KvwireSendMixin` has exactly the parameter list of sglang's
``MooncakeKVManager.send_kvcache`` (0.5.18 to 0.5.23, names and annotations as
sglang writes them; a test reads sglang's released wheel to keep it so). Mixed
into sglang's manager, it sends through ``self.kvwire_connection`` and answers
the way sglang's transfer worker expects: ``0`` on success, a non-zero status
on failure (``if ret != 0`` marks the session failed), with the typed kvwire
error logged; it never raises into the worker loop for a transfer failure.

:func:`layout_from_kv_args` builds the :class:`~kvwire.KVLayout` of one side
from sglang's ``KVArgs`` fields. Nothing here imports sglang.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Mapping, Sequence
from typing import List, Literal, Optional  # noqa: UP035 - sglang's annotations, verbatim

import numpy as np
import numpy.typing as npt

from kvwire.connection import Connection
from kvwire.errors import InvalidTransferError, KvwireError, PeerUnreachableError, TransferTimeoutError
from kvwire.layout.buffers import HeadLayout, KVBuffer, LayoutError, MemoryKind, Role
from kvwire.layout.kv_layout import KVLayout

__all__ = [
    "STATUS_CODES",
    "KvwireSendMixin",
    "SglangSender",
    "layer_ids_from_sglang",
    "layout_from_kv_args",
    "status_of",
]

log = logging.getLogger("kvwire.compat.sglang")

#: The non-zero status returned for each kvwire error class (most specific first); anything else is -1.
STATUS_CODES: Mapping[type[KvwireError], int] = {
    InvalidTransferError: -22,  # bad input, refused before any byte moved
    TransferTimeoutError: -110,  # the peer did not complete in time
    PeerUnreachableError: -102,  # Mooncake's ERR_SOCKET: dead or unknown peer
}


def status_of(error: KvwireError) -> int:
    """The status :meth:`KvwireSendMixin.send_kvcache` returns for ``error`` (never 0)."""
    for cls, code in STATUS_CODES.items():
        if isinstance(error, cls):
            return code
    return -1


def layer_ids_from_sglang(ids: Sequence[int] | None, name: str = "dst_layer_ids") -> list[int] | None:
    """kvwire's layer ids (one per layer, or None for positional) from a list as sglang builds it.

    sglang's ``build_kv_layer_ids`` (0.5.23) gives ``[]`` for every pool but the
    hybrid ones (layers paired by position: None here), ``layer_ids * 2`` for a
    hybrid MHA pool (one id per K entry, then one per V entry: the first half
    here, when the halves agree) and ``layer_ids`` for a hybrid MLA pool (kept).
    The decode registers the same list and ``transfer_worker`` passes it as
    ``dst_layer_ids``. Halves that differ are refused, naming ``name``.
    """
    if ids is None or len(ids) == 0:
        return None
    values = [int(i) for i in ids]
    half = len(values) // 2
    if len(values) % 2 == 0 and values[:half] == values[half:]:
        return values[:half]
    if len(set(values)) != len(values):
        raise InvalidTransferError(
            f"{name} = {values} repeats layer ids but is not one id per K entry then one per V entry "
            "(sglang's layer_ids * 2): the K and V halves differ"
        )
    return values


class KvwireSendMixin:
    """sglang's ``send_kvcache``, sending through ``self.kvwire_connection``.

    Put it before ``MooncakeKVManager`` in the bases and set
    ``self.kvwire_connection`` (a :class:`kvwire.Connection` with the local
    layout registered, and each decode peer added under its session id).
    ``dst_layer_ids`` is taken as sglang builds it (:func:`layer_ids_from_sglang`).
    """

    kvwire_connection: Connection

    def send_kvcache(
        self,
        mooncake_session_id: str,
        prefill_kv_indices: npt.NDArray[np.int32],
        dst_kv_ptrs: list[int],
        dst_kv_indices: npt.NDArray[np.int32],
        executor: concurrent.futures.ThreadPoolExecutor,
        dst_layer_ids: Optional[List[int]] = None,  # noqa: UP006, UP045 - sglang's annotation
        dst_device_kv_indices: Optional[npt.NDArray[np.int32]] = None,  # noqa: UP045 - sglang's annotation
        dst_kv_item_len: Optional[int] = None,  # noqa: UP045 - sglang's annotation
        dst_attn_tp_size: Optional[int] = None,  # noqa: UP045 - sglang's annotation
    ) -> int:
        """0 when every page arrived; a non-zero status from :data:`STATUS_CODES` when kvwire refused or failed."""
        try:
            self.kvwire_connection.send_kvcache(
                mooncake_session_id,
                prefill_kv_indices,
                dst_kv_ptrs,
                dst_kv_indices,
                executor,
                layer_ids_from_sglang(dst_layer_ids),
                dst_device_kv_indices,
                dst_kv_item_len,
                dst_attn_tp_size,
            )
        except KvwireError as exc:
            status = status_of(exc)
            log.error(
                "kvwire send_kvcache to session %s failed (status %d, peer %s): %s: %s",
                mooncake_session_id,
                status,
                getattr(exc, "peer", None) or mooncake_session_id,
                type(exc).__name__,
                exc,
            )
            return status
        return 0


class SglangSender(KvwireSendMixin):
    """The mixin on its own, around a connection (for hosts that call sglang's signature without sglang)."""

    def __init__(self, connection: Connection) -> None:
        self.kvwire_connection = connection


def layout_from_kv_args(
    kv_data_ptrs: Sequence[int],
    kv_data_lens: Sequence[int],
    kv_item_lens: Sequence[int],
    kv_layer_ids: Sequence[int] | None = None,
    *,
    attention: Literal["mha", "mla"],
    memory: MemoryKind,
    attn_tp_size: int | None = None,
    attn_tp_rank: int | None = None,
    heads: HeadLayout | None = None,
) -> KVLayout:
    """The :class:`KVLayout` of sglang's ``KVArgs`` (``kv_data_ptrs``, ``kv_data_lens``, ``kv_item_lens``...).

    sglang orders MHA buffers as every layer's K, then every layer's V; MLA has
    one buffer per layer. ``kv_item_lens`` are bytes per page and ``kv_data_lens``
    bytes per buffer, so a buffer holds ``data_len // item_len`` pages.
    ``kv_layer_ids`` is taken as sglang builds it (``[]`` or None: ``0..n-1``;
    see :func:`layer_ids_from_sglang`), or one id per layer. ``memory`` is
    required: ``"device"`` for GPU pools, ``"host"`` for CPU tensors (a wrong
    label picks the wrong page ids for split destinations).
    For transfers across attention TP sizes give the rank (sglang's
    ``engine_rank % attn_tp_size``) and ``heads`` (``kv_head_num``,
    ``total_kv_head_num``, head dim, element size, ``page_size``).
    """
    n = len(kv_data_ptrs)
    if not (len(kv_data_lens) == len(kv_item_lens) == n) or n == 0:
        raise LayoutError(
            f"kv_data_ptrs, kv_data_lens and kv_item_lens must have one entry per buffer, got {n}, "
            f"{len(kv_data_lens)} and {len(kv_item_lens)}"
        )
    per_layer = n if attention == "mla" else n // 2
    if attention == "mha" and n % 2:
        raise LayoutError(f"an MHA layout has a K and a V buffer per layer: got {n} buffers (odd)")
    try:
        given = layer_ids_from_sglang(kv_layer_ids, "kv_layer_ids")
    except InvalidTransferError as exc:
        raise LayoutError(str(exc)) from None
    ids = list(range(per_layer)) if given is None else given
    if len(ids) != per_layer:
        raise LayoutError(
            f"kv_layer_ids has {len(ids)} entries; expected none (sglang's [] for positional layers), "
            f"{per_layer} (one per layer) or {2 * per_layer if attention == 'mha' else per_layer} (one per buffer)"
        )
    if attention == "mha":
        ids = ids + ids
    k: Role = "k"
    v: Role = "v"
    kv: Role = "kv"
    roles = [kv] * n if attention == "mla" else [k] * per_layer + [v] * per_layer
    buffers = []
    for i, (ptr, length, item) in enumerate(zip(kv_data_ptrs, kv_data_lens, kv_item_lens)):
        if item <= 0:
            raise LayoutError(f"kv_item_lens[{i}] = {item} must be positive (bytes per page)")
        if length % item:
            raise LayoutError(f"kv_data_lens[{i}] = {length} is not a multiple of kv_item_lens[{i}] = {item}")
        buffers.append(KVBuffer(int(ptr), int(item), int(length) // int(item), ids[i], roles[i], memory))
    return KVLayout(tuple(buffers), attn_tp_size, attn_tp_rank, heads)
