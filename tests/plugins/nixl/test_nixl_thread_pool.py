"""The contract kit again with NIXL's UCX thread pool on (``num_threads=2``): large writes split over NIXL threads."""

from __future__ import annotations

import numpy as np
import pytest

import kvwire
from kvwire import BackendConfig
from kvwire_nixl.locate import nixl_availability

if (_reason := nixl_availability()) is not None:
    pytest.skip(f"kvwire-nixl cannot run here: {_reason}", allow_module_level=True)

from kvwire.testing.contract import *  # noqa: F403 - the contract suite, two real processes
from kvwire.testing.harness import ContractHarness
from kvwire.testing.receiver import LayoutSpec
from kvwire.workload.fragment import fragmented_pages

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def kvwire_backend_name() -> str:
    return "nixl"


@pytest.fixture(scope="session")
def kvwire_two_process() -> bool:
    return True


@pytest.fixture(scope="session")
def kvwire_backend_config() -> BackendConfig:
    return BackendConfig(options={"num_threads": 2})


def test_a_write_split_over_nixl_threads_lands_byte_for_byte(kvwire_backend_config: BackendConfig) -> None:
    spec = LayoutSpec("mla", tuple(range(8)), 2048, 4096)
    rng = np.random.default_rng(12)
    prefill, dst = fragmented_pages(rng, 2048, 900, mean_run=3), fragmented_pages(rng, 2048, 900, mean_run=3)
    harness = ContractHarness("nixl", two_process=True, config=kvwire_backend_config)
    with harness.pair(spec, spec, 12) as pair:
        plan = kvwire.plan_transfer(pair.local, pair.receiver.layout, prefill, pair.dst_kv_ptrs, dst)
        assert len(plan) >= 1024  # NIXL splits batches of at least 1024 descriptors over its threads
        assert pair.send(prefill, dst) == 900 * 4096 * 8
        assert pair.receiver.hashes() == pair.expected_hashes(prefill, dst)
