"""kvwire.Landing over real NIXL: two prefill ranks write whole pages into a decode rank's landing pool.

Prefill TP 2 -> decode TP 1, token-major pages, in one process: each sender is
its own NIXL agent, the landing pool is registered on a third; after each
real write the decode side scatters, and every byte of the decode rank's KV
pages (targets and the rest) must match the per-token, per-head oracle.
"""

from __future__ import annotations

import numpy as np
import pytest
from tp_oracle import PAGES, oracle, spec

import kvwire
from kvwire_nixl.locate import nixl_availability

if (_reason := nixl_availability()) is not None:
    pytest.skip(f"kvwire-nixl cannot run here: {_reason}", allow_module_level=True)

from kvwire.workload.fragment import fragmented_pages

pytestmark = pytest.mark.slow


def test_real_writes_into_landing_pages_then_the_scatter_match_the_oracle() -> None:
    rng = np.random.default_rng(5)
    src, dst = fragmented_pages(rng, PAGES, 24), fragmented_pages(rng, PAGES, 24)
    final = spec(1, 0).allocate(100)
    prefill = [spec(2, p).allocate(200 + p) for p in range(2)]
    with kvwire.Landing(final.layout, 2, 48) as landing, kvwire.connect("nixl") as decode:
        decode.register_kv_buffers(landing.layout)
        peer = kvwire.PeerDescription(decode.endpoint(), landing.layout)
        ptrs = [b.base for b in landing.layout.buffers]
        reserved = landing.reserve(len(src))
        assert reserved is not None and list(reserved) == [0, 1]
        for p, memory in enumerate(prefill):
            with kvwire.connect("nixl") as conn:
                conn.register_kv_buffers(memory.layout)
                conn.add_peer(peer.endpoint, peer.layout)
                plan = kvwire.plan_transfer(memory.layout, peer.layout, src, ptrs, reserved[p].astype(np.int32))
                assert plan.descriptors_before == len(src) * len(ptrs)  # whole pages, not 4 token slices each
                moved = conn.send_kvcache(peer.endpoint, src, ptrs, reserved[p].astype(np.int32))
                assert moved == len(src) * memory.layout.buffers[0].page_bytes * len(ptrs)
            landing.scatter(p, reserved[p], dst)
            landing.release(reserved[p])
        assert landing.credits.free == 48
    expected = oracle(
        [(spec(2, p), prefill[p].views) for p in range(2)], spec(1, 0), spec(1, 0).allocate(100).views, src, dst
    )
    for i, view in enumerate(final.views):
        assert np.array_equal(view, expected[i]), f"buffer {i}"
