"""Heterogeneous attention TP over real processes: every byte of every decode rank, against a per-head oracle."""

from __future__ import annotations

import numpy as np
import pytest
from tp_oracle import PAGES, oracle, routed, spec

import kvwire
from kvwire.testing.receiver import SubprocessReceiver, buffer_digests
from kvwire.workload.fragment import fragmented_pages

pytestmark = pytest.mark.slow

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
                if not routed(prefill_tp, decode_tp, p_spec.tp[1] if p_spec.tp else 0, receiver.layout.attn_tp_rank):
                    continue  # sglang's routing: this prefill rank does not feed that decode rank
                conn.add_peer(receiver.endpoint, receiver.layout)
                ptrs = [b.base for b in receiver.layout.buffers]
                conn.send_kvcache(receiver.endpoint, src_pages, ptrs, dst_pages)
        for d, receiver in enumerate(receivers):
            d_spec = spec(decode_tp, d)
            feeding = [
                (p_spec, memory.views) for p_spec, memory, _ in senders
                if routed(prefill_tp, decode_tp, p_spec.tp[1] if p_spec.tp else 0, d)
            ]
            expected = oracle(feeding, d_spec, d_spec.allocate(100 + d).views, src_pages, dst_pages)
            assert receiver.hashes() == buffer_digests(expected), f"decode rank {d}"
    finally:
        for _, _, conn in senders:
            conn.close()
        for receiver in receivers:
            receiver.close()


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
