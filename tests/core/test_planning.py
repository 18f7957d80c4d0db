"""kvwire.planning: address arithmetic, coalescing, layer mapping, split destinations, validation."""

from __future__ import annotations

import ctypes
import re
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

import kvwire
from kvwire.errors import InvalidTransferError
from kvwire.layout.buffers import KVBuffer
from kvwire.layout.kv_layout import KVLayout
from kvwire.planning import planner as planning
from kvwire.planning.plan import TransferPlan
from kvwire.planning.planner import plan_transfer
from kvwire.workload.fragment import place, run_lengths


def idx(*values: int, dtype: Any = np.int32) -> NDArray[Any]:
    return np.array(values, dtype=dtype)


def triples(plan: TransferPlan) -> list[tuple[int, int, int]]:
    return list(zip(plan.src.tolist(), plan.dst.tolist(), plan.length.tolist(), strict=True))


def ptrs(layout: KVLayout) -> list[int]:
    return [b.base for b in layout.buffers]


def apply(plan: TransferPlan, local: KVLayout, peer: KVLayout) -> None:
    """Perform the plan's copies in this process's memory (what an engine would do).

    Each descriptor is checked against the layouts first, so a wrong plan fails
    the test instead of corrupting the interpreter's memory.
    """
    for s, d, n in triples(plan):
        assert any(b.base <= s and s + n <= b.end for b in local.buffers), (s, n)
        assert any(b.base <= d and d + n <= b.end for b in peer.buffers), (d, n)
        ctypes.memmove(d, s, n)


# -- fixtures: synthetic layouts (addresses only) ----------------------------------


@pytest.fixture
def hisparse() -> tuple[KVLayout, KVLayout]:
    """The known HiSparse vector: MLA, layer 0 lands in host DRAM, layers 1 and 2 on the device."""
    local = KVLayout(tuple(KVBuffer(1000 * (i + 1), 100, 9, i) for i in range(3)))
    peer = KVLayout(
        (
            KVBuffer(10000, 100, 50, 0, memory="host"),
            KVBuffer(20000, 100, 50, 1, memory="device"),
            KVBuffer(30000, 100, 50, 2, memory="device"),
        )
    )
    return local, peer


def mha(layers: list[int], first_base: int, page_bytes: int = 64, pages: int = 16) -> KVLayout:
    """K of every layer, then V of every layer (sglang's order), buffers back to back."""
    specs = [(layer, role) for role in ("k", "v") for layer in layers]
    stride = page_bytes * pages
    return KVLayout(
        tuple(
            KVBuffer(first_base + i * stride, page_bytes, pages, layer, role)  # type: ignore[arg-type]
            for i, (layer, role) in enumerate(specs)
        )
    )


def mla(n: int, first_base: int, page_bytes: int = 64, pages: int = 16, memory: str = "host") -> KVLayout:
    return KVLayout(
        tuple(
            KVBuffer(first_base + i * page_bytes * pages, page_bytes, pages, i, "kv", memory)  # type: ignore[arg-type]
            for i in range(n)
        )
    )


# -- arithmetic ----------------------------------------------------------------------


def test_hisparse_known_vector(hisparse: tuple[KVLayout, KVLayout]) -> None:
    local, peer = hisparse
    plan = plan_transfer(local, peer, idx(1, 2), [10000, 20000, 30000], idx(7, 8), None, idx(21, 22))
    assert triples(plan) == [(1100, 10700, 200), (2100, 22100, 200), (3100, 32100, 200)]
    assert plan.descriptors_before == 6
    assert len(plan) == 3
    assert plan.nbytes == 600


def test_hisparse_known_vector_without_coalescing(hisparse: tuple[KVLayout, KVLayout]) -> None:
    local, peer = hisparse
    plan = plan_transfer(local, peer, idx(1, 2), ptrs(peer), idx(7, 8), None, idx(21, 22), coalesce=False)
    assert triples(plan) == [
        (1100, 10700, 100),
        (1200, 10800, 100),
        (2100, 22100, 100),
        (2200, 22200, 100),
        (3100, 32100, 100),
        (3200, 32200, 100),
    ]
    assert plan.descriptors_before == 6


def test_mha_with_layer_mapping_onto_later_decode_layers() -> None:
    # a pipeline stage holding 2 layers (its local ids 0, 1) sends them to layers 2, 3 of a 4-layer decode
    local = mha([0, 1], 1 << 20)  # buffers: k0, k1, v0, v1 of 16 pages x 64 B
    peer = mha([0, 1, 2, 3], 1 << 30)  # buffers: k0..k3, v0..v3
    plan = plan_transfer(local, peer, idx(3, 4, 9), ptrs(peer), idx(10, 11, 0), [2, 3])
    lb, pb, stride = 1 << 20, 1 << 30, 64 * 16
    expected = []
    # local buffer order k0, k1, v0, v1 -> peer buffers k2, k3, v2, v3 (positions 2, 3, 6, 7)
    for local_pos, peer_pos in ((0, 2), (1, 3), (2, 6), (3, 7)):
        src, dst = lb + local_pos * stride, pb + peer_pos * stride
        expected += [(src + 3 * 64, dst + 10 * 64, 128), (src + 9 * 64, dst + 0 * 64, 64)]
    assert triples(plan) == expected
    assert plan.descriptors_before == 3 * 4


def test_identity_mapping_equals_no_mapping() -> None:
    local, peer = mha([0, 1], 1 << 20), mha([0, 1], 1 << 30)
    a = plan_transfer(local, peer, idx(5, 6, 1), ptrs(peer), idx(2, 3, 9))
    b = plan_transfer(local, peer, idx(5, 6, 1), ptrs(peer), idx(2, 3, 9), [0, 1])
    assert triples(a) == triples(b)


def test_mapping_of_non_contiguous_local_layer_ids() -> None:
    # the position of a layer in local.layers (sorted) selects its entry of dst_layer_ids
    local = KVLayout((KVBuffer(1 << 20, 64, 16, 7), KVBuffer(1 << 21, 64, 16, 3)))  # layers (3, 7)
    peer = mla(4, 1 << 30)
    plan = plan_transfer(local, peer, idx(0), ptrs(peer), idx(1), [1, 0])
    # buffer 0 is layer 7 = local.layers[1] -> dst_layer_ids[1] = 0; buffer 1 is layer 3 -> 1
    assert triples(plan) == [(1 << 20, (1 << 30) + 64, 64), (1 << 21, (1 << 30) + 16 * 64 + 64, 64)]


def test_consecutive_pages_coalesce_to_one_descriptor_per_pair() -> None:
    local, peer = mha([0, 1], 1 << 20), mha([0, 1], 1 << 30)
    plan = plan_transfer(local, peer, np.arange(2, 12, dtype=np.int32), ptrs(peer), np.arange(5, 15, dtype=np.int32))
    assert len(plan) == 4
    assert plan.length.tolist() == [10 * 64] * 4
    assert plan.descriptors_before == 40
    assert plan.nbytes == 40 * 64


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        ([0, 2, 4, 6], [0, 1, 2, 3]),  # source alternates
        ([0, 1, 2, 3], [0, 2, 4, 6]),  # destination alternates
        ([0, 1, 2, 3], [3, 2, 1, 0]),  # destination runs backwards
        ([4, 4, 4, 4], [0, 1, 2, 3]),  # a repeated source page never merges
    ],
)
def test_no_merge_unless_both_sides_step_by_one(src: list[int], dst: list[int]) -> None:
    local, peer = mla(2, 1 << 20), mla(2, 1 << 30)
    plan = plan_transfer(local, peer, idx(*src), ptrs(peer), idx(*dst))
    assert len(plan) == 8 == plan.descriptors_before
    assert set(plan.length.tolist()) == {64}


def test_runs_split_where_either_side_breaks() -> None:
    local, peer = mla(1, 1 << 20), mla(1, 1 << 30)
    plan = plan_transfer(local, peer, idx(0, 1, 2, 3, 7, 8), ptrs(peer), idx(4, 5, 9, 10, 11, 12))
    b, p = 1 << 20, 1 << 30
    assert triples(plan) == [(b, p + 4 * 64, 128), (b + 2 * 64, p + 9 * 64, 128), (b + 7 * 64, p + 11 * 64, 128)]


def test_order_is_by_buffer_pair_then_run() -> None:
    local, peer = mha([0, 1], 1 << 20), mha([0, 1], 1 << 30)
    plan = plan_transfer(local, peer, idx(8, 0, 1), ptrs(peer), idx(0, 5, 6))
    stride = 64 * 16
    starts = [(1 << 20) + i * stride for i in range(4)]
    assert plan.src.tolist() == [x for s in starts for x in (s + 8 * 64, s)]
    assert plan.length.tolist() == [64, 128] * 4


def test_split_destinations_interleaved_by_local_buffer() -> None:
    """Each local buffer has a host and a device target: the host target comes first (peer order)."""
    local = mla(2, 1 << 20)
    peer = KVLayout(
        (
            KVBuffer(1 << 30, 64, 16, 0, memory="host"),
            KVBuffer((1 << 30) + 4096, 64, 16, 1, memory="host"),
            KVBuffer(1 << 30, 64, 16, 0, memory="device"),  # same addresses, another memory kind: allowed
            KVBuffer((1 << 30) + 8192, 64, 16, 1, memory="device"),
        )
    )
    plan = plan_transfer(local, peer, idx(0, 1, 5), ptrs(peer), idx(2, 3, 4), None, idx(9, 1, 2))
    l0, l1, h0, h1, d0, d1 = (1 << 20), (1 << 20) + 1024, 1 << 30, (1 << 30) + 4096, 1 << 30, (1 << 30) + 8192
    # host runs: [0,1]->[2,3], [5]->[4]; device runs: [0]->[9], [1]->[1], [5]->[2] (found once per index set)
    assert triples(plan) == [
        (l0, h0 + 128, 128),
        (l0 + 320, h0 + 256, 64),  # local 0 -> peer 0 (host)
        (l0, d0 + 576, 64),
        (l0 + 64, d0 + 64, 64),
        (l0 + 320, d0 + 128, 64),  # local 0 -> peer 2 (device)
        (l1, h1 + 128, 128),
        (l1 + 320, h1 + 256, 64),  # local 1 -> peer 1 (host)
        (l1, d1 + 576, 64),
        (l1 + 64, d1 + 64, 64),
        (l1 + 320, d1 + 128, 64),  # local 1 -> peer 3 (device)
    ]
    assert plan.descriptors_before == 3 * 4


def test_all_device_peer_takes_dst_kv_indices() -> None:
    """An ordinary GPU decode (every target a device buffer) is addressed by dst_kv_indices, as sglang does."""
    local, peer = mla(2, 1 << 20), mla(2, 1 << 30, memory="device")
    plan = plan_transfer(local, peer, idx(0, 1), ptrs(peer), idx(4, 5))
    assert triples(plan) == [(1 << 20, (1 << 30) + 256, 128), ((1 << 20) + 1024, (1 << 30) + 1024 + 256, 128)]
    assert triples(plan_transfer(local, peer, idx(0, 1), ptrs(peer), idx(4, 5), None, None)) == triples(plan)


def test_split_layout_stage_mapped_onto_device_layer_needs_device_ids(hisparse: tuple[KVLayout, KVLayout]) -> None:
    """The reviewer's case (sglang #31482): the split is the peer layout's, not the request's.

    A 1-layer pipeline stage mapped onto layer 1 of the HiSparse peer targets only a device
    buffer; it must still be addressed by dst_device_kv_indices, never by dst_kv_indices.
    """
    _, peer = hisparse
    local = KVLayout((KVBuffer(1000, 100, 9, 0),))
    with raises(
        "dst_device_kv_indices is None, but the peer layout has host and device buffers (split destinations) "
        "and this request targets a device buffer, peer buffer 1 (layer 1, kv, device): pass dst_device_kv_indices"
    ):
        plan_transfer(local, peer, idx(1, 2), ptrs(peer), idx(7, 8), [1])
    plan = plan_transfer(local, peer, idx(1, 2), ptrs(peer), idx(7, 8), [1], idx(21, 22))
    assert triples(plan) == [(1100, 22100, 200)]  # device page 21 of peer buffer 1, not host page 7
    assert plan.descriptors_before == 2
    # dst_kv_indices is not range-checked against buffers it does not address
    plan_transfer(local, peer, idx(1), ptrs(peer), idx(0), [2], idx(49))


def test_split_layout_stage_mapped_onto_device_layer_moves_bytes_to_device_ids() -> None:
    """Real buffers: layer 0 host, layers 1-2 device; a 1-layer stage sent onto layer 1."""
    rng = np.random.default_rng(31482)
    src = [rng.integers(1, 256, size=(12, 48), dtype=np.uint8)]
    peer_arrays = [rng.integers(1, 256, size=(40, 48), dtype=np.uint8)] + [
        rng.integers(1, 256, size=(8, 48), dtype=np.uint8) for _ in range(2)
    ]
    before = [a.copy() for a in peer_arrays]
    local = KVLayout.mla(src)
    peer = KVLayout.mla(peer_arrays, memory=["host", "device", "device"])
    assert [b.memory for b in peer.buffers] == ["host", "device", "device"]
    prefill = np.array([0, 1, 2, 9, 4], dtype=np.int32)
    host_pages = np.array([30, 31, 32, 20, 39], dtype=np.int32)  # host ids: past the 8 device pages
    device_pages = np.array([5, 6, 7, 0, 2], dtype=np.int32)
    with raises("dst_device_kv_indices is None, but the peer layout has host and device buffers"):
        plan_transfer(local, peer, prefill, ptrs(peer), host_pages, [1])
    plan = plan_transfer(local, peer, prefill, ptrs(peer), host_pages, [1], device_pages)
    apply(plan, local, peer)
    want = [a.copy() for a in before]
    want[1][device_pages] = src[0][prefill]
    for got, expected in zip(peer_arrays, want, strict=True):
        np.testing.assert_array_equal(got, expected)
    assert len(plan) == 3  # runs [0,1,2]->[5,6,7], [9]->[0], [4]->[2]


def test_different_page_sizes_per_buffer() -> None:
    local = KVLayout((KVBuffer(1 << 20, 64, 16, 0), KVBuffer(1 << 21, 32, 16, 1)))
    peer = KVLayout((KVBuffer(1 << 30, 64, 16, 0), KVBuffer(1 << 31, 32, 16, 1)))
    plan = plan_transfer(local, peer, idx(1, 2), ptrs(peer), idx(3, 4))
    assert triples(plan) == [((1 << 20) + 64, (1 << 30) + 192, 128), ((1 << 21) + 32, (1 << 31) + 96, 64)]


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint16, np.uint32, np.int16])
def test_integer_dtypes_accepted(dtype: Any) -> None:
    local, peer = mla(1, 1 << 20), mla(1, 1 << 30)
    plan = plan_transfer(local, peer, idx(1, 2, dtype=dtype), ptrs(peer), idx(3, 4, dtype=dtype))
    assert triples(plan) == [((1 << 20) + 64, (1 << 30) + 192, 128)]


def test_dst_kv_ptrs_may_be_a_numpy_array_or_tuple() -> None:
    local, peer = mla(2, 1 << 20), mla(2, 1 << 30)
    a = plan_transfer(local, peer, idx(1), np.array(ptrs(peer), dtype=np.uint64), idx(3))  # type: ignore[arg-type]
    b = plan_transfer(local, peer, idx(1), tuple(ptrs(peer)), idx(3))
    assert triples(a) == triples(b)


# -- the plan object -----------------------------------------------------------------


def test_plan_arrays_are_int64_and_read_only() -> None:
    local, peer = mla(2, 1 << 20), mla(2, 1 << 30)
    plan = plan_transfer(local, peer, idx(1, 2), ptrs(peer), idx(3, 4))
    for a in (plan.src, plan.dst, plan.length):
        assert a.dtype == np.int64
        assert a.ndim == 1
        with pytest.raises(ValueError, match="read-only"):
            a[0] = 0


def test_chunks_are_consecutive_views() -> None:
    local, peer = mla(3, 1 << 20), mla(3, 1 << 30)
    plan = plan_transfer(local, peer, idx(0, 2, 4, 6), ptrs(peer), idx(0, 2, 4, 6))  # 12 descriptors
    chunks = list(plan.chunks(5))
    assert [len(c) for c in chunks] == [5, 5, 2]
    assert all(np.shares_memory(c.src, plan.src) and np.shares_memory(c.length, plan.length) for c in chunks)
    assert [t for c in chunks for t in triples(c)] == triples(plan)
    assert all(c.descriptors_before == plan.descriptors_before for c in chunks)
    assert [len(c) for c in plan.chunks(12)] == [12]
    assert [len(c) for c in plan.chunks(100)] == [12]
    assert [len(c) for c in plan.chunks(1)] == [1] * 12


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (0, "max_descriptors must be >= 1, got 0"),
        (-3, "max_descriptors must be >= 1, got -3"),
        (True, "max_descriptors must be an int, got bool True"),
        (2.5, "max_descriptors must be an int, got float 2.5"),
    ],
)
def test_chunks_rejects_bad_size(bad: Any, message: str) -> None:
    with pytest.raises(InvalidTransferError, match=re.escape(message)):
        TransferPlan.empty().chunks(bad)  # raises at the call, before iteration


def test_empty_plan() -> None:
    plan = TransferPlan.empty()
    assert len(plan) == 0
    assert plan.nbytes == 0
    assert plan.descriptors_before == 0
    assert list(plan.chunks(8)) == []


def test_plan_rejects_mismatched_arrays() -> None:
    a = np.zeros(3, dtype=np.int64)
    with pytest.raises(InvalidTransferError, match=r"shapes \(3,\), \(2,\), \(3,\)"):
        TransferPlan(a, a[:2], a, 3)


def test_empty_request_is_a_valid_empty_plan(hisparse: tuple[KVLayout, KVLayout]) -> None:
    local, peer = hisparse
    plan = plan_transfer(local, peer, idx(), ptrs(peer), idx(), None, idx())
    assert len(plan) == 0
    assert plan.nbytes == 0
    assert plan.descriptors_before == 0


def test_empty_request_is_still_validated(hisparse: tuple[KVLayout, KVLayout]) -> None:
    local, peer = hisparse
    with pytest.raises(InvalidTransferError, match=r"dst_kv_ptrs\[2\] = 30001"):
        plan_transfer(local, peer, idx(), [10000, 20000, 30001], idx(), None, idx())
    with pytest.raises(InvalidTransferError, match="dst_device_kv_indices is None"):
        plan_transfer(local, peer, idx(), ptrs(peer), idx())


# -- validation ----------------------------------------------------------------------


def raises(message: str) -> Any:
    """pytest.raises for an InvalidTransferError whose message starts with ``message`` (literal)."""
    return pytest.raises(InvalidTransferError, match="^" + re.escape(message))


def test_error_is_a_value_error() -> None:
    assert issubclass(InvalidTransferError, ValueError)


def test_prefill_index_out_of_range_names_position_value_and_buffer() -> None:
    local = mha([0], 1 << 20, pages=4096)
    peer = mha([0], 1 << 40, pages=8192)
    with raises("prefill_kv_indices[3] = 4096 is out of range: local buffer 0 (layer 0, k) has 4096 pages"):
        plan_transfer(local, peer, idx(0, 1, 2, 4096, 5000), ptrs(peer), idx(0, 1, 2, 3, 4))


def test_prefill_out_of_range_names_the_smaller_buffer() -> None:
    local = KVLayout((KVBuffer(1 << 20, 64, 16, 0), KVBuffer(1 << 21, 64, 8, 1)))
    peer = mla(2, 1 << 30)
    with raises("prefill_kv_indices[1] = 10 is out of range: local buffer 1 (layer 1, kv) has 8 pages"):
        plan_transfer(local, peer, idx(7, 10, 20), ptrs(peer), idx(0, 1, 2))


def test_negative_prefill_index() -> None:
    local, peer = mla(1, 1 << 20), mla(1, 1 << 30)
    with raises("prefill_kv_indices[2] = -1 is negative"):
        plan_transfer(local, peer, idx(0, 1, -1, 99), ptrs(peer), idx(0, 1, 2, 3))


def test_dst_index_out_of_range_names_peer_buffer() -> None:
    local = mla(2, 1 << 20)
    peer = KVLayout((KVBuffer(1 << 30, 64, 16, 0), KVBuffer(1 << 31, 64, 12, 1), KVBuffer(1 << 32, 64, 4, 2)))
    # peer buffer 2 (4 pages) is not a target: only targets bound the destination ids
    with raises("dst_kv_indices[1] = 12 is out of range: peer buffer 1 (layer 1, kv, host) has 12 pages"):
        plan_transfer(local, peer, idx(0, 1), ptrs(peer), idx(11, 12))
    plan_transfer(local, peer, idx(0, 1), ptrs(peer), idx(10, 11))


def test_negative_dst_index() -> None:
    local, peer = mla(1, 1 << 20), mla(1, 1 << 30)
    with raises("dst_kv_indices[0] = -5 is negative"):
        plan_transfer(local, peer, idx(0), ptrs(peer), idx(-5))


def test_device_index_out_of_range(hisparse: tuple[KVLayout, KVLayout]) -> None:
    local, peer = hisparse
    with raises("dst_device_kv_indices[1] = 50 is out of range: peer buffer 1 (layer 1, kv, device) has 50 pages"):
        plan_transfer(local, peer, idx(1, 2), ptrs(peer), idx(7, 8), None, idx(49, 50))
    with raises("dst_device_kv_indices[0] = -2 is negative"):
        plan_transfer(local, peer, idx(1, 2), ptrs(peer), idx(7, 8), None, idx(-2, 50))


def test_host_index_range_ignores_device_buffers(hisparse: tuple[KVLayout, KVLayout]) -> None:
    local, peer = hisparse
    with raises("dst_kv_indices[0] = 50 is out of range: peer buffer 0 (layer 0, kv, host) has 50 pages"):
        plan_transfer(local, peer, idx(1, 2), ptrs(peer), idx(50, 8), None, idx(1, 2))


def test_all_device_peer_checks_dst_kv_indices_against_device_buffers() -> None:
    local = mla(2, 1 << 20)
    peer = KVLayout(
        (
            KVBuffer(1 << 30, 64, 16, 0, memory="device"),
            KVBuffer(1 << 31, 64, 10, 1, memory="device"),
        )
    )
    with raises("dst_kv_indices[1] = 10 is out of range: peer buffer 1 (layer 1, kv, device) has 10 pages"):
        plan_transfer(local, peer, idx(0, 1), ptrs(peer), idx(9, 10))
    with raises("dst_kv_indices[0] = -1 is negative"):
        plan_transfer(local, peer, idx(0, 1), ptrs(peer), idx(-1, 3))


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([1, 2], "prefill_kv_indices must be a 1-D numpy integer array, got list"),
        ((1, 2), "prefill_kv_indices must be a 1-D numpy integer array, got tuple"),
        (None, "prefill_kv_indices must be a 1-D numpy integer array, got NoneType"),
        (np.zeros((1, 2), dtype=np.int32), "prefill_kv_indices must be a 1-D numpy integer array, got shape (1, 2)"),
        (np.int32(3), "prefill_kv_indices must be a 1-D numpy integer array, got int32"),
        (np.array([1.0, 2.0]), "prefill_kv_indices must have an integer dtype (int32 or int64), got float64"),
        (np.array([True, False]), "prefill_kv_indices must have an integer dtype (int32 or int64), got bool"),
        (
            np.array([1, 2], dtype=np.uint64),
            "prefill_kv_indices must have an integer dtype (int32 or int64), got uint64",
        ),
    ],
)
def test_prefill_indices_type(value: Any, message: str) -> None:
    local, peer = mla(1, 1 << 20), mla(1, 1 << 30)
    with raises(message):
        plan_transfer(local, peer, value, ptrs(peer), idx(0, 1))


def test_dst_indices_type() -> None:
    local, peer = mla(1, 1 << 20), mla(1, 1 << 30)
    with raises("dst_kv_indices must be a 1-D numpy integer array, got list"):
        plan_transfer(local, peer, idx(0), ptrs(peer), [0])  # type: ignore[arg-type]
    with raises("dst_kv_indices must have an integer dtype (int32 or int64), got float32"):
        plan_transfer(local, peer, idx(0), ptrs(peer), np.zeros(1, dtype=np.float32))


def test_device_indices_type(hisparse: tuple[KVLayout, KVLayout]) -> None:
    local, peer = hisparse
    with raises("dst_device_kv_indices must be a 1-D numpy integer array, got list"):
        plan_transfer(local, peer, idx(0), ptrs(peer), idx(0), None, [0])  # type: ignore[arg-type]


def test_lengths_must_match(hisparse: tuple[KVLayout, KVLayout]) -> None:
    local, peer = hisparse
    with raises("dst_kv_indices has 3 entries but prefill_kv_indices has 2: they must be equal"):
        plan_transfer(local, peer, idx(1, 2), ptrs(peer), idx(1, 2, 3), None, idx(1, 2))
    with raises("dst_device_kv_indices has 1 entries but prefill_kv_indices has 2: they must be equal"):
        plan_transfer(local, peer, idx(1, 2), ptrs(peer), idx(1, 2), None, idx(1))


def test_device_ids_required_when_split_layout_request_targets_device(hisparse: tuple[KVLayout, KVLayout]) -> None:
    local, peer = hisparse
    with raises(
        "dst_device_kv_indices is None, but the peer layout has host and device buffers (split destinations) "
        "and this request targets a device buffer, peer buffer 1 (layer 1, kv, device): pass dst_device_kv_indices"
    ):
        plan_transfer(local, peer, idx(1, 2), ptrs(peer), idx(7, 8))


@pytest.mark.parametrize("memory", ["host", "device"])
def test_device_ids_rejected_for_a_one_kind_layout(memory: str) -> None:
    local, peer = mla(2, 1 << 20), mla(2, 1 << 30, memory=memory)
    with raises(
        f"dst_device_kv_indices was given, but the peer layout's buffers are all {memory}: "
        "there is no split destination; pass None"
    ):
        plan_transfer(local, peer, idx(0, 1), ptrs(peer), idx(3, 3), None, idx(4, 5))
    with raises("dst_device_kv_indices was given"):  # even an empty request: the rule does not depend on n
        plan_transfer(local, peer, idx(), ptrs(peer), idx(), None, idx())
    with raises("dst_device_kv_indices was given"):  # nor on the mapping
        plan_transfer(local, peer, idx(0), ptrs(peer), idx(3), [1, 0], idx(4))


def test_split_layout_host_only_request_takes_dst_kv_indices_and_refuses_device_ids() -> None:
    """A split layout whose device buffer is not targeted: dst_kv_indices only, device ids refused."""
    local = mla(1, 1 << 20)
    peer = KVLayout((KVBuffer(1 << 30, 64, 16, 0), KVBuffer(1 << 31, 64, 16, 1, memory="device")))
    plan = plan_transfer(local, peer, idx(1), ptrs(peer), idx(2))
    assert triples(plan) == [((1 << 20) + 64, (1 << 30) + 128, 64)]
    with raises(
        "dst_device_kv_indices was given, but this request targets no device buffer: the peer layout has host "
        "and device buffers (split destinations)"
    ):
        plan_transfer(local, peer, idx(1), ptrs(peer), idx(2), None, idx(3))
    with raises("dst_device_kv_indices was given, but this request targets no device buffer"):
        plan_transfer(local, peer, idx(), ptrs(peer), idx(), [0], idx())


def test_dst_kv_ptrs_count() -> None:
    local, peer = mla(2, 1 << 20), mla(3, 1 << 30)
    with raises("dst_kv_ptrs has 2 entries, expected 3 (one per peer buffer)"):
        plan_transfer(local, peer, idx(1), ptrs(peer)[:2], idx(1))


def test_dst_kv_ptrs_value() -> None:
    local, peer = mla(2, 1 << 20), mla(3, 1 << 30)
    bad = ptrs(peer)
    bad[1] += 64
    expected = bad[1] - 64
    with raises(
        f"dst_kv_ptrs[1] = {bad[1]} does not match the peer layout: "
        f"peer buffer 1 (layer 1, kv, host) has base {expected}"
    ):
        plan_transfer(local, peer, idx(1), bad, idx(1))


@pytest.mark.parametrize("bad", ["1", 1.5, None, True])
def test_dst_kv_ptrs_element_type(bad: Any) -> None:
    local, peer = mla(1, 1 << 20), mla(2, 1 << 30)
    with raises(f"dst_kv_ptrs[1] = {bad!r} must be an int, got {type(bad).__name__}"):
        plan_transfer(local, peer, idx(1), [ptrs(peer)[0], bad], idx(1))


def test_dst_kv_ptrs_float_equal_to_base_is_rejected() -> None:
    local, peer = mla(1, 1 << 20), mla(1, 1 << 30)
    with raises(f"dst_kv_ptrs[0] = {float(1 << 30)!r} must be an int, got float"):
        plan_transfer(local, peer, idx(1), [float(1 << 30)], idx(1))  # type: ignore[list-item]


def test_dst_kv_ptrs_not_a_sequence() -> None:
    local, peer = mla(1, 1 << 20), mla(1, 1 << 30)
    with raises("dst_kv_ptrs must be a sequence of ints, got int"):
        plan_transfer(local, peer, idx(1), 1 << 30, idx(1))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([2], "dst_layer_ids has 1 entries, expected 2 (one per local layer [0, 1])"),
        ([2, 3, 1], "dst_layer_ids has 3 entries, expected 2 (one per local layer [0, 1])"),
        ([2, "3"], "dst_layer_ids[1] = '3' must be an int, got str"),
        ([2, 3.0], "dst_layer_ids[1] = 3.0 must be an int, got float"),
        ([True, 3], "dst_layer_ids[0] = True must be an int, got bool"),
        ([3, 3], "dst_layer_ids[1] = 3 is a duplicate of dst_layer_ids[0]"),
        ([2, 4], "dst_layer_ids[1] = 4 is not a layer of the peer layout (peer layers: [0, 1, 2, 3])"),
        ([-1, 2], "dst_layer_ids[0] = -1 is not a layer of the peer layout"),
        (7, "dst_layer_ids must be a sequence of ints or None, got int"),
        ("23", "dst_layer_ids must be a sequence of ints or None, got str"),
    ],
)
def test_dst_layer_ids(ids: Any, message: str) -> None:
    local, peer = mha([0, 1], 1 << 20), mha([0, 1, 2, 3], 1 << 30)
    with raises(message):
        plan_transfer(local, peer, idx(1), ptrs(peer), idx(1), ids)


def test_dst_layer_ids_numpy_ints_accepted() -> None:
    local, peer = mha([0, 1], 1 << 20), mha([0, 1, 2, 3], 1 << 30)
    a = plan_transfer(local, peer, idx(1), ptrs(peer), idx(1), np.array([2, 3]))  # type: ignore[arg-type]
    b = plan_transfer(local, peer, idx(1), ptrs(peer), idx(1), [2, 3])
    assert triples(a) == triples(b)


def test_cache_does_not_let_an_equal_float_through() -> None:
    local, peer = mha([0, 1], 1 << 20), mha([0, 1, 2, 3], 1 << 30)
    plan_transfer(local, peer, idx(1), ptrs(peer), idx(1), [2, 3])  # cached for ints
    with raises("dst_layer_ids[0] = 2.0 must be an int, got float"):
        plan_transfer(local, peer, idx(1), ptrs(peer), idx(1), [2.0, 3])  # type: ignore[list-item]


def test_equal_layouts_that_are_distinct_objects_plan_alike() -> None:
    a = plan_transfer(mha([0], 1 << 20), mha([0], 1 << 30), idx(1, 2), ptrs(mha([0], 1 << 30)), idx(3, 4))
    b = plan_transfer(mha([0], 1 << 20), mha([0], 1 << 30), idx(1, 2), ptrs(mha([0], 1 << 30)), idx(3, 4))
    expected = [((1 << 20) + 64, (1 << 30) + 192, 128), ((1 << 20) + 1024 + 64, (1 << 30) + 1024 + 192, 128)]
    assert triples(a) == expected
    assert triples(b) == expected


def test_local_buffer_without_target() -> None:
    local = mla(3, 1 << 20)
    peer = mla(2, 1 << 30)
    with raises("local buffer 2 (layer 2, kv) has no target: the peer layout has no buffer with layer 2 and role 'kv'"):
        plan_transfer(local, peer, idx(1), ptrs(peer), idx(1))


def test_mla_into_mha_has_no_target() -> None:
    local, peer = mla(1, 1 << 20), mha([0], 1 << 30)
    with raises("local buffer 0 (layer 0, kv) has no target"):
        plan_transfer(local, peer, idx(1), ptrs(peer), idx(1))


def test_mapped_layer_without_role_names_the_mapping() -> None:
    local = mha([0], 1 << 20)
    peer = KVLayout((KVBuffer(1 << 30, 64, 16, 5, "k"), KVBuffer(1 << 31, 64, 16, 6, "v")))
    with raises(
        "local buffer 0 (layer 0, k) has no target: the peer layout has no buffer with layer 6 "
        "(mapped by dst_layer_ids from layer 0) and role 'k'"
    ):
        plan_transfer(local, peer, idx(1), ptrs(peer), idx(1), [6])


def test_page_size_mismatch_names_both_buffers() -> None:
    local = mla(2, 1 << 20)
    peer = KVLayout((KVBuffer(1 << 30, 64, 16, 0), KVBuffer(1 << 31, 128, 16, 1)))
    with raises(
        "page size mismatch: local buffer 1 (layer 1, kv) has 64 bytes per page, "
        "its target peer buffer 1 (layer 1, kv, host) has 128"
    ):
        plan_transfer(local, peer, idx(1), ptrs(peer), idx(1))


def test_safety_net_catches_a_run_past_the_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """An arithmetic bug that passed validation still cannot produce an out-of-buffer descriptor."""
    local, peer = mla(2, 1 << 20), mla(2, 1 << 30)

    def broken_runs(src: Any, dst: Any, coalesce: bool) -> Any:
        return src[:1], dst[:1], np.array([len(src) + 20], dtype=np.int64)  # claims 22 pages in one run

    monkeypatch.setattr(planning, "_runs", broken_runs)
    with raises(
        "internal planning error: run 0 covers pages [1, 23), outside its source local buffer 0 "
        "(layer 0, kv) of 16 pages"
    ):
        plan_transfer(local, peer, idx(1, 2), ptrs(peer), idx(3, 4))


def test_safety_net_checks_the_target_side(monkeypatch: pytest.MonkeyPatch) -> None:
    local = mla(1, 1 << 20, pages=64)
    peer = mla(1, 1 << 30, pages=16)

    def broken_runs(src: Any, dst: Any, coalesce: bool) -> Any:
        return src[:1], dst[:1], np.array([30], dtype=np.int64)

    monkeypatch.setattr(planning, "_runs", broken_runs)
    with raises("internal planning error: run 0 covers pages [3, 33), outside its target peer buffer 0"):
        plan_transfer(local, peer, idx(0, 1), ptrs(peer), idx(3, 4))


def test_nothing_cached_from_a_failed_pairing() -> None:
    local, peer = mha([0, 1], 1 << 20), mha([0, 1, 2, 3], 1 << 30)
    for _ in range(2):
        with raises("dst_layer_ids[1] = 3 is a duplicate"):
            plan_transfer(local, peer, idx(1), ptrs(peer), idx(1), [3, 3])


# -- real memory: apply the plan, check every byte --------------------------------------


def test_applied_plan_moves_the_right_bytes_mha_with_layer_mapping() -> None:
    rng = np.random.default_rng(1234)
    pages, page_shape = 24, (4, 8)  # 4 heads x 8 bytes per page -> 32 B pages
    src_k = [rng.integers(1, 256, size=(pages, *page_shape), dtype=np.uint8) for _ in range(2)]
    src_v = [rng.integers(1, 256, size=(pages, *page_shape), dtype=np.uint8) for _ in range(2)]
    dst_k = [rng.integers(1, 256, size=(40, *page_shape), dtype=np.uint8) for _ in range(4)]
    dst_v = [rng.integers(1, 256, size=(40, *page_shape), dtype=np.uint8) for _ in range(4)]
    before_k = [a.copy() for a in dst_k]
    before_v = [a.copy() for a in dst_v]
    local = KVLayout.mha(src_k, src_v)
    peer = KVLayout.mha(dst_k, dst_v)

    prefill = np.array([3, 4, 5, 10, 0, 1, 23], dtype=np.int32)
    dst_pages = np.array([30, 31, 32, 2, 7, 8, 39], dtype=np.int32)
    plan = plan_transfer(local, peer, prefill, ptrs(peer), dst_pages, [1, 3])
    apply(plan, local, peer)

    expected_k = [a.copy() for a in before_k]
    expected_v = [a.copy() for a in before_v]
    for local_layer, peer_layer in ((0, 1), (1, 3)):
        expected_k[peer_layer][dst_pages] = src_k[local_layer][prefill]
        expected_v[peer_layer][dst_pages] = src_v[local_layer][prefill]
    for got, want in zip(dst_k + dst_v, expected_k + expected_v, strict=True):
        np.testing.assert_array_equal(got, want)
    assert plan.nbytes == 7 * 32 * 4
    assert len(plan) == 4 * 4  # runs [3,4,5], [10], [0,1], [23] per buffer pair


def test_applied_plan_moves_the_right_bytes_hisparse() -> None:
    rng = np.random.default_rng(99)
    src = [rng.integers(1, 256, size=(12, 48), dtype=np.uint8) for _ in range(3)]
    host = [rng.integers(1, 256, size=(30, 48), dtype=np.uint8) for _ in range(3)]
    device = [rng.integers(1, 256, size=(6, 48), dtype=np.uint8) for _ in range(3)]
    local = KVLayout.mla(src)
    # every layer has a full host copy and a hot device copy (numpy stands in for device memory)
    peer = KVLayout(KVLayout.mla(host).buffers + KVLayout.mla(device, memory="device").buffers)
    host_before = [a.copy() for a in host]
    device_before = [a.copy() for a in device]
    prefill = np.array([0, 1, 2, 7, 8], dtype=np.int64)
    host_pages = np.array([20, 21, 22, 3, 4], dtype=np.int64)
    device_pages = np.array([5, 0, 1, 2, 3], dtype=np.int64)
    plan = plan_transfer(local, peer, prefill, ptrs(peer), host_pages, None, device_pages)
    apply(plan, local, peer)
    for layer in range(3):
        want_host = host_before[layer].copy()
        want_host[host_pages] = src[layer][prefill]
        want_device = device_before[layer].copy()
        want_device[device_pages] = src[layer][prefill]
        np.testing.assert_array_equal(host[layer], want_host)
        np.testing.assert_array_equal(device[layer], want_device)


def test_applied_plan_moves_the_right_bytes_all_device_peer() -> None:
    """A non-HiSparse GPU decode: every buffer marked device (numpy stands in), addressed by dst_kv_indices."""
    rng = np.random.default_rng(7)
    src_k = [rng.integers(1, 256, size=(12, 32), dtype=np.uint8) for _ in range(2)]
    src_v = [rng.integers(1, 256, size=(12, 32), dtype=np.uint8) for _ in range(2)]
    dst_k = [rng.integers(1, 256, size=(20, 32), dtype=np.uint8) for _ in range(2)]
    dst_v = [rng.integers(1, 256, size=(20, 32), dtype=np.uint8) for _ in range(2)]
    before = [a.copy() for a in dst_k + dst_v]
    local = KVLayout.mha(src_k, src_v)
    peer = KVLayout.mha(dst_k, dst_v, memory="device")
    assert all(b.memory == "device" for b in peer.buffers)
    prefill = np.array([0, 1, 2, 9, 4], dtype=np.int32)
    dst_pages = np.array([17, 18, 19, 0, 5], dtype=np.int32)
    plan = plan_transfer(local, peer, prefill, ptrs(peer), dst_pages)
    apply(plan, local, peer)
    for got, want, src in zip(dst_k + dst_v, before, src_k + src_v, strict=True):
        want[dst_pages] = src[prefill]
        np.testing.assert_array_equal(got, want)
    assert len(plan) == 3 * 4  # runs [0,1,2], [9], [4] per buffer pair


def test_llama_sized_plan_counts() -> None:
    page = 32 * 1024
    local = KVLayout(
        tuple(KVBuffer((1 << 40) + i * page * 4096, page, 4096, i % 32, "k" if i < 32 else "v") for i in range(64))
    )
    peer = KVLayout(
        tuple(KVBuffer((1 << 44) + i * page * 65536, page, 65536, i % 32, "k" if i < 32 else "v") for i in range(64))
    )
    rng = np.random.default_rng(5)
    starts = rng.choice(4096 // 8, size=256, replace=False) * 8
    prefill = (starts[:, None] + np.arange(8)).ravel().astype(np.int32)  # 256 runs of 8
    dst = (rng.choice(65536 // 16, size=256, replace=False)[:, None] * 16 + np.arange(8)).ravel().astype(np.int32)
    plan = plan_transfer(local, peer, prefill, ptrs(peer), dst)
    assert plan.descriptors_before == 2048 * 64
    assert len(plan) == 256 * 64  # destination runs start 16 pages apart: no two of them touch
    assert plan.nbytes == 2048 * 64 * page


def test_strided_index_arrays() -> None:
    local, peer = mla(1, 1 << 20), mla(1, 1 << 30)
    src = np.arange(0, 12, dtype=np.int64)[::3]  # 0, 3, 6, 9: a non-contiguous view
    dst = np.arange(8, dtype=np.int32)[4:]  # 4, 5, 6, 7
    plan = plan_transfer(local, peer, src, ptrs(peer), dst)
    assert plan.src.tolist() == [(1 << 20) + p * 64 for p in (0, 3, 6, 9)]
    assert plan.dst.tolist() == [(1 << 30) + p * 64 for p in (4, 5, 6, 7)]
    with pytest.raises(InvalidTransferError, match=r"^prefill_kv_indices\[1\] = -3 is negative"):
        plan_transfer(local, peer, -src, ptrs(peer), dst)


# -- repeated destination pages (issue 11 item 8) ----------------------------------------


def test_repeated_destination_page_names_both_positions() -> None:
    local, peer = mla(2, 1 << 20), mla(2, 1 << 30)
    dst = idx(0, 1, 2, 12, 4, 5, 6, 12)
    with raises("dst_kv_indices[7] = 12 repeats dst_kv_indices[3]"):
        plan_transfer(local, peer, idx(0, 1, 2, 3, 4, 5, 6, 7), ptrs(peer), dst)


@pytest.mark.parametrize("coalesce", [True, False])
def test_repeat_inside_a_run_and_first_repeat_wins(coalesce: bool) -> None:
    local, peer = mla(1, 1 << 20), mla(1, 1 << 30)
    # runs [0..2] -> [4..6] and [3] -> [5]: the second run overlaps the first
    with raises("dst_kv_indices[3] = 5 repeats dst_kv_indices[1]"):
        plan_transfer(local, peer, idx(0, 1, 2, 3), ptrs(peer), idx(4, 5, 6, 5), coalesce=coalesce)
    with raises("dst_kv_indices[2] = 5 repeats dst_kv_indices[0]"):  # the first position that repeats
        plan_transfer(local, peer, idx(0, 1, 2, 3), ptrs(peer), idx(5, 6, 5, 6), coalesce=coalesce)


def test_repeat_in_a_long_request() -> None:
    """More runs than the small-request path handles: the sorted (numpy) path finds it."""
    local, peer = mla(2, 1 << 20, pages=512), mla(2, 1 << 30, pages=512)
    rng = np.random.default_rng(8)
    dst = (rng.permutation(200)[:100] * 2).astype(np.int64)  # 100 runs of one page, scattered
    plan_transfer(local, peer, np.arange(100, dtype=np.int64), ptrs(peer), dst)
    dst[90] = dst[40]
    with raises(f"dst_kv_indices[90] = {dst[40]} repeats dst_kv_indices[40]"):
        plan_transfer(local, peer, np.arange(100, dtype=np.int64), ptrs(peer), dst)
    ascending = np.arange(0, 300, 3, dtype=np.int64)  # ascending runs: the one-comparison path
    plan_transfer(local, peer, np.arange(100, dtype=np.int64), ptrs(peer), ascending)
    ascending[50] = ascending[49]
    with raises(f"dst_kv_indices[50] = {ascending[49]} repeats dst_kv_indices[49]"):
        plan_transfer(local, peer, np.arange(100, dtype=np.int64), ptrs(peer), ascending)


def test_repeated_device_page(hisparse: tuple[KVLayout, KVLayout]) -> None:
    local, peer = hisparse
    with raises("dst_device_kv_indices[1] = 21 repeats dst_device_kv_indices[0]"):
        plan_transfer(local, peer, idx(1, 2), ptrs(peer), idx(7, 8), None, idx(21, 21))
    with raises("dst_kv_indices[1] = 7 repeats dst_kv_indices[0]"):
        plan_transfer(local, peer, idx(1, 2), ptrs(peer), idx(7, 7), None, idx(21, 22))


def test_repeats_only_matter_in_an_index_set_the_request_uses(hisparse: tuple[KVLayout, KVLayout]) -> None:
    """A stage mapped onto device layers only: dst_kv_indices addresses nothing (nor is it range-checked)."""
    _, peer = hisparse
    local = KVLayout((KVBuffer(1000, 100, 9, 0),))
    plan = plan_transfer(local, peer, idx(1, 2), ptrs(peer), idx(7, 7), [1], idx(21, 22))
    assert triples(plan) == [(1100, 22100, 200)]


def test_repeated_source_pages_are_fine() -> None:
    local, peer = mla(1, 1 << 20), mla(1, 1 << 30)
    plan = plan_transfer(local, peer, idx(3, 3, 3), ptrs(peer), idx(0, 1, 2))
    src = (1 << 20) + 192
    assert triples(plan) == [(src, 1 << 30, 64), (src, (1 << 30) + 64, 64), (src, (1 << 30) + 128, 64)]


def test_safety_net_refuses_an_empty_run(monkeypatch: pytest.MonkeyPatch) -> None:
    local, peer = mla(1, 1 << 20), mla(1, 1 << 30)

    def broken_runs(src: Any, dst: Any, coalesce: bool) -> Any:
        return src[:1], dst[:1], np.array([0], dtype=np.int64)

    monkeypatch.setattr(planning, "_runs", broken_runs)
    with raises("internal planning error: run 0 has 0 pages; no plan was returned"):
        plan_transfer(local, peer, idx(1, 2), ptrs(peer), idx(3, 4))


# -- output buffers: pooled, never shared with a live plan (issue 12 item 3) ---------------


def test_a_live_plan_is_never_overwritten() -> None:
    local, peer = mha([0, 1], 1 << 20), mha([0, 1], 1 << 30)
    first = plan_transfer(local, peer, idx(1, 5, 9), ptrs(peer), idx(2, 3, 8))
    single = plan_transfer(local, peer, idx(11), ptrs(peer), idx(12))  # the one-page path
    kept = [a.copy() for a in (first.src, first.dst, first.length, single.src, single.dst)]
    chunk = next(first.chunks(2))
    kept_chunk = chunk.src.copy()
    for k in range(20):  # more plans than the pool holds slabs, of both paths
        other = plan_transfer(local, peer, idx(k % 16, (k + 7) % 16), ptrs(peer), idx(0, 15))
        one = plan_transfer(local, peer, idx(k % 16), ptrs(peer), idx(k % 16))
        assert not np.shares_memory(other.src, first.src) and not np.shares_memory(one.src, single.src)
    for got, want in zip((first.src, first.dst, first.length, single.src, single.dst), kept, strict=True):
        np.testing.assert_array_equal(got, want)
    del first
    plan_transfer(local, peer, idx(4, 6, 10), ptrs(peer), idx(1, 4, 9))
    np.testing.assert_array_equal(chunk.src, kept_chunk)  # a chunk alone keeps its memory


def test_a_dropped_plan_s_memory_is_reused() -> None:
    local, peer = mha([0, 1], 1 << 20), mha([0, 1], 1 << 30)
    first = plan_transfer(local, peer, idx(1, 5, 9), ptrs(peer), idx(2, 3, 8))
    address = first.src.ctypes.data
    del first
    second = plan_transfer(local, peer, idx(2, 6, 10), ptrs(peer), idx(2, 3, 8))
    assert second.src.ctypes.data == address


def test_big_pooled_plans_of_changing_shapes_stay_independent() -> None:
    """Plans of thousands of descriptors (pooled slabs), made one after another, shapes growing and shrinking.

    Each plan is checked against a copy taken when it was made, after every
    later plan, and against per-page descriptors computed here, so a slab (or
    any scratch) handed out while a plan still uses it fails the test.
    """
    layers = list(range(8))
    local, peer = mha(layers, 1 << 30, page_bytes=256, pages=4096), mha(layers, 1 << 40, page_bytes=256, pages=4096)
    rng = np.random.default_rng(24)
    held: list[tuple[TransferPlan, list[NDArray[np.int64]]]] = []
    for pages, run in ((2048, 4), (300, 1), (4000, 16), (2048, 4), (64, 2), (3000, 1), (1, 1), (2048, 4)):
        lengths = run_lengths(rng, pages, run)  # fragmented on both sides, as a serving engine's pools are
        src, dst = place(rng, lengths, 4096).astype(np.int32), place(rng, lengths, 4096).astype(np.int32)
        plan = plan_transfer(local, peer, src, ptrs(peer), dst)
        per_page = sorted(
            (b.base + s * 256, peer.buffers[i].base + d * 256, 256)
            for i, b in enumerate(local.buffers)
            for s, d in zip(src.tolist(), dst.tolist(), strict=True)
        )
        covered = sorted(
            (s + k, d + k, 256) for s, d, n in triples(plan) for k in range(0, n, 256)
        )  # a coalesced descriptor, split back into pages
        assert covered == per_page
        held.append((plan, [a.copy() for a in (plan.src, plan.dst, plan.length)]))
        for earlier, kept in held:
            for got, want in zip((earlier.src, earlier.dst, earlier.length), kept, strict=True):
                np.testing.assert_array_equal(got, want)
        if len(held) > 3:  # drop the oldest: its slab may be reused by the next plan, never a live one's
            del held[0]


def test_plan_arrays_cannot_be_made_writeable_when_shared() -> None:
    """Constant lengths (every run one page) are shared between plans, on memory nobody can write."""
    local, peer = mla(2, 1 << 20), mla(2, 1 << 30)
    for plan in (
        plan_transfer(local, peer, idx(1), ptrs(peer), idx(3)),  # the one-page path
        plan_transfer(local, peer, idx(1, 5), ptrs(peer), idx(3, 9)),  # runs of one page
    ):
        assert plan.length.tolist() == [64] * len(plan)
        with pytest.raises(ValueError, match=r"read-only|cannot set WRITEABLE"):
            plan.length.flags.writeable = True
        for a in (plan.src, plan.dst):
            with pytest.raises(ValueError, match="read-only"):
                a[0] = 0


def test_plans_from_many_threads_are_right() -> None:
    import concurrent.futures

    local, peer = mha([0, 1, 2], 1 << 20, pages=64), mha([0, 1, 2], 1 << 30, pages=64)
    rng = np.random.default_rng(3)
    requests = [(rng.permutation(64)[:20], rng.permutation(64)[:20]) for _ in range(32)]
    expected = [triples(plan_transfer(local, peer, s, ptrs(peer), d)) for s, d in requests]

    def job(k: int) -> list[tuple[int, int, int]]:
        plans = []  # held together: each thread's pool hands out several slabs at once
        for i in range(8):
            src, dst = requests[(k + i) % 32]
            plans.append(plan_transfer(local, peer, src, ptrs(peer), dst))
        return [t for p in plans for t in triples(p)]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for k, got in enumerate(pool.map(job, range(32))):
            assert got == [t for i in range(8) for t in expected[(k + i) % 32]]


def test_one_page_with_different_page_sizes() -> None:
    local = KVLayout((KVBuffer(1 << 20, 64, 16, 0), KVBuffer(1 << 21, 32, 16, 1)))
    peer = KVLayout((KVBuffer(1 << 30, 64, 16, 0), KVBuffer(1 << 31, 32, 16, 1)))
    plan = plan_transfer(local, peer, idx(2), ptrs(peer), idx(3))
    assert triples(plan) == [((1 << 20) + 128, (1 << 30) + 192, 64), ((1 << 21) + 64, (1 << 31) + 96, 32)]
    with raises("prefill_kv_indices[0] = 16 is out of range: local buffer 0 (layer 0, kv) has 16 pages"):
        plan_transfer(local, peer, idx(16), ptrs(peer), idx(3))


# -- planning: ids past the first 16 are range-checked by the fast path, naming the argument ---------------------------


_PLAN_LOCAL = KVLayout((KVBuffer(1 << 20, 64, 64, 0, "kv"),))
_PLAN_PEER = KVLayout((KVBuffer(1 << 30, 64, 64, 0, "kv"),))


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("argument", ["prefill_kv_indices", "dst_kv_indices"])
@pytest.mark.parametrize("bad", [-1, 64, 1000])
def test_a_bad_page_id_past_the_first_16_is_refused_naming_the_argument(
    dtype: type[np.integer], argument: str, bad: int
) -> None:
    src, dst = np.arange(20, dtype=dtype), np.arange(20, dtype=dtype)
    (src if argument == "prefill_kv_indices" else dst)[17] = bad
    if bad < 0:
        message = f"{argument}[17] = {bad} is negative: page ids must be >= 0"
    elif argument == "prefill_kv_indices":
        message = f"prefill_kv_indices[17] = {bad} is out of range: local buffer 0 (layer 0, kv) has 64 pages"
    else:
        message = f"dst_kv_indices[17] = {bad} is out of range: peer buffer 0 (layer 0, kv, host) has 64 pages"
    with pytest.raises(kvwire.InvalidTransferError) as exc:
        kvwire.plan_transfer(_PLAN_LOCAL, _PLAN_PEER, src, [1 << 30], dst)
    assert str(exc.value) == message


def test_a_negative_int32_page_id_is_refused_when_buffers_have_more_than_2_31_pages() -> None:
    huge = 1 << 32  # an int32 -1 read as unsigned (2**32 - 1) is below this limit
    local = KVLayout((KVBuffer(1 << 20, 1, huge, 0, "kv"),))
    peer = KVLayout((KVBuffer(1 << 40, 1, huge, 0, "kv"),))
    src = np.arange(20, dtype=np.int32)
    dst = np.arange(20, dtype=np.int32)
    src[17] = -1
    with pytest.raises(kvwire.InvalidTransferError) as exc:
        kvwire.plan_transfer(local, peer, src, [1 << 40], dst)
    assert str(exc.value) == "prefill_kv_indices[17] = -1 is negative: page ids must be >= 0"
