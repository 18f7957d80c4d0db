"""What the scheduler side tells the worker side each step (vLLM's ``KVConnectorMetadata`` payload).

Plain data, no vLLM types: :class:`~kvwire.hosts.vllm.connector.KvwireConnectorMetadata` wraps one
:class:`StepMetadata`. In one engine the scheduler and the workers may be different processes, so it
holds only ints, strings and tuples (vLLM pickles it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvwire.hosts.vllm.params import RemotePrefill

__all__ = ["ReadyToSend", "StepMetadata", "ToReceive"]


@dataclass(frozen=True)
class ReadyToSend:
    """Prefill: ``request_id`` finished; its blocks may be written to the decode that registers for them."""

    request_id: str
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class ToReceive:
    """Decode: ``request_id``'s blocks ``block_ids`` wait for the prefill's blocks described by ``remote``."""

    request_id: str
    block_ids: tuple[int, ...]
    remote: RemotePrefill


@dataclass(frozen=True)
class StepMetadata:
    """One step's new work for the workers."""

    to_send: tuple[ReadyToSend, ...] = field(default=())
    to_receive: tuple[ToReceive, ...] = field(default=())
