"""kvwire.landing: landing pages for prefill TP > decode TP, scattered into the decode rank's KV pages.

Each sender's whole pages are put into its landing pages here by a copy (what
its transport write does; the bench's and the mooncake test's runs move them
with real engines), then :meth:`Landing.scatter` must leave every byte of the
KV pages exactly as the per-token, per-head oracle says.
"""

from __future__ import annotations

import ctypes
import re
from typing import Any

import numpy as np
import pytest
from tp_oracle import PAGES, oracle, routed, spec

from kvwire import ConfigError, HeadLayout, InvalidTransferError, KVBuffer, KVLayout, LayoutError
from kvwire.benchmark.presets import get_preset
from kvwire.benchmark.tp import expected_digest
from kvwire.landing import Landing, LandingCredits
from kvwire.workload.memory import KVMemory, allocate


def _pool(landing: Landing, i: int) -> np.ndarray:
    """Landing buffer ``i`` as (pages, page_bytes) bytes."""
    buf = landing.layout.buffers[i]
    raw = (ctypes.c_uint8 * buf.nbytes).from_address(buf.base)
    return np.frombuffer(memoryview(raw).cast("B"), np.uint8).reshape(buf.num_pages, buf.page_bytes)


def _land(landing: Landing, memory: KVMemory, src: np.ndarray, pages: np.ndarray) -> None:
    """What a sender's whole-page write does: its pages ``src`` into landing pages ``pages``."""
    for i in range(len(landing.layout.buffers)):
        _pool(landing, i)[pages] = memory.views[i][src]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (4, 1), (4, 2), (8, 2)])
def test_every_decode_rank_gets_exactly_its_heads(prefill_tp: int, decode_tp: int, threads: int) -> None:
    rng = np.random.default_rng(prefill_tp * 10 + decode_tp)
    src = rng.permutation(PAGES)[:24].astype(np.int32)
    dst = rng.permutation(PAGES)[:24].astype(np.int32)
    prefill = [spec(prefill_tp, p).allocate(200 + p) for p in range(prefill_tp)]
    for d in range(decode_tp):
        final = spec(decode_tp, d).allocate(100 + d)
        with Landing(final.layout, prefill_tp, 24 * prefill_tp, threads=threads) as landing:
            feeding = [p for p in range(prefill_tp) if routed(prefill_tp, decode_tp, p, d)]
            assert landing.senders == tuple(feeding)
            reserved = landing.reserve(24)
            assert reserved is not None and list(reserved) == feeding
            for p, pages in reserved.items():
                _land(landing, prefill[p], src, pages)
                landing.scatter(p, pages, dst)
                landing.release(pages)
            assert landing.credits.free == 24 * prefill_tp
        expected = oracle(
            [(spec(prefill_tp, p), prefill[p].views) for p in feeding],
            spec(decode_tp, d),
            spec(decode_tp, d).allocate(100 + d).views,
            src,
            dst,
        )
        for i, view in enumerate(final.views):  # the target pages and every other page
            assert np.array_equal(view, expected[i]), f"decode rank {d}, buffer {i}"


def test_replicated_heads_come_from_their_first_holder_as_the_bench_oracle_says() -> None:
    """qwen2.5-7b has 4 KV heads: at prefill TP 8 each head is on two ranks and only the first of them sends."""
    preset = get_preset("qwen2.5-7b")
    entries = preset.entries(decode_side=False)[:4]
    p_tp, d_tp, d = 8, 2, 1
    pools = []
    for p in range(p_tp):
        pool = allocate(entries, 8, preset.heads(p_tp).page_bytes)
        pool.layout = preset.rank_layout(pool.layout, p_tp, p, False)
        pool.fill_random(p)
        pools.append(pool)
    final = allocate(entries, 8, preset.heads(d_tp).page_bytes)
    final.layout = preset.rank_layout(final.layout, d_tp, d, False)
    final.fill_random(99)
    src, dst = np.array([5, 1, 2], np.int32), np.array([0, 7, 3], np.int32)
    landing = Landing(final.layout, p_tp, 8)
    assert landing.senders == (4, 6)  # heads 2 and 3: ranks 4-5 hold head 2, ranks 6-7 head 3
    reserved = landing.reserve(3)
    assert reserved is not None and {p: v.tolist() for p, v in reserved.items()} == {4: [0, 1, 2], 6: [3, 4, 5]}
    for p, pages in reserved.items():
        _land(landing, pools[p], src, pages)
        landing.scatter(p, pages, dst)
    assert landing.reserve(2) is None and landing.credits.free == 2  # 2 each for 2 senders: all or nothing
    assert final.digest(dst.astype(np.int64)) == expected_digest(preset, pools, d_tp, d, src.astype(np.int64))


def test_non_contiguous_landing_pages_scatter_by_index() -> None:
    final = spec(1, 0).allocate(1)
    senders = [spec(2, p).allocate(10 + p) for p in range(2)]
    src, dst = np.array([3, 9, 4], np.int64), np.array([60, 2, 30], np.int64)
    landing = Landing(final.layout, 2, 8)
    whole = landing.reserve(4)
    assert whole is not None
    landing.release(whole[0][[0, 2]])  # free 0, 2 and 5, 7: no range of 2 is left
    landing.release(whole[1][[1, 3]])
    reserved = landing.reserve(2)
    assert reserved is not None and {p: v.tolist() for p, v in reserved.items()} == {0: [0, 2], 1: [5, 7]}
    for p, pages in reserved.items():
        _land(landing, senders[p], src[:2], pages)
        landing.scatter(p, pages, dst[:2])
    expected = oracle(
        [(spec(2, p), senders[p].views) for p in range(2)], spec(1, 0), spec(1, 0).allocate(1).views, src[:2], dst[:2]
    )
    assert all(np.array_equal(v, e) for v, e in zip(final.views, expected))


def test_landing_pages_out_of_order_whose_ends_look_contiguous_scatter_by_index() -> None:
    """[p0, p2, p1, p3] spans p0..p3 without being the slice p0..p3: each landing page goes where its index says."""
    final = spec(1, 0).allocate(1)
    senders = [spec(2, p).allocate(10 + p) for p in range(2)]
    src, dst = np.array([3, 9, 4, 7], np.int64), np.array([60, 2, 30, 11], np.int64)
    landing = Landing(final.layout, 2, 8)
    reserved = landing.reserve(4)
    assert reserved is not None
    for p, pages in reserved.items():
        shuffled = pages[[0, 2, 1, 3]]
        assert int(shuffled[-1]) - int(shuffled[0]) == 3  # first and last alone would say "contiguous"
        _land(landing, senders[p], src, shuffled)
        landing.scatter(p, shuffled, dst)
    expected = oracle(
        [(spec(2, p), senders[p].views) for p in range(2)], spec(1, 0), spec(1, 0).allocate(1).views, src, dst
    )
    assert all(np.array_equal(v, e) for v, e in zip(final.views, expected))


def test_head_major_pages_scatter_one_run_per_page() -> None:
    heads = HeadLayout(2, 4, 8, 2, 4, head_major=True)  # 2 of 4 heads x 4 tokens x 16 bytes
    rng = np.random.default_rng(1)
    k, v = (rng.integers(0, 255, (6, heads.page_bytes), np.uint8) for _ in range(2))
    before = [k.copy(), v.copy()]
    final = KVLayout.mha([k], [v], attn_tp_size=2, attn_tp_rank=1, heads=heads)
    landing = Landing(final, 4, 4)
    assert landing.senders == (2, 3)
    reserved = landing.reserve(2)
    assert reserved is not None
    for p, pages in reserved.items():
        for i in range(2):
            _pool(landing, i)[pages] = 10 * i + p  # sender p's one head of every token, in K (i = 0) and V
        landing.scatter(p, pages, np.array([4, 1]))
    for i, buf in enumerate((k, v)):
        got = buf.reshape(6, 2, 4, 16)
        assert (got[[4, 1], 0] == 10 * i + 2).all() and (got[[4, 1], 1] == 10 * i + 3).all(), f"buffer {i}"
        untouched = [0, 2, 3, 5]
        assert np.array_equal(buf[untouched], before[i][untouched])


def test_decode_replicas_take_whole_rows_from_their_one_sender() -> None:
    """2 KV heads, prefill TP 8, decode TP 4: decode rank 1 holds head 0; ranks 2 and 3 send to it, only 2 sends."""
    heads = HeadLayout(1, 2, 8, 2, 4)
    final_k, final_v = np.zeros((5, heads.page_bytes), np.uint8), np.zeros((5, heads.page_bytes), np.uint8)
    final = KVLayout.mha([final_k], [final_v], attn_tp_size=4, attn_tp_rank=1, heads=heads)
    landing = Landing(final, 8, 2, threads=64)  # more threads than buffers: two run
    assert landing.senders == (2,)
    reserved = landing.reserve(2)
    assert reserved is not None and list(reserved) == [2]
    rng = np.random.default_rng(3)
    sent = [rng.integers(1, 255, (2, heads.page_bytes), np.uint8) for _ in range(2)]
    for i in range(2):
        _pool(landing, i)[reserved[2]] = sent[i]
    landing.scatter(np.int64(2), reserved[2], np.array([3, 0], np.int32))  # type: ignore[arg-type]
    for buf, rows in zip((final_k, final_v), sent):
        assert np.array_equal(buf[[3, 0]], rows) and not buf[[1, 2, 4]].any()


# -- the landing layout is what a sender plans as a same-shape peer --------------------------------------------


def test_the_landing_layout_takes_whole_pages_from_each_sender() -> None:
    from kvwire import plan_transfer

    final = spec(1, 0).allocate(1)
    landing = Landing(final.layout, 2, 16)
    layout = landing.layout
    assert (layout.attn_tp_size, layout.attn_tp_rank, layout.heads) == (None, None, None)
    assert [(b.layer, b.role, b.memory) for b in layout.buffers] == [
        (b.layer, b.role, "host") for b in final.layout.buffers
    ]
    sender = spec(2, 1).allocate(3)
    assert {b.page_bytes for b in layout.buffers} == {sender.layout.buffers[0].page_bytes}
    pages = np.arange(4, 8, dtype=np.int32)
    plan = plan_transfer(
        sender.layout, layout, np.array([9, 10, 11, 30], np.int32), [b.base for b in layout.buffers], pages
    )
    assert len(plan) == 2 * len(layout.buffers)  # runs [9..11] and [30]: whole pages, coalesced


# -- credits -----------------------------------------------------------------------------------------------------


def _credits(pages: int) -> LandingCredits:
    return LandingCredits(KVLayout((KVBuffer(4096, 64, pages, 0, "k"),)))


def test_credits_hand_out_the_lowest_fitting_range_then_say_none() -> None:
    c = _credits(10)
    got = c.reserve(4, [0])
    more = c.reserve(3, [5])
    assert got is not None and more is not None
    assert (got[0].tolist(), more[5].tolist(), c.free) == ([0, 1, 2, 3], [4, 5, 6], 3)
    c.release(got[0][1:3])
    again = c.reserve(3, [1])  # 1, 2 and 7..9 are free: the range 7..9 fits
    assert again is not None and again[1].tolist() == [7, 8, 9]
    assert c.reserve(3, [0]) is None and c.free == 2  # only 1 and 2 left: nothing is reserved
    last = c.reserve(2, [0])
    assert last is not None and last[0].tolist() == [1, 2] and c.free == 0


def test_credits_are_first_fit_the_lowest_range_after_a_release() -> None:
    c = _credits(10)
    got = c.reserve(3, [0, 1])
    last = c.reserve(2, [2])
    assert got is not None and last is not None and last[2].tolist() == [6, 7]
    c.release(got[0])  # 0..2 and 8, 9 are free: both fit 2 pages, the lowest is taken
    again = c.reserve(2, [3])
    assert again is not None and again[3].tolist() == [0, 1]


def test_credits_for_several_senders_are_all_or_nothing() -> None:
    c = _credits(8)
    assert c.reserve(3, [0, 1]) is not None and c.free == 2
    assert c.reserve(1, [0, 1, 2]) is None and c.free == 2


def test_a_request_that_can_never_fit_is_an_error_not_a_wait() -> None:
    with pytest.raises(
        InvalidTransferError,
        match=re.escape(
            "count = 5 pages for each of 2 senders is more than the landing pool's 8 pages: it can never be "
            "reserved; make the pool larger"
        ),
    ):
        _credits(8).reserve(5, [0, 1])


@pytest.mark.parametrize(
    ("pages", "message"),
    [
        (np.array([2, 3]), "pages[0] = 2 is not a reserved landing page"),
        (np.array([0, 0]), "pages[1] = 0 repeats pages[0]"),
        (np.array([0, 12]), "pages[1] = 12 is out of range: the landing pool has 10 pages"),
        (np.array([-1]), "pages[0] = -1 is negative"),
        (np.array([2**63 - 1], np.int64), f"pages[0] = {2**63 - 1} is out of range"),
        ([0], "pages must be a 1-D numpy integer array, got list"),
        (np.array([[0]]), "pages must be a 1-D numpy integer array, got shape (1, 1)"),
    ],
)
def test_release_refuses_what_was_not_reserved_and_keeps_every_credit(pages: Any, message: str) -> None:
    c = _credits(10)
    c.reserve(2, [0])
    with pytest.raises(InvalidTransferError, match=re.escape(message)):
        c.release(pages)
    assert c.free == 8


@pytest.mark.parametrize("count", [0, -3, True, 2.0, "2", None])
def test_reserve_needs_a_whole_count(count: Any) -> None:
    with pytest.raises(InvalidTransferError, match=re.escape(f"count must be an int >= 1, got {count!r}")):
        _credits(4).reserve(count, [0])


def test_numpy_integers_are_whole_numbers() -> None:
    got = _credits(4).reserve(np.int64(2), [np.int32(3)])  # type: ignore[list-item]
    assert got is not None and got[3].tolist() == [0, 1]


# -- bad input: a typed error naming the argument, before a byte moves -------------------------------------------


@pytest.fixture
def landed() -> tuple[Landing, KVMemory, np.ndarray]:
    final = spec(2, 1).allocate(5)
    landing = Landing(final.layout, 4, 8)
    reserved = landing.reserve(2)
    assert reserved is not None
    return landing, final, reserved[2]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda pages: (0, pages, np.array([1, 2])),
            "sender = 0 does not send into this landing pool: decode rank 1 (of 2) receives from prefill ranks "
            "[2, 3] (of 4)",
        ),
        (lambda pages: (True, pages, np.array([1, 2])), "sender = True does not send into this landing pool"),
        (lambda pages: (2, np.array([5, 6]), np.array([1, 2])), "landing_pages[0] = 5 is not a reserved landing page"),
        (
            lambda pages: (3, pages, np.array([1, 2])),
            f"landing_pages[0] = {0} is reserved for sender 2, not sender 3: each sender's pages hold its own heads",
        ),
        (lambda pages: (2, pages, np.array([1, 2**63 - 1])), f"final_pages[1] = {2**63 - 1} is out of range"),
        (
            lambda pages: (2, pages, np.array([1])),
            "final_pages has 1 entries but landing_pages has 2: they must be equal",
        ),
        (lambda pages: (2, pages, np.array([1, PAGES])), f"final_pages[1] = {PAGES} is out of range"),
        (lambda pages: (2, pages, np.array([3, 3])), "final_pages[1] = 3 repeats final_pages[0]"),
        (
            lambda pages: (2, pages, np.array([1.0, 2.0])),
            "final_pages must have an integer dtype (int32 or int64), got float64",
        ),
    ],
)
def test_a_bad_scatter_names_its_argument_and_moves_nothing(
    landed: tuple[Landing, KVMemory, np.ndarray], call: Any, message: str
) -> None:
    landing, final, pages = landed
    before = final.digest()
    with pytest.raises(InvalidTransferError, match=re.escape(message)):
        landing.scatter(*call(pages))
    assert final.digest() == before and landing.credits.free == 4


def test_an_unsuitable_decode_layout_is_refused_at_construction() -> None:
    final = spec(2, 0).allocate(1).layout
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "Landing: prefill_tp must be an int larger than the decode's attn_tp_size = 2 and a multiple of it, got 3"
        ),
    ):
        Landing(final, 3, 4)
    with pytest.raises(
        ConfigError, match=re.escape("got 2 (with prefill TP <= decode TP each decode page has one sender")
    ):
        Landing(final, 2, 4)
    with pytest.raises(ConfigError, match=re.escape("Landing: final must record attn_tp_size, attn_tp_rank and heads")):
        Landing(KVLayout(final.buffers), 4, 4)
    with pytest.raises(ConfigError, match=re.escape("Landing: pages must be an int >= 1, got 0")):
        Landing(final, 4, 0)
    with pytest.raises(ConfigError, match=re.escape("Landing: threads must be an int >= 1, got 1.5")):
        Landing(final, 4, 4, threads=1.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=re.escape(f"Landing: threads must be an int <= 64, got {2**62}")):
        Landing(final, 4, 4, threads=2**62)
    with pytest.raises(
        ConfigError,
        match=re.escape(f"Landing: pages = {2**62} of 256 bytes for each of 4 buffers is past the address space"),
    ):
        Landing(final, 4, 2**62)
    with pytest.raises(
        ConfigError,
        match=re.escape("Landing: prefill_tp = 12 does not fit the model's KV heads: HeadLayout.total_kv_heads = 8"),
    ):
        Landing(final, 12, 4)
    with pytest.raises(ConfigError, match=re.escape("Landing: prefill_tp must be an int >= 1, got True")):
        Landing(final, True, 4)  # type: ignore[arg-type]
    assert Landing(final, np.int64(4), np.int64(2)).senders == (0, 1)  # type: ignore[arg-type]
    device = KVLayout(
        tuple(KVBuffer(b.base, b.page_bytes, b.num_pages, b.layer, b.role, "device") for b in final.buffers),
        2,
        0,
        final.heads,
    )
    with pytest.raises(LayoutError, match=re.escape("Landing: final buffer 0 (layer 0, k) is device memory")):
        Landing(device, 4, 4)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_closed_landing_scatters_nothing(threads: int) -> None:
    final = spec(1, 0).allocate(2)
    landing = Landing(final.layout, 2, 4, threads=threads)
    reserved = landing.reserve(1)
    assert reserved is not None
    before = final.digest()
    landing.close()
    with pytest.raises(InvalidTransferError, match=re.escape("the Landing is closed; nothing was scattered")):
        landing.scatter(0, reserved[0], np.array([1]))
    assert final.digest() == before


@pytest.mark.parametrize("threads", [1, 2])
def test_senders_scattered_from_two_host_threads_at_once_match_the_oracle(threads: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(17)
    src, dst = rng.permutation(PAGES)[:32], rng.permutation(PAGES)[:32]
    prefill = [spec(4, p).allocate(40 + p) for p in range(4)]
    final = spec(1, 0).allocate(4)
    with Landing(final.layout, 4, 128, threads=threads) as landing:
        reserved = landing.reserve(32)
        assert reserved is not None
        for p, pages in reserved.items():
            _land(landing, prefill[p], src, pages)
        with ThreadPoolExecutor(4) as host:  # each sender's arrival handled on its own host thread
            for done in [host.submit(landing.scatter, p, pages, dst) for p, pages in reserved.items()]:
                done.result()
    expected = oracle(
        [(spec(4, p), prefill[p].views) for p in range(4)], spec(1, 0), spec(1, 0).allocate(4).views, src, dst
    )
    assert all(np.array_equal(v, e) for v, e in zip(final.views, expected))
