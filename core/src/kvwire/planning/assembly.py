"""Writing a plan: descriptor matrices broadcast over buffer pairs into one pooled slab.

Planning (:mod:`kvwire.planning.planner`) validates a request and finds its runs; this
module turns them into the flat arrays of a :class:`~kvwire.planning.plan.TransferPlan`
(whole pages, or head slices between TP sizes), with the last-line safety net
that no descriptor leaves its buffers.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire.errors import InvalidTransferError
from kvwire.planning.checks import SMALL, as_i64, check_range, raise_repeat
from kvwire.planning.head_slicing import Slicing, fill_sliced
from kvwire.planning.pairing import Group, Pairing, local_name, peer_name
from kvwire.planning.plan import TransferPlan, constant_lengths, frozen, output_slab, trusted_plan

__all__ = ["Fill", "Filler", "Runs", "assemble", "check_runs", "one_page", "page_fill", "sliced_fill"]

_I64 = np.int64
_max = np.maximum.reduce
_min = np.minimum.reduce

#: (first source page, first destination page, page count) of each run
Runs = tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]


def fill_pages(
    g: Group,
    runs: Runs,
    *,
    src: NDArray[np.int64],
    dst: NDArray[np.int64],
    length: NDArray[np.int64] | None,
) -> None:
    """Write the (pairs, runs) descriptor matrices of group ``g`` into ``src``/``dst``/``length``.

    ``length`` None: the caller shares a constant length array (every run one page).
    """
    run_src, run_dst, run_len = runs
    pb = g.uniform_page_bytes
    if pb:
        np.add(g.src_base, run_src * pb, out=src)
        np.add(g.dst_base, run_dst * pb, out=dst)
        if length is not None:
            length[...] = run_len * pb
    else:
        assert length is not None  # the length of a one-page run is constant only when page sizes are
        np.multiply(g.page_bytes, run_src, out=src)
        src += g.src_base
        np.multiply(g.page_bytes, run_dst, out=dst)
        dst += g.dst_base
        np.multiply(g.page_bytes, run_len, out=length)


def check_runs(pairing: Pairing, g: Group, runs: Runs, pages: NDArray[np.integer[Any]]) -> None:
    """The safety net (no descriptor of group ``g`` leaves its buffers), then no repeated destination page.

    Safety net, the last line of defence against an arithmetic bug: the
    descriptor of pair ``p`` and run ``k`` covers bytes ``base_p + [page_k,
    page_k + len_k) * page_bytes_p``, inside buffer ``p`` exactly when ``len_k
    >= 1``, ``0 <= page_k`` and ``page_k + len_k <= num_pages_p``; checking the
    runs against the group's smallest buffer covers every pair at O(runs).
    Repeats: ids within a run are consecutive, so a destination page repeats
    exactly when two runs overlap. Runs already ascending and disjoint cost one
    comparison; otherwise the starts and the ends are sorted, each on its own
    (half-open runs are disjoint exactly when the k-th smallest end is <= the
    (k+1)-th smallest start), and the sorted arrays give the safety net's
    extremes too. The positions of a repeat are looked for only when there is one.
    """
    run_src, run_dst, run_len = runs
    r = run_src.shape[0]
    if r <= SMALL:  # Python ints: numpy's per-call cost would dominate
        src, dst, count = run_src.tolist(), run_dst.tolist(), run_len.tolist()
        spans = sorted(zip(dst, count, strict=True))
        safe = min(count) >= 1 and min(src) >= 0 and max(map(sum, zip(src, count))) <= g.src_limit
        safe = safe and spans[0][0] >= 0 and max(map(sum, spans)) <= g.dst_limit
        if not safe:
            _outside(pairing, g, runs)
        if any(a + n > b for (a, n), (b, _) in itertools.pairwise(spans)):
            raise_repeat(g.index_name, pages)
        return
    src_stop = run_src + run_len
    dst_stop = run_dst + run_len
    repeats = False
    if (dst_stop[:-1] > run_dst[1:]).any():  # not ascending and disjoint: sort
        dst_stop.sort()
        starts = np.sort(run_dst)
        repeats = bool((dst_stop[:-1] > starts[1:]).any())
        lowest = int(starts[0])
    else:
        lowest = int(run_dst[0])
    if not (
        _min(run_len) >= 1
        and _min(run_src) >= 0
        and _max(src_stop) <= g.src_limit
        and lowest >= 0
        and int(dst_stop[-1]) <= g.dst_limit
    ):
        _outside(pairing, g, runs)
    if repeats:
        raise_repeat(g.index_name, pages)


def _outside(pairing: Pairing, g: Group, runs: Runs) -> None:
    """Raise for the first run that leaves a buffer (or is empty): an internal error, never the caller's."""
    run_src, run_dst, run_len = runs
    bad = np.flatnonzero(run_len < 1)
    if bad.shape[0]:
        k = int(bad[0])
        raise InvalidTransferError(
            f"internal planning error: run {k} has {int(run_len[k])} pages; no plan was returned"
        )
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
    raise InvalidTransferError("internal planning error: a run leaves its buffers; no plan was returned")


def one_page(
    pairing: Pairing,
    src_ids: NDArray[np.integer[Any]],
    host_ids: NDArray[np.integer[Any]],
    device_ids: NDArray[np.integer[Any]] | None,
) -> TransferPlan:
    """A one-page request to one index set: a descriptor per pair, without the run machinery.

    Same checks as the general path (ranges, then the safety net), on Python
    ints: at this size numpy's per-call cost is the whole cost.
    """
    g = pairing.groups[0]
    dst_ids = device_ids if g.device_ids else host_ids
    assert dst_ids is not None  # planning checked that device ids come exactly when a device group is targeted
    src_page, dst_page = int(src_ids.item(0)), int(dst_ids.item(0))
    if not 0 <= src_page < pairing.src_limit:
        local = pairing.local
        check_range(
            "prefill_kv_indices",
            as_i64(src_ids),
            pairing.src_limit,
            layout=local,
            ids=range(len(local.buffers)),
            describe=local_name,
        )
    if not 0 <= dst_page < g.dst_limit:
        check_range(g.index_name, as_i64(dst_ids), g.dst_limit, layout=pairing.peer, ids=g.dst_ids, describe=peer_name)
    if not (0 <= src_page < g.src_limit and 0 <= dst_page < g.dst_limit):  # the safety net, for one page
        raise InvalidTransferError(f"internal planning error: page {src_page} -> {dst_page} is out of its buffers")
    if pairing.slicing is not None and not pairing.slicing.sends:
        return TransferPlan.empty()  # another sender covers this decode rank (see kvwire.planning.head_slicing)
    count = g.num_pairs
    block = output_slab(count)[:2, :count]
    pb = g.uniform_page_bytes
    if pb:
        offsets = np.empty((2, 1), dtype=_I64)
        offsets[0, 0] = src_page * pb
        offsets[1, 0] = dst_page * pb
        np.add(g.bases, offsets, out=block)
    else:
        np.multiply(g.page_lengths, [[src_page], [dst_page]], out=block)
        block += g.bases
    block.flags.writeable = False
    return trusted_plan(block[0], block[1], g.page_lengths, count)


Filler = Callable[[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64] | None], None]
#: (group, rows per pair, its filler, the constant length of every row or 0)
Fill = tuple[Group, int, Filler, int]


def page_fill(g: Group, runs: Runs, pages: int) -> Fill:
    """Whole pages: a row per run (a constant length when every run is one page of a uniform size)."""

    def fill(src: NDArray[np.int64], dst: NDArray[np.int64], length: NDArray[np.int64] | None) -> None:
        fill_pages(g, runs, src=src, dst=dst, length=length)

    rows = runs[0].shape[0]
    return g, rows, fill, g.uniform_page_bytes if rows == pages else 0  # as many runs as pages: all of one


def sliced_fill(sliced: Slicing, g: Group, runs: Runs) -> Fill:
    """Head slices: a row per token of each page, all of ``sliced.length`` bytes."""

    def fill(src: NDArray[np.int64], dst: NDArray[np.int64], length: NDArray[np.int64] | None) -> None:
        fill_sliced(sliced, g.src_base, g.dst_base, runs[0], runs[1], src=src, dst=dst, length=length)

    return g, runs[0].shape[0] * sliced.tokens, fill, sliced.length


def assemble(pairing: Pairing, fills: list[Fill], descriptors_before: int) -> TransferPlan:
    """Write each group's (pairs, rows) descriptor matrix into pair-major flat arrays (one pooled slab).

    A single group of constant length shares an immutable lengths array
    instead of writing one (a third less memory traffic).
    """
    if len(fills) == 1:
        g, rows, fill, constant = fills[0]
        total = g.num_pairs * rows
        slab = output_slab(total)
        src, dst = slab[0, :total], slab[1, :total]
        shape = (g.num_pairs, rows)
        if constant:
            fill(src.reshape(shape), dst.reshape(shape), None)
            length = constant_lengths(constant, total)
        else:
            length = slab[2, :total]
            fill(src.reshape(shape), dst.reshape(shape), length.reshape(shape))
            frozen(length)
        return trusted_plan(frozen(src), frozen(dst), length, descriptors_before)
    per_pair = np.array([rows for _, rows, _, _ in fills], dtype=_I64)[pairing.pair_group]  # in output order
    row_start = np.cumsum(per_pair) - per_pair
    total = int(per_pair.sum())
    slab = output_slab(total)
    flat_src, flat_dst, flat_len = slab[0, :total], slab[1, :total], slab[2, :total]
    for g, r, fill, _ in fills:
        shape = (g.num_pairs, r)
        if g.contiguous:  # the group's pairs are adjacent in the output: write in place
            start = int(row_start[g.pair_pos[0]])
            stop = start + g.num_pairs * r
            fill(
                flat_src[start:stop].reshape(shape),
                flat_dst[start:stop].reshape(shape),
                flat_len[start:stop].reshape(shape),
            )
        else:  # interleaved with the other group's pairs: scatter
            src, dst, length = np.empty(shape, _I64), np.empty(shape, _I64), np.empty(shape, _I64)
            fill(src, dst, length)
            pos = row_start[g.pair_pos][:, None] + np.arange(r, dtype=_I64)
            flat_src[pos], flat_dst[pos], flat_len[pos] = src, dst, length
    return trusted_plan(frozen(flat_src), frozen(flat_dst), frozen(flat_len), descriptors_before)
