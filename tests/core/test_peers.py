"""LayoutBook: the bookkeeping every backend plans with, and its two errors."""

from __future__ import annotations

import numpy as np
import pytest

from kvwire import InvalidTransferError, KVBuffer, KVLayout
from kvwire.peers import LayoutBook

LOCAL = KVLayout((KVBuffer(4096, 64, 8, 0, "kv"),))
PEER = KVLayout((KVBuffer(1 << 20, 64, 8, 0, "kv"),))
IDX = np.array([1, 2], np.int32)


def test_plan_needs_a_local_layout_first() -> None:
    book = LayoutBook()
    book.add_peer("p", PEER)
    with pytest.raises(InvalidTransferError, match=r"^register_kv_buffers\(\) must be called before send_kvcache\(\)$"):
        book.plan("p", IDX, [1 << 20], IDX, None, None)


def test_plan_needs_the_peer_layout_first() -> None:
    book = LayoutBook()
    book.register(LOCAL)
    book.add_peer("p", PEER)
    with pytest.raises(InvalidTransferError) as exc:
        book.plan("q", IDX, [1 << 20], IDX, None, None)
    assert str(exc.value) == "session_id 'q' is unknown: call add_peer(session_id, layout) first (known: p)"


def test_plan_and_clear() -> None:
    book = LayoutBook()
    book.register(LOCAL)
    book.add_peer("p", PEER)
    plan = book.plan("p", IDX, [1 << 20], np.array([5, 6], np.int32), None, None)
    assert (plan.src.tolist(), plan.dst.tolist(), plan.length.tolist()) == ([4096 + 64], [(1 << 20) + 320], [128])
    book.clear()
    assert book.local is None
    with pytest.raises(InvalidTransferError, match="is unknown"):
        book.peer("p")
