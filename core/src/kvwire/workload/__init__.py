"""Workloads shared by ``kvwire bench`` and the contract test kit: fragmented page sets, KV memory, digests."""

from kvwire.workload.fragment import fragmented_pages, place, run_lengths
from kvwire.workload.memory import KVMemory, allocate, digest

__all__ = ["KVMemory", "allocate", "digest", "fragmented_pages", "place", "run_lengths"]
