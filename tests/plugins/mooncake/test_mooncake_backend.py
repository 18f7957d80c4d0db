"""kvwire-mooncake end to end: the contract kit over two real processes, and faults."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from freezing import freeze

import kvwire
from kvwire import BackendConfig
from kvwire.testing.contract import *  # noqa: F403 - the contract suite, two real processes
from kvwire.testing.harness import ContractHarness, expected_buffers
from kvwire.testing.receiver import LayoutSpec, buffer_digests
from kvwire.workload.fragment import fragmented_pages

pytestmark = pytest.mark.slow

SPEC = LayoutSpec("mha", (0, 1), 256, 16384)


@pytest.fixture(scope="session")
def kvwire_backend_name() -> str:
    return "mooncake"


@pytest.fixture(scope="session")
def kvwire_two_process() -> bool:
    return True


def _send_all(pair: object, count: int = 64, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return fragmented_pages(rng, SPEC.num_pages, count), fragmented_pages(rng, SPEC.num_pages, count)


def test_more_descriptors_than_the_engine_queue_allows_are_chunked() -> None:
    spec = LayoutSpec("mha", (0, 1), 2048, 512)  # 4 buffers x 1000 single-page runs = 4000 descriptors
    harness = ContractHarness("mooncake", two_process=True)
    rng = np.random.default_rng(2)
    prefill = (rng.permutation(1024)[:1000] * 2).astype(np.int32)  # never consecutive: no coalescing
    dst = rng.permutation(2048)[:1000].astype(np.int32)
    with harness.pair(spec, spec, 2) as pair:
        plan = kvwire.plan_transfer(pair.local, pair.receiver.layout, prefill, pair.dst_kv_ptrs, dst)
        assert len(plan) > 2100
        assert pair.send(prefill, dst) == 1000 * 512 * 4
        assert pair.receiver.hashes() == pair.expected_hashes(prefill, dst)


def test_remote_address_outside_the_peer_layout_is_rejected_before_the_engine() -> None:
    harness = ContractHarness("mooncake", two_process=True)
    with harness.pair(SPEC, SPEC, 3) as pair:
        calls: list[object] = []
        engine = pair.connection.backend.transport.engine
        original = engine.write
        engine.write = lambda *a: calls.append(a) or original(*a)  # type: ignore[method-assign]
        ptrs = [p + 16384 * 300 for p in pair.dst_kv_ptrs]
        with pytest.raises(kvwire.InvalidTransferError, match=r"dst_kv_ptrs\[0\]"):
            pair.connection.send_kvcache(pair.receiver.endpoint, np.array([1], np.int32), ptrs, np.array([1], np.int32))
        assert calls == []
        assert pair.receiver.hashes() == pair.untouched_hashes()


def test_unreachable_session_fails_at_once() -> None:
    harness = ContractHarness("mooncake", two_process=True)
    with harness.pair(SPEC, SPEC, 4) as pair:
        pair.connection.add_peer("127.0.0.1:1", pair.receiver.layout)
        start = time.monotonic()
        with pytest.raises(kvwire.PeerUnreachableError):
            pair.connection.send_kvcache(
                "127.0.0.1:1", np.array([1], np.int32), pair.dst_kv_ptrs, np.array([1], np.int32)
            )
        assert time.monotonic() - start < 5.0


def test_killed_peer_errors_fast_and_another_peer_is_still_served() -> None:
    harness = ContractHarness("mooncake", two_process=True)
    big = LayoutSpec("mha", (0, 1, 2, 3), 512, 65536)  # 8 buffers x 256 pages x 64 KiB = 128 MiB per request
    rng = np.random.default_rng(5)
    prefill, dst = fragmented_pages(rng, 512, 256, mean_run=4), fragmented_pages(rng, 512, 256, mean_run=4)
    with harness.pair(big, big, 5) as pair:
        second_receiver = type(pair.receiver)("mooncake", big, 99)  # a second decode process
        try:
            pair.connection.add_peer(second_receiver.endpoint, second_receiver.layout)
            started = threading.Event()
            outcome: dict[str, object] = {}

            def send() -> None:
                started.set()
                try:
                    outcome["moved"] = pair.send(prefill, dst)
                except kvwire.TransferError as exc:
                    outcome["error"] = exc
                outcome["done"] = time.monotonic()

            worker = threading.Thread(target=send)
            worker.start()
            started.wait()
            pair.receiver.child.proc.kill()  # type: ignore[attr-defined]
            killed = time.monotonic()
            worker.join(timeout=30)
            assert not worker.is_alive()
            if "error" not in outcome:  # the transfer beat the kill: the next one must fail
                with pytest.raises(kvwire.TransferError):
                    pair.send(prefill, dst)
                outcome["done"] = time.monotonic()
            assert float(outcome["done"]) - killed < 2.0  # type: ignore[arg-type]
            ptrs = [b.base for b in second_receiver.layout.buffers]
            moved = pair.connection.send_kvcache(second_receiver.endpoint, prefill, ptrs, dst)
            assert moved == 256 * 65536 * 8
            initial = big.allocate(99)
            expected = expected_buffers(
                pair.memory.views, pair.local, initial.views, second_receiver.layout, prefill, dst
            )
            assert second_receiver.hashes() == buffer_digests(expected)
        finally:
            second_receiver.close()


def test_frozen_peer_times_out_within_the_configured_timeout() -> None:
    harness = ContractHarness("mooncake", two_process=True, config=BackendConfig(timeout_s=3.0))
    with harness.pair(SPEC, SPEC, 6) as pair:
        prefill, dst = _send_all(pair)
        pid = pair.receiver.pid  # type: ignore[attr-defined]
        freeze(pid)
        try:
            start = time.monotonic()
            with pytest.raises(kvwire.TransferTimeoutError):
                pair.send(prefill, dst)
            elapsed = time.monotonic() - start
            assert elapsed < 3.0 + 1.5, elapsed
        finally:
            os.kill(pid, signal.SIGCONT)


def test_bench_json_verifies_every_byte() -> None:
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
            "3",
            "--tokens",
            "1024",
            "--json",
            "--compare-raw",
            "--compare-uncoalesced",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert (result["verified"], result["guards_unchanged"]) == (True, True)
    assert result["bytes"] == 3 * 64 * 16384 * 28 * 2
    assert result["descriptors_before"] == 64 * 56 > result["descriptors_after"]
    assert {"gbps", "p50_ms", "p99_ms", "raw_gbps", "ratio", "uncoalesced_gbps"} <= set(result)
    # two ratios, each named for what it is: the median of per-request ratios and the ratio of totals
    assert result["ratio_of_totals"] == round(result["gbps"] / result["raw_gbps"], 3)
