"""The sending (prefill) side of a contract test, and the byte-level oracle.

The oracle is a plain per-page loop, independent of :mod:`kvwire.planning`,
so the kit checks the planner as much as the backend.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from kvwire.config import BackendConfig
from kvwire.connection import Connection
from kvwire.layout import KVLayout
from kvwire.registry import connect, default_registry
from kvwire.testing.receiver import (
    InProcessReceiver,
    LayoutSpec,
    Receiver,
    SubprocessReceiver,
    allocate,
    fill_random,
    hashes,
)

__all__ = ["ContractHarness", "Pair", "expected_buffers", "fragmented_pages"]


def fragmented_pages(rng: np.random.Generator, num_pages: int, count: int, mean_run: int = 3) -> NDArray[np.int32]:
    """``count`` distinct page ids out of ``num_pages``: shuffled runs of random length (mean ``mean_run``)."""
    if count > num_pages:
        raise ValueError(f"count {count} exceeds num_pages {num_pages}")
    starts = np.arange(0, num_pages, mean_run)
    rng.shuffle(starts)
    pages: dict[int, None] = {}  # ordered set
    for start in starts.tolist():
        run = int(rng.integers(1, 2 * mean_run))
        pages.update(dict.fromkeys(range(start, min(start + run, num_pages))))
        if len(pages) >= count:
            break
    rest = [p for p in rng.permutation(num_pages).tolist() if p not in pages]
    return np.array((list(pages) + rest)[:count], dtype=np.int32)


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
    split = len({b.memory for b in peer.buffers}) > 1  # the peer LAYOUT mixes kinds, not the request's targets
    for i, j in pairs:
        pages = dst_device_pages if split and peer.buffers[j].memory == "device" else dst_pages
        assert pages is not None
        for k in range(len(prefill)):
            out[j][int(pages[k])] = src[i][int(prefill[k])]
    return out


@dataclass
class Pair:
    """A connected sender (this process) and receiver, with the receiver's initial seed."""

    connection: Connection
    src: list[NDArray[np.uint8]]
    local: KVLayout
    receiver: Receiver
    peer_spec: LayoutSpec
    peer_seed: int

    @property
    def dst_kv_ptrs(self) -> list[int]:
        return [b.base for b in self.receiver.layout.buffers]

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

    def initial_peer(self) -> list[NDArray[np.uint8]]:
        arrays, _ = allocate(self.peer_spec)
        fill_random(arrays, self.peer_seed)
        return arrays

    def expected_hashes(
        self,
        prefill: NDArray[np.integer],
        dst_pages: NDArray[np.integer],
        dst_layer_ids: Sequence[int] | None = None,
        dst_device_pages: NDArray[np.integer] | None = None,
    ) -> list[str]:
        return hashes(
            expected_buffers(
                self.src,
                self.local,
                self.initial_peer(),
                self.receiver.layout,
                prefill,
                dst_pages,
                dst_layer_ids,
                dst_device_pages,
            )
        )

    def untouched_hashes(self) -> list[str]:
        return hashes(self.initial_peer())


class ContractHarness:
    """Creates sender/receiver pairs of one backend, in one process or two."""

    def __init__(self, backend: str, *, two_process: bool = False, config: BackendConfig | None = None) -> None:
        self.backend = backend
        self.two_process = two_process
        self.config = config
        self.info = default_registry().get(backend)

    @property
    def capabilities(self) -> frozenset[str]:
        return self.info.capabilities

    @contextmanager
    def pair(self, local_spec: LayoutSpec, peer_spec: LayoutSpec, seed: int) -> Iterator[Pair]:
        """A sender with ``local_spec`` (random data from ``seed``) connected to a receiver with ``peer_spec``."""
        peer_seed = seed + 1_000_003
        receiver: Receiver = (
            SubprocessReceiver(self.backend, peer_spec, peer_seed, self.config)
            if self.two_process
            else InProcessReceiver(self.backend, peer_spec, peer_seed, self.config)
        )
        try:
            src, local = allocate(local_spec)
            fill_random(src, seed)
            with connect(self.backend, self.config) as conn:
                conn.register_kv_buffers(local)
                conn.add_peer(receiver.endpoint, receiver.layout)
                yield Pair(conn, src, local, receiver, peer_spec, peer_seed)
        finally:
            receiver.close()
