"""sglang's ``KVArgs`` as a kvwire :class:`~kvwire.KVLayout`, and sglang's layer ids as kvwire's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from kvwire.errors import InvalidTransferError
from kvwire.layout.buffers import HeadLayout, KVBuffer, LayoutError, MemoryKind, Role
from kvwire.layout.kv_layout import KVLayout
from kvwire.planning.pairing import layer_id_list

__all__ = ["layer_ids_from_sglang", "layout_from_kv_args"]


def layer_ids_from_sglang(ids: Sequence[int] | None, name: str = "dst_layer_ids") -> list[int] | None:
    """kvwire's layer ids (one per layer, or None for positional) from a list as sglang builds it.

    sglang's ``build_kv_layer_ids`` (0.5.23) gives ``[]`` for every pool but the
    hybrid ones (layers paired by position: None here), ``layer_ids * 2`` for a
    hybrid MHA pool (one id per K entry, then one per V entry: the first half
    here, when the halves agree) and ``layer_ids`` for a hybrid MLA pool (kept).
    The decode registers the same list and ``transfer_worker`` passes it as
    ``dst_layer_ids``. Halves that differ are refused, naming ``name``.
    """
    if ids is None:
        return None
    values = layer_id_list(name, ids)
    if not values:
        return None
    half = len(values) // 2
    if len(values) % 2 == 0 and values[:half] == values[half:]:
        return values[:half]
    if len(set(values)) != len(values):
        raise InvalidTransferError(
            f"{name} = {values} repeats layer ids but is not one id per K entry then one per V entry "
            "(sglang's layer_ids * 2): the K and V halves differ"
        )
    return values


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
    first_layer: int = 0,
) -> KVLayout:
    """The :class:`KVLayout` of sglang's ``KVArgs`` (``kv_data_ptrs``, ``kv_data_lens``, ``kv_item_lens``...).

    sglang orders MHA buffers as every layer's K, then every layer's V; MLA has
    one buffer per layer. ``kv_item_lens`` are bytes per page and ``kv_data_lens``
    bytes per buffer, so a buffer holds ``data_len // item_len`` pages.
    ``kv_layer_ids`` is taken as sglang builds it (``[]`` or None: ``0..n-1``;
    see :func:`layer_ids_from_sglang`), or one id per layer; positional ids start at
    ``first_layer`` (a pipeline stage's ``prefill_start_layer``, so that its layers land on
    the decode's layers of the same number, as sglang's ``get_mha_kv_ptrs_with_pp`` does). ``memory`` is
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
    ids = list(range(first_layer, first_layer + per_layer)) if given is None else given
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
