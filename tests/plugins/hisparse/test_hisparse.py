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
from kvwire.testing.harness import ContractHarness
from kvwire.testing.receiver import LayoutSpec
from kvwire.workload.fragment import fragmented_pages

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


class _PlanRecorder(kvwire.Transport):
    """Records the plans the backend hands its transport (synthetic addresses: nothing is written)."""

    def __init__(self) -> None:
        self.plans: list[tuple[str, kvwire.TransferPlan]] = []

    @property
    def endpoint(self) -> str:
        return "recorder:1"

    def register_memory(self, base: int, nbytes: int) -> None:
        pass

    def unregister_memory(self, base: int) -> None:
        pass

    def write(self, session_id: str, plan: kvwire.TransferPlan) -> None:
        self.plans.append((session_id, plan))

    def close(self) -> None:
        pass


def test_known_vector_through_send_kvcache() -> None:
    """HiSparseBackend.send_kvcache hands its transport the plan of the known vector, device ids included."""
    from kvwire_hisparse.backend import HiSparseBackend

    class Recorded(HiSparseBackend):
        def open_transport(self, config: kvwire.BackendConfig) -> kvwire.Transport:
            return _PlanRecorder()

    backend = Recorded(kvwire.BackendConfig())
    local, peer = _known_layouts()
    backend.register_kv_buffers(local)
    backend.add_peer("decode:1", peer)
    moved = backend.send_kvcache(
        "decode:1",
        np.array([1, 2], np.int32),
        [10000, 20000, 30000],
        np.array([7, 8], np.int32),
        None,
        None,
        np.array([21, 22], np.int32),
    )
    assert moved == 600
    assert isinstance(backend.transport, _PlanRecorder)
    ((session, plan),) = backend.transport.plans
    triples = list(zip(plan.src.tolist(), plan.dst.tolist(), plan.length.tolist()))
    assert (session, triples) == ("decode:1", [(1100, 10700, 200), (2100, 22100, 200), (3100, 32100, 200)])
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
    assert (result["verified"], result["guards_unchanged"]) == (True, True)
    assert result["backend"] == "hisparse"
    assert result["bytes"] == 3 * 64 * 18432 * 61 * 2  # 64 pages x 61 layers x (host + device)
    assert {"gbps", "p50_ms", "p99_ms", "descriptors_before", "descriptors_after"} <= set(result)
