"""kvwire's transfers in vLLM's own metrics, read back from vLLM's stats path (slow, once per supported release).

A prefill and a decode ``pd_node.py`` (real Schedulers with ``log_stats``) move requests through kvwire-nixl;
each step's ``KVConnectorOutput.kv_connector_stats`` goes through the Scheduler's ``make_stats`` into
``SchedulerStats.kv_connector_stats``, which each node hands to vLLM's own ``KVConnectorProm`` (what
``PrometheusStatLogger`` records with) and ``KVConnectorLogging`` (what ``LoggingStatLogger`` prints). The
``vllm:kvwire_*`` samples read from prometheus_client's registry must count exactly what happened.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from ports import free_port_run

sys.path.insert(0, str(Path(__file__).parent / "vllm"))

from pd_pair import NodeProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

PROMPT = 100  # tokens: 4 blocks of 32
BLOCK_BYTES = 2 * 32 * 128 * 2  # 2 KV heads, 32 tokens, K|V of 64 + 64 fp16 values


def _totals(samples: dict[str, float]) -> dict[str, float]:
    """name -> value of the samples without a bucket label (counts, sums, counters), one engine."""
    return {key.split("[")[0]: value for key, value in samples.items() if "('le'," not in key}


def test_transfers_show_in_vllms_own_connector_metrics(each_vllm_python: Path) -> None:
    extra: dict[str, Any] = {"backend": "nixl", "side_channel_port": free_port_run(2), "load_timeout_s": 8.0}
    extra["transfer_timeout_s"] = 5
    prefill, decode = NodeProcess(each_vllm_python, "prefill"), NodeProcess(each_vllm_python, "decode")
    try:
        prefill.call("start", role="prefill", extra=extra)
        decode.call("start", role="decode", extra=extra, filler_tokens=PROMPT)
        for i in range(2):
            sent = prefill.call("prefill", req_id=f"p{i}", n_tokens=PROMPT, seed=61 + i)
            got = decode.call("decode", req_id=f"d{i}", n_tokens=PROMPT, params=sent["params"], timeout_s=60)
            assert got["finished_recving"] is True and got["digests"] == sent["digests"], got
            assert prefill.call("step_until_sent", req_id=f"p{i}", timeout_s=30)["sent"] is True
        sent = prefill.call("prefill", req_id="p2", n_tokens=PROMPT, seed=63)
        bad = dict(sent["params"], remote_block_ids=[*sent["block_ids"][:3], 63])  # not p2's: refused
        got = decode.call("decode", req_id="d2", n_tokens=PROMPT, params=bad, timeout_s=60)
        assert got["invalid_block_ids"] == sorted(got["block_ids"])
        p_metrics = prefill.call("metrics", prefix="vllm:kvwire")
        d_metrics = decode.call("metrics", prefix="vllm:kvwire")
    finally:
        prefill.close()
        decode.close()
    p_totals, d_totals = _totals(p_metrics["samples"]), _totals(d_metrics["samples"])
    written = 2 * 4 * BLOCK_BYTES  # 4 blocks of 2 layers per request
    assert p_totals["vllm:kvwire_xfer_time_seconds_count"] == 2 and p_totals["vllm:kvwire_xfer_time_seconds_sum"] > 0
    assert (p_totals["vllm:kvwire_bytes_transferred_count"], p_totals["vllm:kvwire_bytes_transferred_sum"]) == (
        2,
        2 * written,
    )
    assert p_totals["vllm:kvwire_num_descriptors_count"] == 2 and p_totals["vllm:kvwire_num_descriptors_sum"] >= 4
    assert p_totals["vllm:kvwire_num_refused_registrations_total"] == 1
    assert (
        p_totals["vllm:kvwire_num_failed_transfers_total"] == 0 and p_totals["vllm:kvwire_num_failed_loads_total"] == 0
    )
    assert d_totals["vllm:kvwire_num_failed_loads_total"] == 1 and d_totals["vllm:kvwire_xfer_time_seconds_count"] == 0
    summary = p_metrics["summary"]  # vLLM's "KV Transfer metrics: ..." line for the interval
    assert (summary["Num successful transfers"], summary["Num refused registrations"]) == (2, 1)
    assert summary["Avg MB per transfer"] == round(written / 2**20, 3) and summary["Avg xfer time (ms)"] > 0
    assert d_metrics["summary"]["Num failed loads"] == 1
