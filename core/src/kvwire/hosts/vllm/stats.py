"""kvwire's transfers in vLLM's metrics: ``KVConnectorStats`` and ``vllm:kvwire_*`` Prometheus metrics.

This module imports vLLM (it is imported by :mod:`~kvwire.hosts.vllm.connector` only). The payload is
:mod:`~kvwire.hosts.vllm.telemetry`'s. vLLM's engine core aggregates the workers' stats
(:meth:`KvwireConnectorStats.aggregate`), its logger prints :meth:`KvwireConnectorStats.reduce` as
"KV Transfer metrics: ...", and its Prometheus logger records them per engine
(:class:`KvwirePromMetrics`), as vLLM's NIXL connector does with ``vllm:nixl_*``:

- ``vllm:kvwire_xfer_time_seconds``, ``vllm:kvwire_bytes_transferred``, ``vllm:kvwire_num_descriptors``:
  histograms, one observation per successful write (on the prefill);
- ``vllm:kvwire_num_failed_transfers``, ``vllm:kvwire_num_refused_registrations`` (prefill) and
  ``vllm:kvwire_num_failed_loads`` (decode): counters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # type: ignore[import-not-found, unused-ignore]
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine  # type: ignore[import-not-found, unused-ignore]

from kvwire.hosts.vllm.telemetry import STAT_KEYS, StatsData, reduce_stats

__all__ = ["KvwireConnectorStats", "KvwirePromMetrics"]

_TIME_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0]
_BYTE_BUCKETS = [2 ** (10 + i) for i in range(1, 25, 2)]  # 2 KiB .. 8 GiB
_DESCRIPTOR_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384]
_HISTOGRAMS = (
    ("transfer_duration", "vllm:kvwire_xfer_time_seconds", "Seconds per kvwire KV write", _TIME_BUCKETS),
    ("bytes_transferred", "vllm:kvwire_bytes_transferred", "Bytes per kvwire KV write", _BYTE_BUCKETS),
    ("num_descriptors", "vllm:kvwire_num_descriptors", "Descriptors per kvwire KV write", _DESCRIPTOR_BUCKETS),
)
_COUNTERS = (
    ("num_failed_transfers", "vllm:kvwire_num_failed_transfers", "kvwire KV writes that failed (prefill)"),
    (
        "num_refused_registrations",
        "vllm:kvwire_num_refused_registrations",
        "Decode registrations the prefill refused before anything moved",
    ),
    ("num_failed_loads", "vllm:kvwire_num_failed_loads", "Decode requests whose KV did not all arrive"),
)


@dataclass
class KvwireConnectorStats(KVConnectorStats):  # type: ignore[misc, unused-ignore]
    """The observations of one or more workers (``data``: :data:`~kvwire.hosts.vllm.telemetry.STAT_KEYS`)."""

    def __post_init__(self) -> None:
        for key in STAT_KEYS:
            self.data.setdefault(key, [])

    def reset(self) -> None:
        self.data: StatsData = {key: [] for key in STAT_KEYS}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, values in other.data.items():
            self.data.setdefault(key, []).extend(values)
        return self

    def reduce(self) -> dict[str, int | float]:
        return reduce_stats(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.get(key) for key in STAT_KEYS)


class KvwirePromMetrics(KVConnectorPromMetrics):  # type: ignore[misc, unused-ignore]
    """``vllm:kvwire_*``, one child per engine (vLLM's ``create_metric_per_engine``)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._histograms = {
            key: create_metric_per_engine(
                self._histogram_cls(name=name, documentation=doc, buckets=buckets, labelnames=labelnames),
                self.per_engine_labelvalues,
            )
            for key, name, doc, buckets in _HISTOGRAMS
        }
        self._counters = {
            key: create_metric_per_engine(
                self._counter_cls(name=name, documentation=doc, labelnames=labelnames), self.per_engine_labelvalues
            )
            for key, name, doc in _COUNTERS
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, per_engine in self._histograms.items():
            for value in transfer_stats_data.get(key, ()):
                per_engine[engine_idx].observe(value)
        for key, per_engine in self._counters.items():
            count = len(transfer_stats_data.get(key, ()))
            if count:
                per_engine[engine_idx].inc(count)
