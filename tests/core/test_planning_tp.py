"""Heterogeneous attention TP: plan_transfer between prefill and decode ranks of different TP sizes.

Property tests build every rank of both sides on real numpy buffers (sglang's
token-major pages: tokens x local heads x head bytes), plan every routed
(prefill rank, decode rank) pair, apply the plans with ``memmove`` and compare
every byte with a naive per-token, per-head oracle; the plans are also compared
descriptor by descriptor (split into single heads) with the oracle's list. The
routing and the "each head once" rule are restated here naively, from the
documentation of :mod:`kvwire.planning.head_slicing`, not imported from it.
"""

from __future__ import annotations

import ctypes
import itertools
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from kvwire.errors import InvalidTransferError
from kvwire.layout.buffers import HeadLayout, KVBuffer, LayoutError, MemoryKind, Role
from kvwire.layout.kv_layout import KVLayout
from kvwire.planning.head_slicing import needs_head_slicing, tp_mismatch
from kvwire.planning.planner import plan_transfer

TP_SIZES = (1, 2, 4, 8)
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def raises(message: str) -> Any:
    return pytest.raises(InvalidTransferError, match="^" + re.escape(message))


# -- the naive model -------------------------------------------------------------------


def naive_heads(tp: int, rank: int, total: int) -> list[int]:
    """Heads a rank holds: total / tp consecutive heads, or one head replicated on tp / total ranks."""
    if total >= tp:
        return list(range(rank * total // tp, (rank + 1) * total // tp))
    return [rank * total // tp]


def naive_senders(p_tp: int, d_tp: int, d: int) -> list[int]:
    """sglang / vLLM: one prefill rank d*P/D when P <= D, else the P/D ranks from d*P/D."""
    return [d * p_tp // d_tp] if p_tp <= d_tp else [d * p_tp // d_tp + i for i in range(p_tp // d_tp)]


def naive_sender_of(p_tp: int, d_tp: int, d: int, head: int, total: int) -> int:
    """The sender of ``head`` to decode rank ``d``: the lowest of its senders holding it."""
    return min(p for p in naive_senders(p_tp, d_tp, d) if head in naive_heads(p_tp, p, total))


@dataclass
class Rank:
    layout: KVLayout
    arrays: list[NDArray[np.uint8]]  # per buffer: (pages, tokens, local heads, head bytes), or (pages, bytes) for MLA


@dataclass
class Case:
    attention: str
    p_tp: int
    d_tp: int
    total: int
    head_bytes: int
    tokens: int
    prefill: list[Rank]
    decode: list[Rank]
    truth: dict[tuple[int, Role], NDArray[np.uint8]]  # (local layer, role) -> (pages, tokens, heads, head bytes)
    src: NDArray[Any]
    dst: NDArray[Any]
    device: NDArray[Any] | None
    layer_ids: list[int] | None
    head_major: bool = False  # MHA pages: (local heads, tokens, head bytes) instead of (tokens, local heads, ...)


def _buffer(a: NDArray[np.uint8], layer: int, role: Role, memory: MemoryKind) -> KVBuffer:
    return KVBuffer(a.ctypes.data, a.nbytes // a.shape[0], a.shape[0], layer, role, memory)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    attention = draw(st.sampled_from(("mha", "mha", "mha", "mla")))
    p_tp = draw(st.sampled_from(TP_SIZES))
    same = draw(st.integers(0, 7)) == 0  # mostly different TP sizes, sometimes the same (the whole-page path)
    d_tp = p_tp if same else draw(st.sampled_from([t for t in TP_SIZES if t != p_tp]))
    total = draw(st.sampled_from((1, 2, 4, 8, 16))) if attention == "mha" else 1
    head_dim, elem = draw(st.sampled_from((1, 2, 3))), draw(st.sampled_from((1, 2, 4)))
    head_bytes = head_dim * elem
    tokens = draw(st.integers(1, 4))
    head_major = attention == "mha" and draw(st.booleans())
    roles: tuple[Role, ...] = ("k", "v") if attention == "mha" else ("kv",)
    n_local = draw(st.integers(1, 2))
    mapped = draw(st.booleans())
    n_peer = n_local + (draw(st.integers(0, 2)) if mapped else 0)
    layer_ids = list(draw(st.permutations(range(n_peer)))[:n_local]) if mapped else None
    peer_memory = draw(st.sampled_from(("host", "device", "split")))
    local_pages, host_pages, device_pages = 8, 9, 7
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    truth = {
        (layer, role): rng.integers(1, 256, size=(local_pages, tokens, total, head_bytes), dtype=np.uint8)
        for layer in range(n_local)
        for role in roles
    }

    def rank(tp: int, r: int, specs: list[tuple[int, Role, MemoryKind, int]], fill: bool) -> Rank:
        held = naive_heads(tp, r, total)
        arrays = []
        for layer, role, _, pages in specs:
            if fill:  # a prefill rank holds its heads of the truth (replicas hold the same bytes)
                mine = truth[(layer, role)][:, :, held, :]
                a = np.ascontiguousarray(mine.transpose(0, 2, 1, 3) if head_major else mine)
            else:
                shape = (pages, len(held), tokens, head_bytes) if head_major else (pages, tokens, len(held), head_bytes)
                a = rng.integers(1, 256, size=shape, dtype=np.uint8)
            arrays.append(a)
        bufs = tuple(_buffer(a, layer, role, m) for a, (layer, role, m, _) in zip(arrays, specs, strict=True))
        heads = HeadLayout(len(held), total, head_dim, elem, tokens, head_major) if attention == "mha" else None
        return Rank(KVLayout(bufs, tp, r, heads), arrays)

    local_specs: list[tuple[int, Role, MemoryKind, int]] = [
        (layer, role, "host", local_pages) for role in roles for layer in range(n_local)
    ]
    peer_layers = range(n_peer) if mapped else range(n_local)
    kinds: list[tuple[int, Role, MemoryKind]] = []
    for role in roles:
        for layer in peer_layers:
            kind = draw(st.sampled_from(("host", "device"))) if peer_memory == "split" else peer_memory
            kinds.append((layer, role, kind))  # type: ignore[arg-type]
    split = len({m for _, _, m in kinds}) == 2  # device buffers of a split layout have their own, fewer pages
    peer_specs: list[tuple[int, Role, MemoryKind, int]] = [
        (layer, role, m, device_pages if split and m == "device" else host_pages) for layer, role, m in kinds
    ]
    prefill = [rank(p_tp, p, local_specs, True) for p in range(p_tp)]
    decode = [rank(d_tp, d, peer_specs, False) for d in range(d_tp)]
    n = draw(st.integers(0, 6))
    int_type = draw(st.sampled_from((np.int32, np.int64)))
    src = rng.choice(local_pages, size=n, replace=draw(st.booleans())).astype(int_type)
    dst = rng.choice(host_pages, size=n, replace=False).astype(int_type)  # host buffers, or all of one kind
    mapped_layers = layer_ids if layer_ids is not None else list(range(n_local))
    targets_device = split and any(m == "device" for layer, _, m, _ in peer_specs if layer in mapped_layers)
    device = rng.choice(device_pages, size=n, replace=False).astype(int_type) if targets_device else None
    if n >= 2 and draw(st.integers(0, 9)) == 0:  # now and then a repeated destination page
        which = dst if device is None or draw(st.booleans()) else device
        i, j = sorted(draw(st.lists(st.integers(0, n - 1), min_size=2, max_size=2, unique=True)))
        which[j] = which[i]
    return Case(
        attention,
        p_tp,
        d_tp,
        total,
        head_bytes,
        tokens,
        prefill,
        decode,
        truth,
        src,
        dst,
        device,
        layer_ids,
        head_major,
    )


def expected_repeat(case: Case) -> str | None:
    """The refusal due for a repeated destination page, over the index sets the request uses."""
    peer = case.decode[0].layout
    split = len({b.memory for b in peer.buffers}) == 2
    host_used = not split or any(peer.buffers[j].memory == "host" for _, j in targets(case, 0))
    return (first_repeat("dst_kv_indices", case.dst) if host_used else None) or first_repeat(
        "dst_device_kv_indices", case.device
    )


def first_repeat(name: str, ids: NDArray[Any] | None) -> str | None:
    if ids is None:
        return None
    seen: dict[int, int] = {}
    for j, v in enumerate(ids.tolist()):
        if v in seen:
            return f"{name}[{j}] = {v} repeats {name}[{seen[v]}]"
        seen[v] = j
    return None


def plan(case: Case, p: int, d: int) -> Any:
    local, peer = case.prefill[p].layout, case.decode[d].layout
    return plan_transfer(local, peer, case.src, [b.base for b in peer.buffers], case.dst, case.layer_ids, case.device)


def targets(case: Case, d: int) -> list[tuple[int, int]]:
    """(local buffer, peer buffer) pairs, the naive way."""
    local, peer = case.prefill[0].layout, case.decode[d].layout
    out = []
    for i, lb in enumerate(local.buffers):
        layer = lb.layer if case.layer_ids is None else case.layer_ids[local.layers.index(lb.layer)]
        out += [(i, j) for j, pb in enumerate(peer.buffers) if pb.layer == layer and pb.role == lb.role]
    return out


def dst_ids(case: Case, d: int, j: int) -> NDArray[Any]:
    peer = case.decode[d].layout
    split = len({b.memory for b in peer.buffers}) == 2
    if split and peer.buffers[j].memory == "device":
        assert case.device is not None
        return case.device
    return case.dst


def oracle_slices(case: Case, p: int, d: int) -> list[tuple[int, int, int]]:
    """(src address, dst address, bytes) per token per head that p sends d (MLA: per token)."""
    local, peer = case.prefill[p].layout, case.decode[d].layout
    out = []
    for i, j in targets(case, d):
        lb, pb = local.buffers[i], peer.buffers[j]
        ids = dst_ids(case, d, j)
        if case.attention == "mla":
            if p != naive_senders(case.p_tp, case.d_tp, d)[0]:
                continue
            row = lb.page_bytes // case.tokens
            for k in range(len(case.src)):
                for t in range(case.tokens):
                    out.append(
                        (
                            lb.base + int(case.src[k]) * lb.page_bytes + t * row,
                            pb.base + int(ids[k]) * pb.page_bytes + t * row,
                            row,
                        )
                    )
            continue
        mine, theirs = naive_heads(case.p_tp, p, case.total), naive_heads(case.d_tp, d, case.total)
        for k in range(len(case.src)):
            for t in range(case.tokens):
                for h in theirs:
                    if naive_sender_of(case.p_tp, case.d_tp, d, h, case.total) != p:
                        continue
                    if case.head_major:  # head h's tokens are one run of the page
                        s_row, q_row = mine.index(h) * case.tokens + t, theirs.index(h) * case.tokens + t
                    else:
                        s_row, q_row = t * len(mine) + mine.index(h), t * len(theirs) + theirs.index(h)
                    s = lb.base + int(case.src[k]) * lb.page_bytes + s_row * case.head_bytes
                    q = pb.base + int(ids[k]) * pb.page_bytes + q_row * case.head_bytes
                    out.append((s, q, case.head_bytes))
    return out


def split_plan(plan: Any, unit: int) -> list[tuple[int, int, int]]:
    """The plan cut into ``unit``-byte pieces (a descriptor must be a whole number of them)."""
    out = []
    for s, d, n in zip(plan.src.tolist(), plan.dst.tolist(), plan.length.tolist(), strict=True):
        assert n > 0 and n % unit == 0, (n, unit)
        out += [(s + x, d + x, unit) for x in range(0, n, unit)]
    return out


def inside(addr: NDArray[np.int64], length: NDArray[np.int64], layout: KVLayout) -> bool:
    bases = np.array(sorted(b.base for b in layout.buffers), dtype=np.int64)
    ends = {b.base: b.end for b in layout.buffers}
    k = np.searchsorted(bases, addr, side="right") - 1
    if len(addr) and (k < 0).any():
        return False
    return all(a + n <= ends[int(bases[i])] for a, n, i in zip(addr.tolist(), length.tolist(), k.tolist(), strict=True))


# -- properties ----------------------------------------------------------------------------


@SETTINGS
@given(cases())
def test_every_decode_rank_gets_exactly_its_heads_once(case: Case) -> None:
    repeat = expected_repeat(case)
    event(f"{case.attention} P={case.p_tp} D={case.d_tp}" if case.p_tp != case.d_tp else f"{case.attention} same TP")
    if case.attention == "mha":
        event("mha, replicated heads" if case.total < max(case.p_tp, case.d_tp) else "mha, no replication")
    event("refused: repeated page" if repeat else "planned")
    before = [[a.copy() for a in r.arrays] for r in case.prefill]
    for d in range(case.d_tp):
        decode = case.decode[d]
        want = [a.copy() for a in decode.arrays]
        written: list[tuple[int, int]] = []
        for p in range(case.p_tp):
            if p not in naive_senders(case.p_tp, case.d_tp, d):
                with raises(f"rank out of range: prefill rank {p} (of {case.p_tp}) does not send to decode rank {d}"):
                    plan(case, p, d)
                continue
            if repeat is not None:  # the oracle is not asked: the request is refused
                with raises(repeat):
                    plan(case, p, d)
                continue
            got = plan(case, p, d)
            unit = (
                case.head_bytes
                if case.attention == "mha"
                else case.prefill[p].layout.buffers[0].page_bytes // case.tokens
            )
            assert sorted(split_plan(got, unit)) == sorted(oracle_slices(case, p, d))
            assert inside(got.src, got.length, case.prefill[p].layout)
            assert inside(got.dst, got.length, decode.layout)
            for s, q, n in zip(got.src.tolist(), got.dst.tolist(), got.length.tolist(), strict=True):
                ctypes.memmove(q, s, n)
                written.append((q, n))
        if repeat is not None:
            continue
        written.sort()  # every destination byte at most once, over all of d's senders
        assert all(a + n <= b for (a, n), (b, _) in itertools.pairwise(written))
        for i, j in targets(case, d):  # the oracle, one token and one head at a time
            layer, role = case.prefill[0].layout.buffers[i].layer, case.prefill[0].layout.buffers[i].role
            theirs = naive_heads(case.d_tp, d, case.total)
            ids = dst_ids(case, d, j)
            for k in range(len(case.src)):
                for t in range(case.tokens):
                    for x, h in enumerate(theirs):
                        at = (int(ids[k]), x, t) if case.head_major else (int(ids[k]), t, x)
                        want[j][at] = case.truth[(layer, role)][int(case.src[k]), t, h]
        for got_array, want_array in zip(decode.arrays, want, strict=True):
            np.testing.assert_array_equal(got_array, want_array)
    for r, arrays in zip(case.prefill, before, strict=True):  # sources untouched
        for a, b in zip(r.arrays, arrays, strict=True):
            np.testing.assert_array_equal(a, b)


@SETTINGS
@given(cases())
def test_descriptor_counts_and_coalescing(case: Case) -> None:
    """Whole pages (coalesced into runs) when the moved heads are whole rows on both sides, else one per token."""
    if expected_repeat(case):
        return
    d = case.d_tp - 1
    pairs, n = len(targets(case, d)), len(case.src)
    for p in naive_senders(case.p_tp, case.d_tp, d):
        got = plan(case, p, d)
        mine, theirs = naive_heads(case.p_tp, p, case.total), naive_heads(case.d_tp, d, case.total)
        if case.attention == "mla":
            moved = mine if p == naive_senders(case.p_tp, case.d_tp, d)[0] else []
        else:
            moved = [h for h in theirs if naive_sender_of(case.p_tp, case.d_tp, d, h, case.total) == p]
        if not moved or n == 0:
            assert len(got) == 0
        elif moved == mine == theirs:
            assert got.descriptors_before == n * pairs
            assert len(got) <= n * pairs
        elif case.head_major:  # the moved heads of a page are one run: one descriptor per page
            assert got.descriptors_before == len(got) == n * pairs
            assert set(got.length.tolist()) == {len(moved) * case.head_bytes * case.tokens}
        else:
            assert got.descriptors_before == len(got) == n * case.tokens * pairs
            assert set(got.length.tolist()) == {len(moved) * case.head_bytes}


# -- known vectors ---------------------------------------------------------------------------


def mha_rank(
    first_base: int,
    tp: int,
    rank: int,
    total: int = 2,
    head_bytes: tuple[int, int] = (2, 2),
    tokens: int = 2,
    pages: int = 8,
    layers: int = 1,
    head_major: bool = False,
) -> KVLayout:
    held = max(1, total // tp)
    heads = HeadLayout(held, total, head_bytes[0], head_bytes[1], tokens, head_major)
    pb = heads.page_bytes
    specs = [(layer, role) for role in ("k", "v") for layer in range(layers)]
    return KVLayout(
        tuple(KVBuffer(first_base + i * pb * pages, pb, pages, layer, role) for i, (layer, role) in enumerate(specs)),  # type: ignore[arg-type]
        tp,
        rank,
        heads,
    )


def triples(p: Any) -> list[tuple[int, int, int]]:
    return list(zip(p.src.tolist(), p.dst.tolist(), p.length.tolist(), strict=True))


def test_known_vector_one_prefill_rank_to_the_second_of_two_decode_ranks() -> None:
    # 2 KV heads of 4 bytes, 2 tokens a page: prefill pages are 16 B (rows of 8), decode pages 8 B (rows of 4)
    local, peer = mha_rank(1 << 20, 1, 0), mha_rank(1 << 30, 2, 1)
    got = plan_transfer(local, peer, np.array([3], np.int32), [b.base for b in peer.buffers], np.array([1], np.int32))
    k, v = 1 << 20, (1 << 20) + 16 * 8
    dk, dv = 1 << 30, (1 << 30) + 8 * 8
    assert triples(got) == [
        (k + 48 + 4, dk + 8, 4),  # K, token 0: head 1 (second half of the prefill row)
        (k + 48 + 8 + 4, dk + 8 + 4, 4),  # K, token 1
        (v + 48 + 4, dv + 8, 4),
        (v + 48 + 8 + 4, dv + 8 + 4, 4),
    ]
    assert got.descriptors_before == 4
    assert tp_mismatch(local, peer) and needs_head_slicing(local, peer)


def test_known_vector_head_major_pages_move_one_run_per_page_both_ways() -> None:
    # 2 KV heads of 4 bytes, 2 tokens a page, head-major: prefill pages are [h0t0 h0t1 h1t0 h1t1] (16 B),
    # decode rank 1 holds head 1: its pages are [h1t0 h1t1] (8 B), the second half of a prefill page.
    local, peer = mha_rank(1 << 20, 1, 0, head_major=True), mha_rank(1 << 30, 2, 1, head_major=True)
    ptrs = [b.base for b in peer.buffers]
    got = plan_transfer(local, peer, np.array([3, 6], np.int32), ptrs, np.array([1, 4], np.int32))
    k, v = 1 << 20, (1 << 20) + 16 * 8
    dk, dv = 1 << 30, (1 << 30) + 8 * 8
    assert triples(got) == [
        (k + 48 + 8, dk + 8, 8),
        (k + 96 + 8, dk + 32, 8),
        (v + 48 + 8, dv + 8, 8),
        (v + 96 + 8, dv + 32, 8),
    ]
    assert got.descriptors_before == 4
    # 2 -> 1: each prefill rank fills its half of every decode page, one descriptor per page
    peer = mha_rank(1 << 30, 1, 0, head_major=True)
    for p in range(2):
        local = mha_rank((1 << 20) * (p + 1), 2, p, head_major=True)
        got = plan_transfer(
            local, peer, np.array([2], np.int64), [b.base for b in peer.buffers], np.array([7], np.int64)
        )
        k, v = local.buffers[0].base, local.buffers[1].base
        dk, dv = peer.buffers[0].base, peer.buffers[1].base
        assert triples(got) == [(k + 2 * 8, dk + 7 * 16 + 8 * p, 8), (v + 2 * 8, dv + 7 * 16 + 8 * p, 8)]


def test_vllm_style_kv_blocks_with_head_major_heads_are_mha_and_sliced_per_block() -> None:
    """One 'kv' buffer per layer whose block is [heads, tokens, K|V] (vLLM's): head-sliced like MHA."""

    # 2 KV heads, 2 tokens a block, K|V of 2 x 2 bytes per token: a prefill block is 16 B, a decode rank's 8 B
    def rank(base: int, tp: int, r: int) -> KVLayout:
        heads = HeadLayout(2 // tp, 2, 4, 1, 2, head_major=True)
        return KVLayout((KVBuffer(base, heads.page_bytes, 8, 0, "kv"),), tp, r, heads)

    local, peer = rank(1 << 20, 1, 0), rank(1 << 30, 2, 1)
    assert local.attention == peer.attention == "mha" and needs_head_slicing(local, peer)
    got = plan_transfer(local, peer, np.array([3], np.int32), [peer.buffers[0].base], np.array([5], np.int32))
    assert triples(got) == [((1 << 20) + 3 * 16 + 8, (1 << 30) + 5 * 8, 8)]  # head 1's K|V of both tokens
    mla = KVLayout((KVBuffer(1 << 20, 16, 8, 0, "kv"),), 1, 0)
    assert mla.attention == "mla"


def test_pages_of_different_orders_are_refused_before_planning() -> None:
    ptrs_of = lambda layout: [b.base for b in layout.buffers]  # noqa: E731
    one = np.array([0], np.int32)
    for local, peer, message in (
        (
            mha_rank(1 << 20, 1, 0, head_major=True),
            mha_rank(1 << 30, 2, 1),
            "head-major, the decode layout's token-major",
        ),
        (
            mha_rank(1 << 20, 2, 0),
            mha_rank(1 << 30, 2, 0, head_major=True),
            "token-major, the decode layout's head-major",
        ),
    ):
        with raises(
            f"page order mismatch: the prefill layout's pages are {message}; "
            "head slices move only between pages of the same order"
        ):
            plan_transfer(local, peer, one, ptrs_of(peer), one)


def test_two_prefill_ranks_fill_one_decode_page() -> None:
    peer = mha_rank(1 << 30, 1, 0)  # rows of 8 B: head 0 then head 1
    for p in range(2):
        local = mha_rank((1 << 20) * (p + 1), 2, p)
        got = plan_transfer(
            local, peer, np.array([2, 5], np.int64), [b.base for b in peer.buffers], np.array([0, 7], np.int64)
        )
        k = local.buffers[0].base
        assert triples(got)[:2] == [(k + 2 * 8, (1 << 30) + 4 * p, 4), (k + 2 * 8 + 4, (1 << 30) + 8 + 4 * p, 4)]
        assert len(got) == 2 * 2 * 2


def test_whole_rows_merge_tokens_and_pages() -> None:
    """One KV head replicated on both decode ranks: its row is the whole row on both sides, pages coalesce."""
    local, peer = mha_rank(1 << 20, 1, 0, total=1), mha_rank(1 << 30, 2, 1, total=1)
    got = plan_transfer(
        local, peer, np.array([2, 3, 4], np.int32), [b.base for b in peer.buffers], np.array([5, 6, 7], np.int32)
    )
    assert triples(got) == [((1 << 20) + 2 * 8, (1 << 30) + 5 * 8, 24), ((1 << 20) + 64 + 16, (1 << 30) + 64 + 40, 24)]
    assert got.descriptors_before == 6


def test_gqa_replicas_send_once() -> None:
    """2 KV heads, prefill TP 8 (each head on 4 ranks), decode TP 2: the first replica of each head sends."""
    for d in range(2):
        peer = mha_rank(1 << 30, 2, d)
        ptrs = [b.base for b in peer.buffers]
        for p in range(8):
            local = mha_rank(1 << 20, 8, p)
            if p // 4 != d:
                with raises(
                    f"rank out of range: prefill rank {p} (of 8) does not send to decode rank {d} (of 2); "
                    f"decode rank {d} receives from prefill ranks {4 * d}..{4 * d + 3}"
                ):
                    plan_transfer(local, peer, np.array([1], np.int32), ptrs, np.array([1], np.int32))
                continue
            got = plan_transfer(local, peer, np.array([1, 2], np.int32), ptrs, np.array([1, 2], np.int32))
            assert len(got) == (2 if p == 4 * d else 0)  # one head a side: whole pages, one run per buffer


def test_gqa_decode_replicas_each_receive_their_head() -> None:
    """2 KV heads, prefill TP 2, decode TP 8: decode rank d takes head d // 4 from prefill rank d // 4."""
    for d in range(8):
        peer = mha_rank(1 << 30, 8, d)
        local = mha_rank(1 << 20, 2, d // 4)
        got = plan_transfer(
            local, peer, np.array([1], np.int32), [b.base for b in peer.buffers], np.array([3], np.int32)
        )
        assert got.nbytes == 2 * 2 * 4  # K and V, 2 tokens of one 4-byte head


def test_mla_across_tp_sizes_sends_whole_pages_from_the_first_sender() -> None:
    def mla(base: int, tp: int, rank: int) -> KVLayout:
        return KVLayout((KVBuffer(base, 64, 8, 0, "kv"), KVBuffer(base + 512, 64, 8, 1, "kv")), tp, rank)

    peer = mla(1 << 30, 1, 0)
    ptrs = [b.base for b in peer.buffers]
    first = plan_transfer(mla(1 << 20, 4, 0), peer, np.array([1, 2], np.int32), ptrs, np.array([3, 4], np.int32))
    assert triples(first) == [
        ((1 << 20) + 64, (1 << 30) + 192, 128),
        ((1 << 20) + 512 + 64, (1 << 30) + 512 + 192, 128),
    ]
    for p in (1, 2, 3):
        assert len(plan_transfer(mla(1 << 20, 4, p), peer, np.array([1], np.int32), ptrs, np.array([3], np.int32))) == 0
    assert tp_mismatch(mla(1, 4, 0), peer) and not needs_head_slicing(mla(1, 4, 0), peer)


def test_same_tp_keeps_whole_pages_and_checks_the_rank() -> None:
    local, peer = mha_rank(1 << 20, 2, 1), mha_rank(1 << 30, 2, 1)
    got = plan_transfer(
        local, peer, np.array([1, 2], np.int32), [b.base for b in peer.buffers], np.array([3, 4], np.int32)
    )
    assert triples(got) == [((1 << 20) + 8, (1 << 30) + 24, 16), ((1 << 20) + 64 + 8, (1 << 30) + 64 + 24, 16)]
    assert not tp_mismatch(local, peer)
    with raises(
        "rank out of range: prefill rank 1 (of 2) does not send to decode rank 0 (of 2); "
        "decode rank 0 receives from prefill rank 0"
    ):
        plan_transfer(
            local,
            mha_rank(1 << 30, 2, 0),
            np.array([1], np.int32),
            [b.base for b in peer.buffers],
            np.array([3], np.int32),
        )


def test_the_sglang_slice_arithmetic_agrees() -> None:
    """sglang's send_kvcache_slice addresses, transliterated, give the same descriptors (no replication)."""
    total, hb, tokens = 8, 4, 4
    src_ids, dst_ids = np.array([5, 1, 6], np.int64), np.array([0, 9, 4], np.int64)
    for p_tp, d_tp in ((1, 2), (2, 1), (2, 8), (8, 2), (4, 8), (1, 8)):
        for d in range(d_tp):
            for p in naive_senders(p_tp, d_tp, d):
                local = mha_rank(1 << 20, p_tp, p, total, (2, 2), tokens, pages=16, layers=2)
                peer = mha_rank(1 << 32, d_tp, d, total, (2, 2), tokens, pages=16, layers=2)
                got = plan_transfer(local, peer, src_ids, [b.base for b in peer.buffers], dst_ids)
                src_heads, dst_heads = max(1, total // p_tp), max(1, total // d_tp)
                if p_tp > d_tp:
                    src_off, heads, dst_off = 0, src_heads, (p * src_heads) % dst_heads
                else:
                    src_off, heads, dst_off = (d * dst_heads) % src_heads, dst_heads, 0
                want = []
                for lb, pb in zip(local.buffers, peer.buffers, strict=True):
                    for k in range(3):
                        for t in range(tokens):
                            want.append(
                                (
                                    lb.base + int(src_ids[k]) * lb.page_bytes + t * src_heads * hb + src_off * hb,
                                    pb.base + int(dst_ids[k]) * pb.page_bytes + t * dst_heads * hb + dst_off * hb,
                                    heads * hb,
                                )
                            )
                assert triples(got) == want, (p_tp, p, d_tp, d)


# -- refusals --------------------------------------------------------------------------------


def _request(local: KVLayout, peer: KVLayout) -> Any:
    return plan_transfer(local, peer, np.array([0], np.int32), [b.base for b in peer.buffers], np.array([0], np.int32))


@pytest.mark.parametrize(
    ("local", "peer", "message"),
    [
        (
            mha_rank(1 << 20, 2, 0, total=6),
            mha_rank(1 << 30, 3, 0, total=6),
            "attention TP sizes differ (prefill 2, decode 3): the larger must be a multiple of the smaller",
        ),
        (
            mha_rank(1 << 20, 1, 0, total=8),
            mha_rank(1 << 30, 2, 0, total=4),
            "KV head count mismatch: the prefill layout has total_kv_heads = 8, the decode layout 4",
        ),
        (
            mha_rank(1 << 20, 1, 0, head_bytes=(2, 2)),
            mha_rank(1 << 30, 2, 0, head_bytes=(1, 2)),
            "head_dim mismatch: the prefill layout has head_dim = 2, the decode layout 1",
        ),
        (
            mha_rank(1 << 20, 1, 0, head_bytes=(2, 2)),
            mha_rank(1 << 30, 2, 0, head_bytes=(2, 1)),
            "element size (dtype) mismatch: the prefill layout has elem_bytes = 2, the decode layout 1",
        ),
        (
            mha_rank(1 << 20, 1, 0, tokens=2),
            mha_rank(1 << 30, 2, 0, tokens=4),
            "tokens per page mismatch: the prefill layout has tokens_per_page = 2, the decode layout 4",
        ),
        (
            mha_rank(1 << 20, 2, 1),
            mha_rank(1 << 30, 4, 0),
            "rank out of range: prefill rank 1 (of 2) does not send to decode rank 0 (of 4); "
            "decode rank 0 receives from prefill rank 0",
        ),
        (
            mha_rank(1 << 20, 4, 0),
            mha_rank(1 << 30, 2, 1),
            "rank out of range: prefill rank 0 (of 4) does not send to decode rank 1 (of 2); "
            "decode rank 1 receives from prefill ranks 2..3",
        ),
        (
            mha_rank(1 << 20, 1, 0, total=8),
            mha_rank(1 << 30, 2, 0, total=8, tokens=3),
            "tokens per page mismatch: the prefill layout has tokens_per_page = 2, the decode layout 3",
        ),
    ],
)
def test_bad_combinations_are_refused(local: KVLayout, peer: KVLayout, message: str) -> None:
    with raises(message):
        _request(local, peer)


def test_without_ranks_the_whole_page_path_applies() -> None:
    """Layouts that do not record their ranks (older descriptions) are planned as before: pages must match."""
    full = mha_rank(1 << 30, 2, 0)
    no_rank = KVLayout(full.buffers, 2)
    with raises(
        "page size mismatch: local buffer 0 (layer 0, k) has 16 bytes per page, its target peer buffer 0 "
        "(layer 0, k, host) has 8; the attention TP sizes differ (prefill 1, decode 2): record attn_tp_rank "
        "(and heads, for MHA) on both layouts to plan head slices"
    ):
        _request(mha_rank(1 << 20, 1, 0), no_rank)
    assert tp_mismatch(mha_rank(1 << 20, 1, 0), no_rank) and not needs_head_slicing(mha_rank(1 << 20, 1, 0), no_rank)
    legacy = KVLayout(mha_rank(1 << 40, 1, 0, total=1).buffers, 1)  # one head: equal pages, whole pages as before
    got = _request(legacy, KVLayout(mha_rank(1 << 30, 2, 1, total=1).buffers, 2))
    assert triples(got) == [(1 << 40, 1 << 30, 8), ((1 << 40) + 64, (1 << 30) + 64, 8)]


def test_missing_heads_are_refused() -> None:
    no_heads = KVLayout(mha_rank(1 << 20, 1, 0).buffers, 1, 0)
    with raises(
        "attention TP sizes differ (prefill 1, decode 2): slicing MHA pages needs each side's KV heads; "
        "the local (prefill) layout does not record heads"
    ):
        _request(no_heads, mha_rank(1 << 30, 2, 0))
    with raises(
        "attention TP sizes differ (prefill 2, decode 1): slicing MHA pages needs each side's KV heads; "
        "the peer (decode) layout does not record heads"
    ):
        _request(mha_rank(1 << 20, 2, 0), KVLayout(mha_rank(1 << 30, 1, 0).buffers, 1, 0))


def test_layout_fields_are_validated() -> None:
    buf = (KVBuffer(4096, 16, 4, 0, "k"), KVBuffer(8192, 16, 4, 0, "v"))
    heads = HeadLayout(2, 2, 2, 2, 2)
    bad: list[tuple[dict[str, Any], str]] = [
        ({"attn_tp_size": 2, "attn_tp_rank": 2}, "KVLayout.attn_tp_rank = 2 is out of range: attn_tp_size is 2"),
        ({"attn_tp_rank": 0}, "KVLayout.attn_tp_rank needs attn_tp_size"),
        ({"attn_tp_size": 1, "attn_tp_rank": -1}, "KVLayout.attn_tp_rank must be >= 0, got -1"),
        ({"attn_tp_size": 1, "heads": heads}, "KVLayout.heads needs attn_tp_size and attn_tp_rank"),
        (
            {"attn_tp_size": 2, "attn_tp_rank": 0, "heads": heads},
            "HeadLayout.kv_heads = 2, but total_kv_heads = 2 over attn_tp_size = 2 gives 1 per rank",
        ),
        (
            {"attn_tp_size": 1, "attn_tp_rank": 0, "heads": HeadLayout(2, 2, 4, 2, 2)},
            "KVLayout.buffers[0].page_bytes = 16, but heads say kv_heads 2 x head_dim 4 x elem_bytes 2 "
            "x tokens_per_page 2 = 32",
        ),
        (
            {"attn_tp_size": 1, "attn_tp_rank": 0, "heads": "2x2"},
            "KVLayout.heads must be a HeadLayout or None, got str",
        ),
    ]
    for kwargs, message in bad:
        with pytest.raises(LayoutError, match="^" + re.escape(message)):
            KVLayout(buf, **kwargs)
    with pytest.raises(
        LayoutError,
        match=re.escape("HeadLayout.total_kv_heads = 6 is not divisible by attn_tp_size = 4 (nor divides it)"),
    ):
        KVLayout((KVBuffer(4096, 12, 4, 0, "k"),), 4, 0, HeadLayout(1, 6, 3, 2, 2))
    with pytest.raises(LayoutError, match=re.escape("HeadLayout.total_kv_heads = 3 does not divide attn_tp_size = 4")):
        KVLayout((KVBuffer(4096, 12, 4, 0, "k"),), 4, 0, HeadLayout(1, 3, 3, 2, 2))
    with pytest.raises(LayoutError) as exc:
        KVLayout((KVBuffer(4096, 16, 4, 0, "kv"),), 1, 0, heads)
    assert str(exc.value) == (
        "KVLayout.heads: 'kv' buffers are head-sliced only as head-major pages that hold each head's K and V "
        "together (vLLM's blocks: HeadLayout(..., head_major=True) with head_dim K + V); an MLA latent buffer is "
        "not head-sliced: leave heads None"
    )
    for args, message in [
        ((0, 2, 2, 2, 2), "HeadLayout.kv_heads must be >= 1, got 0"),
        ((3, 2, 2, 2, 2), "HeadLayout.kv_heads = 3 exceeds total_kv_heads = 2"),
        ((1, 1, 2, 3, 2), "HeadLayout.elem_bytes must be one of (1, 2, 4, 8), got 3"),
        ((1, 1, 2, 2, True), "HeadLayout.tokens_per_page must be an int, got bool True"),
        ((1, 1, 1 << 21, 2, 2), f"HeadLayout.head_dim must be <= {1 << 20}, got {1 << 21}"),
    ]:
        with pytest.raises(LayoutError, match="^" + re.escape(message)):
            HeadLayout(*args)
