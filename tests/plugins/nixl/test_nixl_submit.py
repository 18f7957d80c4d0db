"""kvwire-nixl's submitter thread and NIXL notifications over two real processes."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import Future

import numpy as np
import pytest
import submit_scenarios
from freezing import freeze

import kvwire
from kvwire import BackendConfig
from kvwire.testing.harness import ContractHarness
from kvwire.testing.receiver import LayoutSpec
from kvwire.transport.busy import busy_fractions
from kvwire.workload.fragment import fragmented_pages
from kvwire_nixl.locate import nixl_availability

if (_reason := nixl_availability()) is not None:
    pytest.skip(f"kvwire-nixl cannot run here: {_reason}", allow_module_level=True)

pytestmark = pytest.mark.slow


def test_killed_peer_with_submissions_in_flight_fails_each_typed_and_another_peer_is_served() -> None:
    submit_scenarios.killed_peer_with_submissions_in_flight("nixl")


def test_notifications_never_arrive_before_their_data_over_many_rounds() -> None:
    submit_scenarios.notifications_over_many_rounds("nixl")


def test_a_frozen_peer_times_out_its_submission_while_another_peer_is_served() -> None:
    """Frozen before first contact: its write cannot complete; the submitter keeps serving the other peer."""
    spec = LayoutSpec("mha", (0, 1), 64, 16384)
    harness = ContractHarness("nixl", two_process=True, config=BackendConfig(timeout_s=3.0))
    with harness.pair(spec, spec, 21) as pair:
        other = type(pair.receiver)("nixl", spec, 22)
        try:
            pair.connection.add_peer(other.endpoint, other.layout)
            pid = pair.receiver.pid  # type: ignore[attr-defined]
            freeze(pid)
            try:
                ids = np.arange(16, dtype=np.int32)
                start = time.monotonic()
                frozen = pair.submit(ids, ids)
                ptrs = [b.base for b in other.layout.buffers]
                served = pair.connection.submit_kvcache(other.endpoint, ids, ptrs, ids)
                assert served.result(timeout=3.0) == 16 * 16384 * 4
                with pytest.raises(kvwire.TransferTimeoutError):
                    frozen.result(timeout=3.0 + 2.0)
                assert time.monotonic() - start < 3.0 + 1.5
            finally:
                os.kill(pid, signal.SIGCONT)
        finally:
            other.close()


def test_close_with_submissions_queued_and_in_flight_leaves_none_pending() -> None:
    submit_scenarios.close_with_submissions_in_flight("nixl")


def test_notifications_arrive_once_in_send_order() -> None:
    submit_scenarios.notifications_in_send_order("nixl")


def test_writes_of_several_chunks_queued_together_land_whole_and_a_done_callback_may_call_back() -> None:
    """Three 160 MiB submissions (three 64 MiB-class chunks each, fed to two streams across write boundaries):
    every byte lands; each one's notification follows its data; a done-callback that sends a notification and
    submits again (back into the transport whose submitter completed it) neither deadlocks nor is lost."""
    spec = LayoutSpec("mha", (0, 1, 2, 3), 1024, 65536)  # 8 buffers: 320 pages per request = 160 MiB
    harness = ContractHarness("nixl", two_process=True)
    rng = np.random.default_rng(23)
    with harness.pair(spec, spec, 23) as pair:
        dst = rng.permutation(1024).astype(np.int32)
        requests = [(fragmented_pages(rng, 1024, 320), np.sort(dst[k * 320 : (k + 1) * 320])) for k in range(3)]
        messages = [f"big-{k}".encode() for k in range(3)]
        pair.receiver.start_watch({m: [int(i) for i in d] for m, (_, d) in zip(messages, requests, strict=True)})
        again: list[Future[int]] = []

        def call_back(_: Future[int]) -> None:
            pair.connection.send_notification(pair.receiver.endpoint, b"from-a-callback")
            again.append(pair.submit(*requests[0]))

        transport = pair.connection.backend.transport
        busy_before, start = transport.busy.snapshot(), time.perf_counter()
        futures = [pair.submit(p, d, m) for (p, d), m in zip(requests, messages, strict=True)]
        futures[0].add_done_callback(call_back)
        assert [f.result(timeout=60) for f in futures] == [320 * 65536 * 8] * 3
        elapsed = time.perf_counter() - start
        # every stream posted chunks (each busy for a while, never longer than the writes took)
        fractions = busy_fractions(busy_before, transport.busy.snapshot(), elapsed)
        assert set(fractions) == {f"stream {i}" for i in range(transport.agent.streams)}, fractions
        assert all(0 < f <= 1 for f in fractions.values()), fractions
        arrivals = pair.receiver.collect(4, 30.0)
        seen = {message: digest for _, message, digest in arrivals}
        assert set(seen) == {*messages, b"from-a-callback"}
        for message, (prefill, pages) in zip(messages, requests, strict=True):
            assert seen[message] == pair.expected_page_digest(prefill, pages), f"{message!r} arrived before its data"
        assert len(again) == 1 and again[0].result(timeout=60) == 320 * 65536 * 8
        prefill = np.concatenate([p for p, _ in requests])
        pages = np.concatenate([d for _, d in requests])
        assert pair.receiver.hashes() == pair.expected_hashes(prefill, pages)


def test_a_submission_queued_behind_others_is_cancellable_until_its_first_chunk_is_posted() -> None:
    """The submitter takes every queued write at once, but each stays cancellable until a stream posts its
    first chunk: with the agent's lock held here the submitter cannot post, so the middle of three writes is
    cancelled for certain; the other two land, its pages stay as they were."""
    spec = LayoutSpec("mha", (0, 1), 96, 65536)
    harness = ContractHarness("nixl", two_process=True)
    rng = np.random.default_rng(29)
    with harness.pair(spec, spec, 29) as pair:
        pair.send(np.arange(1, dtype=np.int32), np.arange(1, dtype=np.int32))  # connected: nothing left to set up
        dst = rng.permutation(np.arange(1, 96)).astype(np.int32)
        requests = [(fragmented_pages(rng, 96, 24), np.sort(dst[k * 24 : (k + 1) * 24])) for k in range(3)]
        transport = pair.connection.backend.transport
        with transport.agent.lock:
            futures = [pair.submit(p, d) for p, d in requests]
            assert futures[1].cancel()
        assert futures[0].result(timeout=30) == futures[2].result(timeout=30) == 24 * 65536 * 4
        assert futures[1].cancelled()
        sent = [requests[0], requests[2]]
        prefill = np.concatenate([np.arange(1), *(p for p, _ in sent)])
        pages = np.concatenate([np.arange(1), *(d for _, d in sent)])
        assert pair.receiver.hashes() == pair.expected_hashes(prefill, pages)
