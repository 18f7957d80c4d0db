"""Heterogeneous attention TP in tests: small MHA layouts per (TP size, rank), sglang's routing, a per-head oracle."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from kvwire.testing.receiver import LayoutSpec

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


def routed(prefill_tp: int, decode_tp: int, p: int, d: int) -> bool:
    """Whether prefill rank p sends to decode rank d (sglang/vLLM routing)."""
    if prefill_tp <= decode_tp:
        return p == d * prefill_tp // decode_tp
    ratio = prefill_tp // decode_tp
    return d * ratio <= p < (d + 1) * ratio
