"""``HostMemoryEngine``: a stand-in for Mooncake's ``TransferEngine`` that copies in host memory.

It has the engine's call surface and return-code conventions (0 ok, negative
error; overlapping registrations -7; a remote range outside the peer's
registered memory fails the whole batch; ``send_probe`` answers 0 for a live
peer and -102 ``ERR_SOCKET`` otherwise) and moves bytes with ``memmove``
between engines of one process. Backends accept it through their
``engine_factory`` seam, so their planning and error paths are tested on any
CPU without the engine or the accelerator.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Sequence

__all__ = ["HostMemoryEngine"]

_engines: dict[str, HostMemoryEngine] = {}
_ports = itertools.count(20000)
_lock = threading.Lock()

OK = 0
ERR_INVALID = -1
ERR_OVERLAP = -7
ERR_SOCKET = -102


class HostMemoryEngine:
    """In-process engine double; peers are other ``HostMemoryEngine`` objects of this process."""

    def __init__(self) -> None:
        self.host = ""
        self.port = 0
        self.regions: dict[int, int] = {}
        self.protocol = ""
        self.device = ""
        self._closed = False

    def initialize(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str) -> int:
        with _lock:
            self.host, self.port = local_hostname, next(_ports)
            self.protocol, self.device = protocol, device_name
            _engines[f"{self.host}:{self.port}"] = self
        return OK

    def get_rpc_port(self) -> int:
        return self.port

    def register_memory(self, buffer_addr: int, capacity: int) -> int:
        for start, size in self.regions.items():
            if buffer_addr < start + size and start < buffer_addr + capacity:
                return ERR_OVERLAP
        self.regions[buffer_addr] = capacity
        return OK

    def unregister_memory(self, buffer_addr: int) -> int:
        return OK if self.regions.pop(buffer_addr, None) is not None else ERR_INVALID

    def _inside(self, addr: int, length: int) -> bool:
        return any(start <= addr and addr + length <= start + size for start, size in self.regions.items())

    def batch_transfer_sync_write(
        self, target_hostname: str, buffers: Sequence[int], peer_buffer_addresses: Sequence[int], lengths: Sequence[int]
    ) -> int:
        peer = _engines.get(target_hostname)
        if peer is None:
            return ERR_INVALID
        triples = list(zip(buffers, peer_buffer_addresses, lengths))
        if not all(peer._inside(int(d), int(n)) for _, d, n in triples):
            return ERR_INVALID
        for s, d, n in triples:
            ctypes.memmove(int(d), int(s), int(n))
        return OK

    def send_probe(self, target_hostname: str) -> int:
        """0 if ``target_hostname`` is a live engine of this process, else -102 (``ERR_SOCKET``), as Mooncake."""
        return OK if _engines.get(target_hostname) is not None else ERR_SOCKET

    def close(self) -> None:
        """Leave the process-wide registry (no longer a peer); idempotent."""
        with _lock:
            if self._closed:
                return
            self._closed = True
            key = f"{self.host}:{self.port}"
            if _engines.get(key) is self:
                del _engines[key]
