"""Model presets: the KV layout shapes ``kvwire bench`` allocates."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvwire.errors import ConfigError
from kvwire.layout.buffers import HeadLayout, MemoryKind, Role
from kvwire.layout.kv_layout import KVLayout
from kvwire.workload.memory import BufferEntry

__all__ = ["PRESETS", "Preset", "get_preset"]


@dataclass(frozen=True)
class Preset:
    """A model's KV shape; ``page_bytes`` is per buffer (one layer's K, V or latent KV)."""

    name: str
    attention: Literal["mha", "mla"]
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    page_tokens: int = 16
    split_device: bool = False  # decode side holds host and device buffers (HiSparse)

    @property
    def page_bytes(self) -> int:
        return self.page_tokens * self.kv_heads * self.head_dim * self.dtype_bytes

    def entries(self, *, decode_side: bool, device: str = "cpu") -> list[BufferEntry]:
        """(layer, role, memory) of every buffer one side allocates.

        The decode side of a split preset holds host and device buffers; with a
        ``device`` other than cpu, the decode side's buffers are device buffers.
        """
        roles: tuple[Role, ...] = ("k", "v") if self.attention == "mha" else ("kv",)
        kinds: tuple[MemoryKind, ...] = ("host",)
        if decode_side and self.split_device:
            kinds = ("host", "device")
        elif decode_side and device != "cpu":
            kinds = ("device",)
        return [(layer, role, kind) for kind in kinds for role in roles for layer in range(self.num_layers)]

    def check_tp(self, tp: int, flag: str) -> None:
        """ConfigError unless an attention-TP group of ``tp`` ranks can hold this preset's KV heads (MHA only)."""
        if self.attention != "mha":
            raise ConfigError(
                f"{flag} {tp}: preset {self.name!r} is MLA (never head-sliced); TP sizes other than 1 are for "
                f"MHA presets ({', '.join(p.name for p in PRESETS.values() if p.attention == 'mha')})"
            )
        if tp < 1:
            raise ConfigError(f"{flag} must be >= 1, got {tp}")
        heads = self.kv_heads
        if (heads >= tp and heads % tp) or (heads < tp and tp % heads):
            raise ConfigError(
                f"{flag} {tp}: preset {self.name!r} has {heads} KV heads; the TP size must divide them "
                f"or be a multiple of them"
            )

    def heads(self, tp: int, head_major: bool = False) -> HeadLayout:
        """How one rank of an attention-TP group of ``tp`` holds the KV heads (one replicated head when fewer)."""
        model = HeadLayout(self.kv_heads, self.kv_heads, self.head_dim, self.dtype_bytes, self.page_tokens, head_major)
        return model.for_tp(tp)

    def rank_layout(self, layout: KVLayout, tp: int, rank: int, head_major: bool = False) -> KVLayout:
        """``layout`` (buffers of ``heads(tp).page_bytes``) recording TP size, rank and heads (in page order)."""
        return KVLayout(layout.buffers, tp, rank, self.heads(tp, head_major), keep=layout.keep)


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("llama3-8b", "mha", 32, 8, 128),
        Preset("qwen2.5-7b", "mha", 28, 4, 128),
        # DeepSeek-V3 MLA: one latent vector per token, kv_lora_rank 512 + rope 64 dims
        Preset("deepseek-v3", "mla", 61, 1, 576),
        # The same, decoded with HiSparse: full KV in host DRAM plus a device copy per layer
        Preset("deepseek-v3-hisparse", "mla", 61, 1, 576, split_device=True),
    )
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"--preset: unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
