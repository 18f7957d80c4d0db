"""What a worker's transfers did since vLLM last asked: the payload of vLLM's ``KVConnectorStats``.

vLLM collects a connector's stats each step (``get_kv_connector_stats`` on every
worker, aggregated in the engine core), logs a summary (``reduce``) and feeds
its Prometheus metrics (``build_prom_metrics``). This module keeps the
observations as plain lists, as vLLM's NIXL connector does, so the payload
crosses processes as it is; :mod:`~kvwire.hosts.vllm.stats` wraps it in
vLLM's classes. Nothing of vLLM is imported here.

Keys (:data:`STAT_KEYS`): ``transfer_duration`` (seconds from the prefill's
submission to the write's end, per successful write), ``bytes_transferred``
and ``num_descriptors`` (of that write, as planned), and one ``1`` per event
in ``num_failed_transfers`` (a prefill's accepted write that failed),
``num_refused_registrations`` (a registration the prefill refused) and
``num_failed_loads`` (a decode request whose blocks did not all arrive).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Final

__all__ = ["STAT_KEYS", "StatsData", "TransferStats", "reduce_stats"]

#: Every key of the payload, in this order.
STAT_KEYS: Final = (
    "transfer_duration",
    "bytes_transferred",
    "num_descriptors",
    "num_failed_transfers",
    "num_refused_registrations",
    "num_failed_loads",
)
#: The payload: each key's observations since the last drain.
StatsData = dict[str, list[float]]


def _empty() -> StatsData:
    return {key: [] for key in STAT_KEYS}


class TransferStats:
    """One worker's observations; thread-safe (writes end on the transport's threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = _empty()

    def record_write(self, seconds: float, nbytes: int, descriptors: int | None) -> None:
        """A write ended well after ``seconds``, moving ``nbytes`` in ``descriptors`` (None: not known)."""
        with self._lock:
            self._data["transfer_duration"].append(float(seconds))
            self._data["bytes_transferred"].append(int(nbytes))
            if descriptors is not None:
                self._data["num_descriptors"].append(int(descriptors))

    def _count(self, key: str) -> None:
        with self._lock:
            self._data[key].append(1)

    def record_failed_write(self) -> None:
        self._count("num_failed_transfers")

    def record_refusal(self) -> None:
        self._count("num_refused_registrations")

    def record_failed_load(self) -> None:
        self._count("num_failed_loads")

    def drain(self) -> StatsData | None:
        """The observations since the last call (None when there are none), and start anew."""
        with self._lock:
            if not any(self._data.values()):
                return None
            data, self._data = self._data, _empty()
        return data


def reduce_stats(data: Mapping[str, Sequence[float]]) -> dict[str, int | float]:
    """The summary vLLM logs for an interval ("KV Transfer metrics: ..."): counts, mean and p90 time, MB/s."""
    times = sorted(data.get("transfer_duration", ()))
    total_mb = sum(data.get("bytes_transferred", ())) / 2**20
    descriptors = data.get("num_descriptors", ())
    n = len(times)
    return {
        "Num successful transfers": n,
        "Avg xfer time (ms)": round(sum(times) / n * 1e3, 3) if n else 0,
        "P90 xfer time (ms)": round(times[min(n - 1, int(0.9 * n))] * 1e3, 3) if n else 0,
        "Avg MB per transfer": round(total_mb / n, 3) if n else 0,
        "Throughput (MB/s)": round(total_mb / sum(times), 3) if n and sum(times) > 0 else 0,
        "Avg number of descriptors": round(sum(descriptors) / len(descriptors), 1) if descriptors else 0,
        "Num failed transfers": len(data.get("num_failed_transfers", ())),
        "Num refused registrations": len(data.get("num_refused_registrations", ())),
        "Num failed loads": len(data.get("num_failed_loads", ())),
    }
