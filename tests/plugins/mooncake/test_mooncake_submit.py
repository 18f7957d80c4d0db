"""kvwire-mooncake's submit and notifications over two real processes: faults and visibility over many rounds."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import submit_scenarios

pytestmark = pytest.mark.slow


def test_killed_peer_with_submissions_in_flight_fails_each_typed_and_another_peer_is_served() -> None:
    submit_scenarios.killed_peer_with_submissions_in_flight("mooncake")


def test_notifications_never_arrive_before_their_data_over_many_rounds() -> None:
    submit_scenarios.notifications_over_many_rounds("mooncake")


def test_notifications_arrive_once_in_send_order() -> None:
    submit_scenarios.notifications_in_send_order("mooncake")


def test_close_with_submissions_queued_and_in_flight_leaves_none_pending() -> None:
    submit_scenarios.close_with_submissions_in_flight("mooncake")


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
    assert result["sequential_gbps"] > 0 and result["inflight_gbps"] > 0 and result["inflight_ratio_paired"] > 0
    assert len(result["inflight_wave_ratios"]) == 3  # waves of 2, 2 and 1 requests
    assert all(r > 0 for r in result["inflight_wave_ratios"])
    assert result["submit_p50_us"] > 0 and result["notify_p50_us"] is not None
    # each phase: the one peer's writing time, a fraction of the waves' time (the engine's write calls only)
    for phase in ("sequential", "inflight"):
        ((name, fraction),) = result["busy_fractions"][phase].items()
        assert name.startswith("peer ") and 0 < fraction <= 1, result["busy_fractions"]


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
