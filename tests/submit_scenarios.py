"""Fault and visibility scenarios of submit_kvcache and notifications, run against each interprocess backend."""

from __future__ import annotations

import time
from concurrent.futures import wait

import numpy as np
import pytest

import kvwire
from kvwire import BackendConfig
from kvwire.testing.harness import ContractHarness, expected_buffers
from kvwire.testing.receiver import LayoutSpec, buffer_digests
from kvwire.workload.fragment import fragmented_pages


def killed_peer_with_submissions_in_flight(backend: str, timeout_s: float = 3.0) -> None:
    """Six 32 MiB submissions, then the peer is killed: each ends (bytes or a typed error) within the timeout,
    and a second peer is then served, its bytes verified."""
    harness = ContractHarness(backend, two_process=True, config=BackendConfig(timeout_s=timeout_s))
    big = LayoutSpec("mha", (0, 1, 2, 3), 512, 65536)  # 8 buffers: 64 pages per request = 32 MiB
    rng = np.random.default_rng(11)
    with harness.pair(big, big, 11) as pair:
        second = type(pair.receiver)(backend, big, 12)
        try:
            pair.connection.add_peer(second.endpoint, second.layout)
            dst = rng.permutation(512).astype(np.int32)
            requests = [(fragmented_pages(rng, 512, 64), np.sort(dst[k * 64 : (k + 1) * 64])) for k in range(6)]
            futures = [pair.submit(p, d) for p, d in requests]
            pair.receiver.child.proc.kill()  # type: ignore[attr-defined]
            killed = time.monotonic()
            _, pending = wait(futures, timeout=timeout_s + 2.0)
            assert not pending, f"{len(pending)} still pending {time.monotonic() - killed:.1f} s after the kill"
            errors = [f.exception() for f in futures]
            assert all(e is None or isinstance(e, kvwire.TransferError) for e in errors), errors
            if all(e is None for e in errors):  # every one beat the kill: the next must fail, typed
                with pytest.raises(kvwire.TransferError):
                    pair.submit(*requests[0]).result(timeout=timeout_s + 2.0)
            ptrs = [b.base for b in second.layout.buffers]
            prefill, pages = requests[0]
            moved = pair.connection.submit_kvcache(second.endpoint, prefill, ptrs, pages).result(timeout=10)
            assert moved == 64 * 65536 * 8
            initial = big.allocate(12).views
            expected = expected_buffers(pair.memory.views, pair.local, initial, second.layout, prefill, pages)
            assert second.hashes() == buffer_digests(expected)
        finally:
            second.close()


def notifications_over_many_rounds(backend: str) -> None:
    """Eight rounds of twelve submissions in flight, new source pages each round: 96 notifications, each
    digested on the receiver the moment it is seen, must find their pages complete."""
    harness = ContractHarness(backend, two_process=True)
    spec = LayoutSpec("mha", (0, 1), 128, 65536)
    rng = np.random.default_rng(13)
    with harness.pair(spec, spec, 13) as pair:
        for round_ in range(8):
            dst = rng.permutation(128).astype(np.int32)
            requests = [(fragmented_pages(rng, 128, 8), np.sort(dst[k * 8 : (k + 1) * 8])) for k in range(12)]
            messages = [f"r{round_}-{k}".encode() for k in range(12)]
            pair.receiver.start_watch({m: [int(i) for i in d] for m, (_, d) in zip(messages, requests, strict=True)})
            futures = [pair.submit(p, d, m) for (p, d), m in zip(requests, messages, strict=True)]
            assert [f.result(timeout=30) for f in futures] == [8 * 65536 * 4] * 12
            arrivals = pair.receiver.collect(12, 30.0)
            assert sorted(m for _, m, _ in arrivals) == sorted(messages)
            for _, message, seen in arrivals:  # other rounds overwrite other pages only
                prefill, pages = requests[messages.index(message)]
                assert seen == pair.expected_page_digest(prefill, pages), f"{message!r} arrived before its data"


def notifications_in_send_order(backend: str) -> None:
    """Sixty standalone notifications of every size class from one sender arrive once each, in send order."""
    harness = ContractHarness(backend, two_process=True)
    spec = LayoutSpec("mha", (0,), 16, 4096)
    with harness.pair(spec, spec, 17) as pair:
        sizes = [0, 1, 255, 4096]
        messages = [bytes([k % 256]) * sizes[k % 4] + k.to_bytes(2, "big") for k in range(60)]
        messages = [m[-kvwire.MAX_NOTIFICATION_BYTES :] for m in messages]  # the largest stay within the limit
        pair.receiver.start_watch({})
        for message in messages:
            pair.connection.send_notification(pair.receiver.endpoint, message)
        arrivals = pair.receiver.collect(len(messages), 30.0)
        assert [m for _, m, _ in arrivals] == messages
        pair.receiver.start_watch({})
        assert pair.receiver.collect(1, 0.2) == []


def close_with_submissions_in_flight(backend: str) -> None:
    """A 64 MiB write and 25 small ones submitted, then close(): every future is done when it returns, each
    with its bytes, cancelled, or a typed error; nothing is left pending."""
    spec = LayoutSpec("mha", (0, 1, 2, 3), 256, 65536)
    harness = ContractHarness(backend, two_process=True)
    with harness.pair(spec, spec, 23) as pair:
        rng = np.random.default_rng(23)
        futures = [pair.submit(rng.permutation(256)[:128].astype(np.int32), np.arange(128, dtype=np.int32))]
        futures += [pair.submit(*(np.arange(k, k + 8, dtype=np.int32),) * 2) for k in range(0, 200, 8)]
        pair.connection.close()
        assert all(f.done() for f in futures)
        for future in futures:
            exc = None if future.cancelled() else future.exception()
            assert exc is None or isinstance(exc, kvwire.TransferError), exc
