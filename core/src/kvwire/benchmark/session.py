"""``BenchSession``: what one measurement phase of ``kvwire bench`` works with, passed as one object."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvwire.connection import Connection
from kvwire.control import Channel
from kvwire.layout.kv_layout import KVLayout
from kvwire.layout.peer import PeerDescription
from kvwire.workload.memory import KVMemory

__all__ = ["BenchSession"]


@dataclass(frozen=True)
class BenchSession:
    """The parsed arguments, the open connection, the prefill pool, the decode peer and its control channel."""

    args: argparse.Namespace
    conn: Connection
    pool: KVMemory
    peer: PeerDescription
    pages_per_request: int
    decode: Channel

    @property
    def endpoint(self) -> str:
        return self.peer.endpoint

    @property
    def peer_layout(self) -> KVLayout:
        return self.peer.layout
