"""``WorkerRank``: what a vLLM worker's sender and receiver both work with."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvwire.connection.connection import Connection
from kvwire.hosts.vllm.layout import VllmLayout
from kvwire.hosts.vllm.telemetry import TransferStats

__all__ = ["KEPT_FAILURES", "WorkerRank"]

#: How many failure reasons a sender or a receiver keeps (the latest; for logs and tests).
KEPT_FAILURES = 100


@dataclass(frozen=True)
class WorkerRank:
    """One worker: its kvwire connection, its KV cache's layout, its TP rank of ``tp_size``, the clock, and
    where its transfers are counted for vLLM's metrics."""

    connection: Connection
    local: VllmLayout
    tp_rank: int
    tp_size: int
    clock: Callable[[], float] = time.monotonic
    stats: TransferStats = field(default_factory=TransferStats)
