"""sglang's ``KVArgs`` as a kvwire :class:`~kvwire.KVLayout`, and sglang's layer ids as kvwire's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from kvwire.errors import InvalidTransferError
from kvwire.layout.arrays import memory_per_buffer
from kvwire.layout.buffers import HeadLayout, KVBuffer, LayoutError, MemoryKind, Role
from kvwire.layout.kv_layout import KVLayout
from kvwire.planning.pairing import layer_id_list

__all__ = ["layer_ids_from_sglang", "layout_from_kv_args", "sglang_layer_ids"]


def layer_ids_from_sglang(ids: Sequence[int] | None, name: str = "dst_layer_ids") -> list[int] | None:
    """kvwire's layer ids (one per layer, or None for positional) from a list as sglang builds it.

    sglang's ``build_kv_layer_ids`` (0.5.23) gives ``[]`` for every pool but the
    hybrid ones (layers paired by position: None here), ``layer_ids * 2`` for a
    hybrid MHA pool (one id per K entry, then one per V entry: the first half
    here, when the halves agree) and ``layer_ids`` for a hybrid MLA pool (kept).
    The decode registers the same list and ``transfer_worker`` passes it as
    ``dst_layer_ids``. Halves that differ are refused, naming ``name``.
    """
    return None if ids is None else sglang_layer_ids(layer_id_list(name, ids), name)


def sglang_layer_ids(values: list[int], name: str = "dst_layer_ids") -> list[int] | None:
    """:func:`layer_ids_from_sglang` of ``values`` already checked to be ints (``layer_id_list``)."""
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


def _entry_ids(
    given: Sequence[int] | None,
    n: int,
    drafts: int,
    attention: Literal["mha", "mla"],
    first_layer: int,
    draft_first_layer: int | None,
) -> tuple[list[int], list[Role]]:
    """The layer id and role of each of sglang's ``n`` KV entries, the last ``drafts`` of them the draft model's.

    Target entries first (MHA: every layer's K, then every layer's V; MLA: one per layer), then the
    draft's in the same order. Positional ids (``given`` empty): the target's layers from
    ``first_layer``, the draft's from ``draft_first_layer`` (default: the layer after the target's,
    sglang's ``num_hidden_layers`` band when the pool holds every layer). ``given``: sglang's list
    (:func:`layer_ids_from_sglang` reads the target's part and the draft's part each).
    """
    targets = n - drafts
    groups = 2 if attention == "mha" else 1
    for what, count in (("target", targets), ("draft", drafts)):
        if count % groups:
            raise LayoutError(
                f"an MHA layout has a K and a V buffer per layer: the {what} model has {count} buffers (odd); "
                f"kv_data_ptrs has {n}, num_draft_entries = {drafts}"
            )
    per_target, per_draft = targets // groups, drafts // groups
    ids = list(given) if given else []
    if ids and len(ids) != n:
        raise LayoutError(
            f"kv_layer_ids has {len(ids)} entries; with num_draft_entries = {drafts} expected none (sglang's [] "
            f"for positional layers) or {n} (one per buffer, the draft's in sglang's band after the target's)"
        )
    if not ids:
        band = first_layer + per_target if draft_first_layer is None else draft_first_layer
        target_ids = list(range(first_layer, first_layer + per_target))
        draft_ids = list(range(band, band + per_draft))
    else:
        try:
            target_ids = layer_ids_from_sglang(ids[:targets], "kv_layer_ids") or []
            draft_ids = layer_ids_from_sglang(ids[targets:], "kv_layer_ids (the draft model's part)") or []
        except InvalidTransferError as exc:
            raise LayoutError(str(exc)) from None
        for what, read, count, part in (
            ("target", target_ids, per_target, ids[:targets]),
            ("draft", draft_ids, per_draft, ids[targets:]),
        ):
            if len(read) != count:
                form = "one id per K buffer, then one per V buffer" if groups == 2 else "one id per buffer"
                raise LayoutError(
                    f"kv_layer_ids gives the {what} model's {len(part)} buffers {len(read)} layers "
                    f"({part[:8]}); expected {count}, {form}"
                )
    both = sorted(set(target_ids) & set(draft_ids))
    if both:
        raise LayoutError(
            f"the draft model's layers {both[:8]} are also target layers: sglang numbers the draft's layers in a "
            "band above the target's (num_hidden_layers + i); give kv_layer_ids as sglang builds them"
        )
    k: Role = "k"
    v: Role = "v"
    kv: Role = "kv"
    if attention == "mla":
        return target_ids + draft_ids, [kv] * n
    layer_ids = target_ids + target_ids + draft_ids + draft_ids
    roles = [k] * per_target + [v] * per_target + [k] * per_draft + [v] * per_draft
    return layer_ids, roles


def layout_from_kv_args(
    kv_data_ptrs: Sequence[int],
    kv_data_lens: Sequence[int],
    kv_item_lens: Sequence[int],
    kv_layer_ids: Sequence[int] | None = None,
    *,
    attention: Literal["mha", "mla"],
    memory: MemoryKind | Sequence[MemoryKind],
    attn_tp_size: int | None = None,
    attn_tp_rank: int | None = None,
    heads: HeadLayout | None = None,
    first_layer: int = 0,
    num_draft_entries: int = 0,
    draft_first_layer: int | None = None,
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
    label picks the wrong page ids for split destinations), or one kind per buffer
    (a HiSparse decode: its target KV in host DRAM, its draft KV on the device).
    For transfers across attention TP sizes give the rank (sglang's
    ``engine_rank % attn_tp_size``) and ``heads`` (``kv_head_num``,
    ``total_kv_head_num``, head dim, element size, ``page_size``).

    Draft-model KV (speculative decoding): sglang appends the draft pool's buffers after
    the target's (``num_draft_entries`` of them, in the same K-then-V or one-per-layer
    order) and, for hybrid pools, numbers them ``num_hidden_layers + i`` in
    ``kv_layer_ids``. They become layers of their own after the target's: sglang's ids
    when it gives them, else from ``draft_first_layer`` (default: one past the target's
    last layer, which is sglang's band when the pool holds every layer).
    """
    n = len(kv_data_ptrs)
    if not (len(kv_data_lens) == len(kv_item_lens) == n) or n == 0:
        raise LayoutError(
            f"kv_data_ptrs, kv_data_lens and kv_item_lens must have one entry per buffer, got {n}, "
            f"{len(kv_data_lens)} and {len(kv_item_lens)}"
        )
    drafts = num_draft_entries
    if isinstance(drafts, bool) or not isinstance(drafts, int) or not 0 <= drafts < n:
        raise LayoutError(
            f"num_draft_entries = {drafts!r} must be an int in [0, {n}): the draft model's buffers come after "
            f"at least one of the target's (kv_data_ptrs has {n})"
        )
    if attention == "mha" and n % 2 and not drafts:
        raise LayoutError(f"an MHA layout has a K and a V buffer per layer: got {n} buffers (odd)")
    given = list(kv_layer_ids) if kv_layer_ids is not None else []
    if drafts:
        ids, roles = _entry_ids(given, n, drafts, attention, first_layer, draft_first_layer)
    else:
        ids, roles = _target_entry_ids(given, n, attention, first_layer)
    kinds = memory_per_buffer(memory, n)
    buffers = []
    for i, (ptr, length, item) in enumerate(zip(kv_data_ptrs, kv_data_lens, kv_item_lens)):
        if item <= 0:
            raise LayoutError(f"kv_item_lens[{i}] = {item} must be positive (bytes per page)")
        if length % item:
            raise LayoutError(f"kv_data_lens[{i}] = {length} is not a multiple of kv_item_lens[{i}] = {item}")
        buffers.append(KVBuffer(int(ptr), int(item), int(length) // int(item), ids[i], roles[i], kinds[i]))
    return KVLayout(tuple(buffers), attn_tp_size, attn_tp_rank, heads)


def _target_entry_ids(
    given: Sequence[int], n: int, attention: Literal["mha", "mla"], first_layer: int
) -> tuple[list[int], list[Role]]:
    """The layer id and role of each entry of a pool without draft KV (see :func:`layout_from_kv_args`)."""
    per_layer = n if attention == "mla" else n // 2
    try:
        read = layer_ids_from_sglang(given, "kv_layer_ids")
    except InvalidTransferError as exc:
        raise LayoutError(str(exc)) from None
    ids = list(range(first_layer, first_layer + per_layer)) if read is None else read
    if len(ids) != per_layer:
        raise LayoutError(
            f"kv_layer_ids has {len(ids)} entries; expected none (sglang's [] for positional layers), "
            f"{per_layer} (one per layer) or {2 * per_layer if attention == 'mha' else per_layer} (one per buffer)"
        )
    k: Role = "k"
    v: Role = "v"
    kv: Role = "kv"
    if attention == "mla":
        return ids, [kv] * n
    return ids + ids, [k] * per_layer + [v] * per_layer
