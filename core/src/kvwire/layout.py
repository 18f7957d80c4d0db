"""The KV layout: which memory buffers hold a process's KV cache, and how.

A layout is an ordered tuple of buffers. Each buffer holds ``num_pages`` pages
of ``page_bytes`` bytes from ``base`` on, for one layer and one role: ``"k"``
or ``"v"`` for MHA (two buffers per layer), ``"kv"`` for MLA (one per layer).
``memory`` says whether it is host DRAM or accelerator memory; the decode side
of HiSparse mixes both, and the kind decides which page ids address a buffer.

The order of ``buffers`` is the order of ``dst_kv_ptrs`` in ``send_kvcache``
(sglang's: every K buffer by layer, then every V buffer).

A layout travels to peers as JSON (:meth:`KVLayout.to_json`); the format is
versioned and parsed strictly, since it comes over the wire.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal, cast

import numpy as np
from numpy.typing import NDArray

from kvwire.errors import KvwireError

__all__ = ["LAYOUT_FORMAT", "LAYOUT_FORMAT_VERSION", "KVBuffer", "KVLayout", "LayoutError", "MemoryKind", "Role"]

MemoryKind = Literal["host", "device"]
Role = Literal["k", "v", "kv"]

LAYOUT_FORMAT = "kvwire.layout"
LAYOUT_FORMAT_VERSION = 1

_ROLES: tuple[str, ...] = ("k", "v", "kv")
_MEMORY_KINDS: tuple[str, ...] = ("host", "device")
_BUFFER_FIELDS = ("base", "page_bytes", "num_pages", "layer", "role", "memory")
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


def _memory_per_buffer(memory: MemoryKind | Sequence[MemoryKind], count: int) -> list[MemoryKind]:
    if isinstance(memory, str):
        return [memory] * count
    kinds = list(memory)
    if len(kinds) != count:
        raise LayoutError(f"memory: expected {count} memory kinds (one per buffer), got {len(kinds)}")
    return kinds


def _describe_array(obj: Any, what: str) -> tuple[int, int, int, MemoryKind]:
    """(base, page_bytes, num_pages, memory) of a numpy array or torch tensor; first dim = pages."""
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise LayoutError(f"{what} must be C-contiguous")
        if obj.ndim < 1 or obj.shape[0] == 0:
            raise LayoutError(f"{what} must have at least one page (first dimension), got shape {obj.shape}")
        return int(obj.ctypes.data), obj.nbytes // obj.shape[0], int(obj.shape[0]), "host"
    data_ptr = getattr(obj, "data_ptr", None)
    if callable(data_ptr):  # a torch.Tensor, without importing torch
        if not obj.is_contiguous():
            raise LayoutError(f"{what} must be contiguous")
        if obj.dim() < 1 or obj.shape[0] == 0:
            raise LayoutError(f"{what} must have at least one page (first dimension), got shape {tuple(obj.shape)}")
        nbytes = int(obj.numel()) * int(obj.element_size())
        kind: MemoryKind = "host" if obj.device.type == "cpu" else "device"
        return int(data_ptr()), nbytes // int(obj.shape[0]), int(obj.shape[0]), kind
    raise LayoutError(f"{what} must be a numpy.ndarray or torch.Tensor, got {type(obj).__name__}")


@dataclass(frozen=True)
class KVLayout:
    """An ordered set of KV buffers (see the module docstring).

    ``attn_tp_size`` is the attention tensor-parallel size of the process that
    holds the layout, when it says (None: not recorded); ``send_kvcache``'s
    ``dst_attn_tp_size`` is checked against a peer's.
    """

    buffers: tuple[KVBuffer, ...]
    attn_tp_size: int | None = None

    def __post_init__(self) -> None:
        raw: object = self.buffers
        if isinstance(raw, (str, bytes)) or not hasattr(raw, "__iter__"):
            raise LayoutError(f"KVLayout.buffers must be a sequence of KVBuffer, got {type(raw).__name__}")
        buffers = tuple(self.buffers)
        object.__setattr__(self, "buffers", buffers)
        if not buffers:
            raise LayoutError("KVLayout.buffers must not be empty")
        if self.attn_tp_size is not None:
            tp = _check_int(self.attn_tp_size, "KVLayout.attn_tp_size", 1)
            if tp > 1 << 20:
                raise LayoutError(f"KVLayout.attn_tp_size must be <= {1 << 20}, got {tp}")
            object.__setattr__(self, "attn_tp_size", tp)
        for i, buf in enumerate(buffers):
            if not isinstance(buf, KVBuffer):
                raise LayoutError(f"KVLayout.buffers[{i}] must be a KVBuffer, got {type(buf).__name__}")
        roles = {b.role for b in buffers}
        if "kv" in roles and roles != {"kv"}:
            raise LayoutError("KVLayout mixes MLA ('kv') and MHA ('k'/'v') buffers; use one attention kind")
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

    # -- construction -------------------------------------------------------

    @classmethod
    def mha(
        cls,
        k: Sequence[Any],
        v: Sequence[Any],
        *,
        memory: MemoryKind | Sequence[MemoryKind] | None = None,
        layers: Sequence[int] | None = None,
    ) -> KVLayout:
        """An MHA layout from per-layer K and V arrays/tensors (first dim = pages).

        Buffers are ordered K of every layer, then V of every layer. ``layers``
        gives the global layer ids (default ``0..n-1``); ``memory`` overrides
        the kind inferred from the arrays.
        """
        if len(k) != len(v):
            raise LayoutError(f"k and v must have one array per layer each, got {len(k)} and {len(v)}")
        ids = list(range(len(k))) if layers is None else list(layers)
        if len(ids) != len(k):
            raise LayoutError(f"layers: expected {len(k)} layer ids, got {len(ids)}")
        items = [(a, ids[i], "k", f"k[{i}]") for i, a in enumerate(k)]
        items += [(a, ids[i], "v", f"v[{i}]") for i, a in enumerate(v)]
        return cls._from_items(items, memory)

    @classmethod
    def mla(
        cls,
        kv: Sequence[Any],
        *,
        memory: MemoryKind | Sequence[MemoryKind] | None = None,
        layers: Sequence[int] | None = None,
    ) -> KVLayout:
        """An MLA layout: one latent-KV array/tensor per layer."""
        ids = list(range(len(kv))) if layers is None else list(layers)
        if len(ids) != len(kv):
            raise LayoutError(f"layers: expected {len(kv)} layer ids, got {len(ids)}")
        return cls._from_items([(a, ids[i], "kv", f"kv[{i}]") for i, a in enumerate(kv)], memory)

    @classmethod
    def _from_items(
        cls,
        items: Sequence[tuple[Any, int, str, str]],
        memory: MemoryKind | Sequence[MemoryKind] | None,
    ) -> KVLayout:
        described = [_describe_array(obj, what) for obj, _, _, what in items]
        kinds = [d[3] for d in described] if memory is None else _memory_per_buffer(memory, len(items))
        return cls(
            tuple(
                KVBuffer(base, page_bytes, pages, layer, cast(Role, role), kinds[i])
                for i, ((base, page_bytes, pages, _), (_, layer, role, _)) in enumerate(zip(described, items))
            )
        )

    # -- derived views (vectorised planning reads these) --------------------

    @property
    def attention(self) -> Literal["mha", "mla"]:
        """``"mla"`` when every buffer is ``"kv"``, else ``"mha"``."""
        return "mla" if self.buffers[0].role == "kv" else "mha"

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
        data: dict[str, Any] = {
            "format": LAYOUT_FORMAT,
            "version": LAYOUT_FORMAT_VERSION,
            "buffers": [{f: getattr(b, f) for f in _BUFFER_FIELDS} for b in self.buffers],
        }
        if self.attn_tp_size is not None:
            data["attn_tp_size"] = self.attn_tp_size
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVLayout:
        """Parse a layout description strictly (it may come from another process)."""
        if not isinstance(data, Mapping):
            raise LayoutError(f"layout description must be a JSON object, got {type(data).__name__}")
        if data.get("format") != LAYOUT_FORMAT:
            raise LayoutError(f"layout description: 'format' must be {LAYOUT_FORMAT!r}, got {data.get('format')!r}")
        version = data.get("version")
        if type(version) is not int or version != LAYOUT_FORMAT_VERSION:  # not True, not 1.0
            raise LayoutError(
                f"layout description: 'version' {version!r} is not supported "
                f"(this kvwire reads version {LAYOUT_FORMAT_VERSION})"
            )
        raw = data.get("buffers")
        if not isinstance(raw, list):
            raise LayoutError("layout description: 'buffers' must be a list")
        buffers = []
        for i, item in enumerate(raw):
            if not isinstance(item, Mapping):
                raise LayoutError(f"layout description: buffers[{i}] must be an object")
            missing = [f for f in _BUFFER_FIELDS if f not in item]
            extra = sorted(set(item) - set(_BUFFER_FIELDS))
            if missing or extra:
                raise LayoutError(
                    f"layout description: buffers[{i}] has missing fields {missing} / unknown fields {extra}"
                )
            try:
                buffers.append(KVBuffer(**{f: item[f] for f in _BUFFER_FIELDS}))
            except LayoutError as exc:
                raise LayoutError(f"layout description: buffers[{i}]: {exc}") from None
        extra = sorted(set(data) - {"format", "version", "buffers", "attn_tp_size"})
        if extra:
            raise LayoutError(f"layout description: unknown fields {extra}")
        try:
            return cls(tuple(buffers), data.get("attn_tp_size"))
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
