"""vLLM's per-layer KV tensors as a :class:`~kvwire.KVLayout`: one whole-page buffer per layer.

vLLM 0.33.0 hands ``register_kv_caches`` one tensor per attention layer, its
logical shape ``[num_blocks, num_kv_heads, block_size, head_size + head_size_v]``
(K and V of a head side by side), each a strided view into one shared
allocation (``allocate_kv_cache``), its strides set by the KV-cache layout vLLM
resolved (``KVCacheLayout``). In the layer-outermost, block-compact layouts a
block of one layer is one contiguous run and block ``b`` starts ``b * stride[0]``
elements after block 0, so kvwire moves a block as one page: one ``"kv"``
buffer per layer (layer ids are the positions in vLLM's layer order). Inside a
block the order is one of:

- ``head-major`` (vLLM's ``LBHNC``, HND): head ``h``'s K|V of every token is one
  run; what :meth:`KvwireConnector.get_required_kvcache_layout` asks vLLM for.
  With the model's total KV heads the layout records the TP rank and the heads
  (:class:`kvwire.HeadLayout`, ``head_major``), so ranks of different TP sizes
  exchange exactly the heads they share, one run per block.
- ``token-major`` (``LBNHC``, NHD, vLLM's default without a connector's wish,
  and the only layout of some backends): token ``t``'s heads side by side. Whole
  blocks move between equal TP sizes; across TP sizes a head's slice would be
  one run per token, which kvwire's vLLM connector refuses (:attr:`VllmLayout.tp_refusal`).
- ``latent`` (MLA: one latent vector per token, ``num_kv_heads`` 1, or a 3-d
  ``[num_blocks, block_size, latent]`` tensor): every TP rank holds the whole
  latent, so the layout records the TP rank and no heads; across TP sizes each
  decode rank takes its blocks from one prefill rank
  (:mod:`kvwire.planning.head_slicing`).

Refused, with :class:`kvwire.LayoutError` naming the layer, its shape and its
strides: another number of dimensions (a backend that hands the raw buffer),
a block that is not one contiguous run (a head-outermost ``LHBNC`` layout),
blocks not one block apart (a block-outermost ``BLHNC``/``BLNHC``/``BHLNC``
layout interleaves layers inside a block: one buffer per (layer, block) would
be needed), layers that differ in block count, block size or order (several
KV-cache groups: hybrid models, MLA's sparse-attention indexer caches).

Nothing of vLLM or torch is imported: any object with ``shape``, ``stride()``,
``element_size()``, ``data_ptr()`` and ``device`` serves, so the mapping is
checked on any machine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol

from kvwire.layout.buffers import HeadLayout, KVBuffer, LayoutError, MemoryKind
from kvwire.layout.kv_layout import KVLayout

__all__ = ["BLOCK_ORDERS", "BlockOrder", "KVTensor", "VllmLayout", "layout_from_kv_caches"]

#: How a block holds its bytes (see the module docstring).
BlockOrder = Literal["head-major", "token-major", "latent"]
#: Each order and vLLM's name for the layer-outermost layout that gives it (``KVCacheLayout``).
BLOCK_ORDERS: Final[Mapping[str, str]] = {"head-major": "LBHNC", "token-major": "LBNHC", "latent": "MLA latent"}
#: Why a token-major cache does not move across TP sizes (its refusal, at ``register_kv_caches`` and after).
LBNHC_ACROSS_TP: Final = (
    "its blocks are token-major (vLLM's LBNHC layout: each token's KV heads side by side), so another TP "
    "size's share of the heads is one run per token, not per block, and kvwire's vLLM connector moves "
    "token-major blocks between equal TP sizes only; run the head-major LBHNC layout, which "
    "KvwireConnector.get_required_kvcache_layout asks vLLM for (do not force another with "
    "VLLM_KV_CACHE_LAYOUT, cache_config.kv_cache_layout or an attention backend that supports only LBNHC)"
)
_NO_HEADS: Final = (
    "its connector was not given the model's total KV heads (vllm_config.model_config), so its blocks "
    "are not described by KV head"
)


class KVTensor(Protocol):
    """What :func:`layout_from_kv_caches` reads of a tensor (``torch.Tensor`` has all of it)."""

    @property
    def shape(self) -> Sequence[int]: ...

    @property
    def device(self) -> Any: ...

    def stride(self) -> Sequence[int]: ...

    def element_size(self) -> int: ...

    def data_ptr(self) -> int: ...


@dataclass(frozen=True)
class VllmLayout:
    """A vLLM worker's KV cache as kvwire sees it.

    ``layout`` has one buffer per layer, in ``layer_names`` order; ``num_blocks``
    blocks of ``block_bytes`` each (the same for every layer, so a block id means
    the same page in every buffer). ``order`` is how a block holds its bytes, the
    same in every layer; ``tp_refusal`` says why the blocks cannot move to or from
    a rank of another TP size (None: they can).
    """

    layout: KVLayout
    layer_names: tuple[str, ...]
    num_blocks: int
    block_bytes: int
    order: BlockOrder = "head-major"
    tp_refusal: str | None = None

    def check_block_ids(self, block_ids: Sequence[object], what: str) -> list[int]:
        """``block_ids`` as ints, each a block of this cache other than vLLM's null block 0.

        :class:`kvwire.LayoutError` naming ``what``, the position and the value otherwise: checked
        before anything moves, so a wrong id never reaches the transport.
        """
        out: list[int] = []
        for i, raw in enumerate(block_ids):
            if isinstance(raw, bool) or not isinstance(raw, int):
                raise LayoutError(f"{what}[{i}] = {raw!r} must be an int block id")
            if not 0 < raw < self.num_blocks:
                raise LayoutError(
                    f"{what}[{i}] = {raw} is not a block of this KV cache: ids run 1..{self.num_blocks - 1} "
                    "(block 0 is vLLM's null block)"
                )
            out.append(raw)
        return out


def _memory_kind(tensor: KVTensor) -> MemoryKind:
    device = tensor.device
    kind = getattr(device, "type", device)
    return "host" if kind == "cpu" else "device"


def _fits(shape: tuple[int, ...], stride: tuple[int, ...], packed: tuple[int, int, int]) -> bool:
    """Dimensions 1..3 have the strides of ``packed`` (a dimension of size 1 has any stride)."""
    return all(shape[d] == 1 or stride[d] == packed[d - 1] for d in (1, 2, 3))


def _block_order(where: str, shape: tuple[int, ...], stride: tuple[int, ...], latent: bool) -> BlockOrder:
    """How the block ``[heads, tokens, dims]`` lies in memory; LayoutError when it is not one run."""
    heads, tokens, dims = shape[1:]
    head_major, token_major = (tokens * dims, dims, 1), (dims, heads * dims, 1)
    if latent:
        if heads != 1:
            raise LayoutError(
                f"{where}: an MLA latent cache holds one latent vector per token (num_kv_heads 1), this one "
                f"{heads} heads; kvwire moves MLA's latent cache only"
            )
        if _fits(shape, stride, head_major):
            return "latent"
    elif _fits(shape, stride, head_major):
        return "head-major"
    elif _fits(shape, stride, token_major):
        return "token-major"
    raise LayoutError(
        f"{where}: a block is not one contiguous run: the strides of its [heads, tokens, dims] are "
        f"{list(stride[1:])}, and one run has {list(head_major)} (head-major, vLLM's LBHNC) or "
        f"{list(token_major)} (token-major, LBNHC); kvwire moves a block as one page, so a layout that puts "
        "the heads outside the blocks (LHBNC) is not supported: use LBHNC, which KvwireConnector asks vLLM for"
    )


def _layer_buffer(
    name: str, index: int, tensor: KVTensor, mla: bool, manager_blocks: int | None
) -> tuple[KVBuffer, BlockOrder, int]:
    """The layer's buffer, its block order and its kernel blocks per block, or LayoutError naming the layer."""
    shape = tuple(int(d) for d in tensor.shape)
    stride = tuple(int(s) for s in tensor.stride())
    where = f"layer {name!r} (shape {list(shape)}, stride {list(stride)})"
    if len(shape) == 3:  # [num_blocks, block_size, latent]: MLA's latent cache, one head
        shape, stride = (shape[0], 1, *shape[1:]), (stride[0], 0, *stride[1:])
    elif len(shape) != 4:
        raise LayoutError(
            f"{where}: expected vLLM's [num_blocks, num_kv_heads, block_size, head_size + head_size_v] KV "
            "tensor (or an MLA latent [num_blocks, block_size, latent]); other KV-cache shapes (a raw buffer, a "
            "leading K/V dimension of 2) are not supported"
        )
    num_blocks = shape[0]
    if num_blocks < 1:
        raise LayoutError(f"{where}: the first dimension (the blocks) is empty")
    order = _block_order(where, shape, stride, mla or len(tensor.shape) == 3)
    block_elems = math.prod(shape[1:])
    if num_blocks > 1 and stride[0] != block_elems:
        raise LayoutError(
            f"{where}: blocks are {stride[0]} elements apart but hold {block_elems}: the layout interleaves "
            "something between a layer's blocks (a block-outermost KV-cache layout such as BLHNC); use a "
            "layer-outermost layout such as LBHNC"
        )
    split = 1  # vLLM splits a block into kernel blocks when the backend's kernels take fewer tokens
    if manager_blocks is not None and num_blocks != manager_blocks:
        if manager_blocks < 1 or num_blocks % manager_blocks:
            raise LayoutError(
                f"{where}: {num_blocks} blocks in the tensor, but vLLM's KV cache has {manager_blocks} "
                "(kv_cache_config.num_blocks): not a whole number of kernel blocks per block"
            )
        split = num_blocks // manager_blocks  # dense (checked above): a block's kernel blocks are one run
    elem = int(tensor.element_size())
    base = int(tensor.data_ptr())
    if base <= 0:
        raise LayoutError(f"{where}: data_ptr() is {base}; the tensor has no memory")
    buffer = KVBuffer(base, split * block_elems * elem, num_blocks // split, index, "kv", _memory_kind(tensor))
    return buffer, order, split


def _tp_refusal(order: BlockOrder, total_kv_heads: int | None, split: int) -> str | None:
    """Why a head-major or token-major cache cannot move across TP sizes, or None: it can."""
    if order == "token-major":
        return LBNHC_ACROSS_TP
    if total_kv_heads is None:
        return _NO_HEADS
    if split > 1:
        return (
            f"vLLM splits each of its blocks into {split} kernel blocks (the attention backend's kernel block size "
            "is smaller than the block size), so a head's share of a block is not one run; run a block size the "
            "backend's kernels take (--block-size)"
        )
    return None


def layout_from_kv_caches(
    kv_caches: Mapping[str, KVTensor],
    tp_size: int = 1,
    tp_rank: int = 0,
    total_kv_heads: int | None = None,
    *,
    mla: bool = False,
    num_blocks: int | None = None,
) -> VllmLayout:
    """The :class:`VllmLayout` of what vLLM passes to ``register_kv_caches`` (see the module docstring).

    Every layer must have the same block count, block size and block order (one KV-cache group of full
    attention); :class:`kvwire.LayoutError` naming the first layer that differs otherwise. ``mla`` (vLLM's
    ``model_config.use_mla``) reads the tensors as MLA's latent cache; the layout then records TP rank
    ``tp_rank`` of ``tp_size``. A head-major cache records them, and its heads, given ``total_kv_heads``
    (the model's, ``model_config.get_total_num_kv_heads()``); a cache whose heads do not fit them is
    refused naming the layer and its shape. ``num_blocks`` is vLLM's block count (``kv_cache_config.num_blocks``):
    a tensor holding a multiple of it has each block split into kernel blocks of fewer tokens (the attention
    backend's kernel block size), one contiguous run per block, which moves as one page; a head-major
    cache split so does not move across TP sizes (a head's share is one run per kernel block).
    """
    if not isinstance(kv_caches, Mapping) or not kv_caches:
        raise LayoutError(f"kv_caches must be a non-empty dict of layer name -> tensor, got {type(kv_caches).__name__}")
    buffers: list[KVBuffer] = []
    names: list[str] = []
    first: tuple[int, int, BlockOrder] | None = None
    split = 1
    for index, (name, tensor) in enumerate(kv_caches.items()):
        buf, order, split = _layer_buffer(str(name), index, tensor, mla, num_blocks)
        count = buf.num_pages
        if first is not None and (count, buf.page_bytes, order) != first:
            differs = (
                f"has {count} blocks of {buf.page_bytes} bytes, but layer {names[0]!r} has {first[0]} of {first[1]}"
                if order == first[2]
                else f"has {order} blocks, but layer {names[0]!r} {first[2]} ones"
            )
            raise LayoutError(
                f"layer {name!r} (shape {list(tensor.shape)}) {differs}: kvwire's vLLM connector supports one "
                "KV-cache group with one block size (no hybrid / sliding-window groups, no sparse-attention "
                "indexer caches)"
            )
        buffers.append(buf)
        names.append(str(name))
        first = (count, buf.page_bytes, order)
    assert first is not None
    blocks, block_bytes, order = first
    keep = tuple(kv_caches.values())  # the layout holds vLLM's tensors while a connection has it registered
    if order == "latent":  # every rank holds the whole latent: no heads to slice
        layout = KVLayout(tuple(buffers), tp_size, tp_rank, keep=keep)
        return VllmLayout(layout, tuple(names), blocks, block_bytes, order)
    refusal = _tp_refusal(order, total_kv_heads, split)
    if refusal is not None:  # whole blocks between equal TP sizes only: no TP, no heads recorded
        return VllmLayout(KVLayout(tuple(buffers), keep=keep), tuple(names), blocks, block_bytes, order, refusal)
    assert total_kv_heads is not None
    tensor = next(iter(kv_caches.values()))
    shape = [int(d) for d in tensor.shape]
    try:
        heads = HeadLayout(shape[1], total_kv_heads, shape[3], int(tensor.element_size()), shape[2], head_major=True)
        layout = KVLayout(tuple(buffers), tp_size, tp_rank, heads, keep=keep)
    except LayoutError as exc:
        raise LayoutError(
            f"layer {names[0]!r} (shape {shape}): its blocks cannot be sliced by KV head for TP rank {tp_rank} of "
            f"{tp_size} with the model's {total_kv_heads} KV heads: {exc}"
        ) from None
    return VllmLayout(layout, tuple(names), blocks, block_bytes, order)
