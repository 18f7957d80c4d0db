"""A decode rank's landing pool: whole pages from each prefill rank land here, then scatter into the KV pages.

When the prefill attention-TP size ``P`` is larger than the decode's ``D``,
each of a decode rank's ``P / D`` senders holds some of its KV heads, so a
token-major decode page interleaves bytes from all of them, token by token:
written directly, that is one descriptor per token, per page, per buffer
(262,144 of 1 KiB for llama3-8b, 2,048 tokens, TP 2 -> 1), and transports pay
per descriptor. A :class:`Landing` instead gives each sender pages of its own
shape: it writes its pages whole (coalesced runs, as between equal TP sizes)
into landing pages the decode side reserved for it, and the decode side then
copies each sender's heads into place with one strided numpy copy per buffer
(:meth:`Landing.scatter`), before it reports the request ready.

The landing layout records no TP fields and no heads, so a sender plans it
as a same-shape peer: whole pages, page sizes checked. The scatter's offsets
come from :func:`kvwire.planning.head_slicing.slicing_of`, the planner's own
head arithmetic (one implementation of which heads a sender supplies and
where they go). The KV pages must be host memory of this process that
outlives the :class:`Landing` (the scatter writes them through their
addresses, on the CPU). Head-major pages are scattered correctly too, but need
no landing: a sender's heads are one run of every page already.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire.errors import ConfigError, InvalidTransferError
from kvwire.landing.credits import LandingCredits, whole_number
from kvwire.layout.buffers import ADDRESS_LIMIT, HeadLayout, KVBuffer, LayoutError
from kvwire.layout.hugepages import host_bytes, hugepage_array
from kvwire.layout.kv_layout import KVLayout
from kvwire.planning.checks import check_range, index_array, raise_repeat
from kvwire.planning.head_slicing import Slicing, senders, slicing_of

__all__ = ["Landing"]

_WIDTHS = (8, 4, 2, 1)
#: Most scatter threads a Landing takes (more than the cores only adds switching).
MAX_THREADS = 64


class Landing:
    """Landing pages for the ``prefill_tp // D`` senders of decode rank ``final`` (one pool shared by all).

    ``final``: the decode rank's KV layout (MHA, host memory, recording
    ``attn_tp_size``, ``attn_tp_rank`` and ``heads``). ``pages``: landing
    pages per buffer (a request's pages times its senders, times the
    requests landing at once). ``threads``: threads one scatter splits its
    buffers across (numpy releases the GIL while it copies).

    Use: register :attr:`layout` with a connection of its own and publish it
    as a peer; per request, :meth:`reserve` pages for each sender and send
    them with the request's KV page ids; each sender writes its pages there
    (``send_kvcache`` to the landing peer, ``dst_kv_indices`` = its landing
    pages); on its arrival, :meth:`scatter` them into the KV pages, then
    :meth:`release` them.
    """

    def __init__(self, final: KVLayout, prefill_tp: int, pages: int, *, threads: int = 2) -> None:
        decode_rank, tp, own = _check_final(final, prefill_tp)
        n = len(final.buffers)
        count = whole_number("Landing: pages", pages, 1, ConfigError)
        self._threads = whole_number("Landing: threads", threads, 1, ConfigError)
        if self._threads > MAX_THREADS:
            raise ConfigError(f"Landing: threads must be an int <= {MAX_THREADS}, got {threads!r}")
        if count > ADDRESS_LIMIT // (n * own.page_bytes):
            raise ConfigError(
                f"Landing: pages = {count} of {own.page_bytes} bytes for each of {n} buffers is past the address space"
            )
        try:
            self._memory = hugepage_array(n * count, own.page_bytes).reshape(n, count, own.page_bytes)
        except (OSError, OverflowError, MemoryError) as exc:
            raise ConfigError(
                f"Landing: pages = {count}: cannot map {n * count * own.page_bytes} bytes of landing pages ({exc})"
            ) from exc
        self.final = final
        self.prefill_tp = tp
        base = int(self._memory.ctypes.data)
        step = count * own.page_bytes
        #: The landing pool as a peer layout: register it with a connection; senders write whole pages into it.
        self.layout = KVLayout(
            tuple(
                KVBuffer(base + i * step, own.page_bytes, count, b.layer, b.role) for i, b in enumerate(final.buffers)
            ),
            keep=(self._memory,),  # registered with a connection, the landing memory lives as long as it does
        )
        self.credits = LandingCredits(self.layout)
        d_tp = final.attn_tp_size
        assert d_tp is not None  # _check_final
        kv = [host_bytes(b.base, b.num_pages, b.page_bytes) for b in final.buffers]
        # per sender: its copy and the (landing, KV) views of every buffer it copies between, made once
        self._copies: dict[int, tuple[_Copy, list[tuple[NDArray[Any], NDArray[Any]]]]] = {}
        for p in _candidates(tp, d_tp, decode_rank, own.total_kv_heads):
            s = slicing_of(KVLayout(self.layout.buffers, tp, p, own), final)
            if s is not None and s.sends:
                copy = _Copy(s)
                views = [
                    (copy.view(self._memory[i], s.src_page_bytes), copy.view(f, s.dst_page_bytes))
                    for i, f in enumerate(kv)
                ]
                self._copies[p] = (copy, views)
        #: The prefill ranks that send into this pool (a GQA replica another sender covers sends nothing).
        self.senders: tuple[int, ...] = tuple(self._copies)
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    def reserve(self, count: int) -> dict[int, NDArray[np.int64]] | None:
        """``count`` landing pages for each sender of one request, by sender; None (nothing reserved) when too few
        are free now. InvalidTransferError when ``count`` pages per sender can never fit the pool."""
        return self.credits.reserve(count, self.senders)

    def release(self, pages: NDArray[np.integer[Any]]) -> None:
        """Give back landing pages once scattered (or once their request is dropped)."""
        self.credits.release(pages)

    def scatter(
        self, sender: int, landing_pages: NDArray[np.integer[Any]], final_pages: NDArray[np.integer[Any]]
    ) -> None:
        """Copy prefill rank ``sender``'s heads from ``landing_pages`` into KV pages ``final_pages``.

        ``landing_pages[j]`` holds what the sender sent for ``final_pages[j]``.
        Every argument is checked (InvalidTransferError naming it) before a byte moves.
        """
        try:
            planned = self._copies.get(whole_number("sender", sender, 0))
        except InvalidTransferError:
            planned = None
        if planned is None:
            raise InvalidTransferError(
                f"sender = {sender!r} does not send into this landing pool: decode rank {self.final.attn_tp_rank} "
                f"(of {self.final.attn_tp_size}) receives from prefill ranks {list(self.senders)} "
                f"(of {self.prefill_tp})"
            )
        land = self.credits.hold("landing_pages", landing_pages, int(sender))  # not released while read
        try:
            self._scatter(planned, land, final_pages)
        finally:
            self.credits.unhold(land)

    def _scatter(
        self,
        planned: tuple[_Copy, list[tuple[NDArray[Any], NDArray[Any]]]],
        land: NDArray[np.int64],
        final_pages: NDArray[np.integer[Any]],
    ) -> None:
        dst = index_array("final_pages", final_pages).astype(np.int64, copy=False)
        n = land.shape[0]
        if dst.shape[0] != n:
            raise InvalidTransferError(
                f"final_pages has {dst.shape[0]} entries but landing_pages has {n}: they must be equal"
            )
        if n == 0:
            return
        limit = min(b.num_pages for b in self.final.buffers)
        check_range("final_pages", dst, limit, layout=self.final, ids=range(len(self.final.buffers)), describe=_kv_name)
        if np.unique(dst).shape[0] != n:
            raise_repeat("final_pages", dst)
        contiguous = int(land[-1]) - int(land[0]) == n - 1 and bool((np.diff(land) == 1).all())
        source: slice | NDArray[np.int64] = slice(int(land[0]), int(land[0]) + n) if contiguous else land
        copy, jobs = planned
        k = min(self._threads, len(jobs))
        with self._lock:
            if self._closed:
                raise InvalidTransferError("the Landing is closed; nothing was scattered")
            if k == 1:  # on this thread, holding the lock so close() waits for it
                copy.run_all(jobs, source, dst)
                return
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="kvwire-landing")
            pool = self._pool
            done = [pool.submit(copy.run_all, jobs[i::k], source, dst) for i in range(k)]
        for future in done:  # close() waits for these; an error in one is raised here
            future.result()

    def close(self) -> None:
        """Stop the scatter threads once running scatters finish (the landing memory lives as long as this object)."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown()

    def __enter__(self) -> Landing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Copy:
    """One sender's strided copy: row ``r`` of a page, ``length`` bytes from ``src_off`` to ``dst_off``."""

    def __init__(self, s: Slicing) -> None:
        self.rows = s.tokens
        self.src_off, self.dst_off = int(s.src_tokens[0]), int(s.dst_tokens[0])
        self.length = s.length
        src_row, dst_row = s.src_page_bytes // self.rows, s.dst_page_bytes // self.rows
        rows = np.arange(self.rows, dtype=np.int64)
        if not (
            np.array_equal(s.src_tokens, rows * src_row + self.src_off)
            and np.array_equal(s.dst_tokens, rows * dst_row + self.dst_off)
        ):
            raise InvalidTransferError("internal planning error: head-slice rows are not evenly spaced; nothing moved")
        sizes = (s.length, self.src_off, self.dst_off, src_row, dst_row)
        self.width = next(w for w in _WIDTHS if all(v % w == 0 for v in sizes))

    def view(self, pages: NDArray[np.uint8], page_bytes: int) -> NDArray[Any]:
        """``pages`` (pages x page_bytes bytes) as (pages, rows, row) items of ``width`` bytes."""
        count = pages.size // page_bytes
        return pages.reshape(-1).view(f"u{self.width}").reshape(count, self.rows, -1)

    def run(
        self, src: NDArray[Any], out: NDArray[Any], source: slice | NDArray[np.int64], dst: NDArray[np.int64]
    ) -> None:
        w = self.width
        a, b = self.src_off // w, (self.src_off + self.length) // w
        c, d = self.dst_off // w, (self.dst_off + self.length) // w
        out[dst, :, c:d] = src[source, :, a:b]

    def run_all(
        self, jobs: list[tuple[NDArray[Any], NDArray[Any]]], source: slice | NDArray[np.int64], dst: NDArray[np.int64]
    ) -> None:
        for src, out in jobs:
            self.run(src, out, source, dst)


def _candidates(prefill_tp: int, decode_tp: int, decode_rank: int, total_heads: int) -> list[int]:
    """The senders of decode rank ``decode_rank`` that may send anything: all of them, but with more prefill ranks
    than KV heads only the lowest rank holding each head (the others hold replicas it covers), so a Landing is
    built in time proportional to the heads, not to ``prefill_tp`` (65,536 ranks took 3 s)."""
    routed = senders(prefill_tp, decode_tp, decode_rank)
    if prefill_tp <= total_heads:
        return list(routed)
    first, last = routed[0], routed[-1]
    heads = range(first * total_heads // prefill_tp, last * total_heads // prefill_tp + 1)  # rank r holds r*H//P
    return sorted({max(first, -(-h * prefill_tp // total_heads)) for h in heads})


def _check_final(final: KVLayout, prefill_tp: int) -> tuple[int, int, HeadLayout]:
    """The decode rank, the prefill TP size and its ranks' heads; ConfigError/LayoutError naming what does not fit."""
    if not isinstance(final, KVLayout):
        raise ConfigError(f"Landing: final must be a kvwire.KVLayout, got {type(final).__name__}")
    d_tp, rank, heads = final.attn_tp_size, final.attn_tp_rank, final.heads
    if d_tp is None or rank is None or heads is None:
        raise ConfigError(
            "Landing: final must record attn_tp_size, attn_tp_rank and heads (an MHA decode rank's layout): "
            "the scatter puts each sender's heads where the planner would"
        )
    tp = whole_number("Landing: prefill_tp", prefill_tp, 1, ConfigError)
    if tp <= d_tp or tp % d_tp:
        raise ConfigError(
            f"Landing: prefill_tp must be an int larger than the decode's attn_tp_size = {d_tp} and a multiple "
            f"of it, got {prefill_tp!r} (with prefill TP <= decode TP each decode page has one sender: "
            "no landing needed)"
        )
    try:
        own = heads.for_tp(tp)
    except LayoutError as exc:
        raise ConfigError(f"Landing: prefill_tp = {tp} does not fit the model's KV heads: {exc}") from exc
    for i, b in enumerate(final.buffers):
        if b.memory != "host":
            raise LayoutError(
                f"Landing: final buffer {i} (layer {b.layer}, {b.role}) is {b.memory} memory; "
                "the landing scatter copies on the CPU, so every KV buffer must be host memory"
            )
    return rank, tp, own


def _kv_name(i: int, buf: KVBuffer) -> str:
    return f"KV buffer {i} (layer {buf.layer}, {buf.role})"
