"""The parts of a KV layout: one buffer, how an MHA page holds KV heads, and the layout's limits.

See :mod:`kvwire.layout.kv_layout` for how a :class:`KVLayout` puts them together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from kvwire.errors import KvwireError

__all__ = [
    "ADDRESS_LIMIT",
    "LAYOUT_FORMAT",
    "LAYOUT_FORMAT_VERSION",
    "HeadLayout",
    "KVBuffer",
    "LayoutError",
    "MemoryKind",
    "Role",
]

MemoryKind = Literal["host", "device"]
Role = Literal["k", "v", "kv"]

LAYOUT_FORMAT = "kvwire.layout"
LAYOUT_FORMAT_VERSION = 1

_ROLES: tuple[str, ...] = ("k", "v", "kv")
_MEMORY_KINDS: tuple[str, ...] = ("host", "device")
_BUFFER_FIELDS = ("base", "page_bytes", "num_pages", "layer", "role", "memory")
_HEAD_FIELDS = ("kv_heads", "total_kv_heads", "head_dim", "elem_bytes", "tokens_per_page")
_LAYOUT_FIELDS = frozenset({"format", "version", "buffers", "attn_tp_size", "attn_tp_rank", "heads"})
_ELEM_BYTES = (1, 2, 4, 8)
_COUNT_LIMIT = 1 << 20  # TP sizes, head counts, head dims, tokens per page
#: Planning computes addresses in int64: every byte of a buffer must lie below this.
ADDRESS_LIMIT = 2**63 - 1


class LayoutError(KvwireError, ValueError):
    """A layout (local, or a peer's description) is malformed; the message says where."""


def _check_int(value: object, what: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise LayoutError(f"{what} must be an int, got {type(value).__name__} {value!r}")
    if int(value) < minimum:
        raise LayoutError(f"{what} must be >= {minimum}, got {int(value)}")
    return int(value)


@dataclass(frozen=True)
class KVBuffer:
    """One contiguous KV buffer: ``num_pages`` pages of ``page_bytes`` at ``base``."""

    base: int
    page_bytes: int
    num_pages: int
    layer: int
    role: Role = "kv"
    memory: MemoryKind = "host"

    def __post_init__(self) -> None:
        object.__setattr__(self, "base", _check_int(self.base, "KVBuffer.base", 1))
        object.__setattr__(self, "page_bytes", _check_int(self.page_bytes, "KVBuffer.page_bytes", 1))
        object.__setattr__(self, "num_pages", _check_int(self.num_pages, "KVBuffer.num_pages", 0))
        object.__setattr__(self, "layer", _check_int(self.layer, "KVBuffer.layer", 0))
        if self.base > ADDRESS_LIMIT or self.page_bytes > ADDRESS_LIMIT or self.num_pages > ADDRESS_LIMIT:
            raise LayoutError(
                f"KVBuffer.base = {self.base:#x}, page_bytes = {self.page_bytes} and num_pages = "
                f"{self.num_pages} must each be below 2**63 (the address space planning computes in)"
            )
        if self.page_bytes * self.num_pages > ADDRESS_LIMIT - self.base:
            raise LayoutError(
                f"KVBuffer.base + page_bytes * num_pages = {self.base:#x} + {self.page_bytes} * {self.num_pages} "
                "ends past 2**63 - 1: not an address range of this platform"
            )
        if self.layer > ADDRESS_LIMIT:
            raise LayoutError(f"KVBuffer.layer = {self.layer} must be below 2**63")
        if self.role not in _ROLES:
            raise LayoutError(f"KVBuffer.role must be one of {_ROLES}, got {self.role!r}")
        if self.memory not in _MEMORY_KINDS:
            raise LayoutError(f"KVBuffer.memory must be one of {_MEMORY_KINDS}, got {self.memory!r}")

    @property
    def nbytes(self) -> int:
        """Total bytes of the buffer."""
        return self.page_bytes * self.num_pages

    @property
    def end(self) -> int:
        """One past the last byte of the buffer."""
        return self.base + self.nbytes


@dataclass(frozen=True)
class HeadLayout:
    """How a head-sliced (MHA/GQA) rank's pages hold KV heads: token-major (sglang's) or head-major (HND).

    A token-major page of a K or a V buffer is ``tokens_per_page x kv_heads x
    head_dim`` elements of ``elem_bytes``: token ``t``, local head ``h`` starts at
    byte ``(t * kv_heads + h) * head_dim * elem_bytes`` of the page (sglang's
    ``send_kvcache_slice`` addresses exactly this). A ``head_major`` page is
    ``kv_heads x tokens_per_page x head_dim`` (vLLM's HND): head ``h``, token
    ``t`` at ``(h * tokens_per_page + t) * head_dim * elem_bytes``, so a range of
    heads is one contiguous run of the page and moves as one descriptor
    between different TP sizes. ``kv_heads`` is what this rank holds,
    ``total_kv_heads`` the model's: with fewer KV heads than the TP size each
    rank holds one head, replicated on ``tp // total_kv_heads`` consecutive ranks.
    """

    kv_heads: int
    total_kv_heads: int
    head_dim: int
    elem_bytes: int
    tokens_per_page: int
    head_major: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.head_major, bool):
            raise LayoutError(f"HeadLayout.head_major must be a bool, got {type(self.head_major).__name__}")
        for name in _HEAD_FIELDS:
            value = _check_int(getattr(self, name), f"HeadLayout.{name}", 1)
            if value > _COUNT_LIMIT:
                raise LayoutError(f"HeadLayout.{name} must be <= {_COUNT_LIMIT}, got {value}")
            object.__setattr__(self, name, value)
        if self.elem_bytes not in _ELEM_BYTES:
            raise LayoutError(f"HeadLayout.elem_bytes must be one of {_ELEM_BYTES}, got {self.elem_bytes}")
        if self.kv_heads > self.total_kv_heads:
            raise LayoutError(f"HeadLayout.kv_heads = {self.kv_heads} exceeds total_kv_heads = {self.total_kv_heads}")

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's heads in a page."""
        return self.kv_heads * self.head_dim * self.elem_bytes

    @property
    def page_bytes(self) -> int:
        return self.row_bytes * self.tokens_per_page

    def for_tp(self, tp: int) -> HeadLayout:
        """The heads one rank of an attention-TP group of ``tp`` holds: same model, same page order.

        LayoutError when ``tp`` does not fit the model's KV heads (see :meth:`check_tp`).
        """
        size = _check_int(tp, "attn_tp_size", 1)
        if size > _COUNT_LIMIT:
            raise LayoutError(f"attn_tp_size must be <= {_COUNT_LIMIT}, got {size}")
        total = self.total_kv_heads
        held = HeadLayout(
            max(1, total // size), total, self.head_dim, self.elem_bytes, self.tokens_per_page, self.head_major
        )
        held.check_tp(size)
        return held

    def check_tp(self, tp: int) -> None:
        """The head counts fit an attention-TP group of ``tp`` ranks (LayoutError naming the field)."""
        total, held = self.total_kv_heads, self.kv_heads
        if total >= tp and total % tp:
            raise LayoutError(
                f"HeadLayout.total_kv_heads = {total} is not divisible by attn_tp_size = {tp} (nor divides it)"
            )
        if total < tp and tp % total:
            raise LayoutError(f"HeadLayout.total_kv_heads = {total} does not divide attn_tp_size = {tp}")
        want = max(1, total // tp)
        if held != want:
            raise LayoutError(
                f"HeadLayout.kv_heads = {held}, but total_kv_heads = {total} over attn_tp_size = {tp} "
                f"gives {want} per rank"
            )
