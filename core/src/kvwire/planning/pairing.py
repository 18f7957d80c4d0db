"""Buffer pairing: which local buffer goes to which peer buffer, and under which page ids.

Everything planning derives from ``(local, peer, dst_layer_ids)`` alone, cached
per layout pair (layouts are immutable): the pairs grouped by destination index
set (one set; or host and device sets on a split layout), the TP slicing when
the two sides' attention-TP sizes differ (:mod:`kvwire.planning.head_slicing`), and the shape
checks of the peer that do not depend on the pages (``dst_kv_item_len``,
``dst_attn_tp_size``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence, Sized
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from kvwire.errors import InvalidTransferError
from kvwire.layout.buffers import KVBuffer, MemoryKind
from kvwire.layout.kv_layout import KVLayout
from kvwire.planning.head_slicing import Slicing, slicing_of, tp_mismatch
from kvwire.planning.plan import frozen, readonly_const

__all__ = ["Group", "Namer", "Pairing", "check_shape", "layer_id_list", "local_name", "pairing_of", "peer_name"]

_I64 = np.int64

Namer = Callable[[int, KVBuffer], str]


def local_name(i: int, buf: KVBuffer) -> str:
    return f"local buffer {i} (layer {buf.layer}, {buf.role})"


def peer_name(i: int, buf: KVBuffer) -> str:
    return f"peer buffer {i} (layer {buf.layer}, {buf.role}, {buf.memory})"


def _col(values: Sequence[int]) -> NDArray[np.int64]:
    return frozen(np.array(values, dtype=_I64).reshape(-1, 1))


@dataclass(frozen=True, eq=False)
class Group:
    """The buffer pairs that share one destination index set.

    Every pair when the peer layout has one memory kind; else (a split layout)
    the pairs whose target has memory kind ``memory``.
    """

    memory: MemoryKind  # of every target in the group
    device_ids: bool  # destination ids come from dst_device_kv_indices, not dst_kv_indices
    index_name: str  # the argument holding this group's destination page ids
    pair_pos: NDArray[np.int64]  # positions of these pairs in the global pair order, ascending
    contiguous: bool  # pair_pos is a contiguous range: write a block, no scatter
    src_ids: tuple[int, ...]  # local buffer index per pair
    dst_ids: tuple[int, ...]  # peer buffer index per pair
    src_base: NDArray[np.int64]  # (P, 1) columns, for broadcasting
    dst_base: NDArray[np.int64]
    page_bytes: NDArray[np.int64]  # of the sources (= of the targets, checked, unless head-sliced)
    uniform_page_bytes: int  # the common page size, or 0 when they differ
    src_limit: int  # fewest pages among the sources
    dst_limit: int  # fewest pages among the targets: every dst id must be below it
    bases: NDArray[np.int64]  # (2, pairs): source bases, target bases (the one-page path)
    page_lengths: NDArray[np.int64]  # page_bytes as 1-D on immutable memory: a one-page plan's lengths

    @property
    def num_pairs(self) -> int:
        return len(self.src_ids)


@dataclass(frozen=True, eq=False)
class Pairing:
    """Everything :func:`plan_transfer` derives from (local, peer, dst_layer_ids) alone."""

    local: KVLayout
    peer: KVLayout
    groups: tuple[Group, ...]  # one group; or, split layout, the host group and/or the device group
    pair_group: NDArray[np.int64]  # group number of each pair, in global pair order
    num_pairs: int
    src_limit: int  # fewest pages among local buffers: every prefill id must be below it
    peer_bases: list[int]
    split: bool  # the peer layout has host and device buffers: two page-id spaces
    device_target: int | None  # split layout: the first targeted device buffer (None: none targeted)
    slicing: Slicing | None  # attention-TP sizes differ: what this rank pair moves (None: same TP)
    int_types: list[type]  # [int] * len(peer_bases), for the dst_kv_ptrs fast check
    one_page: bool  # a one-page request may take the short path: one index set, whole pages


def layer_id_list(name: str, value: object) -> list[int]:
    """``value``, a sequence of layer ids, as a list of ints; InvalidTransferError naming ``name`` otherwise.

    A mapping or a set has a length too, but no order: ``{0: 1}`` would be read as its keys.
    """
    unordered = isinstance(value, (str, bytes, Mapping, AbstractSet))
    if unordered or not (isinstance(value, Sized) and isinstance(value, Iterable)):
        raise InvalidTransferError(f"{name} must be a sequence of ints or None, got {type(value).__name__}")
    ids = []
    for i, d in enumerate(value):
        if isinstance(d, (bool, np.bool_)) or not isinstance(d, (int, np.integer)):
            raise InvalidTransferError(f"{name}[{i}] = {d!r:.50} must be an int, got {type(d).__name__}")
        ids.append(int(d))
    return ids


def _check_layer_ids(local: KVLayout, peer: KVLayout, dst_layer_ids: Sequence[int]) -> dict[int, int]:
    ids = layer_id_list("dst_layer_ids", dst_layer_ids)
    if len(ids) != len(local.layers):
        raise InvalidTransferError(
            f"dst_layer_ids has {len(ids)} entries, expected {len(local.layers)} "
            f"(one per local layer {list(local.layers)})"
        )
    peer_layers = set(peer.layers)
    seen: dict[int, int] = {}
    for i, layer in enumerate(ids):
        if layer in seen:
            raise InvalidTransferError(
                f"dst_layer_ids[{i}] = {layer} is a duplicate of dst_layer_ids[{seen[layer]}]: "
                "two local layers cannot land on one peer layer"
            )
        seen[layer] = i
        if layer not in peer_layers:
            raise InvalidTransferError(
                f"dst_layer_ids[{i}] = {layer} is not a layer of the peer layout (peer layers: {sorted(peer_layers)})"
            )
    return {layer: ids[i] for i, layer in enumerate(local.layers)}


def build_pairing(local: KVLayout, peer: KVLayout, dst_layer_ids: Sequence[int] | None) -> Pairing:
    slicing = slicing_of(local, peer)
    sliced = slicing is not None and not slicing.whole_pages  # page sizes differ by design (head slices)
    layer_map = None if dst_layer_ids is None else _check_layer_ids(local, peer, dst_layer_ids)
    targets: dict[tuple[int, str], list[int]] = {}
    for j, buf in enumerate(peer.buffers):
        targets.setdefault((buf.layer, buf.role), []).append(j)
    pairs: list[tuple[int, int]] = []
    for i, buf in enumerate(local.buffers):
        layer = buf.layer if layer_map is None else layer_map[buf.layer]
        found = targets.get((layer, buf.role))
        if not found:
            mapped = "" if layer_map is None else f" (mapped by dst_layer_ids from layer {buf.layer})"
            raise InvalidTransferError(
                f"{local_name(i, buf)} has no target: the peer layout has no buffer with layer "
                f"{layer}{mapped} and role {buf.role!r}"
            )
        for j in found:
            dst = peer.buffers[j]
            if dst.page_bytes != buf.page_bytes and not sliced:
                hint = ""
                if tp_mismatch(local, peer):
                    hint = (
                        f"; the attention TP sizes differ (prefill {local.attn_tp_size}, decode "
                        f"{peer.attn_tp_size}): record attn_tp_rank (and heads, for MHA) on both layouts to plan "
                        "head slices"
                    )
                raise InvalidTransferError(
                    f"page size mismatch: {local_name(i, buf)} has {buf.page_bytes} bytes per page, "
                    f"its target {peer_name(j, dst)} has {dst.page_bytes}{hint}"
                )
            pairs.append((i, j))
    kinds = [peer.buffers[j].memory for _, j in pairs]
    # the peer LAYOUT decides (not the targets): a layout mixing kinds is a split destination
    split = peer.is_split
    parts: list[tuple[MemoryKind, bool, list[int]]]
    if split:  # host buffers take dst_kv_indices, device buffers dst_device_kv_indices; skip an untargeted kind
        parts = [(m, m == "device", [k for k, kind in enumerate(kinds) if kind == m]) for m in ("host", "device")]
        parts = [part for part in parts if part[2]]
    else:  # one memory kind: every target takes dst_kv_indices, whatever the kind
        parts = [(kinds[0], False, list(range(len(pairs))))]
    groups = []
    for memory, device_ids, pos in parts:
        src_ids = tuple(pairs[k][0] for k in pos)
        dst_ids = tuple(pairs[k][1] for k in pos)
        srcs = [local.buffers[i] for i in src_ids]
        dsts = [peer.buffers[j] for j in dst_ids]
        sizes = {b.page_bytes for b in srcs}
        groups.append(
            Group(
                memory=memory,
                device_ids=device_ids,
                index_name="dst_device_kv_indices" if device_ids else "dst_kv_indices",
                pair_pos=frozen(np.array(pos, dtype=_I64)),
                contiguous=pos[-1] - pos[0] + 1 == len(pos),
                src_ids=src_ids,
                dst_ids=dst_ids,
                src_base=_col([b.base for b in srcs]),
                dst_base=_col([b.base for b in dsts]),
                page_bytes=_col([b.page_bytes for b in srcs]),
                uniform_page_bytes=sizes.pop() if len(sizes) == 1 else 0,
                src_limit=min(b.num_pages for b in srcs),
                dst_limit=min(b.num_pages for b in dsts),
                bases=frozen(np.array([[b.base for b in srcs], [b.base for b in dsts]], dtype=_I64)),
                page_lengths=readonly_const(np.array([b.page_bytes for b in srcs], dtype=_I64)),
            )
        )
    return Pairing(
        local=local,
        peer=peer,
        groups=tuple(groups),
        pair_group=frozen(np.array([int(len(parts) > 1 and k == "device") for k in kinds], dtype=_I64)),
        num_pairs=len(pairs),
        src_limit=min(b.num_pages for b in local.buffers),
        peer_bases=[b.base for b in peer.buffers],
        split=split,
        device_target=pairs[kinds.index("device")][1] if split and "device" in kinds else None,
        slicing=slicing,
        int_types=[int] * len(peer.buffers),
        one_page=len(groups) == 1 and (slicing is None or slicing.whole_pages),
    )


_CACHE_SIZE: Final = 64
_cache: dict[tuple[Any, ...], Pairing] = {}
_cache_lock = threading.Lock()


def pairing_of(local: KVLayout, peer: KVLayout, dst_layer_ids: Sequence[int] | None) -> Pairing:
    """The pairing of (local, peer, dst_layer_ids), cached by object identity.

    Layouts are immutable and the cache holds them, so an id is never reused
    while its entry lives. The element types are part of the key so that, say,
    ``2.0`` is rejected every time rather than hitting the entry made for ``2``.
    """
    if dst_layer_ids is None:
        key: tuple[Any, ...] = (id(local), id(peer))
    else:
        try:
            ids = tuple(dst_layer_ids)
            key = (id(local), id(peer), ids, tuple(map(type, ids)))
            hash(key)
        except TypeError:  # not iterable, or unhashable elements: let validation explain
            return build_pairing(local, peer, dst_layer_ids)
    hit = _cache.get(key)
    if hit is not None and hit.local is local and hit.peer is peer:
        return hit
    pairing = build_pairing(local, peer, dst_layer_ids)
    with _cache_lock:
        while len(_cache) >= _CACHE_SIZE:
            _cache.pop(next(iter(_cache)), None)
        _cache[key] = pairing
    return pairing


def _check_scalar(name: str, value: object) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise InvalidTransferError(f"{name} must be an int or None, got {type(value).__name__} {value!r:.100}")
    if int(value) < 1:
        raise InvalidTransferError(f"{name} must be >= 1, got {int(value)}")
    return int(value)


def check_shape(pairing: Pairing, dst_kv_item_len: object, dst_attn_tp_size: object) -> None:
    if dst_kv_item_len is not None:
        item_len = _check_scalar("dst_kv_item_len", dst_kv_item_len)
        for g in pairing.groups:
            for j in g.dst_ids:
                buf = pairing.peer.buffers[j]
                if buf.page_bytes != item_len:
                    raise InvalidTransferError(
                        f"dst_kv_item_len = {item_len}, but the peer's layout says its target "
                        f"{peer_name(j, buf)} has {buf.page_bytes} bytes per page; nothing was sent"
                    )
    if dst_attn_tp_size is not None:
        tp = _check_scalar("dst_attn_tp_size", dst_attn_tp_size)
        recorded = pairing.peer.attn_tp_size
        if recorded is not None and recorded != tp:
            raise InvalidTransferError(
                f"dst_attn_tp_size = {tp}, but the peer's layout records attention TP size {recorded}; nothing was sent"
            )
