"""Heterogeneous attention TP over real processes: every byte of every decode rank, against a per-head oracle."""

from __future__ import annotations

import numpy as np
import pytest
from numpy.typing import NDArray

import kvwire
from kvwire.testing.receiver import LayoutSpec, SubprocessReceiver, buffer_digests
from kvwire.workload.fragment import fragmented_pages

pytestmark = pytest.mark.slow

TOTAL_HEADS, HEAD_DIM, ELEM, TOKENS, LAYERS = 8, 16, 2, 4, (0, 1)
PAGES = 64


def spec(tp: int, rank: int) -> LayoutSpec:
    heads = TOTAL_HEADS // tp
    page_bytes = TOKENS * heads * HEAD_DIM * ELEM
    return LayoutSpec("mha", LAYERS, PAGES, page_bytes, (), (tp, rank), (heads, TOTAL_HEADS, HEAD_DIM, ELEM, TOKENS))


def rows(buffer: NDArray[np.uint8], heads: int) -> NDArray[np.uint8]:
    """(pages, tokens, heads, head bytes) view of one K or V buffer."""
    return buffer.reshape(buffer.shape[0], TOKENS, heads, HEAD_DIM * ELEM)


def oracle(
    senders: list[tuple[LayoutSpec, list[NDArray[np.uint8]]]],
    receiver: LayoutSpec,
    initial: list[NDArray[np.uint8]],
    src_pages: NDArray[np.int32],
    dst_pages: NDArray[np.int32],
) -> list[NDArray[np.uint8]]:
    """Per token, per global head: the decode rank's heads come from whichever prefill rank holds them."""
    assert receiver.tp is not None and receiver.heads is not None
    d_rank = receiver.tp[1]
    d_heads = receiver.heads[0]
    out = [b.copy() for b in initial]
    for i, buf in enumerate(out):
        target = rows(buf, d_heads)
        for s_spec, s_buffers in senders:
            assert s_spec.tp is not None and s_spec.heads is not None
            s_rank = s_spec.tp[1]
            s_heads = s_spec.heads[0]
            source = rows(s_buffers[i], s_heads)
            for g in range(TOTAL_HEADS):
                if g // d_heads != d_rank or g // s_heads != s_rank:
                    continue  # this decode rank does not hold head g, or this prefill rank does not
                for j in range(len(src_pages)):
                    target[dst_pages[j], :, g - d_rank * d_heads] = source[src_pages[j], :, g - s_rank * s_heads]
    return out


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1), (2, 4), (4, 2)])
def test_every_decode_rank_gets_exactly_its_heads(prefill_tp: int, decode_tp: int) -> None:
    rng = np.random.default_rng(prefill_tp * 10 + decode_tp)
    src_pages = fragmented_pages(rng, PAGES, 24)
    dst_pages = fragmented_pages(rng, PAGES, 24)
    receivers = [SubprocessReceiver("mooncake", spec(decode_tp, d), 100 + d) for d in range(decode_tp)]
    senders = []
    try:
        for p in range(prefill_tp):
            memory = spec(prefill_tp, p).allocate(200 + p)
            conn = kvwire.connect("mooncake")
            conn.register_kv_buffers(memory.layout)
            senders.append((spec(prefill_tp, p), memory, conn))
        for p_spec, _memory, conn in senders:
            for receiver in receivers:
                assert receiver.layout.attn_tp_rank is not None
                routed = _routed(prefill_tp, decode_tp, p_spec.tp[1] if p_spec.tp else 0, receiver.layout.attn_tp_rank)
                if not routed:
                    continue  # sglang's routing: this prefill rank does not feed that decode rank
                conn.add_peer(receiver.endpoint, receiver.layout)
                ptrs = [b.base for b in receiver.layout.buffers]
                conn.send_kvcache(receiver.endpoint, src_pages, ptrs, dst_pages)
        for d, receiver in enumerate(receivers):
            d_spec = spec(decode_tp, d)
            feeding = [
                (p_spec, memory.views) for p_spec, memory, _ in senders
                if _routed(prefill_tp, decode_tp, p_spec.tp[1] if p_spec.tp else 0, d)
            ]
            expected = oracle(feeding, d_spec, d_spec.allocate(100 + d).views, src_pages, dst_pages)
            assert receiver.hashes() == buffer_digests(expected), f"decode rank {d}"
    finally:
        for _, _, conn in senders:
            conn.close()
        for receiver in receivers:
            receiver.close()


def _routed(prefill_tp: int, decode_tp: int, p: int, d: int) -> bool:
    """Whether prefill rank p sends to decode rank d (sglang/vLLM routing)."""
    if prefill_tp <= decode_tp:
        return p == d * prefill_tp // decode_tp
    ratio = prefill_tp // decode_tp
    return d * ratio <= p < (d + 1) * ratio


def test_a_rank_pair_that_is_not_routed_is_refused_destination_unchanged() -> None:
    receiver = SubprocessReceiver("mooncake", spec(2, 1), 7)
    memory = spec(2, 0).allocate(8)
    try:
        with kvwire.connect("mooncake") as conn:
            conn.register_kv_buffers(memory.layout)
            conn.add_peer(receiver.endpoint, receiver.layout)
            idx = np.array([1, 2], np.int32)
            with pytest.raises(kvwire.InvalidTransferError, match="rank"):
                conn.send_kvcache(receiver.endpoint, idx, [b.base for b in receiver.layout.buffers], idx)
        assert receiver.hashes() == buffer_digests(spec(2, 1).allocate(7).views)
    finally:
        receiver.close()
