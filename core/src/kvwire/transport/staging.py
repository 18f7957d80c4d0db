"""Staged writes: gather small source slices into one registered buffer, then write whole destination runs.

Across attention-TP sizes a plan moves one descriptor per token and buffer
pair (a head slice, 1 KiB for llama3-8b at decode TP 2): hundreds of thousands
of descriptors, which an engine pays for one by one. When a prefill rank fills
whole decode token rows (prefill TP < decode TP), consecutive slices are
contiguous at the destination and only the source is strided. The sender then
copies the slices, in plan order, into a staging buffer it registered with the
transport (``numpy.take`` of ``L``-byte items: one ``memcpy`` each), and the
transport writes the staging buffer onto the destination in runs: as many
descriptors as destination runs (whole pages, coalesced).

:func:`gather_of` decides per plan, from the plan and the local layout alone
(else the plan is written as planned):

* every descriptor has one length ``L`` (below the transport's
  ``tuning.staging_max_item``, if it sets one) and its source lies in one host buffer
  of the local layout, at an offset that is a multiple of ``L``;
* runs of contiguous destinations (``dst[i + 1] == dst[i] + L``) cut the
  descriptor count at least :data:`MIN_GAIN`-fold.

The staging buffer (:data:`STAGING_BYTES`) is allocated and registered on the
first staged send, reused by every later one (one at a time: concurrent staged
sends on one backend take turns) and unregistered at close. A plan goes in
chunks of half the buffer: one half is written while the next chunk is
gathered into the other.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Final

import numpy as np
from numpy.typing import NDArray

from kvwire.errors import BackendError
from kvwire.layout.hugepages import host_bytes
from kvwire.layout.kv_layout import KVLayout
from kvwire.planning.plan import TransferPlan, trusted_plan
from kvwire.transport.interface import Transport

__all__ = ["MIN_GAIN", "STAGING_BYTES", "Gather", "Staging", "gather_of"]

#: Bytes of a backend's staging buffer (host memory, registered with its transport once used).
STAGING_BYTES: Final = 64 << 20
#: Fewest source descriptors per staged one for staging to be used.
MIN_GAIN: Final = 4


@dataclass(frozen=True, eq=False)
class Gather:
    """How to stage one plan: where each descriptor's bytes are, in ``item``-byte units of their buffer."""

    plan: TransferPlan
    item: int  # L: every descriptor's length
    buffers: tuple[tuple[int, int], ...]  # (base, nbytes) of the local buffers, by address
    blocks: NDArray[np.int64]  # (k + 1,) descriptor positions where the source buffer changes, then len(plan)
    block_buffer: NDArray[np.int64]  # (k,) index into ``buffers`` of each block
    index: NDArray[np.int64]  # (n,) (src - buffer base) // item of each descriptor
    run_start: NDArray[np.bool_]  # (n,) True where a destination run starts


def gather_of(plan: TransferPlan, local: KVLayout, max_item: int | None = None) -> Gather | None:
    """The :class:`Gather` of ``plan``, or None when staging does not apply or would not pay (module docstring).

    ``max_item``: the transport's ``staging_max_item`` (slices this large or larger are not staged).
    """
    n = len(plan)
    if n < 2 * MIN_GAIN:
        return None
    item = int(plan.length[0])
    if item <= 0 or (max_item is not None and item >= max_item) or not (plan.length == item).all():
        return None
    dst = plan.dst
    run_start = np.empty(n, dtype=np.bool_)
    run_start[0] = True
    np.not_equal(dst[1:], dst[:-1] + item, out=run_start[1:])
    if int(np.count_nonzero(run_start)) * MIN_GAIN > n:
        return None
    # The planner checked that every source lies inside one local buffer: find which, then require host memory.
    table = sorted((b.base, b.nbytes, b.memory == "host") for b in local.buffers)
    bases = np.array([t[0] for t in table], dtype=np.int64)
    which = np.searchsorted(bases, plan.src, side="right") - 1
    changes = np.flatnonzero(which[1:] != which[:-1]) + 1
    blocks = np.concatenate(([0], changes, [n])).astype(np.int64)
    block_buffer = which[blocks[:-1]]
    if block_buffer.min() < 0 or not all(table[int(k)][2] for k in np.unique(block_buffer)):
        return None  # a source in device memory (no host gather), or outside the layout
    index = plan.src.copy()
    for lo, hi, k in zip(blocks[:-1].tolist(), blocks[1:].tolist(), block_buffer.tolist()):
        index[lo:hi] -= table[k][0]
    if (index % item).any():
        return None
    index //= item
    buffers = tuple((t[0], t[1]) for t in table)
    return Gather(plan, item, buffers, blocks, block_buffer.astype(np.int64), index, run_start)


def _items(base: int, nbytes: int, item: int) -> NDArray[np.void]:
    """The host memory ``base .. base + nbytes`` as an array of ``item``-byte items (no copy)."""
    return host_bytes(base, nbytes // item, item, np.dtype((np.void, item)))


class Staging:
    """A backend's staging buffer: gathers a plan's sources into it and writes it out in destination runs."""

    def __init__(self, transport: Transport, nbytes: int = STAGING_BYTES) -> None:
        self._transport = transport
        self._nbytes = nbytes
        #: The transport's ``staging_max_item``, read once: slices this large or larger are written as planned.
        self.max_item: int | None = transport.tuning.staging_max_item
        self._lock = threading.Lock()
        self._buffer: NDArray[np.uint8] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    def _ensure(self) -> NDArray[np.uint8]:
        if self._buffer is None:
            buffer = np.empty(self._nbytes, dtype=np.uint8)
            buffer.fill(0)  # fault every page in now, not in the first gather
            self._transport.register_memory(int(buffer.ctypes.data), buffer.nbytes)
            self._buffer = buffer
        return self._buffer

    def write(self, session_id: str, gather: Gather) -> None:
        """Gather and write ``gather.plan`` through the staging buffer, in chunks that fit half of it.

        The halves alternate: while one half's chunk is being written (on the
        staging's writer thread), the next chunk is gathered into the other.
        """
        with self._lock:
            if self._closed:  # a send that raced close() past the backend's own check
                raise BackendError("the backend is closed (its staging buffer is gone); nothing was sent")
            buffer = self._ensure()
            item = gather.item
            per_chunk = max(1, buffer.nbytes // 2 // item)
            halves = [buffer[h * per_chunk * item : (h + 1) * per_chunk * item] for h in (0, 1)]
            used = {k: gather.buffers[k] for k in set(gather.block_buffer.tolist())}
            sources = {k: _items(base, nbytes, item) for k, (base, nbytes) in used.items()}
            n = len(gather.plan)
            writing: Future[None] | None = None
            try:
                for k, a in enumerate(range(0, n, per_chunk)):
                    b = min(n, a + per_chunk)
                    half = halves[k % 2]
                    self._gather(gather, sources, half.view(np.dtype((np.void, item))), a, b)
                    plan = self._staged_plan(gather, int(half.ctypes.data), a, b)
                    if writing is not None:
                        writing.result()  # the other half is free again (and a failure stops here)
                    writing = self._writer().submit(self._transport.write, session_id, plan)
                if writing is not None:
                    writing.result()
            except BaseException:
                if writing is not None:
                    wait([writing])  # never leave a write reading a half the next send overwrites
                raise

    def _writer(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvwire-staging")
        return self._pool

    @staticmethod
    def _gather(gather: Gather, sources: dict[int, NDArray[np.void]], staged: NDArray[np.void], a: int, b: int) -> None:
        """Copy the sources of descriptors ``a .. b`` to the start of the staging buffer, in plan order."""
        blocks = gather.blocks
        first = int(np.searchsorted(blocks, a, side="right")) - 1
        for k in range(first, len(blocks) - 1):
            lo, hi = max(a, int(blocks[k])), min(b, int(blocks[k + 1]))
            if lo >= hi:
                break
            src = sources[int(gather.block_buffer[k])]
            np.take(src, gather.index[lo:hi], out=staged[lo - a : hi - a], mode="clip")

    @staticmethod
    def _staged_plan(gather: Gather, base: int, a: int, b: int) -> TransferPlan:
        """Descriptors ``a .. b`` as staged: one per destination run (a run cut at the chunk's start starts anew)."""
        starts = np.flatnonzero(gather.run_start[a:b])
        if starts.size == 0 or starts[0] != 0:
            starts = np.concatenate(([0], starts))
        starts = starts.astype(np.int64)
        counts = np.diff(np.append(starts, b - a))
        item = gather.item
        src = base + starts * item
        dst = gather.plan.dst[a:b][starts]
        length = counts * item
        for arr in (src, dst, length):
            arr.setflags(write=False)
        return trusted_plan(src, np.ascontiguousarray(dst), length, gather.plan.descriptors_before)

    def close(self) -> None:
        """Unregister the buffer (idempotent); a staged write in progress finishes first."""
        with self._lock:
            self._closed = True
            buffer, self._buffer = self._buffer, None
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown()
        if buffer is not None:
            self._transport.unregister_memory(int(buffer.ctypes.data))
