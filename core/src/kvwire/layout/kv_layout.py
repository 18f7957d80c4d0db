"""The KV layout: which memory buffers hold a process's KV cache, and how.

A layout is an ordered tuple of buffers. Each buffer holds ``num_pages`` pages
of ``page_bytes`` bytes from ``base`` on, for one layer and one role: ``"k"``
or ``"v"`` for MHA (two buffers per layer), ``"kv"`` for MLA (one per layer).
``memory`` says whether it is host DRAM or accelerator memory; the decode side
of HiSparse mixes both, and the kind decides which page ids address a buffer.

The order of ``buffers`` is the order of ``dst_kv_ptrs`` in ``send_kvcache``
(sglang's: every K buffer by layer, then every V buffer).

With tensor parallelism a layout may also say where it sits in its
attention-TP group (``attn_tp_size``, ``attn_tp_rank``) and, for MHA/GQA, how
its pages hold KV heads (:class:`HeadLayout`), so that a prefill and a decode
of different TP sizes can exchange head slices (see :mod:`kvwire.planning.head_slicing`).
MLA is never head-sliced (every rank holds the whole latent).

A layout travels to peers as JSON (:meth:`KVLayout.to_json`); the format is
versioned and parsed strictly, since it comes over the wire.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal, cast

import numpy as np
from numpy.typing import NDArray

from kvwire.layout.arrays import describe_array, memory_per_buffer
from kvwire.layout.buffers import (
    _COUNT_LIMIT,
    _MEMORY_KINDS,
    LAYOUT_FORMAT,
    LAYOUT_FORMAT_VERSION,
    HeadLayout,
    KVBuffer,
    LayoutError,
    MemoryKind,
    Role,
    _check_int,
)
from kvwire.layout.wire import layout_fields_from_dict, layout_to_dict

__all__ = [
    "LAYOUT_FORMAT",
    "LAYOUT_FORMAT_VERSION",
    "HeadLayout",
    "KVBuffer",
    "KVLayout",
    "LayoutError",
    "MemoryKind",
    "Role",
]


@dataclass(frozen=True)
class KVLayout:
    """An ordered set of KV buffers (see the module docstring).

    ``attn_tp_size`` is the attention tensor-parallel size of the process that
    holds the layout, when it says (None: not recorded); ``send_kvcache``'s
    ``dst_attn_tp_size`` is checked against a peer's. ``attn_tp_rank`` is the
    rank's place in that group and ``heads`` how an MHA layout's pages hold
    KV heads: planning across TP sizes needs the rank on both sides (and, for
    MHA, ``heads``). Each may be None (an older description): without ranks
    planning keeps the whole-page path, where page sizes must match.
    """

    buffers: tuple[KVBuffer, ...]
    attn_tp_size: int | None = None
    attn_tp_rank: int | None = None
    heads: HeadLayout | None = None
    #: What holds the buffers' memory (the arrays or tensors :meth:`mha` and :meth:`mla` were given): kept as long
    #: as this layout, so that memory a connection registered is not freed under it while registered (the
    #: connection keeps the layout). Not compared, not sent to peers. A layout built from addresses (``KVBuffer``
    #: bases, plain ints) holds nothing: keeping that memory alive stays the caller's job.
    keep: tuple[Any, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "keep", tuple(self.keep))
        raw: object = self.buffers
        if isinstance(raw, (str, bytes)) or not hasattr(raw, "__iter__"):
            raise LayoutError(f"KVLayout.buffers must be a sequence of KVBuffer, got {type(raw).__name__}")
        buffers = tuple(self.buffers)
        object.__setattr__(self, "buffers", buffers)
        if not buffers:
            raise LayoutError("KVLayout.buffers must not be empty")
        if self.attn_tp_size is not None:
            tp = _check_int(self.attn_tp_size, "KVLayout.attn_tp_size", 1)
            if tp > _COUNT_LIMIT:
                raise LayoutError(f"KVLayout.attn_tp_size must be <= {_COUNT_LIMIT}, got {tp}")
            object.__setattr__(self, "attn_tp_size", tp)
        for i, buf in enumerate(buffers):
            if not isinstance(buf, KVBuffer):
                raise LayoutError(f"KVLayout.buffers[{i}] must be a KVBuffer, got {type(buf).__name__}")
        roles = {b.role for b in buffers}
        if "kv" in roles and roles != {"kv"}:
            raise LayoutError("KVLayout mixes MLA ('kv') and MHA ('k'/'v') buffers; use one attention kind")
        self._check_tp_fields(buffers, roles)
        seen: dict[tuple[int, str, str], int] = {}
        for i, buf in enumerate(buffers):
            key = (buf.layer, buf.role, buf.memory)
            if key in seen:
                raise LayoutError(
                    f"KVLayout.buffers[{i}] repeats layer {buf.layer} role {buf.role!r} memory "
                    f"{buf.memory!r} of buffers[{seen[key]}]"
                )
            seen[key] = i
        for kind in _MEMORY_KINDS:  # host and device addresses are separate spaces
            order = sorted((i for i, b in enumerate(buffers) if b.memory == kind), key=lambda i: buffers[i].base)
            for prev, cur in itertools.pairwise(order):
                if buffers[cur].base < buffers[prev].end:
                    raise LayoutError(f"KVLayout.buffers[{cur}] overlaps buffers[{prev}]")

    def _check_tp_fields(self, buffers: tuple[KVBuffer, ...], roles: set[Role]) -> None:
        if self.attn_tp_rank is not None:
            rank = _check_int(self.attn_tp_rank, "KVLayout.attn_tp_rank", 0)
            if self.attn_tp_size is None:
                raise LayoutError(
                    "KVLayout.attn_tp_rank needs attn_tp_size (the size of the rank's attention-TP group)"
                )
            if rank >= self.attn_tp_size:
                raise LayoutError(
                    f"KVLayout.attn_tp_rank = {rank} is out of range: attn_tp_size is {self.attn_tp_size}"
                )
            object.__setattr__(self, "attn_tp_rank", rank)
        heads = self.heads
        if heads is None:
            return
        if not isinstance(heads, HeadLayout):
            raise LayoutError(f"KVLayout.heads must be a HeadLayout or None, got {type(heads).__name__}")
        if roles == {"kv"} and not heads.head_major:
            raise LayoutError(
                "KVLayout.heads: 'kv' buffers are head-sliced only as head-major pages that hold each head's K and "
                "V together (vLLM's blocks: HeadLayout(..., head_major=True) with head_dim K + V); an MLA latent "
                "buffer is not head-sliced: leave heads None"
            )
        if self.attn_tp_size is None or self.attn_tp_rank is None:
            raise LayoutError("KVLayout.heads needs attn_tp_size and attn_tp_rank (the rank's attention-TP group)")
        heads.check_tp(self.attn_tp_size)
        for i, buf in enumerate(buffers):
            if buf.page_bytes != heads.page_bytes:
                raise LayoutError(
                    f"KVLayout.buffers[{i}].page_bytes = {buf.page_bytes}, but heads say kv_heads {heads.kv_heads} "
                    f"x head_dim {heads.head_dim} x elem_bytes {heads.elem_bytes} x tokens_per_page "
                    f"{heads.tokens_per_page} = {heads.page_bytes}"
                )

    # -- construction -------------------------------------------------------

    @classmethod
    def mha(
        cls,
        k: Sequence[Any],
        v: Sequence[Any],
        *,
        memory: MemoryKind | Sequence[MemoryKind] | None = None,
        layers: Sequence[int] | None = None,
        attn_tp_size: int | None = None,
        attn_tp_rank: int | None = None,
        heads: HeadLayout | None = None,
    ) -> KVLayout:
        """An MHA layout from per-layer K and V arrays/tensors (first dim = pages).

        Buffers are ordered K of every layer, then V of every layer. ``layers``
        gives the global layer ids (default ``0..n-1``); ``memory`` overrides
        the kind inferred from the arrays; the TP fields are the layout's.
        """
        if len(k) != len(v):
            raise LayoutError(f"k and v must have one array per layer each, got {len(k)} and {len(v)}")
        ids = list(range(len(k))) if layers is None else list(layers)
        if len(ids) != len(k):
            raise LayoutError(f"layers: expected {len(k)} layer ids, got {len(ids)}")
        items = [(a, ids[i], "k", f"k[{i}]") for i, a in enumerate(k)]
        items += [(a, ids[i], "v", f"v[{i}]") for i, a in enumerate(v)]
        return cls._from_items(items, memory, attn_tp_size, attn_tp_rank, heads)

    @classmethod
    def mla(
        cls,
        kv: Sequence[Any],
        *,
        memory: MemoryKind | Sequence[MemoryKind] | None = None,
        layers: Sequence[int] | None = None,
        attn_tp_size: int | None = None,
        attn_tp_rank: int | None = None,
    ) -> KVLayout:
        """An MLA layout: one latent-KV array/tensor per layer (never head-sliced)."""
        ids = list(range(len(kv))) if layers is None else list(layers)
        if len(ids) != len(kv):
            raise LayoutError(f"layers: expected {len(kv)} layer ids, got {len(ids)}")
        items = [(a, ids[i], "kv", f"kv[{i}]") for i, a in enumerate(kv)]
        return cls._from_items(items, memory, attn_tp_size, attn_tp_rank, None)

    @classmethod
    def _from_items(
        cls,
        items: Sequence[tuple[Any, int, str, str]],
        memory: MemoryKind | Sequence[MemoryKind] | None,
        attn_tp_size: int | None,
        attn_tp_rank: int | None,
        heads: HeadLayout | None,
    ) -> KVLayout:
        described = [describe_array(obj, what) for obj, _, _, what in items]
        kinds = [d[3] for d in described] if memory is None else memory_per_buffer(memory, len(items))
        buffers = tuple(
            KVBuffer(base, page_bytes, pages, layer, cast(Role, role), kinds[i])
            for i, ((base, page_bytes, pages, _), (_, layer, role, _)) in enumerate(zip(described, items))
        )
        return cls(buffers, attn_tp_size, attn_tp_rank, heads, keep=tuple(obj for obj, _, _, _ in items))

    # -- derived views (vectorised planning reads these) --------------------

    @property
    def attention(self) -> Literal["mha", "mla"]:
        """``"mla"`` when every buffer is ``"kv"`` and no heads are recorded, else ``"mha"``.

        ``"kv"`` buffers with (head-major) heads hold each MHA head's K and V together, as vLLM's
        blocks do: they are MHA pages, head-sliced across TP sizes like any other.
        """
        return "mla" if self.buffers[0].role == "kv" and self.heads is None else "mha"

    @cached_property
    def bases(self) -> NDArray[np.int64]:
        return np.array([b.base for b in self.buffers], dtype=np.int64)

    @cached_property
    def page_bytes(self) -> NDArray[np.int64]:
        return np.array([b.page_bytes for b in self.buffers], dtype=np.int64)

    @cached_property
    def num_pages(self) -> NDArray[np.int64]:
        return np.array([b.num_pages for b in self.buffers], dtype=np.int64)

    @cached_property
    def layers(self) -> tuple[int, ...]:
        """Distinct layer ids, ascending."""
        return tuple(sorted({b.layer for b in self.buffers}))

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def has_memory(self, kind: MemoryKind) -> bool:
        return any(b.memory == kind for b in self.buffers)

    @cached_property
    def is_split(self) -> bool:
        """A split destination (HiSparse): host and device buffers, two independent page-id spaces.

        Host buffers are addressed by ``dst_kv_indices``, device buffers by
        ``dst_device_kv_indices``. It is the layout's property, never inferred
        from a request: see :func:`kvwire.plan_transfer`.
        """
        return self.has_memory("host") and self.has_memory("device")

    # -- wire format ---------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The wire description (see :mod:`kvwire.layout.wire`)."""
        return layout_to_dict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVLayout:
        """Parse a layout description strictly (it may come from another process)."""
        buffers, attn_tp_size, attn_tp_rank, heads = layout_fields_from_dict(data)
        try:
            return cls(buffers, attn_tp_size, attn_tp_rank, heads)
        except LayoutError as exc:
            raise LayoutError(f"layout description: {exc}") from None

    @classmethod
    def from_json(cls, text: str | bytes) -> KVLayout:
        if not isinstance(text, (str, bytes)):
            raise LayoutError(f"layout description must be JSON text, got {type(text).__name__}")
        try:
            data = json.loads(text)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise LayoutError(f"layout description is not valid JSON: {type(exc).__name__}: {exc}") from None
        return cls.from_dict(data)
