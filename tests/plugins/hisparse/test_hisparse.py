"""kvwire-hisparse: split host/device destinations, known vectors and two-process transfers."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import kvwire
from kvwire import KVBuffer, KVLayout
from kvwire.testing.contract import *  # noqa: F403 - the contract suite, two real processes
from kvwire.testing.harness import ContractHarness, fragmented_pages
from kvwire.testing.receiver import LayoutSpec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def kvwire_backend_name() -> str:
    return "hisparse"


@pytest.fixture(scope="session")
def kvwire_two_process() -> bool:
    return True


def _known_layouts() -> tuple[KVLayout, KVLayout]:
    local = KVLayout(tuple(KVBuffer(base, 100, 9, layer, "kv") for layer, base in enumerate((1000, 2000, 3000))))
    peer = KVLayout(
        (
            KVBuffer(10000, 100, 50, 0, "kv", "host"),
            KVBuffer(20000, 100, 50, 1, "kv", "device"),
            KVBuffer(30000, 100, 50, 2, "kv", "device"),
        )
    )
    return local, peer


def test_known_vector_through_the_backend_planning_path() -> None:
    from kvwire_hisparse.backend import HiSparseBackend

    backend = HiSparseBackend(kvwire.BackendConfig())
    try:
        local, peer = _known_layouts()
        backend.transport.layouts.register(local)  # planning only: synthetic addresses, never registered
        backend.add_peer("decode:1", peer)
        plan = backend.transport.layouts.plan(
            "decode:1",
            np.array([1, 2], np.int32),
            [10000, 20000, 30000],
            np.array([7, 8], np.int32),
            None,
            np.array([21, 22], np.int32),
        )
        triples = list(zip(plan.src.tolist(), plan.dst.tolist(), plan.length.tolist()))
        assert triples == [(1100, 10700, 200), (2100, 22100, 200), (3100, 32100, 200)]
    finally:
        backend.close()


@pytest.mark.parametrize(
    ("device", "match"),
    [
        (None, "dst_device_kv_indices"),  # missing: the peer mixes host and device buffers
        (np.array([21, 22, 23], np.int32), "dst_device_kv_indices"),  # length mismatch
        (np.array([21, 64], np.int32), "dst_device_kv_indices"),  # beyond the device buffers
    ],
)
def test_bad_device_indices_rejected_destination_unchanged(
    kvwire_harness: ContractHarness, device: np.ndarray | None, match: str
) -> None:
    local_spec = LayoutSpec("mla", (0, 1, 2), 24, 1152)
    peer_spec = LayoutSpec("mla", (0, 1, 2), 64, 1152, device_layers=(0, 1, 2))
    with kvwire_harness.pair(local_spec, peer_spec, 11) as pair:
        with pytest.raises(kvwire.InvalidTransferError, match=match):
            pair.send(np.array([1, 2], np.int32), np.array([7, 8], np.int32), None, device)
        assert pair.receiver.hashes() == pair.untouched_hashes()


def test_two_process_host_and_device_pools_fragmented(kvwire_harness: ContractHarness) -> None:
    """Full KV into host buffers of every layer, the hot copy into device buffers, random fragmented pages."""
    local_spec = LayoutSpec("mla", (0, 1, 2, 3), 96, 1152)
    peer_spec = LayoutSpec("mla", (0, 1, 2, 3), 128, 1152, device_layers=(0, 1, 2, 3))
    rng = np.random.default_rng(12)
    prefill = fragmented_pages(rng, 96, 80, mean_run=4)
    host, device = fragmented_pages(rng, 128, 80, mean_run=6), fragmented_pages(rng, 128, 80, mean_run=2)
    with kvwire_harness.pair(local_spec, peer_spec, 12) as pair:
        moved = pair.send(prefill, host, None, device)
        assert moved == 80 * 1152 * 4 * 2
        assert pair.receiver.hashes() == pair.expected_hashes(prefill, host, None, device)


def test_bench_with_split_preset() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvwire",
            "bench",
            "--backend",
            "hisparse",
            "--preset",
            "deepseek-v3-hisparse",
            "--requests",
            "3",
            "--tokens",
            "1024",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["verified"] is True
    assert result["backend"] == "hisparse"
    assert result["bytes"] == 3 * 64 * 18432 * 61 * 2  # 64 pages x 61 layers x (host + device)
    assert {"gbps", "p50_ms", "p99_ms", "descriptors_before", "descriptors_after"} <= set(result)
