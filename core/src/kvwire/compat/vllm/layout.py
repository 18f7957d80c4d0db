"""vLLM's per-layer KV tensors as a :class:`~kvwire.KVLayout`: one whole-page buffer per layer.

vLLM 0.33.0 hands ``register_kv_caches`` one tensor per attention layer, shaped
``[num_blocks, num_kv_heads, block_size, head_size + head_size_v]`` (K and V of a
head side by side in a block), each a strided view into one shared allocation
(``allocate_kv_cache``). A block of one layer is one contiguous run of
``num_kv_heads * block_size * (head_size + head_size_v)`` elements, and block
``b`` starts ``b * stride[0]`` elements after block 0. kvwire moves such a block
as one page: the layout has one ``"kv"`` buffer per layer (layer ids are the
positions in vLLM's layer order), the page the block, so a prefill and a decode
whose layers agree exchange whole blocks, whatever the heads hold.

Given the rank's TP size and rank and the model's total KV heads, the layout
also records them and how a block holds heads (:class:`kvwire.HeadLayout`,
``head_major``: head ``h``'s K|V of every token is one contiguous run), so a
prefill and a decode of different TP sizes exchange exactly the heads they
share, one run per block (:mod:`kvwire.planning.head_slicing`). Without the
total KV heads nothing of TP is recorded: same TP sizes only, whole blocks.

Refused, with :class:`kvwire.LayoutError` naming the layer and its shape: a
tensor that is not 4-dimensional, whose first dimension is not the block count,
whose block is not contiguous, or whose blocks are not evenly spaced one block
apart (a layout that interleaves layers inside a block, such as a block-outermost
``BLHNC`` order, would need one buffer per (layer, block): not supported).

Nothing of vLLM or torch is imported: any object with ``shape``, ``stride()``,
``element_size()``, ``data_ptr()`` and ``device`` serves, so the mapping is
checked on any machine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvwire.layout.buffers import HeadLayout, KVBuffer, LayoutError, MemoryKind
from kvwire.layout.kv_layout import KVLayout

__all__ = ["KVTensor", "VllmLayout", "layout_from_kv_caches"]


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
    the same page in every buffer).
    """

    layout: KVLayout
    layer_names: tuple[str, ...]
    num_blocks: int
    block_bytes: int

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


def _layer_buffer(name: str, index: int, tensor: KVTensor) -> tuple[KVBuffer, int]:
    """The layer's buffer and its block count, or LayoutError naming the layer, its shape and why."""
    shape = tuple(int(d) for d in tensor.shape)
    stride = tuple(int(s) for s in tensor.stride())
    where = f"layer {name!r} (shape {list(shape)}, stride {list(stride)})"
    if len(shape) != 4:
        raise LayoutError(
            f"{where}: expected vLLM's [num_blocks, num_kv_heads, block_size, 2 * head_size] KV tensor; "
            "other KV-cache shapes (a leading K/V dimension of 2, MLA's 3-d latent cache) are not supported"
        )
    num_blocks = shape[0]
    if num_blocks < 1:
        raise LayoutError(f"{where}: the first dimension (the blocks) is empty")
    block_elems = math.prod(shape[1:])
    inner = (shape[2] * shape[3], shape[3], 1)  # a block's [heads, tokens, dims] packed, in that order
    for dim in (1, 2, 3):
        if shape[dim] > 1 and stride[dim] != inner[dim - 1]:
            raise LayoutError(
                f"{where}: a block is not one contiguous run (dimension {dim} has stride {stride[dim]}, "
                f"expected {inner[dim - 1]}); kvwire moves a block as one page"
            )
    if num_blocks > 1 and stride[0] != block_elems:
        raise LayoutError(
            f"{where}: blocks are {stride[0]} elements apart but hold {block_elems}: the layout interleaves "
            "something between a layer's blocks (a block-outermost KV-cache layout); use a layer-outermost "
            "layout such as LBHNC"
        )
    elem = int(tensor.element_size())
    base = int(tensor.data_ptr())
    if base <= 0:
        raise LayoutError(f"{where}: data_ptr() is {base}; the tensor has no memory")
    return KVBuffer(base, block_elems * elem, num_blocks, index, "kv", _memory_kind(tensor)), num_blocks


def layout_from_kv_caches(
    kv_caches: Mapping[str, KVTensor], tp_size: int = 1, tp_rank: int = 0, total_kv_heads: int | None = None
) -> VllmLayout:
    """The :class:`VllmLayout` of what vLLM passes to ``register_kv_caches`` (see the module docstring).

    Every layer must have the same block count and block size (one KV-cache group of full attention);
    :class:`kvwire.LayoutError` naming the first layer that differs otherwise. With ``total_kv_heads``
    (the model's, vLLM's ``model_config.get_total_num_kv_heads()``) the layout records TP rank
    ``tp_rank`` of ``tp_size`` and the heads of a block, for transfers across TP sizes; a cache whose
    heads do not fit them is refused naming the layer and its shape.
    """
    if not isinstance(kv_caches, Mapping) or not kv_caches:
        raise LayoutError(f"kv_caches must be a non-empty dict of layer name -> tensor, got {type(kv_caches).__name__}")
    buffers: list[KVBuffer] = []
    names: list[str] = []
    blocks: int | None = None
    for index, (name, tensor) in enumerate(kv_caches.items()):
        buf, count = _layer_buffer(str(name), index, tensor)
        if buffers and (count, buf.page_bytes) != (blocks, buffers[0].page_bytes):
            raise LayoutError(
                f"layer {name!r} (shape {list(tensor.shape)}) has {count} blocks of {buf.page_bytes} bytes, but "
                f"layer {names[0]!r} has {blocks} of {buffers[0].page_bytes}: kvwire's vLLM connector supports one "
                "KV-cache group with one block size (no hybrid / sliding-window groups)"
            )
        buffers.append(buf)
        names.append(str(name))
        blocks = count
    assert blocks is not None
    if total_kv_heads is None:
        return VllmLayout(KVLayout(tuple(buffers)), tuple(names), blocks, buffers[0].page_bytes)
    first = next(iter(kv_caches.values()))
    shape = [int(d) for d in first.shape]
    try:
        heads = HeadLayout(shape[1], total_kv_heads, shape[3], int(first.element_size()), shape[2], head_major=True)
        layout = KVLayout(tuple(buffers), tp_size, tp_rank, heads)
    except LayoutError as exc:
        raise LayoutError(
            f"layer {names[0]!r} (shape {shape}): its blocks cannot be sliced by KV head for TP rank {tp_rank} of "
            f"{tp_size} with the model's {total_kv_heads} KV heads: {exc}"
        ) from None
    return VllmLayout(layout, tuple(names), blocks, buffers[0].page_bytes)
