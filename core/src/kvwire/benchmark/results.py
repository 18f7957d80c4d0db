"""The fields every ``kvwire bench`` run reports, from its per-request measurements."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["summary"]


def summary(
    requests: int,
    tokens: int,
    total: int,
    latencies: list[float],
    *,
    verified: bool,
    guards: bool,
    descriptors: tuple[int, int],
) -> dict[str, Any]:
    """requests, bytes, verification, throughput, latency percentiles and descriptors per request."""
    seconds = sum(latencies)
    p50, p99 = (float(np.percentile(np.array(latencies), q)) for q in (50, 99)) if latencies else (0.0, 0.0)
    before, after = descriptors
    return {
        "requests": requests,
        "tokens": tokens,
        "bytes": total,
        "verified": verified,
        "guards_unchanged": guards,
        "gbps": round(total / seconds / 1e9, 3) if seconds else 0.0,
        "p50_ms": round(p50 * 1e3, 2),
        "p99_ms": round(p99 * 1e3, 2),
        "descriptors_before": before // requests,
        "descriptors_after": after // requests,
    }
