"""Fault and visibility scenarios of submit_kvcache and notifications, run against each interprocess backend."""

from __future__ import annotations

import re
import time
from concurrent.futures import Future, wait

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
    """A 64 MiB write and 16 small ones to one peer, then close(): when it returns every future is done, and in
    submission order a run of writes that completed (their bytes, verified on the peer) is followed by a run
    that never started (cancelled, or failed typed with "nothing was sent"), whose pages are left unchanged."""
    spec = LayoutSpec("mha", (0, 1, 2, 3), 256, 65536)
    harness = ContractHarness(backend, two_process=True)
    with harness.pair(spec, spec, 23) as pair:
        rng = np.random.default_rng(23)
        requests = [(rng.permutation(256)[:128].astype(np.int32), np.arange(128, dtype=np.int32))]
        small = [np.arange(k, k + 8, dtype=np.int32) for k in range(0, 128, 8)]
        requests += [(pages, pages + 128) for pages in small]
        futures = [pair.submit(*request) for request in requests]  # destinations are disjoint
        pair.connection.close()
        assert all(f.done() for f in futures)
        outcomes = "".join(_outcome(f) for f in futures)
        assert re.fullmatch("S*U*", outcomes), f"completed, then never started, in submission order: {outcomes}"
        print(f"close with {len(futures)} submitted: {outcomes}")
        expected = pair.initial_peer().views
        for (prefill, pages), outcome in zip(requests, outcomes):
            if outcome == "S":
                expected = expected_buffers(
                    pair.memory.views, pair.local, expected, pair.receiver.layout, prefill, pages
                )
        assert pair.receiver.hashes() == buffer_digests(expected)


def _outcome(future: Future[int]) -> str:
    """S: completed with its planned bytes; U: never started (cancelled, or refused with nothing sent)."""
    if future.cancelled():
        return "U"
    exc = future.exception()
    if exc is None:
        assert future.result() == future.nbytes  # type: ignore[attr-defined]
        return "S"
    assert isinstance(exc, kvwire.TransferError) and "nothing was sent" in str(exc), repr(exc)
    return "U"
