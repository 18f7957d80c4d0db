"""kvwire.metrics on backends that submit natively (mooncake, nixl): sends, submissions and notifications counted."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import kvwire
from kvwire.testing.harness import ContractHarness
from kvwire.testing.receiver import LayoutSpec

prometheus_client = pytest.importorskip("prometheus_client", reason="pip install 'kvwire[metrics]'")

from kvwire.metrics import Metrics  # noqa: E402 - after the importorskip

pytestmark = pytest.mark.slow
SPEC = LayoutSpec("mha", (0, 1), 64, 4096)


def _value(registry: Any, name: str, **labels: str) -> float:
    got = registry.get_sample_value(name, labels)
    return 0.0 if got is None else float(got)


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_a_send_a_submission_with_a_notification_and_a_refused_send_are_all_counted(backend: str) -> None:
    registry = prometheus_client.CollectorRegistry()
    metrics = Metrics(registry)
    harness = ContractHarness(backend, middleware=[metrics.middleware(backend)])
    assert "submit" in harness.capabilities
    pages = np.arange(8, dtype=np.int32)
    with harness.pair(SPEC, SPEC, 5) as pair:
        peer = pair.receiver.endpoint
        moved = pair.send(pages, pages)
        assert pair.submit(pages, pages + 8, notification=b"done").result(timeout=30) == moved
        with pytest.raises(kvwire.InvalidTransferError):
            pair.send(pages, pages + 60)  # past the peer's 64 pages: refused, nothing moves
        labels = {"backend": backend, "peer": peer}
        assert _value(registry, "kvwire_send_requests_total", **labels) == 3
        assert _value(registry, "kvwire_submit_requests_total", **labels) == 1
        assert _value(registry, "kvwire_send_bytes_total", **labels) == 2 * moved
        assert _value(registry, "kvwire_send_failures_total", error="InvalidTransferError", **labels) == 1
        assert _value(registry, "kvwire_notifications_sent_total", **labels) == 1
