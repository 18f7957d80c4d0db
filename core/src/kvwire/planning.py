"""Transfer planning: the address arithmetic every backend shares.

:func:`plan_transfer` turns one ``send_kvcache`` request (page ids on both
sides, the peer's buffer pointers, an optional pipeline-parallel layer mapping
and optional HiSparse device page ids) into flat ``(src, dst, length)`` arrays
for one batch call of a transport engine. Keeping it in one place means the
arithmetic, the coalescing and the bounds checks cannot drift between backends.

Destination page ids. A buffer's memory kind (``"host"`` or ``"device"``)
says where its bytes live, not by itself which page ids address it. Which ids
address which buffer is a property of the PEER LAYOUT, declared by the decode
side when it registers its buffers, and never inferred from a request:

* A peer layout with both host and device buffers is a split destination
  (HiSparse: some layers land in host DRAM, others in a device cache, each with
  its own page ids). Every host buffer is addressed by ``dst_kv_indices`` and
  every device buffer by ``dst_device_kv_indices``, whatever the request
  targets. ``dst_device_kv_indices`` is given exactly when the request (after
  ``dst_layer_ids`` mapping) targets at least one device buffer.
* A peer layout of one kind only (an ordinary GPU decode, whose torch tensors
  :class:`~kvwire.layout.KVLayout` marks ``"device"``, or a host-only peer)
  has one page-id space: every buffer takes ``dst_kv_indices``, as sglang
  passes them, and ``dst_device_kv_indices`` must be ``None``.

Deciding from the request's targets instead would be wrong: a pipeline stage
whose layers all map onto the device part of a split layout would be planned
with ``dst_kv_indices`` (host page ids) and write them into device buffers
silently (sglang issue #31482).

Every input is validated before a plan is returned; every failure raises
:class:`~kvwire.errors.InvalidTransferError` naming the argument and the first
offending position and value. The work is vectorised with numpy: runs of
consecutive pages are found once per destination index set (one, or one per
targeted memory kind on a split layout) and broadcast across all buffer pairs,
with no Python loop per layer or per page.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire.errors import InvalidTransferError
from kvwire.layout import KVLayout
from kvwire.pairing import Group, Namer, Pairing, check_shape, local_name, pairing_of, peer_name
from kvwire.plan import TransferPlan, frozen
from kvwire.spec import PARAMETER_FEATURES

__all__ = ["TransferPlan", "TransferRequest", "check_peer_shape", "plan_transfer"]

_I64 = np.int64
_max = np.maximum.reduce
_min = np.minimum.reduce


# -- index validation ---------------------------------------------------------


def _as_indices(name: str, value: object) -> NDArray[np.int64]:
    if not isinstance(value, np.ndarray):
        raise InvalidTransferError(f"{name} must be a 1-D numpy integer array, got {type(value).__name__}")
    if value.ndim != 1:
        raise InvalidTransferError(f"{name} must be a 1-D numpy integer array, got shape {value.shape}")
    if value.dtype.kind not in "iu" or not np.can_cast(value.dtype, _I64):
        raise InvalidTransferError(f"{name} must have an integer dtype (int32 or int64), got {value.dtype}")
    return np.asarray(value, dtype=_I64)


def _check_range(
    name: str, idx: NDArray[np.int64], limit: int, *, layout: KVLayout, ids: Iterable[int], describe: Namer
) -> None:
    """Every id in [0, limit); on failure name the first offender and a buffer (of ``ids``) it overflows."""
    if _max(idx.view(np.uint64)) < limit:  # negatives wrap to >= 2**63
        return
    j = int(np.flatnonzero((idx < 0) | (idx >= limit))[0])
    v = int(idx[j])
    if v < 0:
        raise InvalidTransferError(f"{name}[{j}] = {v} is negative: page ids must be >= 0")
    i = next(i for i in ids if v >= layout.buffers[i].num_pages)
    buf = layout.buffers[i]
    raise InvalidTransferError(f"{name}[{j}] = {v} is out of range: {describe(i, buf)} has {buf.num_pages} pages")


def _check_ptrs(pairing: Pairing, dst_kv_ptrs: Sequence[int]) -> None:
    peer = pairing.peer
    try:
        count = len(dst_kv_ptrs)
    except TypeError:
        raise InvalidTransferError(
            f"dst_kv_ptrs must be a sequence of ints, got {type(dst_kv_ptrs).__name__}"
        ) from None
    if count != len(peer.buffers):
        raise InvalidTransferError(
            f"dst_kv_ptrs has {count} entries, expected {len(peer.buffers)} (one per peer buffer)"
        )
    ptrs = list(dst_kv_ptrs)
    types = set(map(type, ptrs))
    if ptrs == pairing.peer_bases and all(t is int or issubclass(t, np.integer) for t in types):
        return
    for i, (p, base) in enumerate(zip(ptrs, pairing.peer_bases, strict=True)):
        if isinstance(p, (bool, np.bool_)) or not isinstance(p, (int, np.integer)):
            raise InvalidTransferError(f"dst_kv_ptrs[{i}] = {p!r} must be an int, got {type(p).__name__}")
        if int(p) != base:
            raise InvalidTransferError(
                f"dst_kv_ptrs[{i}] = {int(p)} does not match the peer layout: "
                f"{peer_name(i, peer.buffers[i])} has base {base}"
            )




# -- planning -----------------------------------------------------------------


_Runs = tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]


def _runs(src: NDArray[np.int64], dst: NDArray[np.int64], coalesce: bool) -> _Runs:
    """(first source page, first destination page, page count) of each run.

    A run is a maximal stretch where both the source and the destination page
    ids go up by exactly one from each entry to the next.
    """
    n = src.shape[0]
    if not coalesce or n < 2:
        return src, dst, np.ones(n, dtype=_I64)
    step = np.subtract(src[1:], src[:-1])
    starts_mask = np.empty(n, dtype=np.bool_)
    starts_mask[0] = True
    brk = starts_mask[1:]
    np.not_equal(step, 1, out=brk)
    np.subtract(dst[1:], dst[:-1], out=step)
    brk |= step != 1
    starts = np.flatnonzero(starts_mask)
    counts = np.empty_like(starts)
    np.subtract(starts[1:], starts[:-1], out=counts[:-1])
    counts[-1] = n - starts[-1]
    return src[starts], dst[starts], counts


def _fill(
    g: Group,
    runs: _Runs,
    *,
    src: NDArray[np.int64],
    dst: NDArray[np.int64],
    length: NDArray[np.int64],
) -> None:
    """Write the (pairs, runs) descriptor matrices of group ``g`` into ``src``/``dst``/``length``."""
    run_src, run_dst, run_len = runs
    pb = g.uniform_page_bytes
    if pb:
        np.add(g.src_base, run_src * pb, out=src)
        np.add(g.dst_base, run_dst * pb, out=dst)
        length[...] = run_len * pb
    else:
        np.multiply(g.page_bytes, run_src, out=src)
        src += g.src_base
        np.multiply(g.page_bytes, run_dst, out=dst)
        dst += g.dst_base
        np.multiply(g.page_bytes, run_len, out=length)


def _safety_net(pairing: Pairing, g: Group, runs: _Runs) -> None:
    """Last line of defence: no descriptor of group ``g`` leaves its source or target buffer.

    The descriptor of pair ``p`` and run ``k`` covers bytes ``base_p + [page_k, page_k + len_k) *
    page_bytes_p``, so it lies inside buffer ``p`` exactly when ``0 <= page_k`` and ``page_k + len_k
    <= num_pages_p``. Checking the runs against the smallest buffer of the group covers every
    descriptor of every pair at O(runs) cost (checking the (pairs x runs) output would cost more
    than planning it).
    """
    run_src, run_dst, run_len = runs
    checks = (
        ("source", run_src, g.src_limit, g.src_ids, pairing.local, local_name),
        ("target", run_dst, g.dst_limit, g.dst_ids, pairing.peer, peer_name),
    )
    for side, first, limit, ids, layout, name in checks:
        stop = first + run_len
        if _min(first) >= 0 and _max(stop) <= limit:
            continue
        k = int(np.flatnonzero((first < 0) | (stop > limit))[0])
        lo, hi = int(first[k]), int(stop[k])
        b = next(b for b in ids if lo < 0 or hi > layout.buffers[b].num_pages)
        buf = layout.buffers[b]
        raise InvalidTransferError(
            f"internal planning error: run {k} covers pages [{lo}, {hi}), outside its {side} "
            f"{name(b, buf)} of {buf.num_pages} pages; no plan was returned"
        )


def plan_transfer(
    local: KVLayout,
    peer: KVLayout,
    prefill_kv_indices: NDArray[np.integer[Any]],
    dst_kv_ptrs: Sequence[int],
    dst_kv_indices: NDArray[np.integer[Any]],
    dst_layer_ids: Sequence[int] | None = None,
    dst_device_kv_indices: NDArray[np.integer[Any]] | None = None,
    dst_kv_item_len: int | None = None,
    dst_attn_tp_size: int | None = None,
    *,
    coalesce: bool = True,
) -> TransferPlan:
    """Plan the copy of pages ``prefill_kv_indices`` of ``local`` into ``peer``.

    Local buffer ``b`` (layer ``L``, role ``r``) goes to every peer buffer of
    layer ``D`` and role ``r``, where ``D = L``, or ``dst_layer_ids[i]`` when
    given, ``i`` being the position of ``L`` in ``local.layers`` (a pipeline
    stage holding some layers maps them onto the peer's global layer ids).
    Source page ``j`` is ``prefill_kv_indices[j]``; it lands on page
    ``dst_kv_indices[j]`` of every target, except when the peer layout has
    both host and device buffers (a split destination, HiSparse): then it
    lands on page ``dst_kv_indices[j]`` of host targets and on page
    ``dst_device_kv_indices[j]`` of device targets (independent page ids).

    The split is a property of ``peer``, never of the request: a buffer's
    memory kind says where its bytes live, and a layout that mixes kinds
    declares two page-id spaces. So on a split layout a device buffer takes
    device page ids even when it is the only kind a request targets (say a
    pipeline stage mapped by ``dst_layer_ids`` onto device layers only), and
    ``dst_device_kv_indices`` is required exactly when the request targets a
    device buffer (and must be ``None`` when it targets only host buffers).
    On a layout of one kind (an ordinary GPU decode, all ``"device"``, or all
    ``"host"``) every buffer takes ``dst_kv_indices``, as sglang passes them,
    and ``dst_device_kv_indices`` must be ``None``. ``dst_kv_ptrs`` are the
    peer's buffer bases in ``peer.buffers`` order, checked against it.

    With ``coalesce``, pages where both the source and the destination ids go
    up by one are merged into one descriptor. Descriptors are ordered by buffer
    pair (local buffers in layout order; a local buffer's targets in peer
    layout order), then by position in the request.

    ``dst_kv_item_len`` and ``dst_attn_tp_size``, when given, are the caller's
    idea of the peer's shape (sglang passes them): they must match what the
    peer's layout says (see :func:`check_peer_shape`).

    Raises :class:`InvalidTransferError` (before anything is returned) naming
    the argument and the first offending position and value.
    """
    pairing = pairing_of(local, peer, dst_layer_ids)
    check_shape(pairing, dst_kv_item_len, dst_attn_tp_size)
    _check_ptrs(pairing, dst_kv_ptrs)
    src_pages = _as_indices("prefill_kv_indices", prefill_kv_indices)
    host_pages = _as_indices("dst_kv_indices", dst_kv_indices)
    device_pages: NDArray[np.int64] | None = None
    device_target = pairing.device_target
    if dst_device_kv_indices is not None:
        if not pairing.split:
            raise InvalidTransferError(
                f"dst_device_kv_indices was given, but the peer layout's buffers are all "
                f"{peer.buffers[0].memory}: there is no split destination; pass None "
                "(every buffer takes dst_kv_indices)"
            )
        if device_target is None:
            raise InvalidTransferError(
                "dst_device_kv_indices was given, but this request targets no device buffer: the peer layout "
                "has host and device buffers (split destinations) and every target of this request is a host "
                "buffer, addressed by dst_kv_indices; pass None"
            )
        device_pages = _as_indices("dst_device_kv_indices", dst_device_kv_indices)
    elif device_target is not None:
        raise InvalidTransferError(
            "dst_device_kv_indices is None, but the peer layout has host and device buffers (split destinations) "
            f"and this request targets a device buffer, {peer_name(device_target, peer.buffers[device_target])}: "
            "pass dst_device_kv_indices"
        )
    n = src_pages.shape[0]
    for name, pages in (("dst_kv_indices", host_pages), ("dst_device_kv_indices", device_pages)):
        if pages is not None and pages.shape[0] != n:
            raise InvalidTransferError(
                f"{name} has {pages.shape[0]} entries but prefill_kv_indices has {n}: they must be equal"
            )
    if n == 0:
        return TransferPlan.empty()

    _check_range(
        "prefill_kv_indices",
        src_pages,
        pairing.src_limit,
        layout=local,
        ids=range(len(local.buffers)),
        describe=local_name,
    )
    planned: list[tuple[Group, _Runs]] = []
    for g in pairing.groups:  # one, or (split layout) host and/or device
        pages = device_pages if g.device_ids else host_pages
        assert pages is not None  # guaranteed by the device-target check above
        _check_range(g.index_name, pages, g.dst_limit, layout=peer, ids=g.dst_ids, describe=peer_name)
        runs = _runs(src_pages, pages, coalesce)
        _safety_net(pairing, g, runs)
        planned.append((g, runs))
    return _assemble(pairing, planned, n * pairing.num_pairs)


def check_peer_shape(
    local: KVLayout,
    peer: KVLayout,
    dst_layer_ids: Sequence[int] | None,
    dst_kv_item_len: int | None,
    dst_attn_tp_size: int | None,
) -> None:
    """Check the caller's idea of the peer's shape against the peer's published layout.

    ``dst_kv_item_len`` must equal the bytes per page of every buffer the request
    targets; ``dst_attn_tp_size`` must equal the layout's ``attn_tp_size`` when
    the layout records one. :class:`InvalidTransferError` names both values.
    """
    check_shape(pairing_of(local, peer, dst_layer_ids), dst_kv_item_len, dst_attn_tp_size)


def _assemble(pairing: Pairing, planned: list[tuple[Group, _Runs]], descriptors_before: int) -> TransferPlan:
    """Broadcast each group's runs over its buffer pairs into pair-major flat arrays."""
    if len(planned) == 1:
        g, runs = planned[0]
        shape = (g.num_pairs, runs[0].shape[0])
        src, dst, length = np.empty(shape, _I64), np.empty(shape, _I64), np.empty(shape, _I64)
        _fill(g, runs, src=src, dst=dst, length=length)
        return TransferPlan(
            frozen(src.reshape(-1)), frozen(dst.reshape(-1)), frozen(length.reshape(-1)), descriptors_before
        )
    counts = np.array([runs[0].shape[0] for _, runs in planned], dtype=_I64)
    per_pair = counts[pairing.pair_group]  # rows of each pair, in output order
    row_start = np.cumsum(per_pair) - per_pair
    total = int(per_pair.sum())
    flat_src, flat_dst, flat_len = np.empty(total, _I64), np.empty(total, _I64), np.empty(total, _I64)
    for g, runs in planned:
        r = runs[0].shape[0]
        shape = (g.num_pairs, r)
        if g.contiguous:  # the group's pairs are adjacent in the output: write in place
            start = int(row_start[g.pair_pos[0]])
            stop = start + g.num_pairs * r
            _fill(
                g,
                runs,
                src=flat_src[start:stop].reshape(shape),
                dst=flat_dst[start:stop].reshape(shape),
                length=flat_len[start:stop].reshape(shape),
            )
        else:  # interleaved with the other group's pairs: scatter
            src, dst, length = np.empty(shape, _I64), np.empty(shape, _I64), np.empty(shape, _I64)
            _fill(g, runs, src=src, dst=dst, length=length)
            pos = row_start[g.pair_pos][:, None] + np.arange(r, dtype=_I64)
            flat_src[pos], flat_dst[pos], flat_len[pos] = src, dst, length
    return TransferPlan(frozen(flat_src), frozen(flat_dst), frozen(flat_len), descriptors_before)


@dataclass(frozen=True)
class TransferRequest:
    """What planning reads of one ``send_kvcache`` call (all but ``session_id`` and ``executor``).

    Backends built on :class:`kvwire.TransportBackend` hand the request on as one
    object, so a parameter added to the spec is threaded through in one place.
    """

    prefill_kv_indices: NDArray[np.integer[Any]]
    dst_kv_ptrs: Sequence[int]
    dst_kv_indices: NDArray[np.integer[Any]]
    dst_layer_ids: Sequence[int] | None = None
    dst_device_kv_indices: NDArray[np.integer[Any]] | None = None
    dst_kv_item_len: int | None = None
    dst_attn_tp_size: int | None = None

    def features(self) -> frozenset[str]:
        """The features this request uses: a non-None argument for a parameter bound to a feature."""
        return frozenset(f for p, f in PARAMETER_FEATURES.items() if getattr(self, p, None) is not None)

    @staticmethod
    def parameters_for(features: Iterable[str]) -> list[str]:
        """The parameters that need ``features``, in spec order."""
        wanted = set(features)
        return [p for p, f in PARAMETER_FEATURES.items() if f in wanted]

    def plan(self, local: KVLayout, peer: KVLayout, *, coalesce: bool = True) -> TransferPlan:
        """:func:`plan_transfer` of this request from ``local`` into ``peer``."""
        return plan_transfer(
            local,
            peer,
            self.prefill_kv_indices,
            self.dst_kv_ptrs,
            self.dst_kv_indices,
            self.dst_layer_ids,
            self.dst_device_kv_indices,
            self.dst_kv_item_len,
            self.dst_attn_tp_size,
            coalesce=coalesce,
        )
