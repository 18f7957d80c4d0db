"""Property tests: plan_transfer against a naive per-page reference, on real memory filled with random bytes.

Each example builds real numpy buffers (MHA or MLA, optional pipeline-parallel
layer mapping, host-only / device-only / split-by-layer / host+device peers),
draws fragmented page sets, applies the plan with ``memmove`` and compares every
byte of every buffer with what a plain Python loop, one page at a time, says
must happen.

Now and then a destination page id is drawn twice: the request must then be
refused, naming the first repeat and its first occurrence, and the reference
is not asked.

The destination rule the reference applies is a property of the PEER LAYOUT,
not of the request: when the peer layout has both host and device buffers (a
split destination), host buffers take ``dst_kv_indices`` and device buffers
``dst_device_kv_indices``, and device ids are passed exactly when the request
(after layer mapping) targets a device buffer; when the layout is all of one
kind, every buffer takes ``dst_kv_indices`` and no device ids are passed. The
"split" peers draw a kind per layer, so with a layer mapping a request often
targets only one kind of a split layout (sglang issue #31482).
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from kvwire.errors import InvalidTransferError
from kvwire.layout.buffers import KVBuffer, MemoryKind, Role
from kvwire.layout.kv_layout import KVLayout
from kvwire.planning.plan import TransferPlan
from kvwire.planning.planner import plan_transfer

# host / device: one kind; split: a kind per layer; both: a host and a device buffer per layer;
# stage: a split layout whose targeted layers (a mapped pipeline stage) are all of one kind
PEER_MEMORY = ("host", "device", "split", "both", "stage")
INDEX_MODES = ("consecutive", "random", "sorted", "runs", "runs-touching")

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass
class Case:
    local: KVLayout
    peer: KVLayout
    local_arrays: list[NDArray[np.uint8]]
    peer_arrays: list[NDArray[np.uint8]]
    prefill: NDArray[Any]
    host: NDArray[Any]
    device: NDArray[Any] | None
    layer_ids: list[int] | None


def page_ids(rng: np.random.Generator, mode: str, n: int, space: int) -> NDArray[np.int64]:
    """``n`` distinct page ids out of ``space``, fragmented in the way ``mode`` says."""
    if mode == "consecutive":
        start = int(rng.integers(0, space - n + 1))
        return np.arange(start, start + n, dtype=np.int64)
    if mode == "sorted":
        return np.sort(rng.choice(space, size=n, replace=False)).astype(np.int64)
    if mode.startswith("runs") and n:
        lengths: list[int] = []
        while sum(lengths) < n:
            lengths.append(min(int(rng.geometric(1 / 3)), n - sum(lengths)))
        low_gap = 0 if mode == "runs-touching" else 1  # touching runs merge on this side only
        gaps = rng.integers(low_gap, 3, size=len(lengths))
        if sum(lengths) + int(gaps.sum()) <= space:
            order = rng.permutation(len(lengths))
            slots = np.array(lengths)[order] + gaps
            starts = np.empty(len(lengths), dtype=np.int64)
            starts[order] = np.cumsum(slots) - slots
            return np.concatenate([np.arange(s, s + k) for s, k in zip(starts, lengths, strict=True)]).astype(np.int64)
    return rng.choice(space, size=n, replace=False).astype(np.int64)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    attention = draw(st.sampled_from(("mha", "mla")))
    roles: tuple[Role, ...] = ("k", "v") if attention == "mha" else ("kv",)
    n_local = draw(st.integers(1, 3))
    peer_memory = draw(st.sampled_from(PEER_MEMORY))
    stage = peer_memory == "stage"
    mapped = stage or draw(st.booleans())
    n_peer = n_local + (draw(st.integers(1 if stage else 0, 3)) if mapped else 0)
    layer_ids = draw(st.permutations(range(n_peer)))[:n_local] if mapped else None
    page_bytes = draw(st.sampled_from((8, 24, 64)))
    pages = st.integers(16, 64) | st.integers(1, 64)
    local_pages, host_pages, device_pages = draw(pages), draw(pages), draw(pages)
    most = min(local_pages, host_pages, device_pages)
    n = draw(st.integers(most // 2, most) | st.just(most) | st.integers(0, most))  # lean to long requests
    modes = [draw(st.sampled_from(INDEX_MODES)) for _ in range(3)]
    int_type = draw(st.sampled_from((np.int32, np.int64)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))

    def random_pages(pages: int) -> NDArray[np.uint8]:
        return rng.integers(1, 256, size=(pages, page_bytes), dtype=np.uint8)

    def buffer(arr: NDArray[np.uint8], layer: int, role: Role, memory: MemoryKind) -> KVBuffer:
        return KVBuffer(arr.ctypes.data, page_bytes, arr.shape[0], layer, role, memory)

    local_arrays = [random_pages(local_pages) for _ in roles for _ in range(n_local)]
    # local layer ids need not start at 0: a later pipeline stage may keep global ids
    first_local = draw(st.integers(0, 2))
    local = KVLayout(
        tuple(
            buffer(local_arrays[r * n_local + i], first_local + i, role, "host")
            for r, role in enumerate(roles)
            for i in range(n_local)
        )
    )
    if not mapped:
        layer_ids = None
        peer_layers = [first_local + i for i in range(n_local)]
    else:
        peer_layers = list(range(n_peer))
    stage_kind: MemoryKind = draw(st.sampled_from(("host", "device")))
    other_kind: MemoryKind = "device" if stage_kind == "host" else "host"
    peer_specs: list[tuple[int, Role, MemoryKind]] = []
    for role in roles:
        for layer in peer_layers:
            if peer_memory in ("host", "device"):
                peer_specs.append((layer, role, peer_memory))  # type: ignore[arg-type]
            elif peer_memory == "stage":
                assert layer_ids is not None
                peer_specs.append((layer, role, stage_kind if layer in layer_ids else other_kind))
            elif peer_memory == "split":
                peer_specs.append((layer, role, draw(st.sampled_from(("host", "device")))))
            else:
                peer_specs += [(layer, role, "host"), (layer, role, "device")]
    if draw(st.booleans()):
        peer_specs = draw(st.permutations(peer_specs))
    peer_arrays = [random_pages(host_pages if m == "host" else device_pages) for _, _, m in peer_specs]
    peer = KVLayout(tuple(buffer(a, *spec) for a, spec in zip(peer_arrays, peer_specs, strict=True)))

    # the peer layout's kinds decide which ids address what; the targets only whether device ids are due
    split = layout_is_split(peer)
    targets_device = any(peer.buffers[j].memory == "device" for _, j in pair_targets(local, peer, layer_ids))
    # dst_kv_indices addresses the host buffers of a split layout, else every buffer (of the one kind)
    host_space = host_pages if split or peer.buffers[0].memory == "host" else device_pages
    prefill = page_ids(rng, modes[0], n, local_pages).astype(int_type)
    host = page_ids(rng, modes[1], n, host_space).astype(int_type)
    device = page_ids(rng, modes[2], n, device_pages).astype(int_type) if split and targets_device else None
    if n >= 2 and draw(st.integers(0, 9)) == 0:  # a repeated destination page
        ids = host if device is None or draw(st.booleans()) else device
        i, j = sorted(draw(st.lists(st.integers(0, n - 1), min_size=2, max_size=2, unique=True)))
        ids[j] = ids[i]
    return Case(local, peer, local_arrays, peer_arrays, prefill, host, device, layer_ids)


def first_repeat(name: str, ids: NDArray[Any] | None) -> str | None:
    """``name[j] = v repeats name[i]`` for the first position j whose id came before (at i), else None."""
    seen: dict[int, int] = {}
    for j, v in enumerate([] if ids is None else ids.tolist()):
        if v in seen:
            return f"{name}[{j}] = {v} repeats {name}[{seen[v]}]"
        seen[v] = j
    return None


def expected_repeat(case: Case) -> str | None:
    """The refusal due for a repeated destination page, over the index sets the request uses (host first)."""
    host_used = not layout_is_split(case.peer) or any(case.peer.buffers[j].memory == "host" for _, j in targets(case))
    return (first_repeat("dst_kv_indices", case.host) if host_used else None) or first_repeat(
        "dst_device_kv_indices", case.device
    )


def refused_for_repeat(case: Case, coalesce: bool = True) -> bool:
    """True (after checking the refusal) when the case repeats a destination page: the reference is not asked."""
    message = expected_repeat(case)
    if message is None:
        return False
    with pytest.raises(InvalidTransferError, match="^" + re.escape(message)):
        plan_of(case, coalesce)
    return True


def pair_targets(local: KVLayout, peer: KVLayout, layer_ids: list[int] | None) -> list[tuple[int, int]]:
    """(local buffer, peer buffer) pairs, the naive way."""
    out = []
    for i, lb in enumerate(local.buffers):
        layer = lb.layer if layer_ids is None else layer_ids[local.layers.index(lb.layer)]
        out += [(i, j) for j, pb in enumerate(peer.buffers) if pb.layer == layer and pb.role == lb.role]
    return out


def targets(case: Case) -> list[tuple[int, int]]:
    return pair_targets(case.local, case.peer, case.layer_ids)


def layout_is_split(peer: KVLayout) -> bool:
    """The peer layout has host and device buffers: two page-id spaces, whatever a request targets."""
    return len({b.memory for b in peer.buffers}) == 2


def dst_ids_of(case: Case, j: int) -> NDArray[Any]:
    """The destination page ids of peer buffer ``j``: split by kind only when the peer layout mixes kinds."""
    if layout_is_split(case.peer) and case.peer.buffers[j].memory == "device":
        assert case.device is not None
        return case.device
    return case.host


def reference_pages(case: Case) -> list[tuple[int, int, int]]:
    """One (src, dst, page_bytes) per page per buffer pair: a plain loop, no cleverness."""
    out = []
    for i, j in targets(case):
        lb, pb = case.local.buffers[i], case.peer.buffers[j]
        dst_ids = dst_ids_of(case, j)
        for k in range(len(case.prefill)):
            out.append(
                (
                    lb.base + int(case.prefill[k]) * lb.page_bytes,
                    pb.base + int(dst_ids[k]) * pb.page_bytes,
                    lb.page_bytes,
                )
            )
    return out


def naive_runs(src: NDArray[Any], dst: NDArray[Any]) -> int:
    return sum(1 for k in range(len(src)) if k == 0 or not (src[k] == src[k - 1] + 1 and dst[k] == dst[k - 1] + 1))


def expand(plan: TransferPlan, page_bytes: int, max_pages: int) -> list[tuple[int, int, int]]:
    """The plan one page per descriptor (a descriptor longer than ``max_pages`` pages is a failure)."""
    out = []
    for s, d, n in zip(plan.src.tolist(), plan.dst.tolist(), plan.length.tolist(), strict=True):
        assert n % page_bytes == 0 and 0 < n <= max_pages * page_bytes, (n, page_bytes)
        out += [(s + k * page_bytes, d + k * page_bytes, page_bytes) for k in range(n // page_bytes)]
    return out


def plan_of(case: Case, coalesce: bool = True) -> TransferPlan:
    return plan_transfer(
        case.local,
        case.peer,
        case.prefill,
        [b.base for b in case.peer.buffers],
        case.host,
        case.layer_ids,
        case.device,
        coalesce=coalesce,
    )


@SETTINGS
@given(cases())
def test_same_bytes_land_in_the_same_places_and_nothing_else_changes(case: Case) -> None:
    if refused_for_repeat(case):
        return
    local_before = [a.copy() for a in case.local_arrays]
    expected = [a.copy() for a in case.peer_arrays]
    for i, j in targets(case):  # the reference, one page at a time
        dst_ids = dst_ids_of(case, j)
        for k in range(len(case.prefill)):
            expected[j][int(dst_ids[k])] = case.local_arrays[i][int(case.prefill[k])]

    plan = plan_of(case)
    for s, d, n in zip(plan.src.tolist(), plan.dst.tolist(), plan.length.tolist(), strict=True):
        # never let a wrong plan scribble over the interpreter: check before copying
        assert any(b.base <= s and s + n <= b.end for b in case.local.buffers), (s, n)
        assert any(b.base <= d and d + n <= b.end for b in case.peer.buffers), (d, n)
        ctypes.memmove(d, s, n)

    for got, want in zip(case.peer_arrays, expected, strict=True):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(case.local_arrays, local_before, strict=True):
        np.testing.assert_array_equal(got, want)


@SETTINGS
@given(cases(), st.booleans())
def test_descriptors_equal_the_per_page_reference(case: Case, coalesce: bool) -> None:
    if refused_for_repeat(case, coalesce):
        return
    plan = plan_of(case, coalesce)
    page_bytes = case.local.buffers[0].page_bytes
    pairs = targets(case)
    n = len(case.prefill)
    reference = reference_pages(case)

    assert sorted(expand(plan, page_bytes, n)) == sorted(reference)
    assert plan.nbytes == n * page_bytes * len(pairs)
    assert plan.descriptors_before == n * len(pairs)
    if not coalesce:
        assert len(plan) == plan.descriptors_before
        assert expand(plan, page_bytes, n) == reference  # same order too: pair by pair, page by page
    else:  # runs are maximal: exactly as many descriptors as the naive run count
        expected = 0
        for _, j in pairs:
            expected += naive_runs(case.prefill, dst_ids_of(case, j))
        assert len(plan) == expected

    # no two descriptors overlap at the destination
    order = np.argsort(plan.dst, kind="stable")
    dst, length = plan.dst[order], plan.length[order]
    assert bool(np.all(dst[:-1] + length[:-1] <= dst[1:]))

    # every descriptor stays inside one source buffer and one target buffer
    for s, d, k in zip(plan.src.tolist(), plan.dst.tolist(), plan.length.tolist(), strict=True):
        assert any(b.base <= s and s + k <= b.end for b in case.local.buffers)
        assert any(b.base <= d and d + k <= b.end for b in case.peer.buffers)


@SETTINGS
@given(cases(), st.integers(1, 7))
def test_chunks_concatenate_to_the_plan(case: Case, size: int) -> None:
    if refused_for_repeat(case):
        return
    plan = plan_of(case)
    chunks = list(plan.chunks(size))
    assert all(1 <= len(c) <= size for c in chunks)
    assert sum(len(c) for c in chunks) == len(plan)
    for field in ("src", "dst", "length"):
        joined = np.concatenate([getattr(c, field) for c in chunks]) if chunks else np.zeros(0, np.int64)
        np.testing.assert_array_equal(joined, getattr(plan, field))


@SETTINGS
@given(cases())
def test_device_ids_are_required_exactly_when_a_split_layout_device_buffer_is_targeted(case: Case) -> None:
    """Omitting device ids when they are due, or passing them when they are not, is rejected."""
    if case.device is not None:  # split layout, a device buffer targeted: leaving them out is an error
        case.device = None
        with pytest.raises(
            InvalidTransferError,
            match=r"^dst_device_kv_indices is None, but the peer layout has host and device buffers .* "
            r"targets a device buffer, peer buffer \d+ \(layer \d+, \w+, device\)",
        ):
            plan_of(case)
        return
    case.device = case.host.copy()  # giving them is an error
    if layout_is_split(case.peer):  # split layout, host buffers only targeted
        assert all(case.peer.buffers[j].memory == "host" for _, j in targets(case))
        match = r"^dst_device_kv_indices was given, but this request targets no device buffer"
    else:
        match = (
            rf"^dst_device_kv_indices was given, but the peer layout's buffers are all {case.peer.buffers[0].memory}:"
        )
    with pytest.raises(InvalidTransferError, match=match):
        plan_of(case)
