"""The sending (prefill) side of a contract test, and the byte-level oracle.

The oracle is a plain per-page loop, independent of :mod:`kvwire.planning.planner`,
so the kit checks the planner as much as the backend.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

import numpy as np
from numpy.typing import NDArray

from kvwire.config import BackendConfig
from kvwire.connection import Connection
from kvwire.layout.kv_layout import KVLayout
from kvwire.registry.manager import connect, default_registry
from kvwire.testing.receiver import InProcessReceiver, LayoutSpec, Receiver, SubprocessReceiver, buffer_digests
from kvwire.transport.futures import TransferFuture
from kvwire.workload.fragment import fragmented_pages
from kvwire.workload.memory import KVMemory, digest

__all__ = ["ContractHarness", "Pair", "expected_buffers", "fragmented_pages"]


def expected_buffers(
    src: Sequence[NDArray[np.uint8]],
    local: KVLayout,
    dst: Sequence[NDArray[np.uint8]],
    peer: KVLayout,
    prefill: NDArray[np.integer],
    dst_pages: NDArray[np.integer],
    dst_layer_ids: Sequence[int] | None = None,
    dst_device_pages: NDArray[np.integer] | None = None,
) -> list[NDArray[np.uint8]]:
    """The receiver's buffers after a correct transfer (copies of ``dst`` updated page by page).

    A peer layout with both host and device buffers is a split destination: its
    device buffers take ``dst_device_pages``, its host buffers ``dst_pages``,
    whichever buffers the request targets. A layout of one kind takes
    ``dst_pages`` everywhere.
    """
    out = [a.copy() for a in dst]
    local_layers = list(local.layers)
    pairs = []
    for i, sbuf in enumerate(local.buffers):
        layer = sbuf.layer if dst_layer_ids is None else dst_layer_ids[local_layers.index(sbuf.layer)]
        pairs += [(i, j) for j, d in enumerate(peer.buffers) if d.layer == layer and d.role == sbuf.role]
    for i, j in pairs:  # the peer LAYOUT decides the page ids (split or not), never the request's targets
        pages = dst_device_pages if peer.is_split and peer.buffers[j].memory == "device" else dst_pages
        assert pages is not None
        for k in range(len(prefill)):
            out[j][int(pages[k])] = src[i][int(prefill[k])]
    return out


@dataclass
class Pair:
    """A connected sender (this process) and receiver, with the receiver's initial seed."""

    connection: Connection
    memory: KVMemory
    receiver: Receiver
    peer_spec: LayoutSpec
    peer_seed: int

    @property
    def dst_kv_ptrs(self) -> list[int]:
        return [b.base for b in self.receiver.layout.buffers]

    def submit(
        self,
        prefill: NDArray[np.integer],
        dst_pages: NDArray[np.integer],
        notification: bytes | None = None,
    ) -> TransferFuture:
        return self.connection.submit_kvcache(
            self.receiver.endpoint,
            prefill,  # type: ignore[arg-type]
            self.dst_kv_ptrs,
            dst_pages,  # type: ignore[arg-type]
            notification=notification,
        )

    def expected_page_digest(self, prefill: NDArray[np.integer], dst_pages: NDArray[np.integer]) -> str:
        """The digest :meth:`Receiver.watch` reports for ``dst_pages`` once this request's bytes have landed."""
        out = expected_buffers(
            self.memory.views, self.local, self.initial_peer().views, self.receiver.layout, prefill, dst_pages
        )
        return digest(out, np.asarray(dst_pages, dtype=np.int64))

    def send(
        self,
        prefill: NDArray[np.integer],
        dst_pages: NDArray[np.integer],
        dst_layer_ids: Sequence[int] | None = None,
        dst_device_pages: NDArray[np.integer] | None = None,
    ) -> int:
        return self.connection.send_kvcache(
            self.receiver.endpoint,
            prefill,  # type: ignore[arg-type]
            self.dst_kv_ptrs,
            dst_pages,  # type: ignore[arg-type]
            None,
            dst_layer_ids,
            dst_device_pages,  # type: ignore[arg-type]
        )

    @property
    def local(self) -> KVLayout:
        return self.memory.layout

    def initial_peer(self) -> KVMemory:
        return self.peer_spec.allocate(self.peer_seed)

    def expected_hashes(
        self,
        prefill: NDArray[np.integer],
        dst_pages: NDArray[np.integer],
        dst_layer_ids: Sequence[int] | None = None,
        dst_device_pages: NDArray[np.integer] | None = None,
    ) -> list[str]:
        peer = self.initial_peer()
        return buffer_digests(
            expected_buffers(
                self.memory.views,
                self.local,
                peer.views,
                self.receiver.layout,
                prefill,
                dst_pages,
                dst_layer_ids,
                dst_device_pages,
            )
        )

    def untouched_hashes(self) -> list[str]:
        return buffer_digests(self.initial_peer().views)


class ContractHarness:
    """Creates sender/receiver pairs of one backend, in one process or two."""

    def __init__(
        self,
        backend: str,
        *,
        two_process: bool = False,
        config: BackendConfig | None = None,
        middleware: Sequence[object] = (),
    ) -> None:
        self.backend = backend
        self.two_process = two_process
        self.config = config
        self.middleware = tuple(middleware)
        self.info = default_registry().get(backend)

    @property
    def capabilities(self) -> frozenset[str]:
        return self.info.capabilities

    def with_timeout(self, timeout_s: float) -> ContractHarness:
        """This harness with ``timeout_s`` in its config (the other settings kept)."""
        config = replace(self.config or BackendConfig(), timeout_s=timeout_s)
        return ContractHarness(self.backend, two_process=self.two_process, config=config, middleware=self.middleware)

    @contextmanager
    def receiver(self, spec: LayoutSpec, seed: int) -> Iterator[Receiver]:
        """One more receiving endpoint (a second peer), with ``spec``'s memory filled from ``seed``."""
        receiver: Receiver = (
            SubprocessReceiver(self.backend, spec, seed, self.config)
            if self.two_process
            else InProcessReceiver(self.backend, spec, seed, self.config)
        )
        try:
            yield receiver
        finally:
            receiver.close()

    @contextmanager
    def pair(self, local_spec: LayoutSpec, peer_spec: LayoutSpec, seed: int) -> Iterator[Pair]:
        """A sender with ``local_spec`` (random data from ``seed``) connected to a receiver with ``peer_spec``."""
        peer_seed = seed + 1_000_003
        with self.receiver(peer_spec, peer_seed) as receiver:
            memory = local_spec.allocate(seed)
            with connect(self.backend, self.config, middleware=self.middleware) as conn:
                conn.register_kv_buffers(memory.layout)
                conn.add_peer(receiver.endpoint, receiver.layout)
                yield Pair(conn, memory, receiver, peer_spec, peer_seed)
