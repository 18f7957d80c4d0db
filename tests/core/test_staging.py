"""Staged writes (kvwire.transport.staging): head slices gathered into a staging buffer, whole runs written.

Through the local backend, in process: every byte of every decode rank against the per-head oracle, the
descriptors the transport was handed, chunking through a small staging buffer, and the plans it must refuse.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
from tp_oracle import ELEM, HEAD_DIM, PAGES, TOTAL_HEADS, oracle, routed, spec

import kvwire
from kvwire.planning.plan import TransferPlan
from kvwire.transport.staging import MIN_GAIN, Staging, gather_of
from kvwire.workload.fragment import fragmented_pages


class Recorded:
    """The plans a transport was handed, by length."""

    def __init__(self, conn: kvwire.Connection) -> None:
        self.lengths: list[int] = []
        transport = conn.backend.transport
        write = transport.write

        def recording(session_id: str, plan: TransferPlan) -> None:
            self.lengths.append(len(plan))
            write(session_id, plan)

        transport.write = recording


def _send_all(
    prefill_tp: int, decode_tp: int, staging_bytes: int | None = None
) -> Iterator[tuple[int, bool, list[int], int]]:
    """Send 24 fragmented pages from every prefill rank to its decode ranks; per decode rank: (rank, bytes ok,
    transport plan lengths, sliced plan length)."""
    rng = np.random.default_rng(prefill_tp * 10 + decode_tp)
    src_pages = fragmented_pages(rng, PAGES, 24)
    dst_pages = fragmented_pages(rng, PAGES, 24)
    decode = [spec(decode_tp, d).allocate(100 + d) for d in range(decode_tp)]
    prefill = [spec(prefill_tp, p).allocate(200 + p) for p in range(prefill_tp)]
    initial = [[v.copy() for v in m.views] for m in decode]
    receivers = [kvwire.connect("local") for _ in decode]
    senders = [kvwire.connect("local") for _ in prefill]
    try:
        for conn, memory in zip(receivers + senders, decode + prefill):
            conn.register_kv_buffers(memory.layout)
        recorded = {}
        for p, conn in enumerate(senders):
            if staging_bytes is not None:
                conn.backend._staging = Staging(conn.backend.transport, staging_bytes)
            recorded[p] = Recorded(conn)
            for d, (rx, target) in enumerate(zip(receivers, decode)):
                if not routed(prefill_tp, decode_tp, p, d):
                    continue
                conn.add_peer(rx.endpoint(), target.layout)
                ptrs = [b.base for b in target.layout.buffers]
                assert conn.send_kvcache(rx.endpoint(), src_pages, ptrs, dst_pages) > 0
        for d, target in enumerate(decode):
            feeding = [
                (spec(prefill_tp, p), prefill[p].views)
                for p in range(prefill_tp)
                if routed(prefill_tp, decode_tp, p, d)
            ]
            expected = oracle(feeding, spec(decode_tp, d), initial[d], src_pages, dst_pages)
            ok = all(np.array_equal(a, b) for a, b in zip(target.views, expected))
            p = next(p for p in range(prefill_tp) if routed(prefill_tp, decode_tp, p, d))
            sliced = len(
                kvwire.plan_transfer(
                    prefill[p].layout, target.layout, src_pages, [b.base for b in target.layout.buffers], dst_pages
                )
            )
            yield d, ok, recorded[p].lengths, sliced
    finally:
        for conn in senders + receivers:
            conn.close()


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 4), (1, 4)])
def test_a_prefill_rank_filling_whole_decode_rows_sends_through_staging_byte_exact(
    prefill_tp: int, decode_tp: int
) -> None:
    for d, ok, lengths, sliced in _send_all(prefill_tp, decode_tp):
        assert ok, f"decode rank {d}: bytes differ from the per-head oracle"
        assert sliced == 24 * 4 * 4  # 24 pages x 4 tokens x 4 buffers: one slice per token
        assert lengths and max(lengths) * MIN_GAIN <= sliced, f"the transport got {lengths}, not whole runs"


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (4, 2)])
def test_a_prefill_rank_filling_part_of_each_decode_row_keeps_the_per_slice_path(
    prefill_tp: int, decode_tp: int
) -> None:
    for d, ok, lengths, sliced in _send_all(prefill_tp, decode_tp):
        assert ok, f"decode rank {d}"
        assert sliced in lengths  # destinations are strided: nothing to gain, written as planned


def test_a_plan_bigger_than_the_staging_buffer_goes_in_chunks_byte_exact() -> None:
    page = spec(2, 0).allocate(0).layout.buffers[0].page_bytes
    for d, ok, lengths, sliced in _send_all(1, 2, staging_bytes=3 * page + 64):  # 3 pages and a bit: runs cut
        assert ok, f"decode rank {d}"
        assert len(lengths) > 10 and sum(lengths) < sliced


def test_gather_refuses_plans_it_cannot_or_need_not_stage() -> None:
    layout = spec(1, 0).allocate(1).layout
    host = layout.buffers[0]
    item = 64

    def plan(src: list[int], dst: list[int], length: list[int]) -> TransferPlan:
        return TransferPlan(*(np.array(x, dtype=np.int64) for x in (src, dst, length)), len(src))

    n = 4 * MIN_GAIN
    contiguous = [(1 << 40) + i * item for i in range(n)]
    strided_src = [host.base + 2 * i * item for i in range(n)]
    assert gather_of(plan(strided_src, contiguous, [item] * n), layout) is not None
    assert gather_of(plan(strided_src, contiguous, [item] * (n - 1) + [item * 2]), layout) is None  # lengths vary
    assert gather_of(plan([s + 1 for s in strided_src], contiguous, [item] * n), layout) is None  # misaligned
    assert gather_of(plan([1 << 20] * n, contiguous, [item] * n), layout) is None  # not in a local buffer
    scattered = [(1 << 40) + 2 * i * item for i in range(n)]
    assert gather_of(plan(strided_src, scattered, [item] * n), layout) is None  # destinations do not coalesce
    assert gather_of(plan(strided_src[:MIN_GAIN], contiguous[:MIN_GAIN], [item] * MIN_GAIN), layout) is None
    on_device = replace(layout, buffers=tuple(replace(b, memory="device") for b in layout.buffers))
    assert gather_of(plan(strided_src, contiguous, [item] * n), on_device) is None  # no host gather from a GPU
    # the transport's staging_max_item: slices this large or larger are written as planned
    assert gather_of(plan(strided_src, contiguous, [item] * n), layout, item + 1) is not None
    assert gather_of(plan(strided_src, contiguous, [item] * n), layout, item) is None


def test_a_transport_with_a_staging_limit_writes_slices_at_the_limit_as_planned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvwire.backends.local import LocalTransport

    slice_bytes = (TOTAL_HEADS // 2) * HEAD_DIM * ELEM  # one token's heads at decode TP 2: one slice
    monkeypatch.setattr(
        LocalTransport, "tuning", kvwire.TransportTuning(staged_writes=True, staging_max_item=slice_bytes)
    )
    for d, ok, lengths, sliced in _send_all(1, 2):
        assert ok, f"decode rank {d}"
        assert sliced in lengths  # not staged: the slices are as large as the limit
    monkeypatch.setattr(
        LocalTransport, "tuning", kvwire.TransportTuning(staged_writes=True, staging_max_item=slice_bytes + 1)
    )
    for d, ok, lengths, sliced in _send_all(1, 2):
        assert ok and max(lengths) * MIN_GAIN <= sliced, f"decode rank {d}: {lengths}"


def test_a_staged_send_that_races_close_is_told_the_backend_is_closed() -> None:
    local = spec(1, 0).allocate(1).layout
    n = 4 * MIN_GAIN
    host = local.buffers[0]
    plan = TransferPlan(
        np.array([host.base + 2 * i * 64 for i in range(n)], dtype=np.int64),
        np.array([(1 << 40) + i * 64 for i in range(n)], dtype=np.int64),
        np.full(n, 64, dtype=np.int64),
        n,
    )
    gather = gather_of(plan, local)
    assert gather is not None
    with kvwire.connect("local") as conn:
        staging = Staging(conn.backend.transport, 4096)
        staging.close()
        with pytest.raises(kvwire.BackendError) as exc:
            staging.write("nobody", gather)
    assert str(exc.value) == "the backend is closed (its staging buffer is gone); nothing was sent"
