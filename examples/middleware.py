"""A middleware: a pluggy hook wrapper around ``send_kvcache`` that logs every send, failures included.

    python examples/middleware.py

It reads the backend's per-send record (:mod:`kvwire.transport.telemetry`: descriptors
before and after coalescing, planning and transfer time) without planning
again. A middleware may wrap only spec hooks and take only spec arguments
(checked at connect). For Prometheus, use the ready one:
``kvwire.metrics.default_metrics().middleware("mooncake")`` (``pip install 'kvwire[metrics]'``).
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import suppress

import numpy as np
from numpy.typing import NDArray

import kvwire
from kvwire.transport import telemetry


class SendLog:
    """Prints one line per send."""

    @kvwire.hookimpl(wrapper=True)
    def send_kvcache(self, session_id: str, prefill_kv_indices: NDArray[np.int32]) -> Generator[None, int, int]:
        marker, started = telemetry.mark(), telemetry.clock()
        try:
            moved = yield
        except kvwire.KvwireError as exc:
            print(f"send to {session_id}: {type(exc).__name__}: {exc}")
            raise
        took = (telemetry.clock() - started) * 1e3
        line = f"send to {session_id}: {len(prefill_kv_indices)} pages, {moved} bytes in {took:.3f} ms"
        record = telemetry.since(marker)  # None for a backend that publishes no telemetry
        if record is not None:
            line += (
                f"; {record.descriptors_before} descriptors coalesced to {record.descriptors}, "
                f"planning {record.planning_s * 1e6:.0f} us, transfer {record.transfer_s * 1e6:.0f} us"
            )
        print(line)
        return moved


def main() -> None:
    rng = np.random.default_rng(0)
    src = [rng.integers(0, 256, (64, 4096), np.uint8) for _ in range(4)]
    dst = [np.zeros((64, 4096), np.uint8) for _ in range(4)]
    peer = kvwire.KVLayout.mha(dst[:2], dst[2:])
    with kvwire.connect("local") as receiver, kvwire.connect("local", middleware=[SendLog()]) as sender:
        receiver.register_kv_buffers(peer)
        sender.register_kv_buffers(kvwire.KVLayout.mha(src[:2], src[2:]))
        sender.add_peer(receiver.endpoint(), peer)
        ptrs = [b.base for b in peer.buffers]
        pages = np.arange(8, 24, dtype=np.int32)
        sender.send_kvcache(receiver.endpoint(), pages, ptrs, pages + 10)  # one run of 16 pages
        sender.send_kvcache(receiver.endpoint(), pages[::2], ptrs, pages[::2])  # 8 separate pages
        with suppress(kvwire.InvalidTransferError):  # logged by the middleware, then raised: nothing was written
            sender.send_kvcache(receiver.endpoint(), np.array([64], np.int32), ptrs, np.array([0], np.int32))


if __name__ == "__main__":
    main()
