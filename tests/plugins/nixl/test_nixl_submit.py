"""kvwire-nixl's submitter thread and NIXL notifications over two real processes."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import submit_scenarios

import kvwire
from kvwire import BackendConfig
from kvwire.testing.harness import ContractHarness
from kvwire.testing.receiver import LayoutSpec
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
            os.kill(pid, signal.SIGSTOP)
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
