"""What the connector counts for vLLM's metrics (``kvwire.hosts.vllm.telemetry``), without vLLM.

vLLM's own classes read these payloads back in ``test_vllm_metrics_real.py`` (slow); here the counting
itself: a write, a refusal and a failed load, each counted once, on the side where it happened.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import torch
from ports import free_port_run

from kvwire.hosts.vllm import ConnectorSettings
from kvwire.hosts.vllm.scheduler import SchedulerSide
from kvwire.hosts.vllm.settings import EngineSide
from kvwire.hosts.vllm.telemetry import STAT_KEYS, TransferStats, reduce_stats
from kvwire.hosts.vllm.worker import WorkerSide

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def kv_caches(blocks: int = 8) -> dict[str, torch.Tensor]:
    """vLLM's LBHNC views (2 heads, 32 tokens, 128 fp16 values: 16384-byte blocks) of one int8 buffer."""
    raw = torch.zeros(len(LAYERS) * blocks * 16384, dtype=torch.int8).view(torch.float16)
    shape, stride = (blocks, 2, 32, 128), (8192, 4096, 128, 1)
    return {name: torch.as_strided(raw, shape, stride, i * blocks * 8192) for i, name in enumerate(LAYERS)}


def _request(req_id: str, n: int, params: dict[str, Any], status: str = "RUNNING") -> Any:
    return SimpleNamespace(
        request_id=req_id, prompt_token_ids=list(range(n)), kv_transfer_params=params,
        status=SimpleNamespace(name=status), num_computed_tokens=n,
    )  # fmt: skip


def _until(fn: Any, timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (got := fn()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)
    return got


def test_observations_are_drained_once_and_summarised_as_vllm_logs_them() -> None:
    stats = TransferStats()
    assert stats.drain() is None
    stats.record_write(0.010, 4 << 20, 8)
    stats.record_write(0.030, 4 << 20, None)  # a backend that does not say how many descriptors
    stats.record_refusal()
    data = stats.drain()
    assert data == {
        "transfer_duration": [0.010, 0.030], "bytes_transferred": [4 << 20, 4 << 20], "num_descriptors": [8],
        "num_failed_transfers": [], "num_refused_registrations": [1], "num_failed_loads": [],
    }  # fmt: skip
    assert list(data) == list(STAT_KEYS) and stats.drain() is None
    assert reduce_stats(data) == {
        "Num successful transfers": 2,
        "Avg xfer time (ms)": 20.0,
        "P90 xfer time (ms)": 30.0,
        "Avg MB per transfer": 4.0,
        "Throughput (MB/s)": 200.0,
        "Avg number of descriptors": 8.0,
        "Num failed transfers": 0,
        "Num refused registrations": 1,
        "Num failed loads": 0,
    }
    assert reduce_stats({})["Num successful transfers"] == 0


def test_a_write_a_refusal_and_a_failed_load_are_counted_where_they_happen() -> None:
    settings = ConnectorSettings.from_extra_config({"backend": "local", "side_channel_port": free_port_run(1)})
    p_engine = EngineSide(settings, 1, producer=True, consumer=False)
    d_engine = EngineSide(settings, 1, producer=False, consumer=True)
    p_work, d_work = WorkerSide(p_engine, 0), WorkerSide(d_engine, 0)
    try:
        p_work.register_kv_caches(kv_caches())
        d_work.register_kv_caches(kv_caches())
        p_sched, d_sched = SchedulerSide(p_engine, "engine-p"), SchedulerSide(d_engine, "engine-d")
        for req, blocks, mine in (("0", [1, 2, 3], [1, 2, 3]), ("1", [4, 5], [4, 6])):  # p1: 6 is not p1's
            _, params = p_sched.request_finished(
                _request(f"p{req}", 70, {"do_remote_decode": True}, "FINISHED_STOPPED"), blocks
            )
            assert params is not None
            p_work.start(p_sched.build_connector_meta(None))
            params = dict(params, remote_block_ids=mine)
            decode = _request(f"d{req}", 70, params)
            d_sched.get_num_new_matched_tokens(decode, 0)
            d_sched.update_state_after_alloc(
                decode, SimpleNamespace(get_unhashed_block_ids=[7, 5, 6][: len(mine)].copy), 70
            )
            d_work.start(d_sched.build_connector_meta(None))
            assert _until(lambda: d_work.get_finished()[1]) == {f"d{req}"}
        assert _until(lambda: p_work.get_finished()[0]) == {"p0"}
        sent, received = p_work.drain_stats(), d_work.drain_stats()
        assert sent is not None and received is not None
        assert sent["bytes_transferred"] == [3 * 2 * 16384] and len(sent["transfer_duration"]) == 1
        assert sent["num_descriptors"] == [4]  # per layer: block 1 -> 7, blocks 2-3 -> 5-6
        assert (sent["num_refused_registrations"], sent["num_failed_transfers"]) == ([1], [])
        assert received == {key: [1] if key == "num_failed_loads" else [] for key in STAT_KEYS}
    finally:
        p_work.shutdown()
        d_work.shutdown()
