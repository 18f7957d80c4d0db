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
  :class:`~kvwire.layout.kv_layout.KVLayout` marks ``"device"``, or a host-only peer)
  has one page-id space: every buffer takes ``dst_kv_indices``, as sglang
  passes them, and ``dst_device_kv_indices`` must be ``None``.

Deciding from the request's targets instead would be wrong: a pipeline stage
whose layers all map onto the device part of a split layout would be planned
with ``dst_kv_indices`` (host page ids) and write them into device buffers
silently (sglang issue #31482).

Prefill and decode of different attention-TP sizes (both layouts record
``attn_tp_size``, ``attn_tp_rank`` and, for MHA, ``heads``): each token of each
page moves just the KV heads the two ranks share (:mod:`kvwire.planning.head_slicing`); the
same TP size keeps the whole-page path.

Destination page ids may not repeat within an index set (a page written twice
is a host bug that would silently keep one of the writes).

Every input is validated before a plan is returned; every failure raises
:class:`~kvwire.errors.InvalidTransferError` naming the argument and the first
offending position and value. The work is vectorised with numpy: runs of
consecutive pages are found once per destination index set (one, or one per
targeted memory kind on a split layout) and broadcast across all buffer pairs,
with no Python loop per layer or per page.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire.errors import InvalidTransferError
from kvwire.layout.kv_layout import KVLayout
from kvwire.planning.assembly import Runs, assemble, check_runs, one_page, page_fill, sliced_fill
from kvwire.planning.checks import as_i64, check_ptrs, check_range, index_array, page_arrays
from kvwire.planning.pairing import Group, check_shape, local_name, pairing_of, peer_name
from kvwire.planning.plan import TransferPlan
from kvwire.spec.request import TransferRequest

__all__ = ["check_peer_shape", "plan_request", "plan_transfer"]

_I64 = np.int64
_max = np.maximum.reduce
_min = np.minimum.reduce


# -- planning -----------------------------------------------------------------


def _runs(src: NDArray[Any], dst: NDArray[Any], coalesce: bool) -> Runs:
    """(first source page, first destination page, page count) of each run.

    A run is a maximal stretch where both the source and the destination page
    ids go up by exactly one from each entry to the next. ``src`` and ``dst``
    are both int64, or both int32 (:func:`~kvwire.planning.checks.page_arrays`).
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
    starts = starts_mask.nonzero()[0]
    counts = np.empty(starts.shape[0], dtype=_I64)
    np.subtract(starts[1:], starts[:-1], out=counts[:-1])
    counts[-1] = n - starts[-1]
    return src[starts], dst[starts], counts


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

    Between layouts of different attention-TP sizes only the KV heads the two
    ranks share move, token by token (see :mod:`kvwire.planning.head_slicing`); a rank that
    another sender covers (a GQA replica, an MLA rank other than the first)
    gets an empty plan after every check.

    Raises :class:`InvalidTransferError` (before anything is returned) naming
    the argument and the first offending position and value.
    """
    for name, layout in (("local", local), ("peer", peer)):
        if not isinstance(layout, KVLayout):
            raise InvalidTransferError(f"{name} must be a kvwire.KVLayout, got {type(layout).__name__}")
    pairing = pairing_of(local, peer, dst_layer_ids)
    if dst_kv_item_len is not None or dst_attn_tp_size is not None:
        check_shape(pairing, dst_kv_item_len, dst_attn_tp_size)
    check_ptrs(pairing, dst_kv_ptrs)
    src_ids = index_array("prefill_kv_indices", prefill_kv_indices)
    host_ids = index_array("dst_kv_indices", dst_kv_indices)
    device_ids: NDArray[np.integer[Any]] | None = None
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
        device_ids = index_array("dst_device_kv_indices", dst_device_kv_indices)
    elif device_target is not None:
        raise InvalidTransferError(
            "dst_device_kv_indices is None, but the peer layout has host and device buffers (split destinations) "
            f"and this request targets a device buffer, {peer_name(device_target, peer.buffers[device_target])}: "
            "pass dst_device_kv_indices"
        )
    n = src_ids.shape[0]
    for name, ids in (("dst_kv_indices", host_ids), ("dst_device_kv_indices", device_ids)):
        if ids is not None and ids.shape[0] != n:
            raise InvalidTransferError(
                f"{name} has {ids.shape[0]} entries but prefill_kv_indices has {n}: they must be equal"
            )
    if n == 0:
        return TransferPlan.empty()
    if n == 1 and pairing.one_page:
        return one_page(pairing, src_ids, host_ids, device_ids)
    src_pages, host_pages, device_pages = page_arrays(src_ids, host_ids, device_ids)

    check_range(
        "prefill_kv_indices",
        src_pages,
        pairing.src_limit,
        layout=local,
        ids=range(len(local.buffers)),
        describe=local_name,
    )
    sliced = pairing.slicing
    whole = sliced is None or sliced.whole_pages
    planned: list[tuple[Group, Runs]] = []
    for g in pairing.groups:  # one, or (split layout) host and/or device
        pages = device_pages if g.device_ids else host_pages
        assert pages is not None  # guaranteed by the device-target check above
        check_range(g.index_name, pages, g.dst_limit, layout=peer, ids=g.dst_ids, describe=peer_name)
        first_src, first_dst, count = _runs(src_pages, pages, coalesce and whole)
        runs = (as_i64(first_src), as_i64(first_dst), as_i64(count))
        check_runs(pairing, g, runs, pages)
        planned.append((g, runs))
    if sliced is not None and not sliced.sends:
        return TransferPlan.empty()  # another sender covers this decode rank (see kvwire.planning.head_slicing)
    if whole:
        return assemble(pairing, [page_fill(g, runs, n) for g, runs in planned], n * pairing.num_pairs)
    assert sliced is not None
    t = sliced.tokens
    return assemble(pairing, [sliced_fill(sliced, g, runs) for g, runs in planned], n * t * pairing.num_pairs)


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


def plan_request(request: TransferRequest, local: KVLayout, peer: KVLayout, *, coalesce: bool = True) -> TransferPlan:
    """:func:`plan_transfer` of ``request`` from ``local`` into ``peer``, planned once per request.

    The plan is kept on the request for these very layouts: the Connection plans a
    submission up front (input errors raise before anything is queued) and the
    backend's send of the same request object reuses that plan instead of planning twice.
    """
    key = (local, peer, coalesce)
    memo: tuple[tuple[KVLayout, KVLayout, bool], TransferPlan] | None = request.__dict__.get("_plan_memo")
    if memo is not None and all(a is b for a, b in zip(memo[0], key)):
        return memo[1]
    plan = plan_transfer(
        local,
        peer,
        request.prefill_kv_indices,
        request.dst_kv_ptrs,
        request.dst_kv_indices,
        request.dst_layer_ids,
        request.dst_device_kv_indices,
        request.dst_kv_item_len,
        request.dst_attn_tp_size,
        coalesce=coalesce,
    )
    request.__dict__["_plan_memo"] = (key, plan)  # frozen fields stay as they are; this is a cache
    return plan
