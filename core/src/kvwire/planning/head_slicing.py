"""Heterogeneous attention TP: which KV heads one prefill rank sends one decode rank, and where.

With MHA/GQA each attention-TP rank holds a contiguous slice of the model's
KV heads, so when the prefill (TP size ``P``) and the decode (TP size ``D``)
differ a prefill page does not match a decode page: every token of every page
must carry just the heads the two ranks share. Token-major pages (sglang's;
:class:`~kvwire.layout.kv_layout.HeadLayout`): token ``t``, local head ``h`` at
byte ``(t * kv_heads + h) * head_dim * elem_bytes`` of the page, as sglang's
``send_kvcache_slice`` addresses them, so the shared heads are one descriptor
per token. Head-major pages (vLLM's HND, ``head_major``): head ``h``, token
``t`` at ``(h * tokens_per_page + t) * head_dim * elem_bytes``, so the shared
heads are one contiguous run: one descriptor per page. Both sides must use
the same order.

This applies when the sizes differ and both layouts record their rank
(``attn_tp_rank``; MHA also ``heads``); layouts without ranks (older
descriptions) keep the whole-page path, where page sizes must match.

Routing follows sglang (``_resolve_rank_mapping``) and vLLM's NIXL connector
(``get_target_remote_ranks``): decode rank ``d`` receives from prefill rank
``d * P // D`` when ``P <= D``, and from the ``P // D`` prefill ranks
``d * P // D ...`` when ``P > D`` (each filling its heads of the decode page).
A prefill rank asked to plan for a decode rank that does not receive from it
is refused ("rank out of range"); so is one of the same TP size but another
rank, when both record theirs.

GQA with fewer KV heads ``H`` than a TP size: a rank then holds one head,
replicated on ``tp // H`` consecutive ranks. Decode replicas each receive
their head (every decode rank needs its own copy). On the prefill side several
replicas of a head may be among the decode rank's senders (sglang lets every
one of them send, writing the same bytes several times); here each decode rank
receives each head once, from the lowest-ranked of its senders that holds it.
The other replicas plan nothing (an empty plan, after every check), just as
sglang's MLA "dummy" ranks send nothing. MLA is never head-sliced (every rank
holds the whole latent): the first sender sends whole pages, the others
nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from kvwire.errors import InvalidTransferError
from kvwire.layout.buffers import HeadLayout
from kvwire.layout.kv_layout import KVLayout
from kvwire.planning.plan import frozen

__all__ = [
    "Slicing",
    "fill_sliced",
    "heads_of",
    "needs_head_slicing",
    "senders",
    "slicing_of",
    "tp_aware",
    "tp_mismatch",
]


def tp_mismatch(local: KVLayout, peer: KVLayout) -> bool:
    """Both layouts record their attention-TP size and the sizes differ."""
    return local.attn_tp_size is not None and peer.attn_tp_size is not None and local.attn_tp_size != peer.attn_tp_size


def tp_aware(local: KVLayout, peer: KVLayout) -> bool:
    """Planning goes across TP sizes: they differ and both layouts record their rank (``attn_tp_rank``).

    Layouts that do not record ranks (older descriptions) keep the whole-page
    path, where page sizes must match, as before.
    """
    return tp_mismatch(local, peer) and local.attn_tp_rank is not None and peer.attn_tp_rank is not None


def needs_head_slicing(local: KVLayout, peer: KVLayout) -> bool:
    """Plans between these layouts may move head slices (sub-page descriptors): MHA planned across TP sizes."""
    return tp_aware(local, peer) and local.attention == "mha"


def heads_of(tp: int, rank: int, total: int) -> range:
    """The global KV heads rank ``rank`` of ``tp`` holds (one replicated head when ``total < tp``)."""
    if total >= tp:
        per = total // tp
        return range(rank * per, rank * per + per)
    head = rank // (tp // total)
    return range(head, head + 1)


def senders(prefill_tp: int, decode_tp: int, decode_rank: int) -> range:
    """The prefill ranks decode rank ``decode_rank`` receives from (sglang's and vLLM's routing)."""
    first = decode_rank * prefill_tp // decode_tp
    return range(first, first + max(1, prefill_tp // decode_tp))


@dataclass(frozen=True, eq=False)
class Slicing:
    """What a (prefill rank, decode rank) pair moves, derived from the two layouts alone.

    ``sends`` is False when this rank sends the decode rank nothing (a replica
    another sender covers). ``whole_pages``: the moved heads fill whole token
    rows on both sides (or MLA), so pages move whole and coalesce as usual.
    Else each row ``r`` of each page moves ``length`` bytes from byte
    ``src_tokens[r]`` of the source page to byte ``dst_tokens[r]`` of the
    destination page: a row per token for token-major pages, one row per
    page (all tokens of the moved heads) for head-major ones.
    """

    prefill: tuple[int, int]  # (TP size, rank)
    decode: tuple[int, int]
    sends: bool  # False: this rank sends the decode rank nothing (another sender covers it)
    heads: range  # global KV heads moved (MHA)
    whole_pages: bool
    length: int  # bytes per row (head-sliced plans)
    src_page_bytes: int
    dst_page_bytes: int
    src_tokens: NDArray[np.int64]  # (tokens,) byte offsets of the moved slice in a source page
    dst_tokens: NDArray[np.int64]

    @property
    def tokens(self) -> int:
        """Rows (descriptors) per page: the tokens of a token-major page, 1 for a head-major one."""
        return int(self.src_tokens.shape[0])


def _need(local: KVLayout, peer: KVLayout, tps: str) -> None:
    for side, layout in (("local (prefill)", local), ("peer (decode)", peer)):
        if layout.heads is None:
            raise InvalidTransferError(
                f"attention TP sizes differ ({tps}): slicing MHA pages needs each side's KV heads; "
                f"the {side} layout does not record heads"
            )


def _check_heads(a: HeadLayout, b: HeadLayout) -> None:
    """Both sides describe the same model's KV heads (same heads, head_dim, dtype, page tokens, page order)."""
    if a.head_major != b.head_major:
        order = {True: "head-major", False: "token-major"}
        raise InvalidTransferError(
            f"page order mismatch: the prefill layout's pages are {order[a.head_major]}, the decode layout's "
            f"{order[b.head_major]}; head slices move only between pages of the same order"
        )
    for field, what in (
        ("total_kv_heads", "KV head count mismatch"),
        ("head_dim", "head_dim mismatch"),
        ("elem_bytes", "element size (dtype) mismatch"),
        ("tokens_per_page", "tokens per page mismatch"),
    ):
        x, y = getattr(a, field), getattr(b, field)
        if x != y:
            raise InvalidTransferError(f"{what}: the prefill layout has {field} = {x}, the decode layout {y}")


def _route(p_tp: int, p: int, d_tp: int, d: int) -> range:
    """The decode rank's senders; raises when ``p`` is not one of them."""
    serving = senders(p_tp, d_tp, d)
    if p not in serving:
        first, last = serving[0], serving[-1]
        who = f"prefill rank {first}" if first == last else f"prefill ranks {first}..{last}"
        raise InvalidTransferError(
            f"rank out of range: prefill rank {p} (of {p_tp}) does not send to decode rank {d} (of {d_tp}); "
            f"decode rank {d} receives from {who}"
        )
    return serving


def _holders(p_tp: int, total: int, head: int) -> range:
    """The prefill ranks holding global head ``head``."""
    if total < p_tp:
        r = p_tp // total
        return range(head * r, head * r + r)
    per = total // p_tp
    return range(head // per, head // per + 1)


def _moved_heads(p_tp: int, p: int, d_tp: int, d: int, total: int, serving: range) -> range:
    """Heads of decode rank ``d`` for which ``p`` is the lowest-ranked sender holding them."""
    moved = [h for h in heads_of(d_tp, d, total) if max(serving.start, _holders(p_tp, total, h).start) == p]
    if moved and moved != list(range(moved[0], moved[-1] + 1)):  # a rank's heads are contiguous
        raise InvalidTransferError(f"internal planning error: heads {moved} are not contiguous; no plan was returned")
    return range(moved[0], moved[-1] + 1) if moved else range(0)


def slicing_of(local: KVLayout, peer: KVLayout) -> Slicing | None:
    """The TP slicing between ``local`` (prefill) and ``peer`` (decode); None: the same-TP path.

    Across TP sizes (:func:`tp_aware`), raises :class:`InvalidTransferError`
    for a combination that cannot be planned: TP sizes that do not divide, a
    decode rank this rank does not send to, a missing head description (MHA),
    or head geometries that differ (checked whenever both sides have one).
    """
    if local.heads is not None and peer.heads is not None:
        _check_heads(local.heads, peer.heads)
    if not tp_aware(local, peer):
        if local.attn_tp_rank is not None and peer.attn_tp_rank is not None and local.attn_tp_size is not None:
            tp = local.attn_tp_size
            _route(tp, local.attn_tp_rank, tp, peer.attn_tp_rank)  # same TP size: the same rank
        return None
    p_tp, d_tp = local.attn_tp_size, peer.attn_tp_size
    assert p_tp is not None and d_tp is not None  # tp_mismatch
    tps = f"prefill {p_tp}, decode {d_tp}"
    if max(p_tp, d_tp) % min(p_tp, d_tp):
        raise InvalidTransferError(f"attention TP sizes differ ({tps}): the larger must be a multiple of the smaller")
    p, d = local.attn_tp_rank, peer.attn_tp_rank
    assert p is not None and d is not None
    serving = _route(p_tp, p, d_tp, d)
    if local.attention == "mla":
        return Slicing((p_tp, p), (d_tp, d), p == serving.start, range(0), True, 0, 0, 0, *_no_tokens())
    _need(local, peer, tps)
    src, dst = local.heads, peer.heads
    assert src is not None and dst is not None
    heads = _moved_heads(p_tp, p, d_tp, d, src.total_kv_heads, serving)
    if not heads:
        return Slicing((p_tp, p), (d_tp, d), False, heads, False, 0, 0, 0, *_no_tokens())
    head_bytes = src.head_dim * src.elem_bytes
    length = len(heads) * head_bytes
    src_off = (heads.start - heads_of(p_tp, p, src.total_kv_heads).start) * head_bytes
    dst_off = (heads.start - heads_of(d_tp, d, dst.total_kv_heads).start) * head_bytes
    if min(src_off, dst_off) < 0 or src_off + length > src.row_bytes or dst_off + length > dst.row_bytes:
        raise InvalidTransferError(  # cannot happen for valid layouts: the last line of defence
            f"internal planning error: heads {heads.start}..{heads.stop - 1} do not fit the token rows "
            f"({src_off}+{length} of {src.row_bytes}, {dst_off}+{length} of {dst.row_bytes}); no plan was returned"
        )
    whole = length == src.row_bytes == dst.row_bytes
    if src.head_major:  # the moved heads of every token: one run of the page, at the same ratio
        n = src.tokens_per_page
        rows_src, rows_dst = np.array([src_off * n], np.int64), np.array([dst_off * n], np.int64)
        pages = (src.page_bytes, dst.page_bytes)
        return Slicing((p_tp, p), (d_tp, d), True, heads, whole, length * n, *pages, frozen(rows_src), frozen(rows_dst))
    t = np.arange(src.tokens_per_page, dtype=np.int64)
    return Slicing(
        (p_tp, p),
        (d_tp, d),
        True,
        heads,
        whole,
        length,
        src.page_bytes,
        dst.page_bytes,
        frozen(t * src.row_bytes + src_off),
        frozen(t * dst.row_bytes + dst_off),
    )


def _no_tokens() -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    empty = frozen(np.zeros(0, dtype=np.int64))
    return empty, empty


def fill_sliced(
    sliced: Slicing,
    src_base: NDArray[np.int64],
    dst_base: NDArray[np.int64],
    src_pages: NDArray[np.int64],
    dst_pages: NDArray[np.int64],
    *,
    src: NDArray[np.int64],
    dst: NDArray[np.int64],
    length: NDArray[np.int64] | None,
) -> None:
    """Write the (pairs, pages x tokens) head-slice descriptors: pair-major, then page, then token.

    ``src_base``/``dst_base`` are (pairs, 1) columns of buffer bases; the
    per-token offsets are computed once for all pairs and broadcast.
    """
    rows = src_pages.shape[0] * sliced.tokens
    src_rows = np.add.outer(src_pages * sliced.src_page_bytes, sliced.src_tokens).reshape(1, rows)
    dst_rows = np.add.outer(dst_pages * sliced.dst_page_bytes, sliced.dst_tokens).reshape(1, rows)
    np.add(src_base, src_rows, out=src)
    np.add(dst_base, dst_rows, out=dst)
    if length is not None:  # None: the caller shares a constant lengths array
        length.fill(sliced.length)
