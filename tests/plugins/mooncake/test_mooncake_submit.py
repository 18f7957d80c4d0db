"""kvwire-mooncake's submit and notifications over two real processes: faults and visibility over many rounds."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import wait

import numpy as np
import pytest

import kvwire
from kvwire import BackendConfig
from kvwire.testing.harness import ContractHarness, expected_buffers
from kvwire.testing.receiver import LayoutSpec, buffer_digests
from kvwire.workload.fragment import fragmented_pages

pytestmark = pytest.mark.slow


def test_killed_peer_with_submissions_in_flight_fails_each_typed_and_another_peer_is_served() -> None:
    harness = ContractHarness("mooncake", two_process=True, config=BackendConfig(timeout_s=3.0))
    big = LayoutSpec("mha", (0, 1, 2, 3), 512, 65536)  # 8 buffers: 64 pages per request = 32 MiB
    rng = np.random.default_rng(11)
    with harness.pair(big, big, 11) as pair:
        second = type(pair.receiver)("mooncake", big, 12)
        try:
            pair.connection.add_peer(second.endpoint, second.layout)
            dst = rng.permutation(512).astype(np.int32)
            requests = [(fragmented_pages(rng, 512, 64), np.sort(dst[k * 64 : (k + 1) * 64])) for k in range(6)]
            futures = [pair.submit(p, d) for p, d in requests]
            pair.receiver.child.proc.kill()  # type: ignore[attr-defined]
            killed = time.monotonic()
            _, pending = wait(futures, timeout=3.0 + 2.0)
            assert not pending, (
                f"{len(pending)} transfers still pending {time.monotonic() - killed:.1f} s after the kill"
            )
            errors = [f.exception() for f in futures]
            assert all(e is None or isinstance(e, kvwire.TransferError) for e in errors), errors
            if all(e is None for e in errors):  # every one beat the kill: the next must fail, typed
                with pytest.raises(kvwire.TransferError):
                    pair.submit(*requests[0]).result(timeout=5.0)
            ptrs = [b.base for b in second.layout.buffers]
            prefill, pages = requests[0]
            moved = pair.connection.submit_kvcache(second.endpoint, prefill, ptrs, pages).result(timeout=10)
            assert moved == 64 * 65536 * 8
            expected = expected_buffers(
                pair.memory.views, pair.local, big.allocate(12).views, second.layout, prefill, pages
            )
            assert second.hashes() == buffer_digests(expected)
        finally:
            second.close()


def test_notifications_never_arrive_before_their_data_over_many_rounds() -> None:
    """Eight rounds of twelve submissions in flight, new source pages each round: 96 notifications checked."""
    harness = ContractHarness("mooncake", two_process=True)
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
            # Each request's pages, as they must be once it has landed (later rounds overwrite other pages only).
            for _, message, seen in arrivals:
                k = messages.index(message)
                prefill, pages = requests[k]
                assert seen == pair.expected_page_digest(prefill, pages), f"{message!r} arrived before its data"


def test_bench_inflight_requests_confirms_each_request_by_notification() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvwire",
            "bench",
            "--backend",
            "mooncake",
            "--preset",
            "qwen2.5-7b",
            "--requests",
            "5",
            "--tokens",
            "1024",
            "--inflight-requests",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert (result["verified"], result["guards_unchanged"], result["inflight_requests"]) == (True, True, 2)
    assert result["bytes"] == 5 * 64 * 16384 * 28 * 2
    assert result["sequential_gbps"] > 0 and result["inflight_gbps"] > 0
    assert result["submit_p50_us"] > 0 and result["notify_p50_us"] is not None


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        (["--inflight-requests", "0"], "--inflight-requests must be >= 1, got 0"),
        (["--inflight-requests", "2", "--compare-raw"], "--inflight-requests compares its own two phases"),
        (["--inflight-requests", "2", "--backend", "ascend"], "does not declare 'notifications'"),
    ],
)
def test_bench_inflight_refuses_bad_combinations(extra: list[str], error: str) -> None:
    argv = [sys.executable, "-m", "kvwire", "bench", "--backend", "mooncake", *extra]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2 and error in proc.stderr, proc.stderr[-2000:]
